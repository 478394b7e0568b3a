"""The host work of an eager GPU step's kernel launches, measured on a machine without a GPU (a
developer's profile, not a benchmark of the engine).

Prefill and mixed steps are not CUDA graphs: the CUDA executor launches each of their kernels from
Python, and on an H200 an 8B engine's 128-token prefill step spent as long enqueueing its 230
kernels as they ran (BENCHMARKS.md, session 17). This runs that same launch path, the CUDA
executor's `_launch` and every plugin's launcher, over CPU memory with kernels that make their
parameter arrays but skip the driver call (which took under 1 us a launch on the H200), on a
32-layer engine built for sm_90 (small widths: the host work does not depend on them).

    PYTHONPATH=. python3 scripts/profile_launch_host.py [--work-dir DIR] [--prompt 128] [--decodes 2] [--profile]

The engine is built once into --work-dir (about a minute: its cubins are compiled).
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from pathlib import Path

from kiln.builder.build import build_engine
from kiln.builder.config import BuildConfig
from kiln.models.random_checkpoint import write_random_checkpoint
from kiln.runtime.cuda_driver import CudaKernel
from kiln.runtime.cuda_executor import CudaExecutor, _launcher, executor_scratch
from kiln.runtime.engine import Engine, load_engine
from kiln.runtime.executor import ArenaExecutor
from kiln.runtime.step import SequenceChunk, pack_step

ARCH = "sm_90"
SMS = 132          # an H200's multiprocessors: only sizes the persistent kernels' global scratch
REPEATS = 50


class HostOnlyKernel(CudaKernel):
    """A kernel that does everything a launch does on the host but the driver call."""

    launches = 0

    def enqueue(self, grid, pointers, stream) -> None:
        HostOnlyKernel.launches += 1


def host_only(cubin: bytes, name: str, signature: list[str], num_warps: int, shared_bytes: int,
              global_scratch: int = 0) -> CudaKernel:
    return HostOnlyKernel(None, name, signature, num_warps, shared_bytes, global_scratch)


class HostProbe(ArenaExecutor):
    """The CUDA executor's launch path (its `_load_ops` and `_launch`) over an arena in CPU memory."""

    _load_ops = CudaExecutor._load_ops
    _launch = CudaExecutor._launch

    def __init__(self, engine: Engine, num_kv_blocks: int):
        launchers = [_launcher(op.spec) for op in engine.plan]
        scratch = executor_scratch(engine, launchers, ARCH, SMS)
        super().__init__(engine, num_kv_blocks, "cpu", {f"scratch:{n}": b for n, b in scratch.items()})
        self.arch = ARCH
        self.weights = engine.weights
        self.scratch = {n: self.memory.bytes(f"scratch:{n}") for n in scratch}
        self.ops = self._load_ops(launchers, load=host_only)


def engine_dir(work: Path) -> Path:
    out = work / "engine"
    if not (out / "config.json").exists():
        checkpoint = write_random_checkpoint(work / "checkpoint", "llama3", hidden_size=512, num_layers=32,
                                             num_heads=4, num_kv_heads=2, intermediate_size=1024, vocab_size=1024,
                                             max_position_embeddings=1024, dtype="bfloat16", overwrite=True)
        build_engine(checkpoint, out, BuildConfig(dtype="bfloat16", max_batch_size=64, max_seq_len=1024,
                                                  max_num_tokens=256, targets=(ARCH,)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, default=Path("engines/launch-host"))
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--decodes", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    engine = load_engine(engine_dir(args.work_dir), target=ARCH)
    m = engine.manifest
    per_seq = m.blocks_per_sequence
    probe = HostProbe(engine, (args.decodes + 1) * per_seq)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(args.decodes + 1)]
    chunks = [SequenceChunk(list(range(100, 100 + args.prompt)), 0, tables[0])]
    chunks += [SequenceChunk([5 + i], 200, tables[1 + i]) for i in range(args.decodes)]
    dims, values = probe._begin(pack_step(chunks, m.kv.block_size, per_seq), ())
    probe._launch(dims, values, 0)  # the first step of a shape fills the caches
    HostOnlyKernel.launches = 0
    profiler = cProfile.Profile() if args.profile else None
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        if profiler:
            profiler.enable()
        probe._launch(dims, values, 0)
        if profiler:
            profiler.disable()
        times.append((time.perf_counter() - start) * 1e3)
    print(f"{m.kv.num_layers}-layer engine, {args.prompt}-token prefill + {args.decodes} decode rows: "
          f"{HostOnlyKernel.launches // REPEATS} launches, host work {statistics.median(times):.3f} ms a step "
          f"(median of {REPEATS}; min {min(times):.3f})")
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
