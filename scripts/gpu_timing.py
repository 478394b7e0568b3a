"""Timing a launch on the GPU the way the engine runs it: inside a CUDA graph (developer tools)."""
from __future__ import annotations

import statistics

REPEAT = 20


def graph_us(fn) -> float:
    """Microseconds per call of `fn`, from a CUDA graph of REPEAT calls (median of 5 replays)."""
    import torch

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEAT):
            fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / REPEAT)
    return statistics.median(times)


def replay_ms(fn, reps: int = 10) -> float:
    """Milliseconds of one replay of a CUDA graph of one call of `fn` (median of `reps`)."""
    import torch

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_rate() -> float:
    """The device's copy bandwidth in TB/s (bytes read + written), as bench-engine measures it: the figure a
    memory-bound kernel's bandwidth is compared with in the same run."""
    from kiln.bench.hardware import copy_bandwidth

    return copy_bandwidth("cuda")[0] / 1e12
