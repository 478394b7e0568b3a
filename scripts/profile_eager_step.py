"""Where an eager GPU step's time goes: steps that are not CUDA graphs (prefill chunks, mixed
steps) launch every kernel from Python, and can be bound by that host work rather than by their
kernels (a developer's profile on the GPU machine, not a benchmark of the engine).

    PYTHONPATH=. python3 scripts/profile_eager_step.py ENGINE_DIR [--prompt 128] [--decodes 2] [--profile]

For a step of one --prompt-token prefill chunk beside --decodes decode rows (and, for comparison,
the same prefill alone and the decode rows alone, which replay a CUDA graph), prints the wall
time per step over 20 back-to-back steps, the host's time to enqueue one step on an idle GPU,
and the kernels' busy time under torch.profiler with the costliest kernels. `--profile` adds
cProfile's top functions of the host work. Session 17 (2026-12-01) found the 8B engine's
128-token prefill step at 7.6 ms of host time for 6.3 ms of kernels, and took it to 6.4.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from collections import defaultdict

import torch

from kiln.runtime.cuda_driver import device_arch
from kiln.runtime.cuda_executor import CudaExecutor
from kiln.runtime.engine import load_engine
from kiln.runtime.step import SequenceChunk, pack_step

REPEATS = 20


def measure(ex: CudaExecutor, name: str, step, profile: bool) -> None:
    for _ in range(5):
        ex.run(step)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(REPEATS):
        ex.run(step)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / REPEATS * 1e3
    profiler = cProfile.Profile() if profile else None
    start = time.perf_counter()
    if profiler:
        profiler.enable()
    ex.run(step)
    if profiler:
        profiler.disable()
    host = (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            ex.run(step)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0]
    by_name: dict[str, float] = defaultdict(float)
    for e in kernels:
        by_name[e.name[:60]] += e.device_time_total / 5
    print(f"{name}: wall {wall:.3f} ms a step, host enqueue {host:.3f} ms, kernels busy "
          f"{sum(by_name.values()) / 1e3:.3f} ms, {len(kernels) // 5} kernels")
    for kernel, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:6]:
        print(f"    {us:9.1f} us  {kernel}")
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--decodes", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    engine = load_engine(args.engine, target=device_arch())
    m = engine.manifest
    if args.prompt + args.decodes > m.max_num_tokens or args.decodes + 1 > m.max_batch_size:
        parser.error(f"the step does not fit the engine's bounds ({m.max_num_tokens} tokens, "
                     f"{m.max_batch_size} sequences)")
    per_seq = m.blocks_per_sequence
    ex = CudaExecutor(engine, (args.decodes + 1) * per_seq)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(args.decodes + 1)]
    prefill = [SequenceChunk(list(range(1000, 1000 + args.prompt)), 0, tables[0])]
    context = min(200, m.max_seq_len - 1)
    decodes = [SequenceChunk([5 + i], context, tables[1 + i]) for i in range(args.decodes)]
    steps = {f"prefill {args.prompt}": prefill, f"prefill {args.prompt} + {args.decodes} decode rows": prefill + decodes}
    if decodes:
        steps[f"{args.decodes} decode rows (graph)"] = decodes
    for name, chunks in steps.items():
        measure(ex, name, pack_step(chunks, m.kv.block_size, per_seq), args.profile)
    ex.close()


if __name__ == "__main__":
    main()
