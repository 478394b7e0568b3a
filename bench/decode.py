"""Decode tokens/s at fixed batch sizes, through the real engine loop.

For a batch size b: b requests with random prompts of `context` tokens go in; the engine
steps until every one has its first token (the prefills, not timed), runs a few warm-up
decode steps, then REPEATS windows of `steps` timed steps in which every request decodes one
token. The figure is tokens decoded / wall time of the median window (scheduler, executor,
sampler and the tokens' trip to the host included: what a caller gets), and every window's
rate is kept beside it, so run-to-run noise shows; its limit is the cost model's least time for
exactly the steps of that window. Beside the step time, the device time of the step's CUDA-graph
replay (CUDA events around each replay, no host work) and the host's share of the step: what
the engine loop costs beyond the GPU's work. There is no graph replay on the CPU (None).
On a tensor-parallel engine, the share of a step spent in collectives: an estimate, from the
step's all-reduces and all-gather timed apart from it (`runtime.collectives`), over the
measured step time; None on one rank.
"""
from __future__ import annotations

import time

from kiln.bench.driver import EngineInfo, EngineRun, random_prompts
from kiln.bench.figures import Figure, skipped
from kiln.bench.hardware import synchronize
from kiln.runtime.sampling_params import SamplingParams

WARMUP_STEPS = 3
REPEATS = 3


def decode_plan(info: EngineInfo, batch: int, context: int, steps: int) -> tuple[int, str | None]:
    """max_tokens per request for this measurement, or the reason it cannot run on this engine."""
    m = info.manifest
    if batch > m.max_batch_size:
        return 0, f"batch {batch} is above the engine's max_batch_size {m.max_batch_size}"
    # Requests that got their first token early keep decoding while others prefill; this many
    # more tokens keeps every request alive through the timed steps.
    prefill_steps = -(-batch * context // m.max_num_tokens) + 1
    max_tokens = 1 + prefill_steps + WARMUP_STEPS + REPEATS * steps
    if context + max_tokens > m.max_seq_len:
        return 0, (f"context {context} + {max_tokens} tokens exceeds the engine's max_seq_len "
                   f"{m.max_seq_len}")
    return max_tokens, None


def kv_tokens_needed(info: EngineInfo, batch: int, context: int, steps: int) -> int:
    """The KV pool that runs `batch` sequences together: each one's tokens, and a block more. The
    projected-peak admission rounds each sequence's last block up on its own (`Scheduler._peak_fits`),
    so a pool of exactly their blocks left the last few admitted prompts waiting until the others
    finished, and the timed steps decoded those few alone (on an H200, b=256: 4-5 rows a step)."""
    max_tokens, why = decode_plan(info, batch, context, steps)
    return 0 if why else batch * (info.kv_tokens(context + max_tokens) + info.manifest.kv.block_size)


def measure_decode(run: EngineRun, batch: int, context: int, steps: int, seed: int = 0) -> Figure:
    """Decode tokens/s at `batch` sequences of about `context` tokens."""
    info, core = run.info, run.core
    name, key = f"decode b={batch}", ("decode", batch)
    max_tokens, why = decode_plan(info, batch, context, steps)
    if why is None and kv_tokens_needed(info, batch, context, steps) > run.kv_pool_tokens:
        why = f"{batch} sequences of {context + max_tokens} tokens do not fit in the KV pool"
    if why:
        return skipped("decode", name, "tok/s", why, key, batch=batch)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"decode-{batch}-{i}" for i in range(batch)]
    requests = [core.add_request(rid, prompt, params)
                for rid, prompt in zip(ids, random_prompts(batch, context, info.manifest.vocab_size, seed))]
    try:
        while not all(r.seqs[0].output_ids for r in requests):
            core.step()
        for _ in range(WARMUP_STEPS):
            core.step()
        windows = []
        for _ in range(REPEATS):
            mark, replays = run.recorder.mark(), run.replays.mark()
            synchronize(run.device)
            start = time.perf_counter()
            for _ in range(steps):
                core.step()
            synchronize(run.device)
            windows.append((time.perf_counter() - start, run.recorder.since(mark), run.replays.seconds_since(replays)))
    finally:
        for rid in ids:
            core.cancel(rid)
    collective_seconds = getattr(core.executor, "collective_seconds", None)  # tensor-parallel executors only
    collective_s = collective_seconds(batch) if collective_seconds else None
    rates = [sum(s.num_tokens for s in shapes) / seconds for seconds, shapes, _ in windows]
    seconds, shapes, replay_s = windows[sorted(range(REPEATS), key=rates.__getitem__)[REPEATS // 2]]
    tokens = sum(s.num_tokens for s in shapes)
    limit_s = info.cost.limit_seconds(shapes, run.hw)
    note = "" if all(s.is_decode and s.num_tokens == batch for _, w, _ in windows for s in w) else \
        "some timed steps were not a pure decode of the whole batch"
    return Figure("decode", name, "tok/s", tokens / seconds, tokens / limit_s, info.cost.bound(shapes, run.hw),
                  note=note, key=key,
                  params={"batch": batch, "context": context, "steps": len(shapes), "tokens": tokens,
                          "seconds": seconds, "ms_per_step": 1e3 * seconds / len(shapes),
                          "limit_ms_per_step": 1e3 * limit_s / len(shapes), "window_tok_s": rates,
                          "replay_ms_per_step": None if replay_s is None else 1e3 * replay_s,
                          "host_share": None if replay_s is None else max(0.0, 1 - replay_s * len(shapes) / seconds),
                          "collective_ms_per_step": None if collective_s is None else 1e3 * collective_s,
                          "collective_share": None if collective_s is None else collective_s * len(shapes) / seconds})
