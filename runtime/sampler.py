"""Token sampling for one engine step: a [B, V] logits tensor in, one token per row out.

Each row belongs to one sequence and is processed in this order:

  (a) repetition_penalty over every token seen in prompt + output (HF semantics: a positive
      logit is divided by the penalty, a negative one multiplied);
  (b) presence_penalty / frequency_penalty over output tokens only (OpenAI semantics:
      logit -= presence * (count > 0) + frequency * count);
  (c) while fewer than min_tokens tokens have been generated, the eos ids and the row's
      stop_token_ids get -inf (ignore_eos only changes when a sequence stops, so eos is
      masked here either way); each bad word whose tokens but the last end the output so far
      gets its last token set to -inf (a one-token bad word always does);
  (d) greedy rows (temperature 0 or top_k 1) take the argmax;
  (e) other rows divide by temperature, keep the top_k most likely tokens, then the smallest
      most-likely set whose cumulative probability reaches top_p (at least one token), then
      drop tokens with probability < min_p * the largest probability, renormalise, and draw
      from what is left.

Everything runs where the logits are (the GPU's, usually) and in batches: one argmax for the
greedy rows, one softmax, sort and draw for the sampled rows. `pick_tokens` leaves the tokens
there and waits for nothing, so the engine loop can enqueue a step's sampling and move on. Only (a)-(c) touch rows one at
a time, and only the rows that use them. A draw is an exponential race, argmax(p / E) with E
~ Exp(1) per token, which picks token i with probability p_i; each seeded row's E comes from
its own generator, so a seeded request gets the same tokens whatever else shares its batch.

The state a step's sampling needs beyond its logits, each sequence's parameters and seeded
generator, is a `SequenceSampler` kept where the logits are: in the engine's executor, or in
every rank's worker of a tensor-parallel engine, which the engine loop tells what to pick with a
`Picks` record of plain data.

Logprobs come from the log-softmax of the logits after (a)-(c) and temperature (temperature 0
counts as 1) but before top-k/top-p/min-p truncation: truncation would give every dropped
token -inf, which tells the client nothing about the model's preferences.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.step import to_device

# `row_argmax`'s first pass (`_chunk_width`), from an H100 sweep of chunk widths at 1-256 rows of
# 128,256 values: 256-value chunks won at 1 and 8 rows, 1,002-2,004 at 64 and 4,008 at 256.
MIN_CHUNK, MAX_CHUNK, FIRST_PASS_OUTPUTS = 256, 4096, 8192


@dataclass
class SampleResult:
    """One step's picks: `tokens[i]` for row i, and `logprobs[i]` when row i asked for them.

    A logprobs entry is `{"token": id, "logprob": float, "top": [(id, logprob), ...]}`, with
    `top` holding the request's N most likely tokens in descending order.
    """

    tokens: list[int]
    logprobs: list[dict | None]


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator on `device` (where the logits will be) seeded with `seed`, or None (draw
    from torch's global RNG) without one."""
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    # torch takes seeds in [0, 2**64); folding keeps negative and huge seeds usable and distinct
    # from each other within that range.
    gen.manual_seed(seed % 2**64)
    return gen


@dataclass
class Picks:
    """What to sample from one step's logits, as plain data: row `rows[i]` of the logits gives
    sequence `seq_ids[i]` its next token. The token lists are those `pick_tokens` takes, empty
    for rows whose params do not `reads_history`. A sequence picked for the first time brings its
    parameters and seed in `new`; `finished` names sequences whose state can be dropped."""

    rows: list[int]
    seq_ids: list[int]
    num_generated: list[int]
    output_tokens: list[list[int]]
    prompt_tokens: list[list[int]]
    new: dict[int, tuple[SamplingParams, int | None]] = field(default_factory=dict)
    finished: list[int] = field(default_factory=list)


class SequenceSampler:
    """The sampling state of the sequences in flight, by sequence id, on the logits' device:
    each one's parameters and its generator (`make_generator`), made on its first pick and
    used once per pick after, so a seeded sequence draws the same tokens wherever it runs."""

    def __init__(self, device: torch.device | str, eos_ids: tuple[int, ...]):
        self.device = device
        self.eos_ids = eos_ids
        self.params: dict[int, SamplingParams] = {}
        self.generators: dict[int, torch.Generator | None] = {}

    def pick(self, logits: torch.Tensor, picks: Picks) -> tuple[torch.Tensor, list[dict | None]]:
        """`pick_tokens` for the rows of `logits` that `picks` names."""
        for seq_id in picks.finished:
            self.params.pop(seq_id, None)
            self.generators.pop(seq_id, None)
        for seq_id, (params, seed) in picks.new.items():
            self.params[seq_id] = params
            self.generators[seq_id] = make_generator(seed, self.device)
        if picks.rows != list(range(logits.shape[0])):
            logits = logits.index_select(0, to_device(picks.rows, torch.long, logits.device))
        return pick_tokens(logits, [self.params[s] for s in picks.seq_ids], [self.generators[s] for s in picks.seq_ids],
                           picks.output_tokens, picks.prompt_tokens, picks.num_generated, self.eos_ids)


