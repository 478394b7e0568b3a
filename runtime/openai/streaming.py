"""Running a request's prompts in the Session and handing their outputs to the client: as one
response, or as server-sent events ending with `data: [DONE]`.

A client that goes away takes its requests with it: the task that serves it is cancelled (by
Starlette for a stream, by `until_disconnected` otherwise), which cancels each prompt's Session
request (`Session.stream_async` cancels on the way out) and so frees its KV blocks at once.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import TypeVar

from starlette.requests import Request

from kiln.runtime.metrics import ServingMetrics
from kiln.runtime.openai.protocol import OpenAIError
from kiln.runtime.openai.responses import FINISH_REASONS, Responder
from kiln.runtime.outputs import RequestOutput
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.session import Session

T = TypeVar("T")
_DONE = object()


class ClientGone(Exception):
    """The client disconnected before its answer was ready; nothing is sent."""


async def outputs(session: Session, prompts: Sequence[list[int]], params: SamplingParams,
                  metrics: ServingMetrics) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Every output of every prompt, as `(prompt index, output)` in the order they arrive; the
    prompts run side by side. Leaving the iteration early cancels the ones still running."""
    queue: asyncio.Queue = asyncio.Queue()

    async def run(index: int, ids: list[int]) -> None:
        tracker, completed = metrics.request(), False
        try:
            async for out in session.stream_async(prompt_token_ids=ids, sampling_params=params):
                tracker.update(out)
                completed = out.finished and all(c.finish_reason in FINISH_REASONS for c in out.outputs)
                queue.put_nowait((index, out))
        except Exception as e:  # a failed engine step: the consumer raises it
            queue.put_nowait((index, e))
        finally:
            tracker.end(completed)
            queue.put_nowait((index, _DONE))

    tasks = [asyncio.ensure_future(run(i, ids)) for i, ids in enumerate(prompts)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is _DONE:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def finals(stream: AsyncIterator[tuple[int, RequestOutput]], count: int) -> list[RequestOutput]:
    """The last output of each of `count` prompts."""
    last: list[RequestOutput | None] = [None] * count
    async for index, out in stream:
        last[index] = out
    return last


async def events(responder: Responder, stream: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[str]:
    """The server-sent events of a streamed answer."""
    try:
        async for index, out in stream:
            for chunk in responder.chunks(index, out):
                yield _event(chunk)
        if responder.job.include_usage:
            yield _event(responder.usage_chunk())
    except RuntimeError as e:  # the status line has gone out: the error travels as an event
        yield _event(OpenAIError(500, f"Kiln could not finish this request: {e}", kind="server_error").body())
    yield "data: [DONE]\n\n"


def _event(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, unless the client disconnects first: then `work` is cancelled and
    `ClientGone` raised."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        finished = task.done()
        if not finished:
            task.cancel()
    if not finished:
        raise ClientGone()
    return task.result()


async def _disconnect(request: Request) -> None:
    # Once the body is read, the server's next message for this request is its disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
