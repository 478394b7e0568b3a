"""What the FP8 KV-cache accuracy check measures, shared by tests/test_fp8_kv_accuracy.py (CPU)
and scripts/fp8_kv_accuracy.py (GPU): the perplexity of one engine on a fixed text, teacher
forced through `kiln_teacher_forced`, and how often two engines' greedy tokens agree."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from kiln import SamplingParams, Session
from parity_tools import kiln_teacher_forced, open_executor

# A fixed English text (written for this check), long enough for a few hundred tokens.
TEXT = (
    "The river that runs through the old town was once the only road to the sea. Barges carried wool, "
    "salt and timber down to the harbour, and came back with spices, glass and news from distant ports. "
    "When the railway arrived, the barges grew fewer every year, and the warehouses along the water were "
    "turned into workshops, then into houses. Today children learn to swim where the boatmen used to load "
    "their cargo, and in summer the quay is crowded with people eating ice cream and watching the light "
    "change on the water. The town museum keeps a model of the last barge, built by a retired carpenter who "
    "had worked on it as a boy. He liked to say that a river remembers everything: every flood, every "
    "drought, every bridge that was built and washed away. Visitors who stop to read the notes beside the "
    "model often leave with the feeling that the town itself is a kind of boat, carried slowly forward by "
    "the current of its own history."
)


@dataclass(frozen=True)
class Fp8KvAccuracy:
    perplexity_model_dtype: float
    perplexity_fp8: float
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


def text_tokens(engine_dir) -> list[int]:
    with Session(engine_dir, device="cpu") as session:
        return session.tokenizer.encode(TEXT, add_special_tokens=False).ids


def perplexity(engine_dir, device: str, tokens: list[int]) -> float:
    """exp of the mean negative log-likelihood of tokens[1:], each given those before it."""
    executor = open_executor(engine_dir, device)
    try:
        logits = kiln_teacher_forced(executor, tokens[:1], tokens[1:])
    finally:
        executor.close()
    nll = torch.nn.functional.cross_entropy(logits.float(), torch.tensor(tokens[1:]))
    return math.exp(float(nll))


def greedy(engine_dir, device: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with Session(engine_dir, device=device) as session:
        return [o.outputs[0].token_ids for o in session.generate(prompt_token_ids=prompts, sampling_params=params)]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of positions where the two completions agree (position by position)."""
    same = sum(x == y for ta, tb in zip(a, b, strict=True) for x, y in zip(ta, tb, strict=True))
    return same / sum(len(t) for t in a)


def measure(model_dtype_engine, fp8_engine, device: str, prompts: list[list[int]], max_tokens: int) -> Fp8KvAccuracy:
    tokens = text_tokens(model_dtype_engine)
    plain, fp8 = greedy(model_dtype_engine, device, prompts, max_tokens), greedy(fp8_engine, device, prompts, max_tokens)
    return Fp8KvAccuracy(perplexity(model_dtype_engine, device, tokens), perplexity(fp8_engine, device, tokens),
                         agreement(plain, fp8), sum(x == y for x, y in zip(plain, fp8)), len(prompts),
                         len(tokens) - 1)
