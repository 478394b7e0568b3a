"""Sampler math on small hand-checked logits, seeded reproducibility, and SamplingParams checks."""
from __future__ import annotations

import math

import pytest
import torch

from kiln.runtime.sampler import (Picks, SequenceSampler, apply_penalties, make_generator, pick_tokens, row_argmax,
                                  sample, sampling_distribution)
from kiln.runtime.sampling_params import SamplingParams

LOGITS = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0])


def _one(logits: torch.Tensor, params: SamplingParams, *, output: list[int] | None = None,
         prompt: list[int] | None = None, generated: int = 0, eos: tuple[int, ...] = (),
         seed: int | None = None):
    result = sample(logits.unsqueeze(0), [params], [make_generator(seed)], [output or []], [prompt or []],
                    [generated], eos)
    return result.tokens[0], result.logprobs[0]


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    out = apply_penalties(LOGITS, SamplingParams(repetition_penalty=2.0), prompt_tokens=[0, 1], output_tokens=[1, 5])
    expected = torch.tensor([2.0 / 2, -1.0 * 2, 0.5, 3.0, -2.0, 1.0 / 2])
    assert torch.equal(out, expected)
    assert torch.equal(LOGITS, torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0]))


def test_presence_and_frequency_penalties_count_output_only():
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(LOGITS, params, prompt_tokens=[2, 2, 2], output_tokens=[3, 3, 3, 0])
    expected = LOGITS.clone()
    expected[3] -= 0.5 + 0.25 * 3
    expected[0] -= 0.5 + 0.25 * 1
    assert torch.allclose(out, expected)


def test_penalties_change_the_greedy_pick():
    assert _one(LOGITS, SamplingParams(temperature=0))[0] == 3
    # 3.0 - (2 presence + 2 * 1 frequency) = -1 puts token 0 (2.0) on top.
    assert _one(LOGITS, SamplingParams(temperature=0, presence_penalty=2, frequency_penalty=1), output=[3])[0] == 0
    # 3.0 / 4 = 0.75 < 2.0.
    assert _one(LOGITS, SamplingParams(temperature=0, repetition_penalty=4), prompt=[3])[0] == 0


def test_min_p_drops_tokens_below_the_threshold():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.05, 0.04, 0.01])
    got = sampling_distribution(probs.log(), SamplingParams(min_p=0.2))  # keeps p >= 0.08
    expected = torch.tensor([0.4, 0.3, 0.2, 0.0, 0.0, 0.0]) / 0.9
    assert torch.allclose(got, expected, atol=1e-6)


def test_top_k_and_top_p_truncate():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.05, 0.04, 0.01])
    top3 = sampling_distribution(probs.log(), SamplingParams(top_k=3))
    assert torch.allclose(top3, torch.tensor([0.4, 0.3, 0.2, 0, 0, 0]) / 0.9, atol=1e-6)
    # 0.4 + 0.3 = 0.7 reaches 0.65; 0.4 alone does not.
    nucleus = sampling_distribution(probs.log(), SamplingParams(top_p=0.65))
    assert torch.allclose(nucleus, torch.tensor([0.4, 0.3, 0, 0, 0, 0]) / 0.7, atol=1e-6)


@pytest.mark.parametrize("params", [SamplingParams(top_k=1), SamplingParams(top_p=1e-6),
                                    SamplingParams(temperature=0), SamplingParams(temperature=2.0, top_p=1e-6)])
def test_greedy_equivalents_pick_the_argmax(params):
    for seed in range(10):
        logits = torch.randn(50, generator=torch.Generator().manual_seed(seed))
        assert _one(logits, params, seed=seed)[0] == int(logits.argmax())


def test_greedy_property():
    assert SamplingParams(temperature=0).greedy and SamplingParams(top_k=1).greedy
    assert not SamplingParams().greedy and not SamplingParams(top_k=2).greedy


