"""The Triton interface of a Kiln model: its tensors, how a request becomes a Session request,
and how Session outputs become responses.

Nothing here imports Triton, so it is tested without a server; `model.py` is the thin glue
between this and `triton_python_backend_utils`. The interface is documented for users in
`runtime/triton/__init__.py`.
"""
from __future__ import annotations

import csv
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

from kiln.runtime.arguments import ArgumentError
from kiln.runtime.outputs import RequestOutput
from kiln.runtime.sampling_params import SamplingParams


@dataclass(frozen=True)
class TensorSpec:
    """One input or output as config.pbtxt declares it (dims without the batch dim)."""

    name: str
    dtype: str  # Triton's config type name, e.g. "TYPE_INT32"
    dims: tuple[int, ...]
    scalar: bool = False  # declared as dims [1] and handed to the model reshaped to []


NUMPY_DTYPES = {"TYPE_INT32": np.int32, "TYPE_UINT64": np.uint64, "TYPE_FP32": np.float32,
                "TYPE_BOOL": np.bool_, "TYPE_STRING": np.object_}


def _scalars(**dtypes: str) -> tuple[TensorSpec, ...]:
    """Inputs of one value each: declared as dims [1], handed to the model reshaped to []."""
    return tuple(TensorSpec(name, dtype, (1,), scalar=True) for name, dtype in dtypes.items())


TOKEN_INPUTS = (
    TensorSpec("input_ids", "TYPE_INT32", (-1,)),
    TensorSpec("stop_words_list", "TYPE_INT32", (2, -1)),
    TensorSpec("bad_words_list", "TYPE_INT32", (2, -1)),
    *_scalars(input_lengths="TYPE_INT32", request_output_len="TYPE_INT32", runtime_top_k="TYPE_INT32",
              runtime_top_p="TYPE_FP32", streaming="TYPE_BOOL", exclude_input_in_output="TYPE_BOOL"),
)
TEXT_INPUTS = (
    TensorSpec("text_input", "TYPE_STRING", (-1,)),
    TensorSpec("stop_words", "TYPE_STRING", (-1,)),
    TensorSpec("bad_words", "TYPE_STRING", (-1,)),
    *_scalars(max_tokens="TYPE_INT32", top_k="TYPE_INT32", top_p="TYPE_FP32", stream="TYPE_BOOL"),
)
SHARED_INPUTS = _scalars(
    end_id="TYPE_INT32", pad_id="TYPE_INT32", temperature="TYPE_FP32", repetition_penalty="TYPE_FP32",
    presence_penalty="TYPE_FP32", frequency_penalty="TYPE_FP32", min_length="TYPE_INT32",
    random_seed="TYPE_UINT64", return_log_probs="TYPE_BOOL",
)
INPUTS = TOKEN_INPUTS + TEXT_INPUTS + SHARED_INPUTS
OUTPUTS = (
    TensorSpec("output_ids", "TYPE_INT32", (-1, -1)),
    TensorSpec("sequence_length", "TYPE_INT32", (-1,)),
    TensorSpec("cum_log_probs", "TYPE_FP32", (-1,)),
    TensorSpec("output_log_probs", "TYPE_FP32", (-1, -1)),
    TensorSpec("text_output", "TYPE_STRING", (-1,)),
)
_SCALARS = {s.name: s for s in INPUTS if s.scalar}

Tensors = dict[str, np.ndarray]
NO_END_ID = -1  # end_id's value for "no end token", as in TensorRT-LLM's tools


@dataclass(frozen=True)
class Job:
    """A parsed request: what to hand the Session and how to shape the replies."""

    params: SamplingParams
    prompt: str | None  # text interface
    prompt_token_ids: list[int] | None  # token interface
    streaming: bool
    include_input: bool  # output_ids start with the prompt (token interface, not streaming)
    return_log_probs: bool
    stop_sequences: tuple[tuple[int, ...], ...] = ()  # multi-token stop words, matched by `Reply`

    @property
    def text(self) -> bool:
        return self.prompt is not None


