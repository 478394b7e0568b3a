"""The public Python API: `Session` serves many callers at once from one engine.

The engine loop runs on a background thread; callers on any thread (or asyncio task) submit
requests and receive `RequestOutput`s through their own sink. Bad requests are refused with a
`ValueError` (an `ArgumentError` naming the argument) in the caller's thread before anything
runs; the rules for prompts are in `runtime/prompts.py`.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import threading
from functools import cached_property
from pathlib import Path
from typing import AsyncIterator, Callable, Iterator, Sequence as Seq

from kiln.runtime.arguments import ArgumentError, require_int
from kiln.runtime.chat_template import ChatTemplate
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.kv_pool import KVPool
from kiln.runtime.outputs import RequestOutput
from kiln.runtime.prompts import Prompt, one_prompt, prompt_batch
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import POLICIES
from kiln.runtime.startup import process_age

Sink = Callable[[RequestOutput | BaseException], None]


class Session:
    """Serve an engine folder. A tensor-parallel engine starts one worker process per rank
    (a fresh interpreter each, so the caller's script needs no `__main__` guard); a rank that
    dies or does not answer within `worker_timeout` seconds fails the requests in flight with an
    error naming it. `overlap=False` runs the plain engine loop instead of the overlapped one
    (runtime/overlap.py); `prefix_caching=False` computes every prompt in full instead of reusing
    the KV blocks of prefixes seen before (runtime/prefix_cache.py). Either way the tokens are
    the same."""

    def __init__(self, engine_dir: str | Path, device: str | None = None, kv_cache_fraction: float | None = None,
                 max_kv_tokens: int | None = None, policy: str = POLICIES[0], worker_timeout: float = 60.0,
                 overlap: bool = True, prefix_caching: bool = True):
        self._core = EngineCore(engine_dir, device, kv_cache_fraction, max_kv_tokens, policy, worker_timeout,
                                overlap, prefix_caching)
        # Start-up latency, in seconds since the process started (runtime/startup.py).
        self._loaded_after = process_age()
        self._first_token_after: float | None = None
        self._lock = threading.Condition()
        # Python's locks are not fair: the loop takes `_lock` again right after each step, before
        # a woken caller can, so a cancel, submit or close could wait until all work is done.
        # Everyone takes `_lock` through this turnstile (see `_locked`), which lets a waiting
        # caller in after the current step.
        self._turnstile = threading.Lock()
        self._sinks: dict[str, Sink] = {}
        self._ids = itertools.count()
        self._closed = False
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="kiln-engine-loop", daemon=True)
        self._thread.start()

    # -- lifecycle -----------------------------------------------------------------------------

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the engine loop; requests still in flight end as cancelled."""
        with self._locked():
            if self._closed:
                return
            self._closed = True
            for rid in list(self._sinks):
                self._cancel_locked(rid)
            self._lock.notify_all()
        self._thread.join()
        self._core.close()

    @property
    def tokenizer(self):
        """The engine's tokenizer (a `tokenizers.Tokenizer`), or None when its checkpoint had none
        (then requests give token ids)."""
        return self._core.tokenizer

    @property
    def chat_template(self) -> str | None:
        """The checkpoint's chat template (Jinja text), as build-engine copied it into the engine
        folder; None when the checkpoint had none."""
        engine = self._core.engine
        name = engine.manifest.chat_template_file
        return None if name is None else (engine.path / name).read_text(encoding="utf-8")

    @cached_property
    def _chat(self) -> ChatTemplate:
        engine = self._core.engine
        return ChatTemplate.from_engine(engine.path, engine.manifest.chat_template_file, self.tokenizer)

    def apply_chat_template(self, messages: Seq[dict], add_generation_prompt: bool = True,
                            tokenize: bool = False) -> str | list[int]:
        """A conversation (`[{"role": "user", "content": "..."}, ...]`) rendered with the engine's
        chat template as transformers' `apply_chat_template` renders it: the prompt text, or with
        `tokenize` its token ids (the template writes the special tokens, so none are added).
        Raises `ChatTemplateError` when the engine has no template, `ValueError` naming
        `messages` for a conversation the template refuses."""
        if tokenize:
            return self._chat.encode(messages, add_generation_prompt)
        return self._chat.render(messages, add_generation_prompt)

    def chat(self, messages: Seq[dict] | Seq[Seq[dict]], sampling_params: SamplingParams | None = None,
             priority: int = 0) -> list[RequestOutput]:
        """Answer one conversation, or a list of them batched in flight: each is rendered with the
        engine's chat template (ending with the assistant's header) and generated like a prompt of
        `generate`; outputs in input order."""
        batch = messages and isinstance(messages, (list, tuple)) and isinstance(messages[0], (list, tuple))
        conversations = list(messages) if batch else [messages]
        ids = [self.apply_chat_template(c, tokenize=True) for c in conversations]
        return self.generate(prompt_token_ids=ids, sampling_params=sampling_params, priority=priority)

    @property
    def max_seq_len(self) -> int:
        """The most tokens (prompt and output together) one sequence may hold."""
        return self._core.max_seq_len

    @property
    def kv_pool(self) -> KVPool:
        """The KV pool chosen at load: its size and why."""
        return self._core.kv_pool

    @property
    def stats(self) -> dict:
        """The KV pool (`kv_cache_bytes` is one rank's; used blocks are those requests hold, cached
        ones are kept for reuse and count as free), the prefix cache's token counts (tokens of
        admitted requests looked up, and found; 0 with prefix caching off) and the scheduler's
        state, now."""
        with self._locked():
            blocks, pool = self._core.blocks, self._core.kv_pool
            return {"kv_blocks_total": blocks.num_blocks, "kv_blocks_used": blocks.used_blocks(),
                    "kv_blocks_cached": blocks.cached_blocks(),
                    "prefix_cache_queries": blocks.cache_queries, "prefix_cache_hits": blocks.cache_hits,
                    "kv_tokens_total": pool.num_tokens, "kv_cache_bytes": pool.nbytes,
                    "running": len(self._core.scheduler.running), "waiting": len(self._core.scheduler.waiting),
                    "preemptions": self._core.scheduler.num_preemptions, "kv_blocks_peak": self._core.peak_blocks,
                    # seconds from the process's start to the engine loaded and to its first token (or None)
                    "loaded_s": self._loaded_after, "first_token_s": self._first_token_after}

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._turnstile:
            self._lock.acquire()
        try:
            yield
        finally:
            self._lock.release()

    # -- the loop ------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._locked():
                while not self._closed and not self._core.has_work():
                    self._lock.wait()
                if self._closed:
                    return
                try:
                    updated = self._core.step()
                except Exception as e:  # a failed step must not leave callers waiting forever
                    self._failed = e
                    for rid in list(self._sinks):
                        self._core.cancel(rid)
                        self._deliver(rid, e)
                    continue
                if updated and self._first_token_after is None:
                    self._first_token_after = process_age()
                for request in updated:
                    out = request.snapshot()
                    self._deliver(request.request_id, out)
                # Until shortly before the device runs out of work: a request submitted meanwhile
                # (its notify ends the wait) still joins the next step.
                if (delay := self._core.pace()) > 0:
                    self._lock.wait(delay)

    def _deliver(self, request_id: str, out: RequestOutput | BaseException) -> None:
        final = isinstance(out, BaseException) or out.finished
        sink = self._sinks.pop(request_id, None) if final else self._sinks.get(request_id)
        if sink is None:
            return
        try:
            sink(out)
        except Exception:  # a caller that went away (say, its event loop closed) must not stop the loop
            self._core.cancel(request_id)
            self._sinks.pop(request_id, None)

    # -- submitting ----------------------------------------------------------------------------

    def _submit(self, prompt: Prompt, params: SamplingParams | None, sink: Sink, priority: int) -> str:
        params = _sampling_params(params)
        require_int("priority", priority)
        ids = self._token_ids(prompt)
        with self._locked():
            if self._closed:
                raise RuntimeError("the session is closed")
            if self._failed is not None:
                raise RuntimeError(f"the session failed ({self._failed}); close it and start a new one")
            rid = f"req-{next(self._ids)}"
            self._core.add_request(rid, ids, params, priority)
            self._sinks[rid] = sink
            self._lock.notify_all()
        return rid

    def _token_ids(self, prompt: Prompt) -> list[int]:
        return self._core.encode(prompt.text) if prompt.text is not None else list(prompt.token_ids)

    def validate(self, prompt: str | None = None, sampling_params: SamplingParams | None = None,
                 prompt_token_ids: Seq[int] | None = None) -> list[int]:
        """Check one request as submitting it would, without submitting it: its prompt's token
        ids, or a `ValueError` naming what this engine cannot serve. Lets a front end refuse a
        request before it answers anything, or check several before it submits any."""
        ids = self._token_ids(one_prompt(prompt, prompt_token_ids))
        self._core.validate(ids, _sampling_params(sampling_params))
        return ids

    def cancel(self, request_id: str) -> None:
        """Stop a request; its blocks are freed and its stream ends with finish_reason 'cancelled'."""
        with self._locked():
            self._cancel_locked(request_id)

    def _cancel_locked(self, request_id: str) -> None:
        request = self._core.cancel(request_id)
        if request is not None:
            self._deliver(request_id, request.snapshot())

    # -- blocking and streaming ----------------------------------------------------------------

    def generate(self, prompts: str | Seq[str] | None = None,
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 prompt_token_ids: Seq[int] | Seq[Seq[int]] | None = None, priority: int = 0) -> list[RequestOutput]:
        """Run a batch to completion; outputs in input order. `prompts` is text: one string or a
        list of strings; `prompt_token_ids` is one list of ids or a list of them (give one of the
        two). An empty list is an empty batch. `sampling_params` is one for all or one per prompt.
        Every request is validated before any is submitted: a bad one raises `ValueError` naming
        it (`prompts[2] ...`) and nothing runs."""
        batch = prompt_batch(prompts, prompt_token_ids)
        n = len(batch)
        if isinstance(sampling_params, (list, tuple)):
            params = list(sampling_params)
            if len(params) != n:
                raise ArgumentError("sampling_params", f"has {len(params)} entries for {n} prompts: give one, or one "
                                                       "per prompt")
        else:
            params = [sampling_params] * n
        params = [_sampling_params(p) for p in params]
        require_int("priority", priority)
        for i, (prompt, p) in enumerate(zip(batch, params)):
            try:
                self._core.validate(self._token_ids(prompt), p)
            except ArgumentError as e:
                if n == 1:
                    raise
                raise ArgumentError(e.argument, f"{e.detail} (prompt {i} of the batch)") from None
        queues = [queue.Queue() for _ in range(n)]
        for prompt, p, q in zip(batch, params, queues):
            self._submit(prompt, p, q.put, priority)
        return [_final(q) for q in queues]

    def stream(self, prompt: str | None = None, sampling_params: SamplingParams | None = None,
               prompt_token_ids: Seq[int] | None = None, priority: int = 0) -> Iterator[RequestOutput]:
        """Yield a `RequestOutput` as each token arrives; the last has `finished=True`.
        One prompt: text, or `prompt_token_ids`. Stopping the iteration early cancels the request."""
        q: queue.Queue = queue.Queue()
        rid = self._submit(one_prompt(prompt, prompt_token_ids), sampling_params, q.put, priority)
        return self._drain(rid, q)

    def _drain(self, rid: str, q: queue.Queue) -> Iterator[RequestOutput]:
        with self._cancel_at_end(rid):
            out = None
            while out is None or not out.finished:
                out = _checked(rid, q.get())
                yield out

    @contextlib.contextmanager
    def _cancel_at_end(self, rid: str) -> Iterator[None]:
        """A stream cancels its request when it ends: finished, abandoned by the caller, or failed."""
        try:
            yield
        finally:
            self.cancel(rid)

    # -- asyncio -------------------------------------------------------------------------------

    async def stream_async(self, prompt: str | None = None, sampling_params: SamplingParams | None = None,
                           prompt_token_ids: Seq[int] | None = None, priority: int = 0
                           ) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        aq: asyncio.Queue = asyncio.Queue()
        rid = self._submit(one_prompt(prompt, prompt_token_ids), sampling_params,
                           lambda out: loop.call_soon_threadsafe(aq.put_nowait, out), priority)
        with self._cancel_at_end(rid):
            out = None
            while out is None or not out.finished:
                out = _checked(rid, await aq.get())
                yield out

    async def generate_async(self, prompt: str | None = None, sampling_params: SamplingParams | None = None,
                             prompt_token_ids: Seq[int] | None = None, priority: int = 0) -> RequestOutput:
        last = None
        async for out in self.stream_async(prompt, sampling_params, prompt_token_ids, priority):
            last = out
        return last


def _checked(rid: str, out: RequestOutput | BaseException) -> RequestOutput:
    """An output, or the failure of the step that should have made it, raised in the caller."""
    if isinstance(out, BaseException):
        raise RuntimeError(f"request {rid} failed: {out}") from out
    return out


def _sampling_params(params: SamplingParams | None) -> SamplingParams:
    # Checked here, not in EngineCore.validate, so a wrong type is a clear ValueError in
    # `generate`'s up-front validation too, not an AttributeError from inside it.
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise ArgumentError("sampling_params", f"must be a SamplingParams, got {type(params).__name__}")
    return params


def _final(q: queue.Queue) -> RequestOutput:
    while True:
        out = q.get()
        if isinstance(out, BaseException):
            raise RuntimeError(f"request failed: {out}") from out
        if out.finished:
            return out
