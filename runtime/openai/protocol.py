"""Requests of the OpenAI API as Kiln jobs, and errors in OpenAI's shape.

A request body becomes a `Job` (prompts or a conversation, `SamplingParams`, how to answer).
The sampling fields are checked by `SamplingParams` itself and the prompt by the Session; this
module only maps OpenAI's names onto Kiln's and back, so a refusal names the parameter as the
client spelled it (`max_completion_tokens`, `top_logprobs`, `messages`).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kiln.runtime.arguments import ArgumentError, require_bool, require_int
from kiln.runtime.sampling_params import SamplingParams

# Body fields -> SamplingParams fields of the same meaning, shared by both endpoints. top_k,
# min_p, repetition_penalty, min_tokens, ignore_eos and stop_token_ids are the extensions vLLM's
# server accepts too.
_SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "seed", "stop", "stop_token_ids", "min_tokens", "ignore_eos")
# Accepted and without effect on the output.
_IGNORED = ("user",)
_COMMON = ("model", "stream", "stream_options", "max_tokens", *_SAMPLING_FIELDS, *_IGNORED)
COMPLETION_FIELDS = frozenset((*_COMMON, "prompt", "logprobs", "echo", "best_of", "logit_bias", "suffix"))
CHAT_FIELDS = frozenset((*_COMMON, "messages", "max_completion_tokens", "logprobs", "top_logprobs", "logit_bias",
                         "tools", "tool_choice", "response_format"))
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to what the engine has room for
MAX_TOP_LOGPROBS = 20


class OpenAIError(Exception):
    """A request answered with an error: its HTTP status and OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad_request(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, message if message.startswith(param) else f"{param} {message}", param)


@dataclass(frozen=True)
class Job:
    """One request to either endpoint, checked."""

    chat: bool
    model: str | None
    prompts: tuple  # completions: each a text or a list of token ids; chat: the one conversation
    params: SamplingParams
    max_tokens_given: bool  # if not, a chat may generate up to the engine's max_seq_len
    max_tokens_param: str  # max_tokens, or chat's max_completion_tokens when the client used it
    stream: bool
    include_usage: bool
    logprobs: bool

    def error(self, e: ArgumentError) -> OpenAIError:
        """A refusal of the Session (or SamplingParams) with the name the client used."""
        return bad_request(self._param(e.argument), e.detail)

    def _param(self, argument: str) -> str:
        if argument in ("prompt", "prompt_token_ids", "prompts"):
            return "messages" if self.chat else "prompt"
        if argument == "logprobs" and self.chat:
            return "top_logprobs"
        return self.max_tokens_param if argument == "max_tokens" else argument


def parse_completion(body: Any) -> Job:
    """A /v1/completions body as a `Job`."""
    body = _object(body, COMPLETION_FIELDS)
    for name, allowed in (("echo", (None, False)), ("suffix", (None, "")), ("logit_bias", (None, {}))):
        if body.get(name) not in allowed:
            raise bad_request(name, "is not supported by this server")
    if body.get("best_of") not in (None, 1, body.get("n", 1)):
        raise bad_request("best_of", "is not supported by this server: leave it out, or give it equal to n")
    if "prompt" not in body:
        raise bad_request("prompt", "is missing")
    logprobs = body.get("logprobs")
    if logprobs is not None:
        _checked(require_int, "logprobs", logprobs)
        if not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request("logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}")
    max_tokens = body.get("max_tokens")
    return _job(body, False, _prompts(body["prompt"]), logprobs,
                COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens, "max_tokens")


def parse_chat(body: Any) -> Job:
    """A /v1/chat/completions body as a `Job`; the conversation is checked when it is rendered."""
    body = _object(body, CHAT_FIELDS)
    if body.get("logit_bias") not in (None, {}):
        raise bad_request("logit_bias", "is not supported by this server")
    if body.get("tools"):
        raise bad_request("tools", "are not supported by this server")
    if body.get("tool_choice") not in (None, "none"):
        raise bad_request("tool_choice", "is not supported by this server: leave it out or give 'none'")
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise bad_request("response_format", "is not supported by this server, except {'type': 'text'}")
    if "messages" not in body:
        raise bad_request("messages", "is missing")
    wants = body.get("logprobs")
    wants = False if wants is None else _checked(require_bool, "logprobs", wants)
    top = body.get("top_logprobs")
    if top is not None:
        _checked(require_int, "top_logprobs", top)
        if not wants:
            raise bad_request("top_logprobs", "needs logprobs: true")
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise bad_request("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
    # max_completion_tokens is the newer name; either may be given.
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return _job(body, True, (body["messages"],), (top or 0) if wants else None, body.get(name), name)


def _job(body: dict, chat: bool, prompts: tuple, logprobs: int | None, max_tokens: Any, max_tokens_name: str) -> Job:
    stream = False if body.get("stream") is None else _checked(require_bool, "stream", body["stream"])
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad_request("stream_options", "is only allowed with stream: true")
        if not isinstance(options, Mapping) or set(options) - {"include_usage"}:
            raise bad_request("stream_options", f"must be {{'include_usage': true|false}}, got {options!r}")
        include_usage = _checked(require_bool, "stream_options", options.get("include_usage", False))
    fields = {k: body[k] for k in _SAMPLING_FIELDS if body.get(k) is not None}
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    try:
        params = SamplingParams(**fields, logprobs=logprobs)
    except ArgumentError as e:
        raise bad_request(max_tokens_name if e.argument == "max_tokens" else e.argument, e.detail) from None
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model", f"must be a string, got {model!r}")
    return Job(chat, model, prompts, params, max_tokens is not None, max_tokens_name, stream, include_usage,
               logprobs is not None)


def _object(body: Any, known: frozenset[str]) -> dict:
    if not isinstance(body, Mapping):
        raise OpenAIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - known)
    if unknown:
        raise bad_request(unknown[0], f"is not a parameter this endpoint knows; known: {', '.join(sorted(known))}")
    return dict(body)


def _prompts(prompt: Any) -> tuple:
    """OpenAI's four prompt forms: a text, a list of texts, a list of token ids, a list of such lists."""
    if isinstance(prompt, str):
        return (prompt,)
    if not isinstance(prompt, list) or not prompt:
        raise bad_request("prompt", f"must be a text, a list of texts, a list of token ids or a list of such lists, "
                                    f"got {prompt!r}")
    if all(isinstance(p, str) for p in prompt):
        return tuple(prompt)
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return (list(prompt),)
    if all(isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompt):
        return tuple(prompt)
    raise bad_request("prompt", "must be a text, a list of texts, a list of token ids or a list of such lists; "
                                "do not mix them")


def _checked(check, name: str, value: Any):
    try:
        return check(name, value)
    except ArgumentError as e:
        raise bad_request(name, e.detail) from None
