"""The overlapped engine loop: the host prepares step N+1 while the device runs step N.

Plain, a step is: schedule, run, sample, wait for the tokens, append and check them. The host
work (scheduling, packing, detokenizing, stop checks) then leaves the GPU idle. Overlapped,
`EngineCore.step` schedules and launches step N+1 (its forward and its sampling, enqueued on
the device's stream) before step N's tokens are on the host, then appends and checks N's
tokens while the device runs N+1. `InFlight` keeps the one launched step whose tokens are
still on their way, and is what makes this exact:

- A sequence whose token is still on the device has `Sequence.pending` set. The scheduler
  counts that token as one to compute, so the sequence decodes in N+1; its input id is taken
  on the device from N's sampled ids (`runtime.step.Feed`), and the sampler counts it among
  the generated tokens (min_tokens). A sequence whose pending token is its last under
  max_tokens is not scheduled again.
- N's ids come back through a non-blocking copy into pinned memory and an event
  (`runtime.step.SampledIds`), or from rank 0 of a tensor-parallel engine, whose every rank
  keeps its own copy of the ids for the feed (`runtime.tp_executor.RankTokens`); only `settle`
  waits for them. Tokens are appended and checked (stop ids, stop strings,
  length) in step order, so outputs and text are those of the plain loop.
- A sequence that N finished (a stop id or string) or that was cancelled meanwhile was already
  launched in N+1: that one extra token is dropped when it arrives, never emitted. Its blocks
  were freed when it finished; the device writes N+1's KV into them before any later step can
  reuse them, since everything runs on one stream.
- A sequence preempted with a pending token gets that token when N settles, and is admitted
  again only then (the scheduler skips it before).
- Penalties and bad words read the token history, which the pending token belongs to: when a
  running sequence with a pending token uses them, N settles before N+1 is scheduled (the
  plain order, for that step only). Seeded draws need nothing from the host: each sequence's
  generator lives on the device and is used once per step, in the same order. Rows asking for
  logprobs read their token on the host when sampled (a wait for the device in that step, but
  the same values).

With `overlap=False` each step settles at its own end: the plain loop, through the same code.
On the CPU executor everything runs synchronously, but through the same code path.

Launching N+1 as soon as N is settled would queue a whole step ahead of the device: a request
arriving while N+1 runs would miss N+2 as well and wait one step more for its first token than
in the plain loop. `InFlight.pace` tells the caller (Session's loop, where requests arrive) how
long to wait before scheduling the next step: until shortly before the step in flight should end,
judged by how far apart recent steps settled. A request arriving meanwhile joins that step.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from kiln.runtime.scheduler import ScheduledChunk
from kiln.runtime.sequence import Request, Sequence, Status
from kiln.runtime.step import Feed

Append = Callable[[Sequence, int, "dict | None"], None]

# The next step is scheduled this share of a step before the one in flight should end, and at
# least as long before as the longest recent step took to schedule, pack and launch (the host's
# work grows with the batch), and at least PACE_MIN_LEAD: room for that work and the estimate's
# error. On an H200 (BENCHMARKS.md, session 18: 8B engine, 4 requests/s, decode steps of 4.3 ms
# and 0.55-1.0 ms of host work) a lead of twice the host's work gave TTFT p50 12.1 ms in two runs;
# this one 11.3 and 11.1, with ITL p50 and p90 unchanged (4.33 and 4.45-4.47 ms).
PACE_LEAD = 0.25
PACE_MIN_LEAD = 0.3e-3
# Settle times kept: the shortest recent interval between two settles is the step time estimate,
# so that after a long (prefill) step the loop does not wait as if every step were as long.
PACE_HISTORY = 8


def pace_delay(settled_at: list[float], prepare_s: list[float], now: float) -> float:
    """How long from `now` until the next step should be scheduled: the step in flight began
    when the last one settled (`settled_at`, monotonic seconds, oldest first) and should last as
    long as the shortest recent interval between settles; the next step goes that long after the
    last settle, less a lead (PACE_LEAD of a step, the longest recent `prepare_s`, at least
    PACE_MIN_LEAD). 0 with fewer than two settles to judge by."""
    if len(settled_at) < 2:
        return 0.0
    step = min(b - a for a, b in zip(settled_at, settled_at[1:]))
    lead = max(PACE_LEAD * step, max(prepare_s, default=0.0), PACE_MIN_LEAD)
    return max(0.0, settled_at[-1] + step - lead - now)


class Sampled(Protocol):
    """What an executor's `execute` returns for a step that picks tokens: `runtime.step.SampledIds`
    on one device, `runtime.tp_executor.RankTokens` for a tensor-parallel engine."""

    ids: torch.Tensor | None  # where the logits were, for the next step's feed (None: on each rank)

    def wait(self) -> tuple[list[int], list[dict | None]]: ...

    def running(self) -> bool:
        """Whether the step is known to be still running on the device (False when done, or
        when it cannot be known cheaply)."""


@dataclass
class Launched:
    """A step whose sampled ids are on their way to the host: row i of them is `seqs[i]`'s."""

    seqs: list[Sequence]
    sampled: Sampled
    row_of: dict[int, int]           # seq_id -> row


