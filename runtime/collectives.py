"""What a tensor-parallel step spends in its all-reduces, timed apart from the step.

Every rank calls `step_all_reduce_seconds` together (each all-reduce needs all of them). The
step's own collectives cannot be timed in place: on the GPU they sit inside captured decode
graphs, between kernels. So each distinct message of the plan (the output of a row-parallel
op at `tokens` tokens: shape and dtype) is all-reduced on its own, REPEATS times, the way the
step sums it (`runtime.all_reduce`: the custom kernel or NCCL), and the mean is counted once
per op that sends it. On the GPU the repeats are captured in a CUDA
graph and timed with CUDA events around its replay, as a decode step replays its
collectives; on the CPU gloo's all-reduces are timed with the host's clock. The figure is an
estimate of the step's collective time, not a measurement inside the step.
"""
from __future__ import annotations

import time
from collections import Counter

import torch

from kiln.dtypes import torch_dtype
from kiln.runtime.all_reduce import AllReduce
from kiln.runtime.engine import Engine

REPEATS = 20


def _mean_all_reduce_seconds(message: torch.Tensor, all_reduce: AllReduce) -> float:
    all_reduce(message)  # warm-up: the first call sets up the communicator's buffers
    if message.device.type != "cuda":
        start = time.perf_counter()
        for _ in range(REPEATS):
            all_reduce(message)
        return (time.perf_counter() - start) / REPEATS
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEATS):
            all_reduce(message)
    graph.replay()  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / REPEATS


def step_all_reduce_seconds(engine: Engine, tokens: int, device: torch.device | str, all_reduce: AllReduce) -> float:
    """Estimated seconds of the all-reduces of one step of `tokens` tokens, summed by
    `all_reduce` (see above)."""
    messages = Counter()
    for op in engine.plan:
        if op.attrs.get("all_reduce"):
            spec = engine.manifest.tensors[op.output]
            messages[(spec.resolve({"T": tokens}), spec.dtype)] += 1
    return sum(count * _mean_all_reduce_seconds(torch.zeros(shape, dtype=torch_dtype(dtype), device=device),
                                                all_reduce)
               for (shape, dtype), count in messages.items())
