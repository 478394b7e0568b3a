"""Issue 14's accuracy check on trained weights, shared by tests/test_fp8_accuracy.py (CPU) and
scripts/fp8_accuracy_gpu.py: a real model's GGUF built as a bf16 engine and as an FP8 one
(--quantization fp8), over 32 chat prompts x 64 greedy tokens of the bf16 engine: the share of
positions where the FP8 engine's greedy token, given the same context, is the bf16 engine's
(teacher-forced, bar 0.90); and the perplexity of a fixed English paragraph, teacher-forced,
within 2% of the bf16 engine's. Two models (`real_models.MODELS`), each with its own prompts:

- Gemma 3 270M (base, Q4_K_M; its turn format, `gemma_turn_prompts`): agreement 0.983,
  perplexity 25.124 -> 25.396 (ratio 1.011) on the CPU. Both bars met.
- SmolLM2-135M-Instruct (Q4_1; its chat template): agreement 0.934; perplexity 35.85 -> 37.85
  (ratio 1.056; on another machine, an AMD EPYC without AVX512-BF16, 35.73 -> 38.01, 1.064), of
  which the weights' e4m3 rounding alone gives 37.89 (the activations' per-token quantization
  adds nothing measurable); o, gate/up and down projections each add 1-3%. The 2% bar is not
  met on this 30-layer 135M model.

With static activation scales (`--calibration-prompts`, CALIBRATION's eight questions), on the CPU
(session 42, where the per-token engine gave Gemma 3 270M 0.986 and a perplexity ratio of 1.0145, and
SmolLM2 0.922 and 1.073):

| static scales on | Gemma 3 270M: agreement, perplexity ratio | SmolLM2-135M |
| --- | --- | --- |
| o_proj and down (what calibration gives since session 42) | 0.971, 1.013 | 0.918, 1.093 |
| qkv and gate/up only | 0.984, 1.024 | |
| every projection (session 40, another CPU) | 0.971, 1.026 | 0.912, 1.099 |

Since session 49 a per-token scale after an unfolded norm weight is rstd * max |x * g| (`plugins.fp8`),
within a bf16 rounding of the normalized row's largest magnitude used before: on this CPU the
per-token engines then gave Gemma 3 270M 0.985 and 1.0135, SmolLM2 0.924 and 1.084 (1.071 before,
within the ratio's chaos: tests/test_fp8_accuracy.py); with static scales 0.973, 1.031 and 0.910,
1.081.

The projections after an RMSNorm gain no launch from a static scale (their norm reads the row anyway),
so they keep per-token scales (`builder.passes.quantize.PER_TOKEN_OPS`)."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from parity_tools import (argmax_agreement, cached_engine, free_gpu, kiln_generate, kiln_teacher_forced,
                          open_executor)
from real_models import CHAT_QUESTIONS, cached, chat_prompts, gemma_turn_prompts

# Each model and how its chat prompts are made (the Gemma GGUF carries no chat template).
PROMPTS = {"gemma3-270m": gemma_turn_prompts, "smollm2-135m": chat_prompts}
MODELS = tuple(PROMPTS)
NUM_PROMPTS, MAX_TOKENS = 32, 64
AGREEMENT, PERPLEXITY_RATIO = 0.90, 1.02
BUILD = dict(max_seq_len=192, max_num_tokens=256, max_batch_size=64, kv_block_size=16)
TEXT = ("The river runs past the old mill and under the stone bridge before it reaches the town. In spring "
        "the water rises with the melting snow from the hills, and the farmers watch the fields along its "
        "banks with care. Children walk to school over the bridge each morning, and in the evening the "
        "fishermen sit on the wall with their lines in the water. The mill has not ground grain for many "
        "years, but the town keeps its wheel turning because visitors like to see it. A small museum inside "
        "tells the story of the families who worked there, the floods they survived, and the bread they sold "
        "at the market every Saturday.")


# --calibration-prompts for static activation scales: chat questions of their own, none of the ones measured.
CALIBRATION = ["How do bees make honey?", "Summarize the plot of a fairy tale you know.",
               "What should I pack for a weekend of hiking?", "Explain what a database index is for.",
               "Write two sentences about the ocean at night.", "Why do leaves change colour in autumn?",
               "What is the difference between weather and climate?", "Give me a recipe for a simple soup."]


@dataclass(frozen=True)
class Engines:
    model: str   # a name of MODELS
    bf16: Path
    fp8: Path


def engines(workdir: Path, targets: list[str], model: str, static: bool = False) -> Engines | None:
    """`model`'s bf16 and FP8 engines, built once; the FP8 one with static activation scales from
    CALIBRATION when `static`. None when its GGUF is not in this machine's cache."""
    files = cached(model)
    if files is None:
        return None
    extra = ("--quantization", "fp8")
    if static:
        prompts = workdir / "calibration-prompts.txt"
        prompts.write_text("\n".join(CALIBRATION) + "\n")
        extra += ("--calibration-prompts", str(prompts))
    return Engines(model, cached_engine(workdir, files.gguf, targets, "bfloat16", **BUILD),
                   cached_engine(workdir, files.gguf, targets, "bfloat16", **BUILD, extra=extra))