def apply_penalties(logits_row: torch.Tensor, params: SamplingParams, prompt_tokens: list[int],
                    output_tokens: list[int]) -> torch.Tensor:
    """Steps (a) and (b) on one [V] row; returns a new tensor and leaves the input alone."""
    row = logits_row.to(torch.float32, copy=True)
    penalty = params.repetition_penalty
    if penalty != 1.0:
        seen = set(prompt_tokens)
        seen.update(output_tokens)
        if seen:
            idx = to_device(sorted(seen), torch.long, row.device)
            vals = row[idx]
            row[idx] = torch.where(vals > 0, vals / penalty, vals * penalty)
    if output_tokens and (params.presence_penalty or params.frequency_penalty):
        # index_add_, not bincount: CUDA's bincount reads the largest id back to the host.
        ids = to_device(output_tokens, torch.long, row.device)
        counts = torch.zeros_like(row).index_add_(0, ids, torch.ones(ids.shape, device=row.device))
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(torch.float32)
    return row


def sampling_distribution(logits_row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The [V] probabilities step (e) draws from, given penalised logits.

    Temperature 0 gives a one-hot on the argmax, which is what greedy rows pick.
    """
    if params.temperature == 0:
        return torch.zeros_like(logits_row).scatter_(0, torch.argmax(logits_row).view(1), 1.0)
    return sampling_distributions(logits_row[None], [params])[0]


def sampling_distributions(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Step (e) for a batch of rows [n, V] with temperatures above 0: their probabilities."""
    def column(values: list[float]) -> torch.Tensor:
        return to_device(values, torch.float32, logits.device)[:, None]

    probs = torch.softmax(logits / column([p.temperature for p in params]), dim=-1)
    if all(p.top_k == 0 and p.top_p == 1.0 and p.min_p == 0.0 for p in params):
        return probs
    # Stable sort so ties truncate the same way on every run.
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    top_k = column([p.top_k or probs.shape[-1] for p in params])
    keep = rank < top_k
    # top_p is measured on what top_k left, renormalised.
    kept = torch.where(keep, sorted_probs, 0.0)
    kept = kept / kept.sum(dim=-1, keepdim=True)
    top_p = column([p.top_p for p in params])
    keep &= (torch.cumsum(kept, dim=-1) - kept < top_p) | (top_p >= 1.0)
    # The ratio to the top token is unchanged by renormalisation, so raw probs do.
    keep &= sorted_probs >= column([p.min_p for p in params]) * sorted_probs[:, :1]
    keep[:, 0] = True
    truncated = torch.zeros_like(probs).scatter_(1, order, torch.where(keep, sorted_probs, 0.0))
    return truncated / truncated.sum(dim=-1, keepdim=True)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           output_tokens: list[list[int]], prompt_tokens: list[list[int]], num_generated: list[int],
           eos_ids: tuple[int, ...]) -> SampleResult:
    """Pick one token for each row of `logits` ([B, V]); every list argument is indexed by row.

    `generators[i]` should come from `make_generator(params[i].seed, logits.device)`; a row
    with None draws from torch's global RNG. Neither `logits` nor the token lists are modified.
    """
    tokens, logprobs = pick_tokens(logits, params, generators, output_tokens, prompt_tokens, num_generated, eos_ids)
    return SampleResult(tokens.tolist(), logprobs)


