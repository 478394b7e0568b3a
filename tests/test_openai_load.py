"""The OpenAI server under load on the CPU: 200 concurrent streaming chat requests through the
official async client, a quarter of them hanging up after their first chunk. Every other request
completes with exactly the Session's greedy tokens (their logprobs, one per token, in order: none
lost or repeated) and text, and afterwards the KV pool is back to its idle count."""
from __future__ import annotations

import asyncio

import openai
import pytest

from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.session import Session
from openai_harness import MODEL, request, serve, wait_idle
from serving_metrics import kiln_samples

REQUESTS = 200
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def server(factory):
    with serve(lambda: Session(factory.engine(factory.checkpoint("llama3"), dtype="float32"))) as running:
        yield running


async def _chat(client: openai.AsyncOpenAI, messages: list[dict], hang_up: bool) -> dict | None:
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, logprobs=True, stream=True,
        stream_options={"include_usage": True}, extra_body={"min_tokens": MAX_TOKENS})
    got = {"text": "", "logprobs": [], "finish_reason": None, "usage": None}
    async for chunk in stream:
        if hang_up:
            await stream.close()
            return None
        for choice in chunk.choices:
            got["text"] += choice.delta.content or ""
            got["logprobs"] += [e.logprob for e in choice.logprobs.content] if choice.logprobs else []
            got["finish_reason"] = choice.finish_reason or got["finish_reason"]
        got["usage"] = chunk.usage or got["usage"]
    return got


async def _all(url: str, conversations: list[list[dict]], hang_ups: set[int]) -> list[dict | None]:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        return await asyncio.gather(*(_chat(client, c, i in hang_ups) for i, c in enumerate(conversations)))


def test_200_streaming_chats_with_a_quarter_hanging_up(server):
    session = server.session
    conversations = [[{"role": "user", "content": f"Kiln {i}?"}] for i in range(REQUESTS)]
    assert max(len(session.apply_chat_template(c, tokenize=True)) for c in conversations) + MAX_TOKENS <= \
        session.max_seq_len
    hang_ups = set(range(0, REQUESTS, 4))
    kept = [i for i in range(REQUESTS) if i not in hang_ups]
    want = session.chat([conversations[i] for i in kept],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprobs=0))
    idle = wait_idle(session)
    before = kiln_samples(request(server, "GET", "/metrics")[1], MODEL)

    results = asyncio.run(_all(server.url, conversations, hang_ups))

    for i, out in zip(kept, want):
        got, completion = results[i], out.outputs[0]
        assert got["text"] == completion.text, f"request {i}"
        assert got["logprobs"] == pytest.approx([e["logprob"] for e in completion.logprobs], abs=1e-4), f"request {i}"
        assert got["finish_reason"] == "length" and got["usage"].completion_tokens == MAX_TOKENS
        assert got["usage"].prompt_tokens == len(out.prompt_token_ids)
    after = wait_idle(session, idle["kv_blocks_used"])
    assert after["kv_blocks_total"] - after["kv_blocks_used"] == idle["kv_blocks_total"] - idle["kv_blocks_used"]
    completed = kiln_samples(request(server, "GET", "/metrics")[1], MODEL)["kiln:e2e_request_latency_seconds_count"]
    assert len(kept) <= completed - before["kiln:e2e_request_latency_seconds_count"] <= REQUESTS
