"""What the GPU does between decode steps in the real engine loop: a developer's profile, not a benchmark.

    PYTHONPATH=. python3 scripts/profile_loop.py ENGINE_DIR [--batch 1] [--context 128] [--steps 16]

`batch` requests decode through an EngineCore (the overlapped loop, as bench-engine's decode figures
run), and torch.profiler records `steps` steady decode steps. Per step, from its inputs' upload to
the next step's: the time in the plan's kernels (the decode graph's), the time in everything
else the GPU ran (staging copies, the sampler's kernels, the ids' copy to the host) and the idle gaps,
with each activity outside the plan listed once with its mean duration. bench-engine's host share is
what this splits up.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from kiln.bench.driver import random_prompts
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.sampling_params import SamplingParams

GPU_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")


def gpu_timeline(prof) -> list[dict]:
    """The GPU activities the profiler saw, in start order: name, start and duration in us."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    return sorted(({"name": e["name"], "ts": float(e["ts"]), "dur": float(e.get("dur", 0))}
                   for e in events if e.get("cat") in GPU_EVENTS), key=lambda e: e["ts"])


def split_steps(timeline: list[dict]) -> list[tuple[list[dict], float]]:
    """The timeline cut where each step's inputs go up (the one host-to-device copy a step makes):
    each whole step's activities, and the next step's start. The plan's kernels do not mark a
    step's start: one can run more than once a step."""
    starts = [i for i, e in enumerate(timeline) if e["name"].startswith("Memcpy HtoD")]
    return [(timeline[a:b], timeline[b]["ts"]) for a, b in zip(starts, starts[1:])]


def summarize(steps: list[tuple[list[dict], float]], plan: set[str]) -> None:
    inside, outside, idle, span = [], [], [], []
    others: dict[str, list[float]] = defaultdict(list)
    for step, end in steps:
        busy = planned = other = 0.0
        cursor = step[0]["ts"]
        for e in step:
            busy += max(0.0, e["ts"] + e["dur"] - max(cursor, e["ts"]))   # overlapping activities count once
            cursor = max(cursor, e["ts"] + e["dur"])
            if e["name"] in plan:
                planned += e["dur"]
            else:
                other += e["dur"]
                others[e["name"]].append(e["dur"])
        inside.append(planned)
        outside.append(other)
        span.append(end - step[0]["ts"])
        idle.append(span[-1] - busy)
    n = len(steps)
    print(f"{n} steps: span {statistics.median(span):.1f} us ({min(span):.1f}-{max(span):.1f}), "
          f"plan kernels {statistics.median(inside):.1f}, "
          f"other GPU work {statistics.median(outside):.1f}, idle {statistics.median(idle):.1f} (medians)")
    for name, durs in sorted(others.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {len(durs) / n:4.1f}x a step  {statistics.mean(durs):7.1f} us  {name[:110]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    core = EngineCore(args.engine, device="cuda")
    vocab = core.engine.manifest.vocab_size
    params = SamplingParams(max_tokens=args.steps * 3 + 16, temperature=0.0, ignore_eos=True)
    requests = [core.add_request(f"r{i}", prompt, params)
                for i, prompt in enumerate(random_prompts(args.batch, args.context, vocab, 0))]
    while not all(r.seqs[0].output_ids for r in requests):
        core.step()
    for _ in range(4):   # warm-up decode steps
        core.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps + 2):
            core.step()
        torch.cuda.synchronize()
    timeline = gpu_timeline(prof)
    # The plan's kernels are the graph's: the ones whose names the engine's kernel index holds.
    plan = {info.entry for info in core.engine.manifest.kernels.values()}
    print(f"batch {args.batch}, context {args.context}")
    summarize(split_steps(timeline)[1:-1], plan)
    core.close()


if __name__ == "__main__":
    main()