def test_min_tokens_masks_eos_and_stop_token_ids():
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[0])
    # Token 3 (eos) then token 0 (stop id) lead; both are held back until 2 tokens exist.
    assert _one(LOGITS, params, generated=0, eos=(3,))[0] == 5
    assert _one(LOGITS, params, generated=1, eos=(3,))[0] == 5
    assert _one(LOGITS, params, generated=2, eos=(3,))[0] == 3
    sampled = SamplingParams(min_tokens=1, ignore_eos=True, logprobs=0)
    for seed in range(20):
        token, lp = _one(LOGITS, sampled, eos=(3,), seed=seed)
        assert token != 3
    _, lp = _one(LOGITS, SamplingParams(temperature=0, min_tokens=1, logprobs=6), eos=(3,))
    assert dict(lp["top"])[3] == -math.inf


def _run_steps(logits_per_step, params, seeds, target, steps):
    """Sample `steps` steps for every row; returns the token sequence of row `target`."""
    gens = [make_generator(s) for s in seeds]
    outputs: list[list[int]] = [[] for _ in params]
    prompts = [[1, 2, 3] for _ in params]
    for step in range(steps):
        logits = logits_per_step(step, len(params))
        result = sample(logits, params, gens, outputs, prompts, [len(o) for o in outputs], (0,))
        for o, t in zip(outputs, result.tokens):
            o.append(t)
    return outputs[target]


def test_seeded_row_is_the_same_alone_and_in_a_batch():
    vocab = 40
    base = torch.randn(20, vocab, generator=torch.Generator().manual_seed(7))
    noise = torch.randn(20, 9, vocab, generator=torch.Generator().manual_seed(8))

    def alone(step, batch):
        return base[step].unsqueeze(0)

    def batched(step, batch):
        rows = noise[step].clone()
        rows[4] = base[step]
        return rows

    target = SamplingParams(temperature=0.9, top_p=0.95, repetition_penalty=1.2, min_tokens=3, seed=1234)
    others = [SamplingParams(temperature=0.5 + 0.1 * i, top_k=i * 3, min_p=0.01 * i, seed=i if i % 2 else None,
                             presence_penalty=0.1 * i) for i in range(8)]
    batch_params = others[:4] + [target] + others[4:]
    batch_seeds = [p.seed for p in batch_params]
    solo = _run_steps(alone, [target], [1234], 0, 20)
    together = _run_steps(batched, batch_params, batch_seeds, 4, 20)
    assert solo == together
    assert 0 not in solo[:3]


def test_different_seeds_give_different_sequences():
    flat = lambda step, batch: torch.zeros(batch, 50)  # noqa: E731
    params = [SamplingParams(seed=1), SamplingParams(seed=2)]
    first = _run_steps(flat, params, [1, 2], 0, 20)
    second = _run_steps(flat, params, [1, 2], 1, 20)
    assert first != second
    assert _run_steps(flat, params[:1], [1], 0, 20) == first


def test_logprobs_top_n_sorted_and_chosen_matches_log_softmax():
    params = SamplingParams(temperature=0.7, logprobs=3)
    token, lp = _one(LOGITS, params, seed=3)
    expected = torch.log_softmax(LOGITS / 0.7, dim=-1)
    assert lp["token"] == token
    assert lp["logprob"] == pytest.approx(float(expected[token]), abs=1e-6)
    assert len(lp["top"]) == 3
    values = [v for _, v in lp["top"]]
    assert values == sorted(values, reverse=True)
    assert [t for t, _ in lp["top"]] == [3, 0, 5]
    assert values[0] == pytest.approx(float(expected[3]), abs=1e-6)
    _, only_chosen = _one(LOGITS, SamplingParams(logprobs=0), seed=3)
    assert only_chosen["top"] == [] and _one(LOGITS, SamplingParams(), seed=3)[1] is None


