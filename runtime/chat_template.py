"""Render a conversation with an engine's chat template, as `transformers`' `apply_chat_template`
does: the same Jinja environment (sandboxed, `trim_blocks`, `lstrip_blocks`, loop controls), the
same names in scope (`messages`, `tools`, `documents`, `add_generation_prompt`, the tokenizer's
special tokens such as `bos_token` and `eos_token`, `raise_exception`, `strftime_now`, a `tojson`
that keeps non-ASCII text) and messages whose `None` values are dropped. The rendered text holds
its special tokens already, so it is tokenized without adding any (`ChatTemplate.encode`).

Every refusal is an `ArgumentError` naming `messages` (a malformed conversation, or one the
template itself rejects with `raise_exception`), or a `ChatTemplateError` when the engine has no
template to render with.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from kiln.runtime.arguments import ArgumentError, require_bool

# The tokenizer's special tokens that transformers hands every template (its special_tokens_map).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
TOKENIZER_CONFIG = "tokenizer_config.json"


class ChatTemplateError(ValueError):
    """The engine cannot render conversations: it has no chat template, or its template is broken."""


class ChatTemplate:
    """An engine's chat template, compiled once; `render` is safe to call from any thread."""

    def __init__(self, source: str, special_tokens: Mapping[str, str], tokenizer: Tokenizer | None = None):
        self.source = source
        self.special_tokens = dict(special_tokens)
        self.tokenizer = tokenizer
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"the engine's chat template does not compile (line {e.lineno}: {e.message}): "
                                    "fix chat_template.jinja in the engine folder") from None

    @classmethod
    def from_engine(cls, engine_dir: Path, template_file: str | None, tokenizer: Tokenizer | None) -> "ChatTemplate":
        """The template build-engine copied into `engine_dir`, with the special tokens of the
        tokenizer_config.json beside it."""
        if template_file is None:
            raise ChatTemplateError(f"the engine {engine_dir} has no chat template (its checkpoint had none in "
                                    "chat_template.jinja or tokenizer_config.json): send a plain prompt instead, or "
                                    "rebuild from a checkpoint that has one")
        source = (engine_dir / template_file).read_text(encoding="utf-8")
        return cls(source, _special_tokens(engine_dir / TOKENIZER_CONFIG), tokenizer)

    def render(self, messages: object, add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
        """The conversation as the prompt text the model was trained on. `add_generation_prompt`
        ends it with the header of an assistant turn; `template_kwargs` are further names for the
        template (they win over the special tokens, as in transformers)."""
        require_bool("add_generation_prompt", add_generation_prompt)
        conversation = normalise_messages(messages)
        scope = {**self.special_tokens, **template_kwargs}
        try:
            return self._template.render(messages=conversation, tools=scope.pop("tools", None),
                                         documents=scope.pop("documents", None),
                                         add_generation_prompt=add_generation_prompt, **scope)
        except jinja2.TemplateError as e:
            # raise_exception's message is the template's own words about what it cannot take.
            raise ArgumentError("messages", f"were refused by the engine's chat template: {e}") from None

    def encode(self, messages: object, add_generation_prompt: bool = True, **template_kwargs: Any) -> list[int]:
        """The rendered conversation's token ids; the template wrote its special tokens itself."""
        if self.tokenizer is None:
            raise ChatTemplateError("the engine has no tokenizer.json, so a rendered conversation cannot be tokenized")
        text = self.render(messages, add_generation_prompt, **template_kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False).ids


def normalise_messages(messages: object) -> list[dict]:
    """A conversation as templates expect it: a non-empty list of dicts, each with a string `role`
    and its `content`; keys whose value is None are left out (as transformers does)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ArgumentError("messages", f"must be a list of messages ({{'role': ..., 'content': ...}}), got "
                                        f"{type(messages).__name__}")
    if not messages:
        raise ArgumentError("messages", "is empty: give at least one message")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ArgumentError("messages", f"[{i}] must be an object with 'role' and 'content', got "
                                            f"{type(message).__name__} {message!r}")
        if not isinstance(message.get("role"), str):
            raise ArgumentError("messages", f"[{i}] needs a 'role' string (system, user, assistant, ...)")
        if "content" not in message:
            raise ArgumentError("messages", f"[{i}] ({message['role']}) has no 'content'")
        out.append({k: v for k, v in message.items() if v is not None})
    return out


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; a prompt needs the plain JSON text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _special_tokens(config_file: Path) -> dict[str, str]:
    """The special tokens named in tokenizer_config.json (plain strings, or added-token objects
    with their text under `content`)."""
    if not config_file.is_file():
        return {}
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ChatTemplateError(f"{config_file} is not valid JSON ({e}): rebuild the engine") from None
    tokens = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, Mapping):
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens
