"""In-flight batching: which sequences run in the next step, and how many tokens each.

Every step packs decode tokens of running sequences and prefill chunks of the others into at
most `max_num_tokens` tokens and `max_batch_size` sequences, with no padding. A long prompt is
prefilled in chunks, so it never stalls the decoding of others. A sequence is admitted with the
longest prefix of its tokens that the prefix cache holds (runtime/prefix_cache.py) already in
the KV cache: its first chunk starts after them, and only computed tokens count against the
budget.

Policies:
- `projected_peak` (the default): admit a request only when the pool holds the running
  sequences at their projected peak. Each is projected to grow a token a step up to the output
  length recent sequences reached (the largest share of max_tokens among the last
  `SHARE_WINDOW` that finished; all of max_tokens before any did, or once it outgrew that) and
  then to free its blocks. With 1,000 requests of 2048/2048 on an 8B model, admitting by free
  blocks alone preempted 625 (each recomputing over 2,000 tokens) as the sequences grew into the
  room that finished ones had left. A wrong guess (a sequence running longer than recent ones)
  falls back to preemption as `max_utilization` does.
- `max_utilization`: admit eagerly; when the pool runs out of blocks, preempt the
  lowest-priority, newest running sequence by recompute (its blocks are freed and it goes back
  to waiting, to be prefilled again with the tokens it already has).
- `guaranteed_no_evict`: admit a request only when the worst case of every admitted request
  (prompt + max_tokens, for each of its samples) fits, so nothing is ever preempted.

With the overlapped loop (runtime/overlap.py) a sequence may have a pending token, sampled on
the device but not on the host yet: it counts as a token to compute, so the sequence decodes
in the next step, unless that token is its last (`Sequence.out_of_tokens`).
"""
from __future__ import annotations

import bisect
import collections
from dataclasses import dataclass

from kiln.runtime.kv_cache import BlockManager
from kiln.runtime.sequence import Sequence, Status

POLICIES = ("projected_peak", "max_utilization", "guaranteed_no_evict")
POLICY_HELP = ("projected_peak admits what fits as the running sequences grow, and preempts only if they outgrow "
               "the guess; max_utilization admits whatever free blocks allow and preempts more; guaranteed_no_evict "
               "admits only what fits at every request's max_tokens and never preempts.")