def test_inputs_are_not_modified():
    logits = LOGITS.unsqueeze(0).clone()
    outputs = [[3, 3]]
    sample(logits, [SamplingParams(repetition_penalty=2, frequency_penalty=1, min_tokens=5)], [None], outputs,
           [[0]], [2], (3,))
    assert torch.equal(logits[0], LOGITS) and outputs == [[3, 3]]


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("min_p", -0.1), ("min_p", 1.1),
    ("repetition_penalty", 0.0), ("max_tokens", 0), ("n", 0), ("min_tokens", -1), ("min_tokens", 17),
    ("logprobs", -1), ("presence_penalty", 2.5), ("presence_penalty", -2.5), ("frequency_penalty", 3.0),
    ("frequency_penalty", -3.0), ("seed", 1.5), ("seed", "7"), ("temperature", float("nan")),
])
def test_invalid_values_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_unknown_field_and_stop_normalisation():
    with pytest.raises(ValueError, match="foo is not a sampling parameter; known: n, temperature"):
        SamplingParams(foo=1)
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[5]).stop == ("a", "b")
    assert SamplingParams(stop_token_ids=[5, 6]).stop_token_ids == (5, 6)
    assert SamplingParams(min_tokens=16).min_tokens == 16
    params = SamplingParams(seed=3)
    with pytest.raises(AttributeError):
        params.seed = 4  # type: ignore[misc]
    assert params == SamplingParams(seed=3) and hash(params) == hash(SamplingParams(seed=3))


def test_make_generator():
    assert make_generator(None) is None
    a, b = make_generator(5), make_generator(5)
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
    assert make_generator(-1) is not None


def test_bad_words_ban_the_last_token_after_their_prefix():
    # LOGITS' order is 3 > 0 > 5 > 2 > 1 > 4.
    single = SamplingParams(temperature=0, bad_words=[[3]])
    assert _one(LOGITS, single)[0] == 0 and _one(LOGITS, single, output=[1, 2])[0] == 0
    phrase = SamplingParams(temperature=0, bad_words=[[2, 5, 3]], logprobs=6)
    assert _one(LOGITS, phrase, output=[1, 5])[0] == 3  # the output does not end with 2, 5
    token, lp = _one(LOGITS, phrase, output=[1, 2, 5])
    assert token == 0 and dict(lp["top"])[3] == -math.inf
    # The prefix is looked for in the generated tokens only, not in the prompt.
    assert _one(LOGITS, phrase, prompt=[2, 5], output=[])[0] == 3
    # Two words banning the top two tokens, and one whose token lies outside the vocabulary.
    both = SamplingParams(temperature=0, bad_words=[[3], [4, 0], [99]])
    assert _one(LOGITS, both, output=[4])[0] == 5
    for seed in range(20):
        assert _one(LOGITS, SamplingParams(bad_words=[[3], [0]]), seed=seed)[0] not in (0, 3)


@pytest.mark.parametrize("value", [[[]], [[-1]], [[1.5]], [[True]], [3], "ab", [[1], "x"]])
def test_bad_words_must_be_lists_of_non_negative_ints(value):
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=value)


def test_bad_words_normalise_to_tuples():
    assert SamplingParams(bad_words=[[1, 2], (3,)]).bad_words == ((1, 2), (3,))
    assert SamplingParams().bad_words == ()


def test_batched_truncation_equals_each_row_alone():
    """One softmax, sort and mask over rows with different temperatures, top_k, top_p and
    min_p gives each row what it gets alone."""
    from kiln.runtime.sampler import sampling_distributions

    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(3)) * 2
    params = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=4),
              SamplingParams(temperature=1.0, top_p=0.6), SamplingParams(temperature=0.9, min_p=0.2),
              SamplingParams(temperature=1.1, top_k=10, top_p=0.8, min_p=0.05)]
    together = sampling_distributions(logits, params)
    for row, p, got in zip(logits, params, together):
        assert torch.allclose(got, sampling_distribution(row, p), atol=1e-7)
        assert float(got.sum()) == pytest.approx(1.0)
    assert int((together[1] > 0).sum()) == 4


