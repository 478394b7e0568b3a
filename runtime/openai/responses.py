"""OpenAI response objects from Session outputs: whole responses, streamed chunks, logprobs and usage.

A request may carry several prompts (completions) of `n` samples each; its choices are numbered
prompt by prompt, `index = prompt * n + sample`, as OpenAI numbers them.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from tokenizers import Tokenizer

from kiln.runtime.openai.protocol import Job
from kiln.runtime.outputs import CompletionOutput, RequestOutput

# Session finish reasons that OpenAI has a name for; a cancelled request has none.
FINISH_REASONS = ("stop", "length")


@dataclass
class _Sent:
    """How much of one choice the client has had: text, logprobs, whether it has ended."""

    text: int = 0
    logprobs: int = 0
    text_offset: int = 0
    started: bool = False
    finished: bool = False


class Responder:
    """Shapes the answers to one request: `response` for the whole of it, `chunks` and
    `usage_chunk` when it streams."""

    def __init__(self, job: Job, model: str, tokenizer: Tokenizer | None):
        self.job, self.model, self.tokenizer = job, model, tokenizer
        self.id = f"{'chatcmpl' if job.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.sent: dict[int, _Sent] = {}
        self.latest: dict[int, RequestOutput] = {}  # per prompt, for the usage

    # -- whole responses -----------------------------------------------------------------------

    def response(self, finals: list[RequestOutput]) -> dict:
        """The answer to a request that does not stream: `finals[i]` is prompt i's last output."""
        choices = []
        for p, out in enumerate(finals):
            self.latest[p] = out
            for c in out.outputs:
                choice = {"index": self._index(p, c), "logprobs": self._logprobs(c, _Sent(), len(c.token_ids)),
                          "finish_reason": _finish_reason(c)}
                if self.job.chat:
                    choice["message"] = {"role": "assistant", "content": c.text}
                else:
                    choice["text"] = c.text
                choices.append(choice)
        return {"id": self.id, "object": "chat.completion" if self.job.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self.usage()}

    def usage(self) -> dict:
        prompt = sum(len(out.prompt_token_ids) for out in self.latest.values())
        completion = sum(len(c.token_ids) for out in self.latest.values() for c in out.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    # -- streaming -----------------------------------------------------------------------------

    def chunks(self, prompt: int, out: RequestOutput) -> list[dict]:
        """The chunks that carry what `out` (an output of prompt `prompt`) adds: per choice, its
        new text and logprobs, and its finish reason once it ends."""
        self.latest[prompt] = out
        chunks = []
        for c in out.outputs:
            index = self._index(prompt, c)
            sent = self.sent.setdefault(index, _Sent())
            if sent.finished:
                continue
            if self.job.chat and not sent.started:  # a chat stream opens each choice with its role
                chunks.append(self._chunk({"index": index, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None}))
            sent.started = True
            text = c.text[sent.text:]
            logprobs = self._logprobs(c, sent, len(c.token_ids))
            reason = _finish_reason(c)
            sent.finished = c.finish_reason is not None
            if not text and reason is None and not (logprobs and _entries(logprobs, self.job.chat)):
                continue
            sent.text = len(c.text)
            choice = {"index": index, "logprobs": logprobs, "finish_reason": reason}
            if self.job.chat:
                choice["delta"] = {"content": text} if text else {}
            else:
                choice["text"] = text
            chunks.append(self._chunk(choice))
        return chunks

    def usage_chunk(self) -> dict:
        """The last chunk of a stream that asked for `stream_options.include_usage`."""
        return {**self._chunk(None), "choices": [], "usage": self.usage()}

    def _chunk(self, choice: dict | None) -> dict:
        chunk = {"id": self.id, "object": "chat.completion.chunk" if self.job.chat else "text_completion",
                 "created": self.created, "model": self.model, "choices": [choice] if choice else []}
        if self.job.include_usage:
            chunk["usage"] = None  # as OpenAI: every chunk has the key, only the last a value
        return chunk

    # -- pieces --------------------------------------------------------------------------------

    def _index(self, prompt: int, c: CompletionOutput) -> int:
        return prompt * self.job.params.n + c.index

    def _logprobs(self, c: CompletionOutput, sent: _Sent, upto: int) -> dict | None:
        """The logprobs of the tokens `sent` has not had yet, in the endpoint's format."""
        if not self.job.logprobs:
            return None
        entries = (c.logprobs or [])[sent.logprobs:upto]
        sent.logprobs += len(entries)
        if self.job.chat:
            return {"content": [{**self._token(e["token"], e["logprob"]),
                                 "top_logprobs": [self._token(t, lp) for t, lp in e["top"]]} for e in entries]}
        tokens = [self._text(e["token"]) for e in entries]
        offsets = []
        for token in tokens:
            offsets.append(sent.text_offset)
            sent.text_offset += len(token)
        return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{self._text(t): lp for t, lp in e["top"]} for e in entries], "text_offset": offsets}

    def _token(self, token: int, logprob: float) -> dict:
        text = self._text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _text(self, token: int) -> str:
        # Without a tokenizer (token-id prompts only) a token is named by its id, as vLLM does.
        if self.tokenizer is None:
            return f"token_id:{token}"
        return self.tokenizer.decode([token], skip_special_tokens=False)


def _finish_reason(c: CompletionOutput) -> str | None:
    return c.finish_reason if c.finish_reason in FINISH_REASONS else None


def _entries(logprobs: dict, chat: bool) -> list:
    return logprobs["content"] if chat else logprobs["tokens"]