class InFlight:
    """The launched step whose tokens have not been appended yet (at most one)."""

    def __init__(self, overlap: bool, append: Append) -> None:
        self.overlap = overlap
        self._append = append
        self.step: Launched | None = None
        self._settled_at: deque[float] = deque(maxlen=PACE_HISTORY)
        self._prepare_s: deque[float] = deque(maxlen=PACE_HISTORY)

    @property
    def busy(self) -> bool:
        return self.step is not None

    def must_settle(self) -> bool:
        """Whether the next step cannot be scheduled before the launched one's tokens are on the
        host: a running sequence with a pending token reads its token history when sampled."""
        return self.step is not None and any(
            s.pending and s.status is Status.RUNNING and s.request.params.reads_history for s in self.step.seqs)

    def feed(self, batch: list[ScheduledChunk]) -> Feed | None:
        """Where the batch's pending tokens go in the step's input ids: each is the last token of
        its sequence's chunk, and the row of its sequence in the launched step's sampled ids."""
        rows, picks, first = [], [], 0
        for c in batch:
            first += c.num_tokens
            if c.seq.pending:
                rows.append(first - 1)
                picks.append(self.step.row_of[c.seq.seq_id])
        return Feed(rows, picks, self.step.sampled.ids) if rows else None

    def launch(self, seqs: list[Sequence], sampled: Sampled) -> Launched:
        """Record a step whose sampling has been enqueued: its sequences' tokens are pending."""
        for seq in seqs:
            seq.pending += 1
        return Launched(seqs, sampled, {s.seq_id: i for i, s in enumerate(seqs)})

    def hand_over(self, launched: Launched | None) -> list[Request]:
        """Make `launched` the step in flight and settle the one before it; without overlap,
        settle `launched` at once. Returns the requests that got tokens or finished."""
        previous, self.step = self.step, launched
        done = self._settle(previous) if previous is not None else []
        if not self.overlap:
            done += self.settle()
        return list({id(r): r for r in done}.values())

    def pace(self) -> float:
        """Seconds the caller may wait for new requests before scheduling the next step and still
        launch it before the device runs out of work (`pace_delay`): 0 unless the step in flight
        is still running."""
        if not self.overlap or self.step is None or not self.step.sampled.running():
            return 0.0
        return pace_delay(list(self._settled_at), list(self._prepare_s), time.monotonic())

    def prepared(self, seconds: float) -> None:
        """Record how long the host took to schedule, pack and launch a step (for `pace`)."""
        self._prepare_s.append(seconds)

    def settle(self) -> list[Request]:
        """Wait for the step in flight, then append and check its tokens."""
        launched, self.step = self.step, None
        return self._settle(launched) if launched is not None else []

    def _settle(self, launched: Launched) -> list[Request]:
        tokens, logprobs = launched.sampled.wait()
        self._settled_at.append(time.monotonic())
        updated: dict[int, Request] = {}
        for seq, token, logprob in zip(launched.seqs, tokens, logprobs):
            seq.pending -= 1
            if seq.status is Status.FINISHED:
                continue  # stopped or cancelled after this step was launched: the extra token is dropped
            self._append(seq, token, logprob)
            updated[id(seq.request)] = seq.request
        return list(updated.values())
