"""Decode step times of two or more source revisions, side by side on one machine (a developer's tool).

BENCHMARKS.md compares times only within one run, and one engine's figures move by several percent
between machines: more than most changes gain.

    python3 scripts/ab_decode.py prepare DIR REV [NAME=REV ...]   # in the git checkout: a source tree per revision
    python3 scripts/ab_decode.py run DIR [--batch-sizes 1,8,64] [--rounds 2] [--build-flags "--quantization fp8"]
                                         [--profile 8,64]

`prepare` writes each revision's tracked files (`git archive`) to DIR/NAME (NAME: the short commit unless
given). `run`, on the GPU machine: writes the random checkpoint (`--model`, Llama-3-8B's shape by default)
once into the work folder, builds every tree's engine from it at the same time (each build with its own
tree first on PYTHONPATH, so each compiles its own kernels), then runs `bench-engine --only decode` on the
engines in turn, `--rounds` times, each round starting one tree later than the one before. It prints, per
batch size, each tree's graph-replay and end-to-end step time (the fastest round's) and their ratios to the
first tree's, with how far its slowest round was from its fastest, and writes them with every bench
result to OUT/ab.json (OUT: --out, else $OUT, else DIR). `--profile` then runs each tree's own
`scripts/profile_decode.py --json` on its engine at those batch sizes and prints each kind of op's time side
by side. An 8B engine is as large as its checkpoint (16 GB in bf16): a checkpoint and two engines fill most
of a 64 GB disk (`--layers 16` halves both). On a machine without a GPU,
`--model tiny --build-flags "--max-seq-len 256 --max-num-tokens 256" --bench-flags "--decode-context 16"`
runs the same path in seconds.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from kiln.bench.model import SHAPES, ensure_checkpoint

BENCH = "from kiln.bench.cli import bench_engine; bench_engine()"
BUILD = "from kiln.builder.cli import build_engine; build_engine()"
ORDER = "trees.txt"   # the trees in `prepare`'s order: the first is the baseline


def prepare(folder: Path, revisions: list[str]) -> None:
    """One source tree per revision under `folder`, from git (run in the checkout)."""
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for spec in revisions:
        name, _, rev = spec.rpartition("=")
        commit = subprocess.run(["git", "rev-parse", "--short", rev], capture_output=True, text=True, check=True)
        name = name or commit.stdout.strip()
        tree = folder / name
        shutil.rmtree(tree, ignore_errors=True)
        tree.mkdir()
        archive = subprocess.run(["git", "archive", rev], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        names.append(name)
        print(f"{name}: {rev} ({commit.stdout.strip()}) -> {tree}")
    (folder / ORDER).write_text("\n".join(names) + "\n")


def _env(tree: Path) -> dict[str, str]:
    """The environment that runs `tree`'s sources: it first on PYTHONPATH, what was there after. The
    commands also run in `tree`: `python -c` puts its working folder ahead of PYTHONPATH, and from the
    checkout every tree would import the checkout's `kiln` (as session 37's A/Bs did)."""
    path = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def _run(cmd: list[str], tree: Path, log: Path, timeout: float) -> None:
    """Run `cmd` with `tree`'s sources, its output to `log`; a failure ends the A/B with the log's tail."""
    with log.open("w") as f:
        code = subprocess.run(cmd, env=_env(tree), cwd=tree, stdout=f, stderr=subprocess.STDOUT,
                              timeout=timeout).returncode
    if code != 0:
        sys.exit(f"{' '.join(cmd[:3])} ... failed ({code}) for {tree.name}:\n" + "".join(log.read_text().splitlines(True)[-15:]))


def check_imports(trees: list[Path]) -> None:
    """Refuse to compare trees that would not run their own sources."""
    for tree in trees:
        found = subprocess.run([sys.executable, "-c", "import kiln.plugins; print(kiln.plugins.__file__)"],
                               env=_env(tree), cwd=tree, capture_output=True, text=True)
        where = Path(found.stdout.strip() or "?").resolve()
        if found.returncode != 0 or tree.resolve() not in where.parents:
            sys.exit(f"{tree.name}'s commands import kiln from {where}, not from the tree:\n{found.stderr[-2000:]}")


def build_all(trees: list[Path], ckpt: Path, work: Path, flags: list[str]) -> dict[str, Path]:
    """Every tree's engine of `ckpt`, built at the same time; returns them by tree name."""
    engines, jobs = {}, []
    for tree in trees:
        engine = work / "engines" / tree.name
        shutil.rmtree(engine, ignore_errors=True)
        log = (work / f"build-{tree.name}.log").open("w")
        jobs.append((tree, log, subprocess.Popen(
            [sys.executable, "-c", BUILD, "--checkpoint", str(ckpt), "--output", str(engine), "--quiet", *flags],
            env=_env(tree), cwd=tree, stdout=log, stderr=subprocess.STDOUT)))
        engines[tree.name] = engine
    for tree, log, job in jobs:
        code = job.wait()
        log.close()
        if code != 0:
            tail = "".join(Path(log.name).read_text().splitlines(True)[-15:])
            sys.exit(f"build-engine failed ({code}) for {tree.name}:\n{tail}")
    return engines


