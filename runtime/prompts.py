"""What a caller may hand the Session as prompts, checked and normalised once: text or token ids,
one prompt or a batch. What depends on the engine (vocabulary, max_seq_len, the tokenizer) is
checked by `EngineCore.encode` and `EngineCore.validate`.

The rules, as `Session`'s docstrings state them: `prompts` holds text only (one string, or a
list of strings); token ids go in `prompt_token_ids` (one list of ints, or a list of such lists;
numpy arrays and 1-D tensors are fine); an empty list of prompts is an empty batch.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kiln.runtime.arguments import ArgumentError, token_ids


@dataclass(frozen=True)
class Prompt:
    """One prompt: text (to be tokenized by the engine) or token ids, never both."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None


def one_prompt(prompt: object, prompt_token_ids: object) -> Prompt:
    """The prompt of `Session.stream` and `generate_async`."""
    if (prompt is None) == (prompt_token_ids is None):
        raise ArgumentError("prompt", "or prompt_token_ids: give exactly one of them")
    if prompt is not None:
        return Prompt(text=_text("prompt", prompt, one=True))
    return Prompt(token_ids=tuple(token_ids("prompt_token_ids", prompt_token_ids)))


def prompt_batch(prompts: object, prompt_token_ids: object) -> list[Prompt]:
    """The prompts of `Session.generate`."""
    if (prompts is None) == (prompt_token_ids is None):
        raise ArgumentError("prompts", "or prompt_token_ids: give exactly one of them")
    if prompts is not None:
        if isinstance(prompts, str):
            return [Prompt(text=prompts)]
        items = _items("prompts", prompts)
        return [Prompt(text=_text(f"prompts[{i}]", p)) for i, p in enumerate(items)]
    if isinstance(prompt_token_ids, (str, bytes)):
        token_ids("prompt_token_ids", prompt_token_ids)  # refuses text by name
    items = _items("prompt_token_ids", prompt_token_ids)
    if not items:
        return []
    if not _is_sequence(items[0]):  # a flat list of ids: one prompt
        return [Prompt(token_ids=tuple(token_ids("prompt_token_ids", items)))]
    return [Prompt(token_ids=tuple(token_ids(f"prompt_token_ids[{i}]", p))) for i, p in enumerate(items)]


def _items(name: str, value: object) -> list:
    if not isinstance(value, Iterable) or isinstance(value, (dict, set, bytes)):
        raise ArgumentError(name, f"must be a list, got {type(value).__name__} {value!r}")
    return list(value)


def _is_sequence(value: object) -> bool:
    return not isinstance(value, (str, bytes)) and hasattr(value, "__len__") and getattr(value, "ndim", 1) != 0


def _text(name: str, value: object, one: bool = False) -> str:
    if isinstance(value, str):
        return value
    if one and _is_sequence(value) and all(isinstance(v, str) for v in value):
        raise ArgumentError(name, f"must be one text, got a list of {len(value)}: use generate() for a batch")
    if _is_sequence(value) or isinstance(value, int):
        raise ArgumentError(name, f"must be text, got {value!r}: pass token ids as prompt_token_ids")
    raise ArgumentError(name, f"must be text, got {type(value).__name__} {value!r}")
