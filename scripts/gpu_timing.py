"""Timing a launch on the GPU the way the engine runs it: inside a CUDA graph (developer tools)."""
from __future__ import annotations

import statistics
import time

REPEAT = 20
# Replays before any is timed. A GPU left idle while a script builds its next inputs drops its SM clock, and
# 5 replays of a few ms each ran before it came back: an H100 (session 44) timed the same FP8 GEMV at 47.9
# and at 41.0 us, by where it came in the probe's order. The engine's step loop never idles so.
WARM_S = 0.2


def warm(fn) -> None:
    """Calls `fn` (a graph's replay, say) for WARM_S seconds."""
    import torch

    start = time.perf_counter()
    while time.perf_counter() - start < WARM_S:
        fn()
        torch.cuda.synchronize()


def graph_us(fn) -> float:
    """Microseconds per call of `fn`, from a CUDA graph of REPEAT calls (median of 5 replays, after
    WARM_S seconds of them)."""
    import torch

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEAT):
            fn()
    warm(graph.replay)
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
    warm(graph.replay)
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
