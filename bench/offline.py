"""Offline throughput, as in TensorRT-LLM's perf-overview: N requests of fixed input and output
lengths submitted at once, run to completion; output tokens/s and total (input + output)
tokens/s over the wall time from the first submission to the last token.

The limit is the cost model's least time for the steps the engine actually ran (its own
schedule: chunked prefills, batch sizes, any preemption), so the ratio says how close each
step came to the hardware, not whether another schedule would have needed fewer steps.
"""
from __future__ import annotations

import time

from tqdm import tqdm

from kiln.bench.driver import EngineInfo, EngineRun, random_prompts
from kiln.bench.figures import Figure, skipped
from kiln.bench.hardware import synchronize
from kiln.runtime.sampling_params import SamplingParams

# Default request count: enough tokens that steady state dominates, few enough that a long
# shape finishes in minutes. N = TOKEN_BUDGET / (in + out), kept within [MIN, MAX]:
# 128/128 -> 256 requests, 2048/2048 -> 32.
TOKEN_BUDGET, MIN_REQUESTS, MAX_REQUESTS = 131072, 8, 256


def default_requests(input_len: int, output_len: int) -> int:
    return max(MIN_REQUESTS, min(MAX_REQUESTS, TOKEN_BUDGET // (input_len + output_len)))


def offline_problem(info: EngineInfo, input_len: int, output_len: int) -> str | None:
    """Why this pair cannot run on this engine, or None."""
    if input_len + output_len > info.manifest.max_seq_len:
        return (f"{input_len}+{output_len} tokens exceed the engine's max_seq_len {info.manifest.max_seq_len}: "
                "rebuild with a larger --max-seq-len")
    return None


def measure_offline(run: EngineRun, input_len: int, output_len: int, requests: int, seed: int = 0,
                    progress: bool = False) -> list[Figure]:
    """Output and total tokens/s for `requests` requests of `input_len` -> `output_len` tokens."""
    info, core = run.info, run.core
    label = f"offline {input_len}/{output_len}"
    keys = [("offline", input_len, output_len, what) for what in ("output", "total")]
    why = offline_problem(info, input_len, output_len)
    if why is None and info.kv_tokens(input_len + output_len) > run.kv_pool_tokens:
        why = f"one request of {input_len + output_len} tokens does not fit in the KV pool"
    if why:
        return [skipped("offline", f"{label} {what}", "tok/s", why, key) for what, key in
                zip(("output", "total"), keys)]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(requests, input_len, info.manifest.vocab_size, seed)
    preempted = core.scheduler.num_preemptions
    bar = tqdm(total=requests, desc=label, unit="req", disable=not progress, leave=False)
    mark = run.recorder.mark()
    synchronize(run.device)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        core.add_request(f"offline-{input_len}-{output_len}-{i}", prompt, params)
    while core.has_work():
        bar.update(sum(r.finished for r in core.step()))
    synchronize(run.device)
    seconds = time.perf_counter() - start
    bar.close()
    shapes = run.recorder.since(mark)
    limit_s = info.cost.limit_seconds(shapes, run.hw)
    bound = info.cost.bound(shapes, run.hw)
    out_tokens, all_tokens = requests * output_len, requests * (input_len + output_len)
    common = {"input_len": input_len, "output_len": output_len, "requests": requests, "seconds": seconds,
              "steps": len(shapes), "limit_seconds": limit_s,
              "preemptions": core.scheduler.num_preemptions - preempted}
    return [Figure("offline", f"{label} output", "tok/s", out_tokens / seconds, out_tokens / limit_s, bound,
                   key=keys[0], params=common),
            Figure("offline", f"{label} total", "tok/s", all_tokens / seconds, all_tokens / limit_s, bound,
                   key=keys[1], params=common)]


def kv_tokens_wanted(info: EngineInfo, input_len: int, output_len: int, requests: int) -> int:
    """KV slots for every request at once (more than needed is never used; less only queues)."""
    return 0 if offline_problem(info, input_len, output_len) else requests * info.kv_tokens(input_len + output_len)