def summary(results: dict[str, list[dict]]) -> list[str]:
    """Per batch size, each tree's fastest graph-replay (ms, where the executor has graphs) and end-to-end step
    time over its rounds, their ratios to the first tree's, and the spread of its replay times (slowest over
    fastest; of its end-to-end times where there are no graphs). The fastest, not the median: what slows a bench down (another process, a clock, the disk) only
    adds, and in session 39 two of main's second rounds at b=64 came out 2.5% slow, which a median of two
    rounds halves into the comparison."""
    rows: dict[int, dict[str, list[tuple]]] = {}
    notes: set[str] = set()
    for name, runs in results.items():
        for run in runs:
            for fig in run["decode"]:
                if fig.get("ms_per_step") is not None:
                    rows.setdefault(fig["batch"], {}).setdefault(name, []).append(
                        (fig.get("replay_ms_per_step"), fig["ms_per_step"]))
                elif fig.get("note"):
                    notes.add(f"{name}, {fig['name']}: {fig['note']}")
    lines = [f"{'batch':>5}  {'tree':<16} {'replay ms':>10} {'vs first':>8} {'spread':>7} "
             f"{'end to end ms':>14} {'vs first':>8}"]
    for batch in sorted(rows):
        base = None
        for name in results:
            if name not in rows[batch]:
                continue
            replays = [r for r, _ in rows[batch][name] if r is not None]
            e2es = [e for _, e in rows[batch][name]]
            replay, e2e = min(replays, default=None), min(e2es)
            base = base or (replay, e2e)
            times = replays or e2es   # the spread of what the executor has: graph replays, else whole steps
            shown = f"{'-':>10} {'-':>8}" if replay is None or base[0] is None else \
                f"{replay:>10.3f} {replay / base[0]:>8.3f}"
            lines.append(f"{batch:>5}  {name:<16} {shown} {max(times) / min(times) - 1:>7.1%} {e2e:>14.3f} "
                         f"{e2e / base[1]:>8.3f}")
    return lines + sorted(notes)


def profiles(trees: list[Path], engines: dict[str, Path], work: Path, batches: str, context: int) -> list[str]:
    """Each tree's per-op profile of its engine (`scripts/profile_decode.py`), as a table: us a launch of each
    kind of op, and the step's ms, by tree."""
    found: dict[str, list[dict]] = {}
    for tree in trees:
        path = work / f"profile-{tree.name}.json"
        _run([sys.executable, str(tree / "scripts" / "profile_decode.py"), str(engines[tree.name]), "--context",
              str(context), *[a for b in batches.split(",") for a in ("--batch", b)], "--json", str(path)],
             tree, work / f"profile-{tree.name}.log", 600)
        found[tree.name] = json.loads(path.read_text())
    return profile_table(found, context)


def profile_table(found: dict[str, list[dict]], context: int) -> list[str]:
    """The profiles of `profiles`, by tree: each kind of op's us a launch alone, then in the step (a tree
    whose profile_decode predates that figure shows '-')."""
    def cell(result: dict, key: str, kind: str) -> str:
        value = result.get(key, {}).get(kind)
        return f"{value:9.1f}" if value is not None else f"{'-':>9}"

    lines = []
    for i, first in enumerate(next(iter(found.values()))):
        for key, what in (("us_each", "alone"), ("us_in_step", "in the step (the step less the step without them)")):
            lines.append(f"profile, batch {first['batch']}, context {context}: us a launch, {what} "
                         f"({', '.join(found)})")
            for kind in first["us_each"]:
                lines.append(f"  {kind:18s} " + " ".join(cell(found[t][i], key, kind) for t in found))
        lines.append(f"  {'step (ms)':18s} " + " ".join(f"{found[t][i]['step_ms']:9.3f}" for t in found))
    return lines


