"""What the device can do, measured in the same run as the figures it is compared with.

Two ceilings: the copy bandwidth (a device-to-device copy of a large buffer, counting bytes
read plus bytes written, as a decode step reads weights and KV) and the dense GEMM rate (a
square matmul in the engine's dtype, as a prefill is mostly GEMMs). Each is the median of
several timed repetitions after warm-up, so one slow repetition does not set the ceiling.
"""
from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import dataclass

import torch

# Sizes: on a GPU large enough that launch overhead and caches do not flatter the figure
# (1 GiB of copy, an 8192^3 GEMM); on a CPU small enough to finish in well under a second.
GPU_COPY_BYTES, CPU_COPY_BYTES = 1 << 30, 64 << 20
GPU_GEMM_N, CPU_GEMM_N = 8192, 512
WARMUP, REPEATS = 2, 7


class Clock:
    """Elapsed seconds of device work: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"
        self._t0 = 0.0
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self.cuda:
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> float:
        if self.cuda:
            self._end.record()
            self._end.synchronize()
            return self._start.elapsed_time(self._end) / 1e3
        return time.perf_counter() - self._t0


def synchronize(device: str) -> None:
    """Wait for queued device work, so a host clock reads finished work."""
    if device == "cuda":
        torch.cuda.synchronize()


def _median_seconds(device: str, fn, warmup: int = WARMUP, repeats: int = REPEATS) -> float:
    for _ in range(warmup):
        fn()
    synchronize(device)
    clock, times = Clock(device), []
    for _ in range(repeats):
        clock.start()
        fn()
        times.append(clock.stop())
    return statistics.median(times)


@dataclass(frozen=True)
class Hardware:
    """The two ceilings, with what was measured to get them."""

    device: str
    device_name: str
    copy_bytes_per_s: float
    gemm_flops_per_s: float
    copy_buffer_bytes: int
    gemm_n: int
    gemm_dtype: str

    def to_dict(self) -> dict:
        return {"device": self.device, "device_name": self.device_name,
                "copy_bandwidth_bytes_per_s": self.copy_bytes_per_s, "gemm_flops_per_s": self.gemm_flops_per_s,
                "copy_buffer_bytes": self.copy_buffer_bytes, "gemm_n": self.gemm_n, "gemm_dtype": self.gemm_dtype}


def copy_bandwidth(device: str, nbytes: int | None = None) -> tuple[float, int]:
    """Bytes read + written per second by a device-to-device copy of `nbytes`; returns (rate, nbytes)."""
    nbytes = nbytes or (GPU_COPY_BYTES if device == "cuda" else CPU_COPY_BYTES)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = _median_seconds(device, lambda: dst.copy_(src))
    return 2 * nbytes / seconds, nbytes


def gemm_rate(device: str, dtype: torch.dtype, n: int | None = None) -> tuple[float, int]:
    """FLOP/s of an n x n x n matmul in `dtype` (2 n^3 FLOPs); returns (rate, n)."""
    n = n or (GPU_GEMM_N if device == "cuda" else CPU_GEMM_N)
    # Random, not zeros: some hardware runs faster on zeros.
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    seconds = _median_seconds(device, lambda: torch.mm(a, b))
    return 2 * n ** 3 / seconds, n


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"CPU {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def measure(device: str, dtype: torch.dtype, copy_bytes: int | None = None, gemm_n: int | None = None) -> Hardware:
    """Measure both ceilings on `device` ("cuda" or "cpu")."""
    bw, nbytes = copy_bandwidth(device, copy_bytes)
    rate, n = gemm_rate(device, dtype, gemm_n)
    return Hardware(device, device_name(device), bw, rate, nbytes, n, str(dtype).removeprefix("torch."))