def _run(engine: Path, device: str, work):
    free_gpu()
    executor = open_executor(engine, device)
    try:
        return work(executor)
    finally:
        executor.close()


@functools.cache
def _bf16_greedy(bf16: Path, model: str, device: str) -> tuple[list[list[int]], list[list[int]]]:
    """The chat prompts and the bf16 engine's greedy tokens for them: once a process per engine, which the
    per-token and the static FP8 engines of a model are both measured against."""
    prompts = PROMPTS[model](bf16, CHAT_QUESTIONS[:NUM_PROMPTS])
    return prompts, kiln_generate(bf16, device, prompts, MAX_TOKENS)


def greedy_agreement(e: Engines, device: str) -> float:
    """The share of the bf16 engine's greedy tokens (32 chat prompts x 64) that the FP8 engine
    also picks from the same context."""
    prompts, tokens = _bf16_greedy(e.bf16, e.model, device)
    forced = _run(e.fp8, device, lambda ex: [kiln_teacher_forced(ex, p, t) for p, t in zip(prompts, tokens)])
    return argmax_agreement(tokens, forced)[0]


def _perplexity(engine: Path, device: str, ids: tuple[int, ...]) -> float:
    def measure(executor) -> float:
        logits = kiln_teacher_forced(executor, list(ids[:1]), list(ids[1:]))
        return math.exp(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])).item())
    return _run(engine, device, measure)


_bf16_perplexity = functools.cache(_perplexity)


def perplexities(e: Engines, device: str) -> tuple[float, float, int]:
    """(bf16 perplexity, FP8 perplexity, tokens) of TEXT, teacher-forced (the bf16 engine's once a process)."""
    from tokenizers import Tokenizer
    ids = tuple(Tokenizer.from_file(str(e.bf16 / "tokenizer.json")).encode(TEXT).ids)
    return _bf16_perplexity(e.bf16, device, ids), _perplexity(e.fp8, device, ids), len(ids)


def report(model: str, agreement: float, ppl: tuple[float, float, int], targets: list[str]) -> str:
    bf16, fp8, n = ppl
    return (f"{model} fp8 engine vs bf16 engine ({', '.join(targets)}): teacher-forced greedy agreement over "
            f"{NUM_PROMPTS} chat prompts x {MAX_TOKENS} tokens {agreement:.4f} (bar {AGREEMENT}); perplexity of a "
            f"{n}-token paragraph bf16 {bf16:.3f}, fp8 {fp8:.3f} (ratio {fp8 / bf16:.4f}, bar {PERPLEXITY_RATIO})")


def passed(agreement: float, ppl: tuple[float, float, int]) -> bool:
    return agreement >= AGREEMENT and ppl[1] <= ppl[0] * PERPLEXITY_RATIO
