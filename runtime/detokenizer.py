"""A sequence's output text, decoded a few tokens per step, and cut at its stop strings.

Decoding the whole output every step costs O(length) per step, O(length^2) per request. Instead
each sequence keeps a `DecodeStream`: a short window of token ids, the tokens whose text was
emitted last (context) followed by the tokens not emitted yet (pending). The window's decode
minus the context's decode is the new text. The context is decoded along because a token's text
can depend on its neighbours (a byte-level BPE token may hold part of a UTF-8 character; a
SentencePiece decoder strips the leading space of the first token), while the context's own
text does not change when tokens are appended after it. New text waits while it ends in
"\\ufffd" (a partial UTF-8 character, or bytes that cannot become one yet), for at most
MAX_PENDING tokens. Stop strings are searched in the new text only (plus the len(stop) - 1
characters before it).

For a byte-level BPE tokenizer (the Llama 3 / Qwen kind, and `train_tokenizer()`'s) the emitted
text equals `tokenizer.decode(output_ids[:j])` for the last pushed `j` whose decode does not end
in "\\ufffd", and after `flush()` it equals `tokenizer.decode(output_ids)`: the window always
starts where the bytes decoded to whole characters, and UTF-8 decoding restarts cleanly there.
A SentencePiece decoder with byte fallback (Llama 2 kind) gives the same for valid text; only
when byte tokens that are not valid UTF-8 follow a character's byte tokens does a full decode
turn that whole run into one "\\ufffd" per byte, while the stream keeps the character it has
already emitted. Either way the final text extends the streamed text: it is never re-decoded.
"""
from __future__ import annotations

from collections.abc import Sequence as IdList
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from kiln.runtime.sequence import Sequence

REPLACEMENT = "\ufffd"
# Pending tokens after which text that still ends in REPLACEMENT is emitted anyway. A UTF-8
# character spans at most 4 byte-level tokens, but a SentencePiece byte-fallback decoder shows a
# whole unfinished run of byte tokens as replacement characters, so valid text (a run of rare
# CJK characters) may need a few dozen. A longer wait means bytes that can never become text (a
# model emitting garbage bytes, as random test models do); waiting on would make every step
# decode an ever longer window. Only a character cut by the cap is then shown as replacement
# characters where a full decode would show it.
MAX_PENDING = 64


class Detokenizer:
    """One tokenizer's decoding, shared by every sequence of an engine."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        # `decode` (skip_special_tokens=True) drops special tokens and ids the tokenizer does not
        # know before its decoder runs; dropping them before they enter a window is the same and
        # keeps windows short, e.g. for a random model whose vocabulary outgrows its tokenizer.
        self._special = frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
        # len(decode([t])) by token: a window that emitted one token (most steps of most
        # sequences) starts the next with it as context, whose text length would otherwise
        # cost a second decode per sequence per step.
        self._lengths: dict[int, int] = {}

    def skips(self, token: int) -> bool:
        return token in self._special or self.tokenizer.id_to_token(token) is None

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def text_length(self, ids: list[int]) -> int:
        """len(decode(ids)), remembered for single tokens."""
        if len(ids) != 1:
            return len(self.decode(ids))
        length = self._lengths.get(ids[0])
        if length is None:
            length = self._lengths[ids[0]] = len(self.decode(ids))
        return length

    def stream(self) -> DecodeStream:
        return DecodeStream(self)

    def update(self, seq: Sequence, final: bool, drop_last: bool = False) -> bool:
        """Decode the sequence's new output tokens into `seq.full_text` and `seq.text`.

        `drop_last` leaves the last token out (an eos or stop token is not text). Mid-stream,
        `seq.text` holds back a partial UTF-8 character and any tail that could start a stop
        string, so it only ever grows; `final` releases both. Returns True when a stop string
        was found: `seq.text` then ends right before it.
        """
        stream = seq.decode_stream
        if stream is None:  # made lazily, so a sequence forked with output already catches up
            stream = seq.decode_stream = self.stream()
        start, end = seq.num_prompt + stream.fed, seq.num_tokens - (1 if drop_last else 0)
        new = stream.push(seq.token_ids[start:end]) if end > start else ""
        if final:
            new += stream.flush()
        stops = seq.request.params.stop
        if new:
            searched = len(seq.full_text)
            seq.full_text += new
            at = find_stop(seq.full_text, searched, stops)
            if at >= 0:
                seq.text = seq.full_text[:at]
                return True
        if final:
            seq.text = seq.full_text
        elif new:
            hold = stop_prefix_len(seq.full_text, stops)
            seq.text = seq.full_text[:len(seq.full_text) - hold] if hold else seq.full_text
        return False


class DecodeStream:
    """One sequence's token ids in, its new text out, decoding only a short window per step."""

    __slots__ = ("_context", "_detok", "_ids", "_prefix_len", "fed")

    def __init__(self, detok: Detokenizer) -> None:
        self._detok = detok
        self._ids: list[int] = []  # the window: `_context` emitted ids, then the pending ones
        self._context = 0
        self._prefix_len = 0  # len(decode(context)): the window's text that was emitted already
        self.fed = 0  # output tokens pushed so far, skipped ones included

    @property
    def window(self) -> int:
        """Tokens the next decode will see."""
        return len(self._ids)

    def push(self, ids: IdList[int]) -> str:
        """Add tokens; returns the text they complete ("" while it has to wait for more)."""
        self.fed += len(ids)
        before = len(self._ids)
        self._ids.extend(t for t in ids if not self._detok.skips(t))
        if len(self._ids) == before:
            return ""  # nothing that decodes to text: the window's text is unchanged
        text = self._detok.decode(self._ids)
        waiting = text.endswith(REPLACEMENT) and len(self._ids) - self._context < MAX_PENDING
        if len(text) <= self._prefix_len or waiting:
            return ""
        return self._emit(text)

    def flush(self) -> str:
        """The pending text, even a partial character (as "\\ufffd", like a full decode shows it).
        For the sequence's end: text pushed after it would not be decoded with that character."""
        if len(self._ids) == self._context:
            return ""
        return self._emit(self._detok.decode(self._ids))

    def _emit(self, text: str) -> str:
        new = text[self._prefix_len:]
        # The tokens just emitted are the next window's context: enough for a decoder that looks
        # at a token's neighbour, and they end where the text ended in whole characters.
        del self._ids[:self._context]
        self._context = len(self._ids)
        self._prefix_len = self._detok.text_length(self._ids)
        return new


def find_stop(text: str, searched: int, stops: tuple[str, ...]) -> int:
    """Where the earliest stop string in `text` starts, or -1. `text[:searched]` was searched
    already, so only occurrences ending after it are looked for: O(new text) per step."""
    best = -1
    for stop in stops:
        at = text.find(stop, max(0, searched - len(stop) + 1))
        if at >= 0 and (best < 0 or at < best):
            best = at
    return best


def stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """The longest tail of `text` that is the start (not the whole) of a stop string."""
    return max((k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)
