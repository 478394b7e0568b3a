"""Time to first token (TTFT) and inter-token latency (ITL) under a steady arrival rate.

Requests arrive every 1/rate seconds, each on its own thread through `Session.stream` (the
public API, with its background engine loop), and every streamed token is timestamped as it
reaches its caller. TTFT is submission to first token; ITL is the gap between a request's
successive tokens, pooled over all requests. Percentiles are p50, p90 and p99.

Limits: TTFT's floor is the lone prompt's prefill (no queueing, no other request); an ITL
gap is one engine step, so its limit at each percentile is the same percentile of the
least times of the steps the engine ran during the test.
"""
from __future__ import annotations

import threading
import time
from itertools import pairwise

import numpy as np
from tqdm import tqdm

from kiln.bench.driver import EngineInfo, StepRecorder, pool_tokens, random_prompts
from kiln.bench.figures import Figure, skipped
from kiln.bench.hardware import Hardware
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import POLICIES
from kiln.runtime.session import Session

PERCENTILES = (50, 90, 99)
JOIN_TIMEOUT_S = 600.0


def _timestamps(session: Session, prompt: list[int], params: SamplingParams, out: list, index: int) -> None:
    """Stream one request; store (submit time, [time of each token]) at out[index], or the error."""
    try:
        submitted = time.perf_counter()
        times: list[float] = []
        seen = 0
        for output in session.stream(prompt_token_ids=prompt, sampling_params=params):
            now = time.perf_counter()
            new = len(output.outputs[0].token_ids) - seen
            times += [now] * new
            seen += new
        out[index] = (submitted, times)
    except BaseException as e:  # noqa: BLE001 - handed to the measuring thread, which raises it
        out[index] = e


def measure_latency(info: EngineInfo, hw: Hardware, kv_tokens: int, rate: float, requests: int,
                    input_len: int, output_len: int, seed: int = 0, progress: bool = False,
                    overlap: bool = True, prefix_caching: bool = True, policy: str = POLICIES[0]) -> list[Figure]:
    """TTFT and ITL percentiles, in ms, for `requests` arriving at `rate` per second."""
    names = [(what, p) for what in ("TTFT", "ITL") for p in PERCENTILES]
    if input_len + output_len > info.manifest.max_seq_len:
        why = f"{input_len}+{output_len} tokens exceed the engine's max_seq_len {info.manifest.max_seq_len}"
        return [skipped("latency", f"{what} p{p}", "ms", why, ("latency", what, p)) for what, p in names]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(requests, input_len, info.manifest.vocab_size, seed)
    results: list = [None] * requests
    session = Session(info.path, device=hw.device, max_kv_tokens=pool_tokens(info, kv_tokens), overlap=overlap,
                      prefix_caching=prefix_caching, policy=policy)
    try:
        # The Session owns its EngineCore; recording its steps is the one place bench reaches in.
        recorder = StepRecorder(session._core.executor)
        threads = []
        start = time.perf_counter()
        for i, prompt in enumerate(tqdm(prompts, desc=f"latency {rate:g} req/s", unit="req",
                                        disable=not progress, leave=False)):
            time.sleep(max(0.0, start + i / rate - time.perf_counter()))
            t = threading.Thread(target=_timestamps, args=(session, prompt, params, results, i), daemon=True)
            t.start()
            threads.append(t)
        for t in threads:
            t.join(JOIN_TIMEOUT_S)
    finally:
        session.close()
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise RuntimeError(f"{len(errors)} of {requests} latency requests failed: {errors[0]}") from errors[0]
    missing = sum(r is None for r in results)
    if missing:
        raise RuntimeError(f"{missing} of {requests} latency requests did not finish in {JOIN_TIMEOUT_S:.0f} s")
    ttft = [times[0] - submitted for submitted, times in results]
    itl = [b - a for _, times in results for a, b in pairwise(times)]
    step_limits = [info.cost.step(s).seconds(hw) for s in recorder.steps]
    prefill = info.cost.prefill_shapes(input_len, info.manifest.max_num_tokens)
    ttft_floor = info.cost.limit_seconds(prefill, hw)
    common = {"rate": rate, "requests": requests, "input_len": input_len, "output_len": output_len,
              "steps": len(recorder.steps)}
    figures = []
    for p in PERCENTILES:
        figures.append(Figure("latency", f"TTFT p{p}", "ms", 1e3 * float(np.percentile(ttft, p)), 1e3 * ttft_floor,
                              info.cost.bound(prefill, hw), higher_is_better=False, key=("latency", "TTFT", p),
                              params=common))
    for p in PERCENTILES:
        value = 1e3 * float(np.percentile(itl, p)) if itl else None
        limit = 1e3 * float(np.percentile(step_limits, p)) if step_limits else None
        figures.append(Figure("latency", f"ITL p{p}", "ms", value, limit, info.cost.bound(recorder.steps, hw),
                              higher_is_better=False, key=("latency", "ITL", p),
                              note="" if itl else "no inter-token gaps: output_len is 1", params=common))
    return figures


def kv_tokens_wanted(info: EngineInfo, input_len: int, output_len: int, requests: int) -> int:
    return requests * info.kv_tokens(input_len + output_len)
