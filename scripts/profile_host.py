"""The engine loop's host work per decode step at a large batch, without the model (a developer's
profile, not a benchmark of the engine).

    PYTHONPATH=. python3 scripts/profile_host.py ENGINE_DIR [--batch 1024] [--steps 40] [--profile]

ENGINE_DIR is any engine the CPU can open whose --max-batch-size covers the batch (a tiny one
does: the model is not run). The executor's `execute` is replaced by one that answers at once
with made-up token ids, so a step's time is what the host spends scheduling, packing, picking,
appending and detokenizing: the part of a step that the overlapped loop must hide behind the
GPU's. `--profile` adds cProfile's top functions. Session 14 (2026-11-30) took it from 14.0 to
11.7 ms a step at 1,024 sequences on the CPU machine.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import time

import torch

from kiln.runtime.engine_core import EngineCore
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.step import SampledIds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    core = EngineCore(args.engine, device="cpu")
    vocab = core.engine.manifest.vocab_size
    rng = random.Random(0)
    # Enough tokens that no sequence finishes while the first ones wait for the last prefill.
    prefill_steps = args.batch * args.prompt_len // core.engine.manifest.max_num_tokens
    params = SamplingParams(max_tokens=args.steps + prefill_steps + 10, temperature=0.0, ignore_eos=True)
    requests = [core.add_request(f"r{i}", [rng.randrange(vocab) for _ in range(args.prompt_len)], params)
                for i in range(args.batch)]

    def answer(step, copies=(), feed=None, picks=None):
        if picks is None:
            return None
        ids = torch.tensor([(7 * i + len(picks.rows)) % vocab for i in range(len(picks.rows))])
        return SampledIds(ids, [None] * len(picks.rows))

    core.executor.execute = answer
    while not all(r.seqs[0].output_ids for r in requests):
        core.step()
    profiler = cProfile.Profile() if args.profile else None
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        if profiler:
            profiler.enable()
        core.step()
        if profiler:
            profiler.disable()
        times.append((time.perf_counter() - start) * 1e3)
    print(f"batch {args.batch}: host work {statistics.median(times):.2f} ms a step (median of {args.steps}; "
          f"min {min(times):.2f}, max {max(times):.2f})")
    if profiler:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats("runtime/", 20)
    core.close()


if __name__ == "__main__":
    main()
