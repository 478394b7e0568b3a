"""Driving the real engine for a measurement: sizing its KV pool, random prompts, and a record
of every step it ran, so each figure's limit is computed for exactly the steps behind it.

Measurements go through `runtime.engine_core.EngineCore` (and `runtime.Session` for latency),
which load a tensor-parallel engine folder by themselves: bench needs no TP code of its own.
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.bench.hardware import Hardware
from kiln.bench.limits import CostModel, StepShape
from kiln.engines.manifest import Manifest
from kiln.runtime.engine import load_engine
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.scheduler import POLICIES

# Share of the free memory the KV pool may take: the rest is headroom for the allocator,
# the sampler's logits and, on the CPU, everything else the machine runs.
KV_MEMORY_FRACTION = {"cuda": 0.85, "cpu": 0.5}


class StepRecorder:
    """Wraps an executor's `execute` so every step's shape is kept; `mark()` then `since(mark)`
    gives the steps of one measurement."""

    def __init__(self, executor) -> None:
        self.steps: list[StepShape] = []
        execute = executor.execute

        def recorded_execute(step, copies=(), feed=None, picks=None):
            # tolist() here, not later: a backend may pad or reuse the step's tensors.
            self.steps.append(StepShape(tuple(step.query_lens.tolist()), tuple(step.context_lens.tolist()),
                                        int(step.logits_indices.shape[0])))
            return execute(step, copies, feed, picks)

        executor.execute = recorded_execute

    def mark(self) -> int:
        return len(self.steps)

    def since(self, mark: int) -> list[StepShape]:
        return self.steps[mark:]


class _TimedGraph:
    """A decode graph whose every replay is bracketed by CUDA events: the device time of the
    graph alone, no host work."""

    def __init__(self, graph, times: list) -> None:
        self.graph, self.times = graph, times

    def replay(self) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.graph.replay()
        end.record()
        self.times.append((start, end))


class ReplayTimer:
    """Times every CUDA-graph replay of an executor's decode steps; `mark()` then
    `seconds_since(mark)` gives the mean replay time of one measurement's steps (after a
    synchronize), None when none replayed (the CPU, tensor-parallel engines, steps too big)."""

    def __init__(self, executor) -> None:
        self.times: list = []
        graphs = getattr(executor, "graphs", {})
        for batch, graph in graphs.items():
            graphs[batch] = _TimedGraph(graph, self.times)

    def mark(self) -> int:
        return len(self.times)

    def seconds_since(self, mark: int) -> float | None:
        times = self.times[mark:]
        if not times:
            return None
        return sum(start.elapsed_time(end) for start, end in times) / 1e3 / len(times)


@dataclass(frozen=True)
class EngineInfo:
    """What a measurement needs to know about an engine before running it."""

    path: Path
    manifest: Manifest
    cost: CostModel

    def kv_tokens(self, num_tokens: int) -> int:
        """KV slots a sequence of `num_tokens` tokens holds: whole blocks."""
        block = self.manifest.kv.block_size
        return -(-num_tokens // block) * block


def engine_target(device: str) -> str:
    """The build target this machine runs: its GPU's arch, or "cpu"."""
    if device == "cuda":
        from kiln.runtime.cuda_driver import device_arch
        return device_arch()
    return "cpu"


def inspect(engine_dir: str | Path, device: str) -> EngineInfo:
    """Read rank 0's manifest (checksums skipped: the run that follows checks them) and check the
    engine was built for this machine, so a wrong target fails before anything is measured."""
    m = load_engine(engine_dir, rank=0, target=engine_target(device), verify=False).manifest
    return EngineInfo(Path(engine_dir), m, CostModel.from_manifest(m))


def kv_token_budget(info: EngineInfo, device: str) -> int:
    """How many KV tokens fit in this device's free memory, next to the engine's weights and arena."""
    if device == "cuda":
        free = torch.cuda.mem_get_info()[0] - info.manifest.weight_bytes - info.manifest.arena_bytes
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    tokens = int(max(free, 0) * KV_MEMORY_FRACTION[device]) // info.manifest.kv.bytes_per_token
    return tokens // info.manifest.kv.block_size * info.manifest.kv.block_size


@dataclass
class EngineRun:
    """An open EngineCore with its steps recorded, and what its figures are compared with."""

    core: EngineCore
    recorder: StepRecorder
    replays: ReplayTimer
    info: EngineInfo
    hw: Hardware
    device: str

    @property
    def kv_pool_tokens(self) -> int:
        return self.core.blocks.num_blocks * self.info.manifest.kv.block_size

    def close(self) -> None:
        self.core.close()
        release(self.device)


def pool_tokens(info: EngineInfo, kv_tokens: int) -> int:
    """`kv_tokens`, raised to one sequence of max_seq_len: the least pool an engine loads with."""
    return max(kv_tokens, info.kv_tokens(info.manifest.max_seq_len))


def open_core(info: EngineInfo, hw: Hardware, kv_tokens: int, overlap: bool = True,
              prefix_caching: bool = True, policy: str = POLICIES[0]) -> EngineRun:
    """An EngineCore whose KV pool holds `kv_tokens` tokens (see `pool_tokens`), with its steps recorded."""
    core = EngineCore(info.path, device=hw.device, max_kv_tokens=pool_tokens(info, kv_tokens), overlap=overlap,
                      prefix_caching=prefix_caching, policy=policy)
    return EngineRun(core, StepRecorder(core.executor), ReplayTimer(core.executor), info, hw, hw.device)


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Token ids drawn uniformly from the vocabulary: the weights are random too, so no text is
    more typical than another, and every run with a seed sees the same prompts."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(count)]


def release(device: str) -> None:
    """Give freed device memory back, so the next phase (say, the eager model) can use it."""
    if device == "cuda":
        torch.cuda.empty_cache()
