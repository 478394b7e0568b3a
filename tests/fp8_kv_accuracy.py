"""What the FP8 KV-cache accuracy check measures, shared by tests/test_fp8_kv_accuracy.py (CPU)
and scripts/fp8_kv_accuracy.py (GPU): the perplexity of one engine on a fixed text, teacher
forced through `kiln_teacher_forced`, and how often two engines' greedy tokens agree."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from kiln import SamplingParams, Session
from passages import text_tokens, token_nlls


@dataclass(frozen=True)
class Fp8KvAccuracy:
    perplexity_model_dtype: float
    perplexity_fp8: float
    # The standard error of the mean per-token difference in log-likelihood, about that of perplexity_change:
    # what separates a change from the noise of the tokens scored.
    change_stderr: float
    greedy_agreement: float      # share of generated positions where both engines' tokens agree
    identical_completions: int
    completions: int
    tokens_scored: int

    @property
    def perplexity_change(self) -> float:
        """Relative change of the FP8-KV engine's perplexity against the model-dtype cache's."""
        return self.perplexity_fp8 / self.perplexity_model_dtype - 1

    def to_json(self) -> dict:
        return {**asdict(self), "perplexity_change": self.perplexity_change}


def greedy(engine_dir, device: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with Session(engine_dir, device=device) as session:
        return [o.outputs[0].token_ids for o in session.generate(prompt_token_ids=prompts, sampling_params=params)]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of positions where the two completions agree (position by position)."""
    same = sum(x == y for ta, tb in zip(a, b, strict=True) for x, y in zip(ta, tb, strict=True))
    return same / sum(len(t) for t in a)


def measure(model_dtype_engine, fp8_engine, device: str, prompts: list[list[int]], max_tokens: int) -> Fp8KvAccuracy:
    texts = text_tokens(model_dtype_engine)
    plain, fp8 = greedy(model_dtype_engine, device, prompts, max_tokens), greedy(fp8_engine, device, prompts, max_tokens)
    reference, quantized = token_nlls(model_dtype_engine, device, texts), token_nlls(fp8_engine, device, texts)
    difference = quantized - reference
    return Fp8KvAccuracy(math.exp(float(reference.mean())), math.exp(float(quantized.mean())),
                         float(difference.std() / math.sqrt(difference.numel())), agreement(plain, fp8),
                         sum(x == y for x, y in zip(plain, fp8)), len(prompts), difference.numel())