def row_argmax(rows: torch.Tensor) -> torch.Tensor:
    """torch.argmax over the last dim of [n, V] (the first of equal values, NaN above all), in two
    passes where V splits into chunks: the largest of each chunk, then the best chunk. Over rows of
    128,256 values on an H100, torch's one pass took 27 us from 1 to 128 rows; two passes take 9.4 us
    at 1 row, 11.2 at 8, 17.7 at 64 and 44.1 at 256, against torch's 47.1 (BENCHMARKS.md, session 39)."""
    n, vocab = rows.shape
    width = _chunk_width(vocab, n)
    if width is None:
        return rows.argmax(dim=-1)
    best, within = rows.reshape(n, vocab // width, width).max(dim=-1)
    chunk = best.argmax(dim=-1, keepdim=True)
    return within.gather(1, chunk).add_(chunk, alpha=width).squeeze(1)


@functools.cache
def _chunk_width(vocab: int, rows: int) -> int | None:
    """The first pass's chunk: the narrowest that divides V, is at least MIN_CHUNK wide and leaves
    about FIRST_PASS_OUTPUTS maxima over all rows (more rows, wider chunks); None past MAX_CHUNK."""
    least = max(MIN_CHUNK, vocab * rows // FIRST_PASS_OUTPUTS)
    return next((w for w in range(least, min(MAX_CHUNK, vocab - 1) + 1) if vocab % w == 0), None)


def pick_tokens(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                output_tokens: list[list[int]], prompt_tokens: list[list[int]], num_generated: list[int],
                eos_ids: tuple[int, ...]) -> tuple[torch.Tensor, list[dict | None]]:
    """`sample`, with the tokens left where the logits are (int64 [B]): everything is enqueued
    on the device's stream and nothing waits for it, except for rows that ask for logprobs,
    whose entries need their token on the host. Only rows whose params `reads_history` read
    their token lists."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
    batch, vocab = logits.shape
    for name, seq in (("params", params), ("generators", generators), ("output_tokens", output_tokens),
                      ("prompt_tokens", prompt_tokens), ("num_generated", num_generated)):
        if len(seq) != batch:
            raise ValueError(f"{name} has {len(seq)} entries for {batch} logits rows")
    device = logits.device

    def index(rows: list[int]) -> torch.Tensor:
        return to_device(rows, torch.long, device)

    # Plain greedy rows take one batched argmax. The other rows get their penalties and masks
    # one by one, then one argmax or one draw.
    plain = [i for i, p in enumerate(params) if p.argmax_only and num_generated[i] >= p.min_tokens]
    logprobs: list[dict | None] = [None] * batch
    if len(plain) == batch:
        return row_argmax(logits), logprobs
    tokens = torch.empty(batch, dtype=torch.long, device=device)
    if plain:
        rows = index(plain)
        tokens.index_copy_(0, rows, row_argmax(logits.index_select(0, rows)))
    others = sorted(set(range(batch)) - set(plain))
    rows = logits.index_select(0, index(others)).to(torch.float32)
    for j, i in enumerate(others):
        p = params[i]
        if p.reads_history:
            rows[j] = apply_penalties(rows[j], p, prompt_tokens[i], output_tokens[i])
        banned = _bad_words_banned(p, output_tokens[i], vocab)
        if num_generated[i] < p.min_tokens:
            banned += [t for t in (*eos_ids, *p.stop_token_ids) if 0 <= t < vocab]
        if banned:
            rows[j].index_fill_(0, index(banned), float("-inf"))
    greedy = [j for j, i in enumerate(others) if params[i].greedy]
    drawn = [j for j, i in enumerate(others) if not params[i].greedy]
    picks = torch.empty(len(others), dtype=torch.long, device=device)
    if greedy:
        at = index(greedy)
        picks.index_copy_(0, at, row_argmax(rows.index_select(0, at)))
    if drawn:
        at = index(drawn)
        probs = sampling_distributions(rows.index_select(0, at), [params[others[j]] for j in drawn])
        race = torch.stack([torch.empty(vocab, device=device).exponential_(generator=generators[others[j]])
                            for j in drawn])
        picks.index_copy_(0, at, row_argmax(probs / race))
    tokens.index_copy_(0, index(others), picks)
    wanted = [j for j, i in enumerate(others) if params[i].logprobs is not None]
    if wanted:
        chosen = picks.tolist()
        for j in wanted:
            logprobs[others[j]] = _token_logprobs(rows[j], params[others[j]], chosen[j])
    return tokens, logprobs


def _bad_words_banned(params: SamplingParams, output: list[int], vocab: int) -> list[int]:
    """The tokens that would complete a bad word right now. Ids outside the vocabulary can never
    be generated, so they need no mask."""
    banned = []
    for word in params.bad_words:
        *prefix, last = word
        tail = output[len(output) - len(prefix):] if prefix else []
        if 0 <= last < vocab and tail == prefix:
            banned.append(last)
    return banned


def _token_logprobs(row: torch.Tensor, params: SamplingParams, token: int) -> dict:
    logp = torch.log_softmax(row / (params.temperature or 1.0), dim=-1)
    top_vals, top_ids = torch.topk(logp, min(params.logprobs, logp.numel()))
    return {
        "token": token,
        "logprob": float(logp[token]),
        "top": [(int(t), float(v)) for t, v in zip(top_ids, top_vals)],
    }