def run(folder: Path, args: argparse.Namespace) -> None:
    order = folder / ORDER
    trees = [folder / name for name in order.read_text().split()] if order.is_file() else []
    if len(trees) < 2:
        sys.exit(f"{folder} holds {len(trees)} source tree(s); `prepare` two or more first")
    work = Path(args.work).resolve()
    out = Path(args.out or os.environ.get("OUT") or folder)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    check_imports(trees)
    start = time.monotonic()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = SHAPES[args.model]
    if args.layers:
        shape = dataclasses.replace(shape, num_layers=args.layers)
    ckpt, _ = ensure_checkpoint(work, shape, "bfloat16", device)
    print(f"checkpoint {ckpt} ({time.monotonic() - start:.0f} s)", flush=True)
    flags = ["--dtype", "bfloat16", "--max-batch-size", str(max(map(int, args.batch_sizes.split(",")))),
             *args.build_flags.split()]
    engines = build_all(trees, ckpt, work, flags)
    # The engines' bytes go to disk now, not while the first bench runs: in session 37 the first bench after
    # the builds showed 6-11% of its step as host time where the later ones showed 1-2%.
    os.sync()
    print(f"built {', '.join(engines)} ({time.monotonic() - start:.0f} s)", flush=True)
    results: dict[str, list[dict]] = {t.name: [] for t in trees}
    for round_ in range(args.rounds):
        # A tree's place in the order moves every round, so no tree always follows the same one.
        for tree in trees[round_ % len(trees):] + trees[:round_ % len(trees)]:
            path = work / f"bench-{tree.name}-{round_}.json"
            _run([sys.executable, "-c", BENCH, "--engine", str(engines[tree.name]), "--only", "decode",
                  "--batch-sizes", args.batch_sizes, "--no-baseline", "--json", str(path), *args.bench_flags.split()],
                 tree, work / f"bench-{tree.name}-{round_}.log", 900)
            results[tree.name].append(json.loads(path.read_text()))
            print(f"round {round_ + 1}, {tree.name} ({time.monotonic() - start:.0f} s)", flush=True)
            # Rewritten after every bench, so a run stopped by a time limit leaves what it measured.
            lines = summary(results)
            (out / "ab.json").write_text(json.dumps({"summary": lines, "results": results}, indent=1))
    if args.profile:
        lines += profiles(trees, engines, work, args.profile, args.context)
        (out / "ab.json").write_text(json.dumps({"summary": lines, "results": results}, indent=1))
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("prepare", "run"))
    parser.add_argument("dir", help="the folder of source trees")
    parser.add_argument("revisions", nargs="*", help="prepare: git revisions, NAME=REV to name a tree")
    parser.add_argument("--batch-sizes", default="1,8,64,256", help="bench-engine's (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=2, help="benches of every engine, alternating (default 2)")
    parser.add_argument("--build-flags", default="--max-seq-len 4352 --max-num-tokens 8192",
                        help="build-engine's flags beside --checkpoint, --output, --dtype and --max-batch-size "
                             "(default %(default)s)")
    parser.add_argument("--bench-flags", default="", help='more bench-engine flags, e.g. "--decode-context 512"')
    parser.add_argument("--model", default="llama3-8b", help="the random checkpoint's shape (bench.model.SHAPES)")
    parser.add_argument("--layers", type=int, help="the model's layers instead of the shape's: fewer make smaller "
                                                   "engines, so more trees fit a disk")
    parser.add_argument("--work", default="engines/gpu-work/ab",
                        help="where the checkpoint and engines go (default %(default)s)")
    parser.add_argument("--out", help="where ab.json goes (default: $OUT, else DIR)")
    parser.add_argument("--profile", help="batch sizes to profile op by op after the benches, e.g. 8,64 (GPU only)")
    parser.add_argument("--context", type=int, default=160, help="the profiles' context length (default %(default)s)")
    args = parser.parse_args()
    folder = Path(args.dir).resolve()
    if args.action == "prepare":
        if not args.revisions:
            parser.error("prepare needs one or more revisions")
        prepare(folder, args.revisions)
    else:
        run(folder, args)


if __name__ == "__main__":
    main()
