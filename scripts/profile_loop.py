"""What the GPU does between decode steps in the real engine loop: a developer's profile, not a benchmark.

    PYTHONPATH=. python3 scripts/profile_loop.py ENGINE_DIR [--batch 1 [--batch 8 ...]] [--context 128] [--steps 16]
        [--timeline N]

For each `batch`, that many requests decode through one EngineCore (the overlapped loop, as bench-engine's decode
figures run), and torch.profiler records `steps` steady decode steps. Per step, from its inputs' upload to
the next step's: the time in the plan's kernels (the decode graph's), the time in everything
else the GPU ran (staging copies, the sampler's kernels, the ids' copy to the host) and the idle gaps,
with each activity outside the plan listed once with its mean duration. bench-engine's host share is
what this splits up. Then the plan's kernels by entry point (each one's time a step: the FP8 quantize
pre-passes apart from their GEMMs, for one) and the idle time between them inside the graph, which
is what the step loses to kernel boundaries. With --timeline, a median step's first N plan launches one by
one: when each started and ended, which shows what ran beside what (a programmatic launch starts while the
kernel before runs, once that kernel's blocks leave it the registers) and where the memory sat idle.
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


def plan_gaps(step: list[dict], plan: set[str]) -> tuple[float, int]:
    """The idle time between one plan kernel's end and the next one's start within a step (where
    the next starts before the previous ends, as programmatic launches do, nothing), and how many
    such boundaries there are: what kernel boundaries cost inside the graph."""
    kernels = [e for e in step if e["name"] in plan]
    gaps = [max(0.0, b["ts"] - (a["ts"] + a["dur"])) for a, b in zip(kernels, kernels[1:])]
    return sum(gaps), len(gaps)


def timeline(step: list[dict], plan: set[str]) -> list[tuple[float, float, float, str]]:
    """A step's plan kernels in start order: each one's start and end in us after the first one started,
    and how far its end moved the step on (its end less the latest end before it; nothing where it ended
    earlier). A programmatic dependent's profiled time starts at its launch and includes its wait for the
    kernel before, so its duration says little; its end is when its work was done."""
    rows, first, done = [], None, None
    for e in step:
        if e["name"] not in plan:
            continue
        end = e["ts"] + e["dur"]
        first = e["ts"] if first is None else first
        rows.append((e["ts"] - first, end - first, end - e["ts"] if done is None else max(0.0, end - done), e["name"]))
        done = end if done is None else max(done, end)
    return rows


def plan_advance(step: list[dict], plan: set[str]) -> dict[str, float]:
    """How far each plan kernel moved the step's end on, by entry point (`timeline`'s third column, summed).
    Summed over a step this is the plan kernels' span."""
    advance: dict[str, float] = defaultdict(float)
    for _, _, moved, name in timeline(step, plan):
        advance[name] += moved
    return advance


def summarize(steps: list[tuple[list[dict], float]], plan: set[str], launches: int = 0) -> None:
    inside, outside, idle, span, gaps = [], [], [], [], []
    others: dict[str, list[float]] = defaultdict(list)
    kernels: dict[str, list[float]] = defaultdict(list)
    advances: dict[str, float] = defaultdict(float)
    boundaries = 0
    for step, end in steps:
        busy = planned = other = 0.0
        cursor = step[0]["ts"]
        for e in step:
            busy += max(0.0, e["ts"] + e["dur"] - max(cursor, e["ts"]))   # overlapping activities count once
            cursor = max(cursor, e["ts"] + e["dur"])
            if e["name"] in plan:
                planned += e["dur"]
                kernels[e["name"]].append(e["dur"])
            else:
                other += e["dur"]
                others[e["name"]].append(e["dur"])
        inside.append(planned)
        outside.append(other)
        span.append(end - step[0]["ts"])
        idle.append(span[-1] - busy)
        gap, boundaries = plan_gaps(step, plan)
        gaps.append(gap)
        for name, us in plan_advance(step, plan).items():
            advances[name] += us
    n = len(steps)
    print(f"{n} steps: span {statistics.median(span):.1f} us ({min(span):.1f}-{max(span):.1f}), "
          f"plan kernels {statistics.median(inside):.1f}, "
          f"other GPU work {statistics.median(outside):.1f}, idle {statistics.median(idle):.1f} (medians)")
    for name, durs in sorted(others.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {len(durs) / n:4.1f}x a step  {statistics.mean(durs):7.1f} us  {name[:110]}")
    print(f"plan kernels by entry point, per step (idle between them: {statistics.median(gaps):.1f} us over "
          f"{boundaries} boundaries, a median step); 'ends' is how far its ends moved the step on (plan_advance):")
    for name, durs in sorted(kernels.items(), key=lambda kv: -advances[kv[0]]):
        print(f"  {len(durs) / n:5.1f}x {sum(durs) / n:8.1f} us  (mean {statistics.mean(durs):6.1f}, "
              f"ends {advances[name] / n:7.1f})  {name[:90]}")
    if launches:
        # The step of median span, so that one odd step does not stand for the rest.
        step = sorted(steps, key=lambda s: s[1] - s[0][0]["ts"])[n // 2][0]
        print(f"the first {launches} plan launches of a median step, in us after the first one started:")
        print("   start      end    ends  kernel")
        for start, end, moved, name in timeline(step, plan)[:launches]:
            print(f"{start:8.1f} {end:8.1f} {moved:7.1f}  {name[:90]}")


def profile_batch(core: EngineCore, batch: int, context: int, steps: int, plan: set[str], launches: int) -> None:
    """Profile `steps` steady decode steps of `batch` fresh requests, then cancel them."""
    vocab = core.engine.manifest.vocab_size
    params = SamplingParams(max_tokens=steps * 3 + 16, temperature=0.0, ignore_eos=True)
    requests = [core.add_request(f"b{batch}-r{i}", prompt, params)
                for i, prompt in enumerate(random_prompts(batch, context, vocab, 0))]
    while not all(r.seqs[0].output_ids for r in requests):
        core.step()
    for _ in range(4):   # warm-up decode steps
        core.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps + 2):
            core.step()
        torch.cuda.synchronize()
    print(f"batch {batch}, context {context}")
    summarize(split_steps(gpu_timeline(prof))[1:-1], plan, launches)
    for r in requests:
        core.cancel(r.request_id)
    while core.has_work():
        core.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine")
    parser.add_argument("--batch", type=int, action="append", help="repeatable (default 1)")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--timeline", type=int, default=0, metavar="N",
                        help="also print a median step's first N plan launches: start, end, how far each moved it on")
    args = parser.parse_args()
    core = EngineCore(args.engine, device="cuda")
    # The plan's kernels are the graph's: the ones whose names the engine's kernel index holds.
    plan = {info.entry for info in core.engine.manifest.kernels.values()}
    for batch in args.batch or [1]:
        profile_batch(core, batch, args.context, args.steps, plan, args.timeline)
    core.close()


if __name__ == "__main__":
    main()
