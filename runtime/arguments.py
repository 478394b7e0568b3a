"""Checks for the arguments callers hand Kiln, shared by every front end (Session, the CLIs, the
Triton model): each refusal is an `ArgumentError` naming the argument, the value and what is
allowed, so a front end can point at its own spelling of the argument (a flag, a tensor name).
"""
from __future__ import annotations

import operator


class ArgumentError(ValueError):
    """An argument with a value that cannot work. `argument` is its name in the Python API
    (`max_tokens`, `kv_cache_fraction`, `prompt`); the message starts with that name."""

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(f"{argument} {message}")
        self.argument = argument
        self.detail = message


def require_int(name: str, value: object, low: int | None = None) -> int:
    # bool is an int subclass, but `seed=True` is a caller's mistake, not a seed.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentError(name, f"must be an int, got {value!r}")
    if low is not None and value < low:
        raise ArgumentError(name, f"must be >= {low}, got {value}")
    return value


def require_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ArgumentError(name, f"must be a bool, got {value!r}")
    return value


def require_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentError(name, f"must be a number, got {value!r}")
    return value


def token_ids(name: str, value: object) -> list[int]:
    """A list of token ids from any sequence of integers (a list, a tuple, a numpy array, a 1-D
    tensor); text, floats and bools are refused by name rather than guessed at."""
    if isinstance(value, (str, bytes)):
        raise ArgumentError(name, f"must be a list of token ids, got the text {value!r}: pass text as the prompt")
    try:
        items = list(value)
    except TypeError:  # an int, a 0-d array, None inside a batch
        raise ArgumentError(name, f"must be a list of token ids, got {type(value).__name__} {value!r}") from None
    ids = []
    for i, t in enumerate(items):
        try:
            if isinstance(t, (bool, float)):
                raise TypeError
            ids.append(operator.index(t))
        except TypeError:
            raise ArgumentError(name, f"must hold ints, got {t!r} at position {i}") from None
    return ids
