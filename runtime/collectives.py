"""What a tensor-parallel step spends in its collectives, timed apart from the step.

Every rank calls `step_collective_seconds` together (each collective needs all of them). The
step's own collectives cannot be timed in place: on the GPU they sit inside captured decode
graphs, between kernels. So each distinct collective of the plan, at `tokens` tokens of a
decode step (one logit row per token), is run on its own, REPEATS times, the way the step runs
it, and the mean is counted once per op that runs it: the all-reduce of a row-parallel op's
output (`runtime.all_reduce`: the custom kernel or NCCL) and the all-gather of the LM head's
slices of the logits (`plugins.linear.reference.all_gather_columns`). On the GPU the repeats
are captured in a CUDA graph and timed with CUDA events around its replay, as a decode step
replays its collectives; on the CPU gloo's are timed with the host's clock. The figure is an
estimate of the step's collective time, not a measurement inside the step.
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Callable

import torch

from kiln.dtypes import torch_dtype
from kiln.plugins.linear.reference import all_gather_columns
from kiln.runtime.all_reduce import AllReduce
from kiln.runtime.engine import Engine

REPEATS = 20


def _mean_seconds(collective: Callable[[], None], device: torch.device) -> float:
    collective()  # warm-up: the first call sets up the communicator's buffers
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(REPEATS):
            collective()
        return (time.perf_counter() - start) / REPEATS
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEATS):
            collective()
    graph.replay()  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / REPEATS


def _collective(kind: str, ranks: int, out: torch.Tensor, all_reduce: AllReduce) -> Callable[[], None]:
    """One run of a collective whose result is `out`: summed in place, or gathered from `ranks`
    slices of its columns."""
    if kind == "all_reduce":
        return lambda: all_reduce(out)
    rows, columns = out.shape
    part, gathered = out[:, :columns // ranks].contiguous(), out.new_empty(ranks * rows, columns // ranks)
    return lambda: all_gather_columns(part, gathered, out)


def step_collective_seconds(engine: Engine, tokens: int, device: torch.device | str, all_reduce: AllReduce) -> float:
    """Estimated seconds of the collectives of one decode step of `tokens` tokens, summing with
    `all_reduce` (see above)."""
    device = torch.device(device)
    runs = Counter()
    for op in engine.plan:
        ranks = op.attrs.get("all_gather", 0)
        kind = "all_reduce" if op.attrs.get("all_reduce") else "all_gather" if ranks > 1 else None
        if kind is not None:
            spec = engine.manifest.tensors[op.output]
            runs[(kind, ranks, spec.resolve({"T": tokens, "L": tokens}), spec.dtype)] += 1
    seconds = 0.0
    for (kind, ranks, shape, dtype), count in runs.items():
        out = torch.zeros(shape, dtype=torch_dtype(dtype), device=device)
        seconds += count * _mean_seconds(_collective(kind, ranks, out, all_reduce), device)
    return seconds
