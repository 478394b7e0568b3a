"""Per-request sampling settings (temperature, top-k/top-p/min-p, penalties, stop rules, bad words,
logprobs).

`SamplingParams` is immutable and checked when built, so the sampler and the scheduler can
trust every field without re-validating it on each step.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any

from kiln.runtime.arguments import ArgumentError, require_bool, require_int, require_number


@dataclass(frozen=True, init=False)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    Build with keyword arguments only; unknown names and out-of-range values raise
    `ValueError` naming the field. `top_k=0` turns top-k off; `logprobs=N` asks for the top-N
    logprobs of each generated token (0: only the chosen token's). `bad_words` are token-id
    sequences that are never generated: a word's last token is banned whenever the output so
    far ends with the rest of it (a one-token word is always banned).
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()
    min_tokens: int = 0
    max_tokens: int = 16
    ignore_eos: bool = False
    logprobs: int | None = None
    # Derived once here, read for every row of every step: the pick is the argmax (temperature 0
    # or top_k 1); the pick reads the token history (penalties, bad words); the token is the
    # plain argmax once min_tokens are out (greedy, no history, no logprobs).
    greedy: bool = field(init=False, repr=False, compare=False)
    reads_history: bool = field(init=False, repr=False, compare=False)
    argmax_only: bool = field(init=False, repr=False, compare=False)

    def __init__(self, **kwargs: Any) -> None:
        # Hand-written so an unknown name is a ValueError (a bad request), not the TypeError
        # the generated __init__ would raise.
        known = {f.name: f for f in fields(self) if f.init}
        unknown = sorted(set(kwargs) - set(known))
        if unknown:
            raise ArgumentError(unknown[0], f"is not a sampling parameter; known: {', '.join(known)}")
        for name, f in known.items():
            object.__setattr__(self, name, kwargs.get(name, f.default))
        self.__post_init__()

    def __post_init__(self) -> None:
        for name in ("n", "top_k", "min_tokens", "max_tokens"):
            require_int(name, getattr(self, name))
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            require_number(name, getattr(self, name))
        for name in ("seed", "logprobs"):
            if getattr(self, name) is not None:
                require_int(name, getattr(self, name))
        require_bool("ignore_eos", self.ignore_eos)
        object.__setattr__(self, "stop", _normalise_stop(self.stop))
        object.__setattr__(self, "stop_token_ids", _normalise_token_ids("stop_token_ids", self.stop_token_ids))
        object.__setattr__(self, "bad_words", _normalise_bad_words(self.bad_words))

        # Written as `not (in range)` so NaN fails every check.
        if not self.temperature >= 0:
            raise ArgumentError("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ArgumentError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ArgumentError("top_k", f"must be >= 0 (0 turns it off), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ArgumentError("min_p", f"must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0:
            raise ArgumentError("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ArgumentError(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if self.n < 1:
            raise ArgumentError("n", f"must be >= 1, got {self.n}")
        if self.max_tokens < 1:
            raise ArgumentError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ArgumentError("min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ArgumentError("logprobs", f"must be >= 0 or None, got {self.logprobs}")
        greedy = self.temperature == 0 or self.top_k == 1
        reads_history = bool(self.repetition_penalty != 1.0 or self.presence_penalty or self.frequency_penalty
                             or self.bad_words)
        object.__setattr__(self, "greedy", greedy)
        object.__setattr__(self, "reads_history", reads_history)
        object.__setattr__(self, "argmax_only", greedy and not reads_history and self.logprobs is None)


def _normalise_stop(stop: str | Iterable[str]) -> tuple[str, ...]:
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)):
        raise ArgumentError("stop", f"must be a string or a list of strings, got {stop!r}")
    items = tuple(stop)
    for s in items:
        if not isinstance(s, str) or not s:
            raise ArgumentError("stop", f"must be a non-empty string or a list of them, got {s!r}")
    return items


def _normalise_token_ids(name: str, ids: Iterable[int]) -> tuple[int, ...]:
    if not isinstance(ids, (list, tuple)):
        raise ArgumentError(name, f"must be a list of ints, got {ids!r}")
    items = tuple(ids)
    for t in items:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ArgumentError(name, f"must be non-negative ints, got {t!r}")
    return items


def _normalise_bad_words(words: Iterable[Iterable[int]]) -> tuple[tuple[int, ...], ...]:
    if not isinstance(words, (list, tuple)):
        raise ArgumentError("bad_words", f"must be a list of token-id lists, got {words!r}")
    items = tuple(_normalise_token_ids("bad_words", w) for w in words)
    if any(not w for w in items):
        raise ArgumentError("bad_words", "must not hold an empty token-id list")
    return items