def parse_request(inputs: Mapping[str, np.ndarray], tokenizer: Tokenizer | None) -> Job:
    """Turn one request's input tensors (each with its leading batch dim) into a `Job`.

    Raises `ValueError` with a message for the client when the request cannot be served.
    """
    x = _strip_batch(inputs)
    text = "text_input" in x
    if text == ("input_ids" in x):
        raise ValueError("give input_ids (token interface) or text_input (text interface), exactly one of them")
    other = TOKEN_INPUTS if text else TEXT_INPUTS
    misplaced = [s.name for s in other if s.name in x]
    if misplaced:
        mine, theirs = ("text", "token") if text else ("token", "text")
        raise ValueError(f"{', '.join(misplaced)}: for the {theirs} interface, but this request uses the {mine} "
                         "interface (see the model repository's README for each interface's inputs)")
    get = lambda name, default=None: _scalar(x, name, default)  # noqa: E731

    stop_ids: tuple[int, ...] = ()
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    if text:
        prompt, prompt_ids = _one_string(x["text_input"], "text_input"), None
        max_tokens = get("max_tokens")
        top_k, top_p, streaming = get("top_k", 0), get("top_p", 0.0), get("stream", False)
        stop_strings = _strings(x.get("stop_words"))
        bad_words = tuple(_encode_word(tokenizer, w, "bad_words") for w in _strings(x.get("bad_words")))
        include_input = False
    else:
        prompt, prompt_ids = None, _prompt_ids(x["input_ids"], get("input_lengths"))
        max_tokens = get("request_output_len")
        top_k, top_p, streaming = get("runtime_top_k", 0), get("runtime_top_p", 0.0), get("streaming", False)
        stops = decode_word_list(x["stop_words_list"], "stop_words_list") if "stop_words_list" in x else ()
        stop_ids = tuple(w[0] for w in stops if len(w) == 1)
        stop_sequences = tuple(w for w in stops if len(w) > 1)
        if any(t < 0 for w in stop_sequences for t in w):
            raise ValueError("stop_words_list holds a negative token id")
        stop_strings = ()
        bad_words = decode_word_list(x["bad_words_list"], "bad_words_list") if "bad_words_list" in x else ()
        include_input = not get("exclude_input_in_output", False)
    if max_tokens is None:
        raise ValueError(f"{'max_tokens' if text else 'request_output_len'} is missing: say how many tokens to "
                         "generate at most")
    end_id = get("end_id")
    if end_id is not None and end_id < NO_END_ID:
        raise ValueError(f"end_id must be a token id, or {NO_END_ID} for no end token, got {end_id}")
    # An end id replaces the eos; TensorRT-LLM's -1 means no end token at all (run to max_tokens).
    end_ids = () if end_id in (None, NO_END_ID) else (end_id,)
    get("pad_id")  # checked like any scalar: outputs hold one sequence, so nothing is ever padded
    # TensorRT-LLM samples greedily when neither top-k nor top-p is set (both 0); top_p 0 alone means off.
    if top_k == 0 and top_p == 0:
        top_k = 1
    return_log_probs = get("return_log_probs", False)
    try:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=get("temperature", 1.0), top_k=top_k, top_p=top_p or 1.0,
            repetition_penalty=get("repetition_penalty", 1.0), presence_penalty=get("presence_penalty", 0.0),
            frequency_penalty=get("frequency_penalty", 0.0), min_tokens=get("min_length", 0), seed=get("random_seed"),
            stop=stop_strings, stop_token_ids=stop_ids + end_ids,
            ignore_eos=end_id is not None, bad_words=bad_words, logprobs=0 if return_log_probs else None)
    except ArgumentError as e:
        raise ValueError(client_message(e, text)) from None
    return Job(params, prompt, prompt_ids, streaming, include_input and not streaming, return_log_probs,
               stop_sequences)


# Session arguments -> the input tensor that carries them, per interface (text, token).
_TENSOR_NAMES = {
    "max_tokens": ("max_tokens", "request_output_len"), "top_k": ("top_k", "runtime_top_k"),
    "top_p": ("top_p", "runtime_top_p"), "min_tokens": ("min_length", "min_length"),
    "seed": ("random_seed", "random_seed"), "prompt": ("text_input", "input_ids"),
    "prompt_token_ids": ("text_input", "input_ids"), "stop": ("stop_words", "stop_words_list"),
    "stop_token_ids": ("end_id", "stop_words_list"), "bad_words": ("bad_words", "bad_words_list"),
}


def client_message(error: ArgumentError, text: bool) -> str:
    """A refusal of the Session (or of SamplingParams) worded with the request's tensor names."""
    names = _TENSOR_NAMES.get(error.argument)
    return f"{names[0] if text else names[1]} {error.detail}" if names else str(error)


def decode_word_list(words: np.ndarray, name: str) -> tuple[tuple[int, ...], ...]:
    """TensorRT-LLM's word-list format, [2, N]: row 0 the words' token ids one after another,
    row 1 each word's exclusive end offset into row 0, padded with -1."""
    if words.ndim != 2 or words.shape[0] != 2:
        raise ValueError(f"{name} must have shape [1, 2, N] (ids row, end-offsets row), got "
                         f"{[1, *words.shape]}")
    ids, ends = words[0].tolist(), words[1].tolist()
    out, start = [], 0
    for end in ends:
        if end < 0:
            break
        if not start < end <= len(ids):
            raise ValueError(f"{name}: end offsets must increase and stay within the {len(ids)} ids of row 0, "
                             f"got {ends}")
        out.append(tuple(ids[start:end]))
        start = end
    return tuple(out)


