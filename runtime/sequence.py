"""Requests and their sequences: the state the scheduler and the engine loop share.

A `Request` is what a caller submitted (prompt, sampling parameters, priority); it owns one
`Sequence` per parallel sample (`n`). A sequence holds its tokens, how many of them are in the
KV cache, and its decoding state; the block manager alone owns its blocks.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum

from kiln.runtime.outputs import CompletionOutput, RequestOutput
from kiln.runtime.sampling_params import SamplingParams

_ids = itertools.count()


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request: "Request"
    index: int
    token_ids: list[int]
    seed: int | None  # this sample's: the request's, plus the sample's index for forked ones
    seq_id: int = field(default_factory=lambda: next(_ids))
    num_cached: int = 0
    # Tokens sampled on the device that have not reached `token_ids` yet (the overlapped loop,
    # runtime/overlap.py): they count as tokens to compute, not as output.
    pending: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    text: str = ""  # what callers see: held back mid-stream, cut at a stop string
    full_text: str = ""  # all text decoded so far (whole characters mid-stream), not cut or held back
    logprobs: list[dict] = field(default_factory=list)
    # The detokenizer's state for this sequence (a runtime.detokenizer.DecodeStream), owned and
    # typed there: the import runs one way, detokenizer -> sequence.
    decode_stream: object | None = field(default=None, repr=False)
    # Fixed for the sequence's life, and read for every sequence in every step: kept, not derived.
    num_prompt: int = field(init=False, repr=False)
    # Scheduling order: higher priority first, then first come first served.
    sort_key: tuple = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.num_prompt = len(self.request.prompt_ids)
        self.sort_key = (-self.request.priority, self.request.arrival, self.index)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncached(self) -> int:
        """Tokens the KV cache still lacks, the pending ones included."""
        return self.num_tokens + self.pending - self.num_cached

    @property
    def out_of_tokens(self) -> bool:
        """Whether the pending token is the last that max_tokens allows, so the sequence needs
        no further step."""
        return self.pending > 0 and self.num_output + self.pending >= self.request.params.max_tokens

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival: float = field(default_factory=time.monotonic)
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False

    @property
    def finished(self) -> bool:
        return all(s.status is Status.FINISHED for s in self.seqs) and (self.forked or self.params.n == 1)

    def snapshot(self) -> RequestOutput:
        """What the caller sees of this request now: copies, so later steps do not change it."""
        outs = [CompletionOutput(s.index, s.text, list(s.output_ids), s.finish_reason,
                                 list(s.logprobs) if self.params.logprobs is not None else None)
                for s in sorted(self.seqs, key=lambda s: s.index)]
        return RequestOutput(self.request_id, list(self.prompt_ids), outs, self.finished)