SHARE_WINDOW = 64  # finished sequences whose output length the admission projection learns from


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence's tokens (a pending one included),
        so its last row's logits give the next token. Read before the step advances
        `num_cached`."""
        return self.num_tokens == self.seq.num_uncached


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_tokens: int, max_batch_size: int,
                 policy: str = POLICIES[0]):
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r}: choose one of {', '.join(POLICIES)}")
        self.blocks = blocks
        self.max_num_tokens = max_num_tokens
        self.max_batch_size = max_batch_size
        self.policy = policy
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # The share of max_tokens that recently finished sequences used (see `_spans`).
        self._used_shares: collections.deque[float] = collections.deque(maxlen=SHARE_WINDOW)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        # An insertion, not a sort per request: 3,000 requests submitted at once sorted the
        # queue 3,000 times.
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def add_running(self, seq: Sequence) -> None:
        """A forked sample: its blocks are already shared with its parent."""
        seq.status = Status.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or cancelled sequence and free its blocks."""
        for queue in (self.waiting, self.running):
            if seq in queue:
                queue.remove(seq)
        self.blocks.free(seq.seq_id, seq.token_ids)
        if seq.finish_reason in ("stop", "length"):
            self._used_shares.append(seq.num_output / seq.request.params.max_tokens)

    def _worst_case_blocks(self, seq: Sequence) -> int:
        params = seq.request.params
        return self.blocks.blocks_needed(seq.num_prompt + params.max_tokens) * params.n

    def _reserved_blocks(self) -> int:
        """Blocks the running requests may still claim before they finish (no-evict policy)."""
        requests = {id(s.request): s.request for s in self.running}.values()
        held = sum(len(self.blocks.table(s.seq_id)) for s in self.running)
        return sum(self._worst_case_blocks(r.seqs[0]) for r in requests) - held

    def _spans(self, seq: Sequence, share: float) -> list[tuple[int, int]]:
        """(steps until the sequence is done, KV tokens it holds then) for each sample of `seq`:
        it grows a token a step, one more step per prefill chunk it still needs, and is expected
        to make `share` of its max_tokens."""
        params = seq.request.params
        made = seq.num_output + seq.pending
        # One that has outgrown the expected share may run to max_tokens.
        expected = -int(-share * params.max_tokens // 1)
        if made >= expected:
            expected = params.max_tokens
        steps = expected - made + (seq.num_uncached - 1) // self.max_num_tokens
        # Its last step samples its last token without writing that token's keys and values.
        last = seq.num_tokens + seq.pending + steps - 1
        samples = params.n if seq.status is Status.WAITING and not seq.request.forked else 1
        return [(steps, last)] * samples

    def _peak_fits(self, spans: list[tuple[int, int]]) -> bool:
        """Whether the pool holds `spans` (see `_spans`) at every future step, each growing by a
        token a step until it is done and then freeing its blocks. Usage only grows between two
        ends, so the peaks are just before each end: with the spans sorted by end, the usage just
        before the k-th end is that of the spans from k on, each `steps_k` steps from its last
        size."""
        size, limit = self.blocks.block_size, self.blocks.num_blocks
        # Each span's last block may be partial: (tokens + size - 1) // size blocks, summed.
        if (sum(last for _, last in spans) + len(spans) * (size - 1)) // size <= limit:
            return True  # every span at its largest at once fits
        spans = sorted(spans)
        tokens = 0
        for k in range(len(spans) - 1, -1, -1):
            tokens += spans[k][1] - spans[k][0]
            alive = len(spans) - k
            if (tokens + spans[k][0] * alive + alive * (size - 1)) // size > limit:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        # Its full blocks stay in the prefix cache: readmitted, it computes only what was evicted.
        self.blocks.free(seq.seq_id, seq.token_ids)
        seq.num_cached = 0
        self.num_preemptions += 1
        self.add(seq)

    def schedule(self) -> tuple[list[ScheduledChunk], list[tuple[int, int]]]:
        """The next step's chunks, and the block copies (copy-on-write) to do before it."""
        budget, batch, copies = self.max_num_tokens, [], []
        scheduled: set[int] = set()
        # Decode tokens first: a long prompt's remaining chunks must never stall decoding.
        decoding_first = sorted(self.running, key=lambda s: (s.num_uncached > 1, s.sort_key))
        for seq in decoding_first:
            # Status, not membership of `running`: a list scan per sequence made scheduling
            # quadratic (15 ms a step at 1,024 sequences).
            if seq.status is not Status.RUNNING or seq.out_of_tokens:
                continue  # preempted while making room for an earlier sequence, or done once its token lands
            if len(batch) == self.max_batch_size or budget == 0:
                break
            n = min(seq.num_uncached, budget)
            appended = self.blocks.try_append(seq.seq_id, seq.token_ids, seq.num_cached + n)
            while appended is None:
                victims = [s for s in self.running if s.seq_id not in scheduled]
                victim = max(victims, key=lambda s: s.sort_key)
                self._preempt(victim)
                if victim is seq:
                    break
                appended = self.blocks.try_append(seq.seq_id, seq.token_ids, seq.num_cached + n)
            if appended is None:
                continue
            copies += appended
            batch.append(ScheduledChunk(seq, n))
            scheduled.add(seq.seq_id)
            budget -= n
        spans = None  # the running sequences' spans, made only when an admission asks
        while self.waiting and budget > 0 and len(batch) < self.max_batch_size:
            seq = self.waiting[0]
            if seq.pending:
                break  # preempted with its last token still on the device: admitted once it lands
            match = self.blocks.match(seq.token_ids)
            n = min(seq.num_tokens - match.num_tokens, budget)
            if self.policy == "guaranteed_no_evict" and seq.num_cached == 0 and not seq.request.forked:
                if self.blocks.num_free - self._reserved_blocks() < self._worst_case_blocks(seq):
                    break
            if not self.blocks.can_allocate(match.num_tokens + n, match):
                break
            if self.policy == "projected_peak":
                if spans is None:
                    # Recent sequences stopped at up to this share of their max_tokens (all of
                    # it before any finished).
                    share = max(self._used_shares, default=1.0)
                    spans = [span for s in self.running if s.status is Status.RUNNING for span in self._spans(s, share)]
                admitted = spans + self._spans(seq, share)
                # With nothing running, the projection may only delay, never refuse: a request
                # whose projected peak overfills the pool runs alone, preempting if it must.
                if self.running and not self._peak_fits(admitted):
                    break
                spans = admitted
            copies += self.blocks.allocate(seq.seq_id, seq.token_ids, match.num_tokens + n, match)
            seq.num_cached = match.num_tokens
            self.waiting.pop(0)
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.append(ScheduledChunk(seq, n))
            budget -= n
        self.blocks.step_scheduled()
        return batch, copies
