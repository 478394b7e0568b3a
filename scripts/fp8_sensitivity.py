"""How far a float32-sized nudge moves an engine's logits, unquantized and W8A8 (a developer's
tool; the measurement behind tests/test_fp8_gpu.py's design, BENCHMARKS.md 2026-11-30).

    .venv/bin/python scripts/fp8_sensitivity.py [--prompts 8] [--noise 1e-6]

Builds the GPU tests' small random llama3 checkpoint for the CPU (float32, once unquantized and
once with --quantization fp8), generates greedy tokens, then teacher-forces each engine on its
tokens twice: as built, and with the embedding table scaled by 1 + noise * N(0, 1). Printed per
engine: the median relative error of the logits between the two runs and the share of positions
whose argmax moved. A difference of a float32 rounding in the inputs stays that size through an
unquantized engine and grows to the whole quantization noise through a W8A8 one.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from statistics import median

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from parity_tools import (argmax_agreement, cached_checkpoint, cached_engine, kiln_generate,  # noqa: E402
                          kiln_teacher_forced, make_prompts, open_executor, relative_errors)
from test_gpu_parity import BUILD, SMALL  # noqa: E402


def nudged_logits(engine: Path, prompts: list[list[int]], noise: float) -> tuple[float, float]:
    """(median relative logits error, share of moved argmax positions) of the nudged run."""
    tokens = kiln_generate(engine, "cpu", prompts)
    executor = open_executor(engine, "cpu")
    try:
        base = [kiln_teacher_forced(executor, p, t) for p, t in zip(prompts, tokens)]
        generator = torch.Generator().manual_seed(0)
        for name, weight in executor.engine.weights.items():
            if "embed" in name:
                weight.mul_(1 + noise * torch.randn(weight.shape, generator=generator))
        nudged = [kiln_teacher_forced(executor, p, t) for p, t in zip(prompts, tokens)]
    finally:
        executor.close()
    moved = 1 - argmax_agreement([logits.argmax(dim=1).tolist() for logits in nudged], base)[1]
    return median(relative_errors(nudged, base)), moved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8, help="prompts of the GPU tests' set to use")
    parser.add_argument("--noise", type=float, default=1e-6, help="relative size of the nudge")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kiln-fp8-sensitivity-"))
    checkpoint = cached_checkpoint(work, "llama3", **SMALL)
    prompts = make_prompts(SMALL["vocab_size"])[:args.prompts]
    for quantization in ("none", "fp8"):
        engine = cached_engine(work, checkpoint, ["cpu"], "float32", **BUILD, extra=("--quantization", quantization))
        error, moved = nudged_logits(engine, prompts, args.noise)
        print(f"{quantization:>4}: logits moved by a median {error:.2e}, argmax moved on {moved:.1%} of positions")


if __name__ == "__main__":
    main()
