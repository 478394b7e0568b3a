"""The engine loop's body, single-threaded: admit requests, run a step, hand tokens back.

A step reads as three verbs: the scheduler picks the chunks, `_run` enqueues the step and the
picking of its tokens where the logits are (`_sample` says what to pick: `runtime.sampler.Picks`),
and the step in flight hands its tokens back to `_append`, which finishes sequences.
Overlapped (the default, see runtime/overlap.py), a step is launched before the
previous one's tokens are handed back. `Session` drives this from a background thread; nothing
here knows about threads.
"""
from __future__ import annotations

import time
from pathlib import Path

from kiln.runtime.arguments import ArgumentError, require_int, require_number
from kiln.runtime.backend import kv_pool, open_engine, open_executor, open_tokenizer
from kiln.runtime.collector import freeze_loaded, thaw
from kiln.runtime.overlap import InFlight, Launched
from kiln.runtime.sampler import Picks
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import POLICIES, ScheduledChunk, Scheduler
from kiln.runtime.sequence import Request, Sequence, Status
from kiln.runtime.step import SequenceChunk, pack_step


def check_engine_options(device: object, kv_cache_fraction: object, max_kv_tokens: object, policy: object,
                         worker_timeout: object, prefix_caching: object = True) -> None:
    """The options of loading an engine (`Session`, `EngineCore`), checked before anything loads."""
    if device not in (None, "auto", "cpu", "cuda"):
        raise ArgumentError("device", f"must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if kv_cache_fraction is not None:
        require_number("kv_cache_fraction", kv_cache_fraction)
        if not 0 < kv_cache_fraction <= 1:
            raise ArgumentError("kv_cache_fraction", f"must be in (0, 1] (a share of the memory left after the "
                                                     f"weights and arena), got {kv_cache_fraction!r}")
    if max_kv_tokens is not None:
        require_int("max_kv_tokens", max_kv_tokens, low=1)
    if kv_cache_fraction is not None and max_kv_tokens is not None:
        raise ArgumentError("kv_cache_fraction", "and max_kv_tokens both size the KV pool: give one of them")
    if policy not in POLICIES:
        raise ArgumentError("policy", f"must be one of {', '.join(POLICIES)}, got {policy!r}")
    require_number("worker_timeout", worker_timeout)
    if not worker_timeout > 0:
        raise ArgumentError("worker_timeout", f"must be > 0 seconds, got {worker_timeout!r}")
    if not isinstance(prefix_caching, bool):
        raise ArgumentError("prefix_caching", f"must be True or False, got {prefix_caching!r}")


class EngineCore:
    def __init__(self, engine_dir: str | Path, device: str | None = None, kv_cache_fraction: float | None = None,
                 max_kv_tokens: int | None = None, policy: str = POLICIES[0], worker_timeout: float = 60.0,
                 overlap: bool = True, prefix_caching: bool = True):
        """`overlap=False` runs the plain loop (runtime/overlap.py). `prefix_caching=False`
        computes every prompt in full (runtime/prefix_cache.py)."""
        check_engine_options(device, kv_cache_fraction, max_kv_tokens, policy, worker_timeout, prefix_caching)
        self.engine, on_gpu = open_engine(engine_dir, device)
        m = self.engine.manifest
        self.block_size = m.kv.block_size
        self.max_seq_len = m.max_seq_len
        self.kv_pool, self.blocks = kv_pool(self.engine, on_gpu, kv_cache_fraction, max_kv_tokens, prefix_caching)
        self.executor = open_executor(self.engine, on_gpu, self.blocks.num_blocks, worker_timeout)
        self.scheduler = Scheduler(self.blocks, m.max_num_tokens, m.max_batch_size, policy)
        self.vocab_size = m.vocab_size
        self.eos_ids = m.eos_token_ids
        self.tokenizer, self.detokenizer = open_tokenizer(self.engine)
        self.requests: dict[str, Request] = {}
        self.peak_blocks = 0
        self.finished: list[int] = []  # sequences whose sampling state the next picks drop
        self.in_flight = InFlight(overlap, self._append)
        freeze_loaded()

    # -- admission -----------------------------------------------------------------------------

    def encode(self, prompt: str) -> list[int]:
        """The prompt's token ids. Empty text is refused: the tokenizer would turn it into the
        start-of-sequence tokens alone, a request few callers mean."""
        if self.tokenizer is None:
            raise ArgumentError("prompt", "is text, but this engine folder has no tokenizer.json: pass "
                                          "prompt_token_ids instead")
        if not prompt:
            start = self.tokenizer.encode("").ids
            hint = f": to generate from the start-of-sequence token alone, pass prompt_token_ids={start}"
            raise ArgumentError("prompt", f"is empty{hint if start else ''}")
        return self.tokenizer.encode(prompt).ids

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Refuse what this engine can never serve, before anything runs."""
        if not prompt_ids:
            raise ArgumentError("prompt_token_ids", "is empty: give at least one token id")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ArgumentError("prompt_token_ids", f"holds token id {bad[0]}, outside the vocabulary "
                                                    f"(0..{self.vocab_size - 1})")
        if len(prompt_ids) > self.max_seq_len:
            raise ArgumentError("prompt", f"has {len(prompt_ids)} tokens; the engine's max_seq_len is "
                                          f"{self.max_seq_len}")
        if len(prompt_ids) + params.max_tokens > self.max_seq_len:
            raise ArgumentError("max_tokens", f"is {params.max_tokens}: with the prompt's {len(prompt_ids)} tokens "
                                              f"that exceeds the engine's max_seq_len {self.max_seq_len}: lower it "
                                              f"to {self.max_seq_len - len(prompt_ids)} or less")
        longest = len(prompt_ids) + params.max_tokens
        worst = self.blocks.blocks_needed(longest) * params.n
        if worst > self.blocks.num_blocks:
            raise ArgumentError("n", f"is {params.n}: {params.n} samples of up to {longest} "
                                     f"tokens need up to {worst} KV blocks but the pool has {self.blocks.num_blocks}: "
                                     "lower n or max_tokens, or give the Session a larger pool "
                                     "(kv_cache_fraction, max_kv_tokens)")

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, priority: int = 0) -> Request:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        self.validate(prompt_ids, params)
        request = Request(request_id, list(prompt_ids), params, priority)
        request.seqs.append(Sequence(request, 0, list(prompt_ids), params.seed))
        self.requests[request_id] = request
        self.scheduler.add(request.seqs[0])
        return request

    def cancel(self, request_id: str) -> Request | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.seqs:
            if seq.status is not Status.FINISHED:
                self._finish(seq, "cancelled")
        request.forked = True  # no samples will be forked from a cancelled request
        return request

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.in_flight.busy

    def close(self) -> None:
        self.in_flight.step = None  # its sampled ids may be a view of the executor's memory
        self.executor.close()
        thaw()

    # -- one step ------------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """Run one step; returns the requests that got new tokens or finished (overlapped: the
        tokens of the step before, while this one runs)."""
        start = time.monotonic()
        done = self.in_flight.settle() if self.in_flight.must_settle() else []
        batch, copies = self.scheduler.schedule()
        if not batch and not self.in_flight.busy:
            if self.scheduler.waiting and not self.scheduler.running:
                raise RuntimeError("the scheduler cannot admit any waiting request (KV pool too small)")
            return done
        self.peak_blocks = max(self.peak_blocks, self.blocks.used_blocks())
        launched = self._run(batch, copies) if batch else None
        self.in_flight.prepared(time.monotonic() - start)
        return done + self.in_flight.hand_over(launched)

    def pace(self) -> float:
        """Seconds to wait for new requests before the next `step` (`runtime.overlap`'s pacing)."""
        return self.in_flight.pace()

    def _run(self, batch: list[ScheduledChunk], copies: list[tuple[int, int]]) -> Launched | None:
        """Enqueue the step and the picking of its tokens where its logits are (on the device,
        or on rank 0 of a tensor-parallel engine); None when it picks none (prefill chunks only)."""
        chunks = []
        for c in batch:
            ids = c.seq.token_ids[c.seq.num_cached:c.seq.num_cached + c.num_tokens]
            # A pending token's id is still on the device: the feed puts it in place there.
            chunks.append(SequenceChunk(ids + [0] * (c.num_tokens - len(ids)), c.seq.num_cached,
                                        self.blocks.table(c.seq.seq_id)))
        step = pack_step(chunks, self.block_size, self.engine.manifest.blocks_per_sequence)
        feed = self.in_flight.feed(batch)
        seqs, picks = self._sample(batch)
        sampled = self.executor.execute(step, copies, feed, picks)
        return self.in_flight.launch(seqs, sampled) if sampled is not None else None

    def _sample(self, batch: list[ScheduledChunk]) -> tuple[list[Sequence], Picks | None]:
        """The sequences this step gives a token (the chunks that reach the end of their
        sequence, and the samples forked from a prompt), and what to pick for them."""
        picked: list[tuple[int, Sequence]] = []
        for i, c in enumerate(batch):
            samples = c.samples
            c.seq.num_cached += c.num_tokens
            if samples:
                picked.append((i, c.seq))
                picked += [(i, child) for child in self._fork(c.seq)]
        if not picked:
            return [], None
        # One pass over the rows: at a thousand sequences every pass costs a fraction of a step.
        rows, seqs, seq_ids, generated, outputs, prompts, new = [], [], [], [], [], [], {}
        for i, s in picked:
            params = s.request.params
            count = len(s.token_ids) - s.num_prompt + s.pending
            rows.append(i)
            seqs.append(s)
            seq_ids.append(s.seq_id)
            generated.append(count)
            # Only rows that penalties or bad words touch read the token history: copying every
            # row's would cost O(length) per step. (`InFlight.must_settle` made it whole.)
            outputs.append(s.output_ids if params.reads_history else [])
            prompts.append(s.token_ids[:s.num_prompt] if params.reads_history else [])
            if count == 0:  # picked for the first time
                new[s.seq_id] = (params, s.seed)
        finished, self.finished = self.finished, []
        return seqs, Picks(rows, seq_ids, generated, outputs, prompts, new, finished)

    def _append(self, seq: Sequence, token: int, logprob: dict | None) -> None:
        seq.token_ids.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        self._check_finished(seq, token)

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """After the prompt's prefill, the other n-1 samples share its blocks."""
        request = parent.request
        if request.forked or request.params.n == 1:
            return []
        request.forked = True
        seed = request.params.seed
        children = []
        for index in range(1, request.params.n):
            child = Sequence(request, index, list(parent.token_ids), None if seed is None else seed + index,
                             num_cached=parent.num_cached)
            self.blocks.fork(parent.seq_id, child.seq_id)
            self.scheduler.add_running(child)
            request.seqs.append(child)
            children.append(child)
        return children

    def _check_finished(self, seq: Sequence, token: int) -> None:
        params = seq.request.params
        # The sampler masks eos and stop tokens until min_tokens are out, so no check here.
        if (token in self.eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
            self._update_text(seq, final=True, drop_last=True)
            return self._finish(seq, "stop")
        length = seq.num_output >= params.max_tokens or seq.num_tokens >= self.max_seq_len
        if self._update_text(seq, final=length):
            return self._finish(seq, "stop")
        if length:
            self._finish(seq, "length")

    def _update_text(self, seq: Sequence, final: bool, drop_last: bool = False) -> bool:
        """Decode the new output tokens (a few per step, see runtime/detokenizer.py). Mid-stream,
        hold back a trailing partial UTF-8 character and any tail that could be the start of a
        stop string, so streamed text only ever grows. True when a stop string cut the text."""
        return self.detokenizer is not None and self.detokenizer.update(seq, final, drop_last)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self.finished.append(seq.seq_id)
        self.scheduler.remove(seq)
        if seq.request.finished:
            self.requests.pop(seq.request.request_id, None)
