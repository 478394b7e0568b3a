"""Offline throughput, as in TensorRT-LLM's perf-overview: N requests of fixed input and output
lengths submitted at once, run to completion; output tokens/s and total (input + output)
tokens/s over the wall time from the first submission to the last token.

The limit is the cost model's least time for the steps the engine actually ran (its own
schedule: chunked prefills, batch sizes, any preemption), so the ratio says how close each
step came to the hardware, not whether another schedule would have needed fewer steps. Beside
the figures: the mean running batch and the share of steps that were prefill only, decode only
or mixed, which say whether the scheduler kept the GPU full.
"""
from __future__ import annotations

import time

from tqdm import tqdm

from kiln.bench.driver import EngineInfo, EngineRun, random_prompts
from kiln.bench.figures import Figure, skipped
from kiln.bench.limits import StepShape
from kiln.bench.hardware import synchronize
from kiln.runtime.sampling_params import SamplingParams

# Default request counts: enough that the running batch stays full for most of the run, as in
# TensorRT-LLM's perf-overview (which runs 30,000 requests at 128/128 and 1,500 at 2048/2048):
# SHORT_REQUESTS where a request has at most SHORT_TOKENS tokens, else LONG_REQUESTS.
SHORT_TOKENS, SHORT_REQUESTS, LONG_REQUESTS = 1024, 3000, 1000


def default_requests(input_len: int, output_len: int) -> int:
    return SHORT_REQUESTS if input_len + output_len <= SHORT_TOKENS else LONG_REQUESTS


def step_mix(shapes: list[StepShape]) -> dict[str, float]:
    """Mean running batch (sequences per step) and the shares of prefill-only, decode-only and
    mixed steps."""
    if not shapes:
        return {"mean_batch": 0.0, "prefill_steps": 0.0, "decode_steps": 0.0, "mixed_steps": 0.0}
    decode = sum(s.is_decode for s in shapes)
    prefill = sum(all(n > 1 for n in s.query_lens) for s in shapes)
    return {"mean_batch": sum(len(s.query_lens) for s in shapes) / len(shapes),
            "prefill_steps": prefill / len(shapes), "decode_steps": decode / len(shapes),
            "mixed_steps": (len(shapes) - decode - prefill) / len(shapes)}


def summary(figure: Figure) -> str:
    """One line on how an offline run was scheduled, from its figure's params."""
    p = figure.params
    return (f"{figure.name.removesuffix(' output')}: {p['requests']:,} requests in {p['steps']:,} steps, "
            f"mean running batch {p['mean_batch']:.0f}; steps {p['prefill_steps']:.0%} prefill, "
            f"{p['decode_steps']:.0%} decode, {p['mixed_steps']:.0%} mixed; {p['preemptions']} preemptions")


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
              "preemptions": core.scheduler.num_preemptions - preempted, **step_mix(shapes)}
    return [Figure("offline", f"{label} output", "tok/s", out_tokens / seconds, out_tokens / limit_s, bound,
                   key=keys[0], params=common),
            Figure("offline", f"{label} total", "tok/s", all_tokens / seconds, all_tokens / limit_s, bound,
                   key=keys[1], params=common)]


def kv_tokens_wanted(info: EngineInfo, input_len: int, output_len: int, requests: int) -> int:
    """KV slots for every request at once (more than needed is never used; less only queues)."""
    return 0 if offline_problem(info, input_len, output_len) else requests * info.kv_tokens(input_len + output_len)