def test_draws_follow_the_distribution():
    """The exponential race picks each token with its probability: 4,000 independent rows of
    one distribution, counted (binomial standard deviation under 0.008), and a token the
    truncation dropped is never drawn."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(4000, 4).clone()
    params = [SamplingParams(temperature=1.0, top_p=0.9)] * 4000  # drops the 0.05 token
    gens = [make_generator(i) for i in range(4000)]
    result = sample(logits, params, gens, [[]] * 4000, [[]] * 4000, [0] * 4000, ())
    counts = torch.bincount(torch.tensor(result.tokens), minlength=4).float() / 4000
    assert counts[3] == 0
    assert torch.allclose(counts[:3], probs[:3] / 0.95, atol=0.03)


def test_sequence_sampler_keeps_each_sequence_generator_until_it_finishes():
    """State by sequence id: made from the seed on the first pick, drawn from on every pick
    after (as one generator held by the sequence would be), dropped once finished."""
    logits = torch.randn(2, 3, 40, generator=torch.Generator().manual_seed(4))
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=21)
    sampler = SequenceSampler("cpu", eos_ids=())
    gen = make_generator(21)
    for step, (rows, new) in enumerate((([2], {7: (params, 21)}), ([0], {}))):
        got, _ = sampler.pick(logits[step], Picks(rows, [7], [step], [[]], [[]], new))
        want, _ = pick_tokens(logits[step][rows], [params], [gen], [[]], [[]], [step], ())
        assert torch.equal(got, want)
    sampler.pick(logits[0], Picks([1], [8], [0], [[]], [[]], {8: (params, None)}, finished=[7]))
    assert list(sampler.generators) == [8] and list(sampler.params) == [8]


def test_bf16_logits_give_what_their_float32_copy_gives():
    """The CUDA executor hands the sampler the LM head's bf16 output as it is: every mode must pick the
    same tokens (and logprobs) as from its float32 copy, which is exact."""
    logits = (torch.randn(6, 500, generator=torch.Generator().manual_seed(3)) * 4).to(torch.bfloat16)
    logits[0, 7] = logits[0, 9] = logits[0].max() + 1   # a tie: both take the first
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, repetition_penalty=1.3),
              SamplingParams(temperature=0.8, seed=5), SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=6),
              SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.0, min_tokens=4)]
    history = [[1, 2], [3, 7, 7], [], [4], [], []]

    def picks(x: torch.Tensor):
        gens = [make_generator(p.seed) for p in params]
        return pick_tokens(x, params, gens, history, [[9]] * 6, [0, 0, 0, 0, 0, 2], (11,))

    (got, got_lp), (want, want_lp) = picks(logits), picks(logits.float())
    assert got.tolist() == want.tolist() and got[0].item() == 7
    assert got_lp == want_lp


@pytest.mark.parametrize("vocab", [128256, 32000, 151936, 1009, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [6, 70])
def test_row_argmax_is_torch_argmax(vocab, dtype, n):
    # Coarse values tie often (bf16 of small integers); ties must go to the first index as torch's do,
    # across chunks and within one. Whole rows of one value, -inf and NaN rows too. 70 rows take
    # wider chunks than 6.
    g = torch.Generator().manual_seed(vocab)
    rows = torch.randint(-50, 50, (n, vocab), generator=g).to(dtype)
    rows[1] = 7.0
    rows[2, : vocab // 2] = float("-inf")
    rows[3, vocab - 3] = float("nan")
    rows[3, vocab // 3] = float("nan")
    rows[4] = float("-inf")
    rows[5, [5, vocab - 1]] = 1000.0
    assert torch.equal(row_argmax(rows), rows.argmax(dim=-1))
    assert torch.equal(row_argmax(rows[2:3]), rows[2:3].argmax(dim=-1))
    assert row_argmax(rows[:0]).shape == (0,)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 256])
def test_row_argmax_on_the_gpu_is_torch_argmax(rows):
    g = torch.Generator(device="cuda").manual_seed(rows)
    logits = torch.randint(-20, 20, (rows, 128256), generator=g, device="cuda").to(torch.bfloat16)
    logits[0, 100_000] = 50.0
    logits[-1, [3, 128_000]] = 60.0
    assert torch.equal(row_argmax(logits), logits.argmax(dim=-1))
    assert torch.equal(row_argmax(logits.float()), logits.float().argmax(dim=-1))