def _strip_batch(inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for name, value in inputs.items():
        if value.ndim == 0 or value.shape[0] != 1:
            raise ValueError(f"{name} has batch size {value.shape[0] if value.ndim else 0}: send one sequence per "
                             "request (they are batched in flight), with a leading batch dim of 1")
        out[name] = value[0]
    return out


def _scalar(x: dict[str, np.ndarray], name: str, default=None):
    if name not in x:
        return default
    value = x[name]
    if value.size != 1:
        raise ValueError(f"{name} must hold one value, got shape {[1, *value.shape]}")
    v = value.reshape(()).item()
    kind = _SCALARS[name].dtype
    if kind == "TYPE_BOOL":
        return bool(v)
    return float(v) if kind == "TYPE_FP32" else int(v)


def _prompt_ids(input_ids: np.ndarray, length: int | None) -> list[int]:
    ids = input_ids.reshape(-1).tolist()
    if length is None:
        return ids
    if not 0 < length <= len(ids):
        raise ValueError(f"input_lengths is {length} but input_ids holds {len(ids)} ids")
    return ids[:length]  # the rest is padding


def _as_str(value: object, name: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{name} is not valid UTF-8") from None
    return str(value)


def _one_string(values: np.ndarray, name: str) -> str:
    if values.size != 1:
        raise ValueError(f"{name} holds {values.size} strings: send one prompt per request")
    return _as_str(values.reshape(-1)[0], name)


def _strings(values: np.ndarray | None) -> tuple[str, ...]:
    """Stop or bad words: one string is a comma-separated list (CSV quoting allowed), as in
    TensorRT-LLM's ensemble; several strings are taken as they are."""
    if values is None:
        return ()
    items = [_as_str(v, "stop_words/bad_words") for v in values.reshape(-1)]
    if len(items) == 1:
        items = next(csv.reader([items[0]]), [])
    return tuple(w for w in items if w)


def _encode_word(tokenizer: Tokenizer | None, word: str, name: str) -> tuple[int, ...]:
    if tokenizer is None:
        raise ValueError(f"{name}: this engine has no tokenizer.json, so words cannot be tokenized; use the token "
                         "interface's bad_words_list")
    ids = tuple(tokenizer.encode(word, add_special_tokens=False).ids)
    if not ids:
        raise ValueError(f"{name}: {word!r} tokenizes to nothing")
    return ids


class Reply:
    """Turns one request's successive `RequestOutput`s into response tensors.

    Streaming replies carry what is new since the previous reply (tokens, or text); a
    non-streaming request gets everything in its final reply. Multi-token stop words are
    matched here, token by token, because the Session stops only on single tokens and strings.
    """

    def __init__(self, job: Job):
        self.job = job
        self.sent_tokens = 0
        self.sent_text = 0
        self.checked = 0  # output positions already searched for a stop sequence

    def update(self, out: RequestOutput) -> tuple[Tensors | None, bool]:
        """The tensors to send for `out` (None: nothing new) and whether this is the last reply;
        after a stop sequence the caller must cancel the Session request."""
        completion = out.outputs[0]
        tokens, done = completion.token_ids, out.finished
        stop_at = self._stop_sequence_end(tokens)
        if stop_at is not None:
            tokens, done = tokens[:stop_at], True
        if not done and not self.job.streaming:
            return None, False
        start = self.sent_tokens if self.job.streaming else 0
        if self.job.text:
            delta = completion.text[self.sent_text:] if self.job.streaming else completion.text
            if self.job.streaming and not delta:
                return None, done
            self.sent_text += len(delta)
            tensors = {"text_output": np.array([[delta.encode("utf-8")]], dtype=np.object_)}
        else:
            new = tokens[start:]
            if self.job.streaming and not new:
                return None, done
            ids = (out.prompt_token_ids if self.job.include_input else []) + new
            tensors = {"output_ids": np.array(ids, dtype=np.int32).reshape(1, 1, len(ids)),
                       "sequence_length": np.array([[len(ids)]], dtype=np.int32)}
        self.sent_tokens = len(tokens)
        if self.job.return_log_probs:
            logprobs = [lp["logprob"] for lp in (completion.logprobs or [])[:len(tokens)]]
            tensors["cum_log_probs"] = np.array([[sum(logprobs)]], dtype=np.float32)
            new_logprobs = logprobs[start:]
            tensors["output_log_probs"] = np.array(new_logprobs, dtype=np.float32).reshape(1, 1, len(new_logprobs))
        return tensors, done

    def _stop_sequence_end(self, tokens: list[int]) -> int | None:
        """The end of the first stop sequence in the output (at least min_tokens in), if any."""
        if not self.job.stop_sequences:
            return None
        found = None
        floor = max(self.checked + 1, self.job.params.min_tokens)
        for end in range(floor, len(tokens) + 1):
            if any(end >= len(s) and tuple(tokens[end - len(s):end]) == s for s in self.job.stop_sequences):
                found = end
                break
        self.checked = max(self.checked, len(tokens))
        return found
