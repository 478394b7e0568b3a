"""`Scheduler` on its own: a `BlockManager` and hand-made requests, no engine.

`step` stands in for the engine: it runs the scheduler, then advances every chunk the way
`EngineCore._postprocess` does (the chunk's tokens are now cached; a chunk that reaches the
end of its sequence samples one token), and finishes sequences at max_tokens.

The prompts here share their first tokens, so most tests turn prefix caching off to see the
scheduling alone; the random workloads run both ways, and the last tests are about admission
with cached prefixes.
"""
from __future__ import annotations

import random

import pytest

from kiln.runtime.kv_cache import BlockManager
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import POLICIES, ScheduledChunk, Scheduler
from kiln.runtime.sequence import Request, Sequence, Status

BLOCK = 4


def make_seq(prompt_len: int, arrival: float, max_tokens: int = 4, priority: int = 0) -> Sequence:
    # Explicit arrivals: two requests made in a row may read the same monotonic clock.
    request = Request(f"r{arrival}", list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=max_tokens),
                      priority, arrival=arrival)
    seq = Sequence(request, 0, list(request.prompt_ids), None)
    request.seqs.append(seq)
    return seq


def step(sched: Scheduler) -> list[tuple[Sequence, int, bool]]:
    """One step; returns (sequence, chunk tokens, whether the chunk sampled) per chunk."""
    batch, copies = sched.schedule()
    if not sched.blocks.prefix_caching:
        assert copies == []  # nothing is forked here, so nothing is ever shared
    done = []
    for c in batch:
        assert isinstance(c, ScheduledChunk)
        assert len(sched.blocks.table(c.seq.seq_id)) * BLOCK >= c.seq.num_cached + c.num_tokens
        done.append((c.seq, c.num_tokens, c.samples))
        c.seq.num_cached += c.num_tokens
        if done[-1][2]:
            c.seq.token_ids.append(7)
            if len(c.seq.output_ids) == c.seq.request.params.max_tokens:
                c.seq.status, c.seq.finish_reason = Status.FINISHED, "length"
                sched.remove(c.seq)
    return done


def run_to_completion(sched: Scheduler, seqs: list[Sequence], max_steps: int = 500) -> list[list[tuple]]:
    steps = []
    while sched.has_work():
        assert len(steps) < max_steps, "the scheduler stopped making progress"
        steps.append(step(sched))
        assert steps[-1], "an empty step with work left"
    for seq in seqs:
        assert seq.status is Status.FINISHED
        assert len(seq.output_ids) == seq.request.params.max_tokens
    assert sched.blocks.used_blocks() == 0
    return steps


def test_invalid_policy_raises():
    with pytest.raises(ValueError, match="policy 'fifo'.*max_utilization"):
        Scheduler(BlockManager(8, BLOCK, prefix_caching=False), 16, 4, policy="fifo")


@pytest.mark.parametrize("caching", (False, True))
@pytest.mark.parametrize("policy", POLICIES)
def test_budget_and_batch_size_are_respected(policy, caching):
    rng = random.Random(0)
    sched = Scheduler(BlockManager(40, BLOCK, caching), max_num_tokens=16, max_batch_size=4, policy=policy)
    seqs = [make_seq(rng.randint(1, 30), arrival=i, max_tokens=rng.randint(1, 8)) for i in range(12)]
    for seq in seqs:
        sched.add(seq)
    steps = run_to_completion(sched, seqs)
    for batch in steps:
        assert sum(n for _, n, _ in batch) <= 16
        assert len(batch) <= 4
        assert len({seq.seq_id for seq, _, _ in batch}) == len(batch)
        assert all(n >= 1 for _, n, _ in batch)
    # The pool is big enough for every request's worst case here: nothing is ever preempted.
    assert sched.num_preemptions == 0


def test_long_prompt_is_chunked_over_several_steps():
    sched = Scheduler(BlockManager(16, BLOCK, prefix_caching=False), max_num_tokens=8, max_batch_size=4)
    seq = make_seq(25, arrival=0, max_tokens=3)
    sched.add(seq)
    steps = run_to_completion(sched, [seq])
    assert [[(n, samples) for _, n, samples in b] for b in steps] == [
        [(8, False)], [(8, False)], [(8, False)], [(1, True)],  # the prompt: 8 + 8 + 8 + 1
        [(1, True)], [(1, True)],  # two more tokens, one per step
    ]


def test_decodes_are_scheduled_before_new_prefills():
    sched = Scheduler(BlockManager(32, BLOCK, prefix_caching=False), max_num_tokens=6, max_batch_size=4)
    a, b = make_seq(3, arrival=0, max_tokens=8), make_seq(2, arrival=1, max_tokens=8)
    sched.add(a)
    sched.add(b)
    assert [(seq, n) for seq, n, _ in step(sched)] == [(a, 3), (b, 2)]
    late = make_seq(20, arrival=2, max_tokens=8)
    sched.add(late)
    # a and b decode one token each; the new prompt gets only what is left of the budget.
    assert [(seq, n) for seq, n, _ in step(sched)] == [(a, 1), (b, 1), (late, 4)]
    # The half-prefilled prompt goes on after the decodes; a newer prompt waits for budget.
    later = make_seq(2, arrival=3, max_tokens=8)
    sched.add(later)
    for _ in range(4):
        assert [(seq, n) for seq, n, _ in step(sched)] == [(a, 1), (b, 1), (late, 4)]
    assert late.num_cached == late.num_tokens - 1 == 20  # its last chunk sampled a token
    assert [(seq, n) for seq, n, _ in step(sched)] == [(a, 1), (b, 1), (late, 1), (later, 2)]


def test_priority_orders_admission():
    sched = Scheduler(BlockManager(32, BLOCK, prefix_caching=False), max_num_tokens=64, max_batch_size=1)
    low, high, mid = (make_seq(4, arrival=i, priority=p) for i, p in enumerate((0, 5, 1)))
    for seq in (low, high, mid):
        sched.add(seq)
    assert sched.waiting == [high, mid, low]
    assert [seq for seq, _, _ in step(sched)] == [high]
    # Equal priorities: first come, first served.
    early = make_seq(4, arrival=-1, priority=1)
    sched.add(early)
    assert sched.waiting == [early, mid, low]


def test_preemption_picks_the_lowest_priority_newest_sequence():
    # 6 blocks: three 8-token prompts take 2 blocks each, and then nobody can grow.
    sched = Scheduler(BlockManager(6, BLOCK, prefix_caching=False), max_num_tokens=64, max_batch_size=8,
                      policy="max_utilization")
    old = make_seq(8, arrival=0, priority=0)
    new = make_seq(8, arrival=1, priority=0)
    urgent = make_seq(8, arrival=2, priority=2)
    for seq in (old, new, urgent):
        sched.add(seq)
    assert {seq for seq, _, _ in step(sched)} == {old, new, urgent}
    assert sched.blocks.num_free == 0
    # Each now holds 9 tokens and needs a third block. `urgent` goes first and evicts `new`
    # (lowest priority, and newer than `old`); `old` then takes the other freed block.
    assert [(seq, n) for seq, n, _ in step(sched)] == [(urgent, 1), (old, 1)]
    assert sched.num_preemptions == 1
    assert new.status is Status.WAITING and new.num_cached == 0 and sched.waiting == [new]
    with pytest.raises(KeyError):
        sched.blocks.table(new.seq_id)
    # Recompute: once blocks are free again, `new` is prefilled with the token it already had.
    steps = run_to_completion(sched, [old, new, urgent])
    assert [(n, samples) for b in steps for seq, n, samples in b if seq is new][0] == (9, True)


def test_forked_samples_copy_on_write_and_are_preempted_alone():
    blocks = BlockManager(4, BLOCK, prefix_caching=False)
    sched = Scheduler(blocks, max_num_tokens=64, max_batch_size=8, policy="max_utilization")
    request = Request("r", list(range(3, 9)), SamplingParams(n=2, max_tokens=6), arrival=0)
    parent = Sequence(request, 0, list(request.prompt_ids), None)
    request.seqs.append(parent)
    sched.add(parent)
    assert step(sched) == [(parent, 6, True)]
    # What EngineCore._fork does after the prompt's prefill: the child shares both blocks.
    child = Sequence(request, 1, list(parent.token_ids[:-1]) + [8], None, num_cached=6)
    blocks.fork(parent.seq_id, child.seq_id)
    sched.add_running(child)
    request.seqs.append(child)
    request.forked = True
    shared = blocks.table(parent.seq_id)

    batch, copies = sched.schedule()
    # The parent writes token 7 first into the shared, partly filled block: it gets a copy.
    # The child is then the block's only holder and writes in place.
    assert [(c.seq, c.num_tokens) for c in batch] == [(parent, 1), (child, 1)]
    [(src, dst)] = copies
    assert src == shared[1] and blocks.table(parent.seq_id) == [shared[0], dst]
    assert blocks.table(child.seq_id) == shared and blocks.ref_count(shared[0]) == 2
    for c in batch:
        c.seq.num_cached += 1
        c.seq.token_ids.append(7)

    assert step(sched) == [(parent, 1, True), (child, 1, True)]  # 8 tokens: still 2 blocks each
    # Token 9 needs a third block each, and one is free: the child (the newer sample) is
    # preempted, and the block it shared stays with the parent.
    assert step(sched) == [(parent, 1, True)]
    assert sched.num_preemptions == 1 and child.status is Status.WAITING
    assert blocks.ref_count(shared[0]) == 1
    run_to_completion(sched, [parent, child])


@pytest.mark.parametrize("policy", ("max_utilization", "guaranteed_no_evict"))
def test_no_evict_refuses_admission_when_the_worst_case_does_not_fit(policy):
    sched = Scheduler(BlockManager(8, BLOCK, prefix_caching=False), max_num_tokens=64, max_batch_size=8,
                      policy=policy)
    a = make_seq(4, arrival=0, max_tokens=12)  # worst case 16 tokens: 4 blocks
    b = make_seq(4, arrival=1, max_tokens=12)
    c = make_seq(4, arrival=2, max_tokens=12)
    for seq in (a, b, c):
        sched.add(seq)
    admitted = [seq for seq, _, _ in step(sched)]
    if policy == "guaranteed_no_evict":
        # 6 blocks are free right now, but a and b may still claim all of them.
        assert admitted == [a, b] and sched.waiting == [c]
    else:
        assert admitted == [a, b, c]
    run_to_completion(sched, [a, b, c])
    assert (sched.num_preemptions == 0) == (policy == "guaranteed_no_evict")


def random_workload(policy: str, caching: bool) -> int:
    """Many requests through a pool far too small for all of them at once; returns how many
    were preempted."""
    rng = random.Random(1)
    sched = Scheduler(BlockManager(12, BLOCK, caching), max_num_tokens=12, max_batch_size=5, policy=policy)
    seqs = []
    for i in range(40):
        # Every request fits the pool on its own (48 tokens), as EngineCore.validate ensures.
        prompt_len = rng.randint(1, 24)
        seqs.append(make_seq(prompt_len, arrival=i, max_tokens=rng.randint(1, 48 - prompt_len),
                             priority=rng.choice((0, 0, 1))))
    pending = list(seqs)
    steps = []
    while pending or sched.has_work():
        for _ in range(rng.randint(0, 2)):
            if pending:
                sched.add(pending.pop(0))
        if sched.has_work():
            steps.append(step(sched))
            assert steps[-1], "an empty step with work left"
            assert sum(n for _, n, _ in steps[-1]) <= 12 and len(steps[-1]) <= 5
        assert len(steps) < 2000
    assert all(s.status is Status.FINISHED and len(s.output_ids) == s.request.params.max_tokens for s in seqs)
    assert sched.blocks.used_blocks() == 0
    assert (sched.blocks.cache_hits > 0) == caching
    return sched.num_preemptions


@pytest.mark.parametrize("caching", (False, True))
def test_random_workload_on_a_tight_pool(caching):
    preempted = {policy: random_workload(policy, caching) for policy in POLICIES}
    assert preempted["guaranteed_no_evict"] == 0
    assert 0 < preempted["max_utilization"]
    assert preempted["projected_peak"] < preempted["max_utilization"]


def test_newer_decodes_are_not_stalled_by_an_older_long_prefill():
    sched = Scheduler(BlockManager(64, BLOCK, prefix_caching=False), max_num_tokens=8, max_batch_size=4)
    short = make_seq(2, arrival=1.0, max_tokens=8)
    sched.add(short)
    step(sched)                                   # the short prompt is prefilled and decoding
    long_seq = make_seq(40, arrival=0.0)          # older (it arrived first), admitted later
    sched.add(long_seq)
    step(sched)                                   # its first chunk takes the rest of the budget
    for _ in range(3):
        chunks = {seq: n for seq, n, _ in step(sched)}
        assert chunks[short] == 1 and chunks[long_seq] == 7


def prompt_seq(prompt: list[int], arrival: float, max_tokens: int = 4) -> Sequence:
    seq = make_seq(len(prompt), arrival, max_tokens)
    seq.token_ids[:] = seq.request.prompt_ids[:] = prompt
    return seq


def test_admission_starts_after_the_cached_prefix():
    sched = Scheduler(BlockManager(32, BLOCK), max_num_tokens=8, max_batch_size=4)
    first = prompt_seq(list(range(100, 112)), arrival=0, max_tokens=2)
    sched.add(first)
    run_to_completion(sched, [first])
    # Two of its three full blocks are a prefix of the next prompt: only the 6 tokens after
    # them are computed, in one chunk that fits the 8-token budget and samples.
    second = prompt_seq(list(range(100, 108)) + list(range(200, 206)), arrival=1)
    sched.add(second)
    assert step(sched) == [(second, 6, True)] and second.num_cached == 14
    assert (sched.blocks.cache_queries, sched.blocks.cache_hits) == (12 + 14, 8)
    run_to_completion(sched, [second])


def test_a_fully_cached_prompt_computes_its_last_token():
    sched = Scheduler(BlockManager(32, BLOCK), max_num_tokens=8, max_batch_size=4)
    first = prompt_seq(list(range(100, 108)), arrival=0, max_tokens=1)
    sched.add(first)
    run_to_completion(sched, [first])
    again = prompt_seq(list(range(100, 108)), arrival=1, max_tokens=3)
    sched.add(again)
    batch, copies = sched.schedule()
    # Its last block is copied out of the cache, so the recomputed last token is written into a
    # block of its own; that token's logits give the first output token.
    assert [(c.seq, c.num_tokens, c.samples) for c in batch] == [(again, 1, True)]
    [(src, dst)] = copies
    assert again.num_cached == 7 and dst == sched.blocks.table(again.seq_id)[1]
    assert sched.blocks.is_cached(src) and sched.blocks.cache_hits == 7


def test_a_preempted_sequence_recomputes_only_what_was_evicted():
    sched = Scheduler(BlockManager(5, BLOCK), max_num_tokens=64, max_batch_size=4, policy="max_utilization")
    a = prompt_seq(list(range(100, 108)), arrival=0, max_tokens=2)
    b = prompt_seq(list(range(200, 208)), arrival=1, max_tokens=4)
    sched.add(a)
    sched.add(b)
    assert step(sched) == [(a, 8, True), (b, 8, True)]
    # Both need a third block and one is free: b is preempted, its two full blocks stay cached;
    # a then finishes, and its two full blocks stay cached too.
    assert step(sched) == [(a, 1, True)]
    assert sched.num_preemptions == 1 and b.status is Status.WAITING and sched.blocks.cached_blocks() == 4
    # b comes back with its prompt's blocks and recomputes only its sampled token.
    assert step(sched) == [(b, 1, True)]
    assert sched.blocks.cache_hits == 8
    run_to_completion(sched, [a, b])


def test_projected_peak_admits_a_request_that_fits_once_an_older_one_ends():
    # 9 blocks. `old` has 4 steps left and ends at 19 KV tokens (5 blocks); `new` ends at 19 too.
    # Both worst cases at once (10 blocks) do not fit, but `old` frees its blocks before `new`
    # grows past 3 blocks.
    admitted = {}
    for policy in ("projected_peak", "guaranteed_no_evict"):
        sched = Scheduler(BlockManager(9, BLOCK, prefix_caching=False), max_num_tokens=64, max_batch_size=4,
                          policy=policy)
        old = make_seq(4, arrival=0, max_tokens=16)
        sched.add(old)
        for _ in range(12):
            step(sched)
        new = make_seq(8, arrival=1, max_tokens=12)
        sched.add(new)
        admitted[policy] = new in {seq for seq, _, _ in step(sched)}
        run_to_completion(sched, [old, new])
        assert sched.num_preemptions == 0
    assert admitted == {"projected_peak": True, "guaranteed_no_evict": False}


def test_projected_peak_holds_back_what_the_running_sequences_will_grow_into():
    # Six prompts of 2 blocks each fill the 12-block pool, and each grows to 4 blocks: admitted
    # by free blocks, they preempt one another and recompute.
    computed, preempted = {}, {}
    for policy in ("projected_peak", "max_utilization"):
        sched = Scheduler(BlockManager(12, BLOCK, prefix_caching=False), max_num_tokens=64, max_batch_size=8,
                          policy=policy)
        seqs = [make_seq(8, arrival=i, max_tokens=8) for i in range(6)]
        for seq in seqs:
            sched.add(seq)
        steps = run_to_completion(sched, seqs)
        computed[policy] = sum(n for batch in steps for _, n, _ in batch)
        preempted[policy] = sched.num_preemptions
    assert preempted["projected_peak"] == 0 < preempted["max_utilization"]
    assert computed["projected_peak"] == 6 * (8 + 7) < computed["max_utilization"]


def test_projected_peak_expects_the_output_lengths_that_recent_requests_reached():
    # Every request may make 40 tokens (43 KV tokens, 11 blocks) but stops after 4.
    sched = Scheduler(BlockManager(16, BLOCK, prefix_caching=False), max_num_tokens=64, max_batch_size=8)

    def run(seqs: list[Sequence]) -> list[int]:
        """Batch sizes, step by step, until every sequence stopped after 4 tokens."""
        for seq in seqs:
            sched.add(seq)
        sizes = []
        while sched.has_work():
            batch, _ = sched.schedule()
            sizes.append(len(batch))
            for c in batch:
                samples = c.samples
                c.seq.num_cached += c.num_tokens
                if samples:
                    c.seq.token_ids.append(7)
                    if c.seq.num_output == 4:
                        c.seq.status, c.seq.finish_reason = Status.FINISHED, "stop"
                        sched.remove(c.seq)
        return sizes

    # Before any finished, each is expected to run to max_tokens: one at a time.
    assert max(run([make_seq(4, arrival=i, max_tokens=40) for i in range(2)])) == 1
    # They made a tenth of their max_tokens: six now run together (2 blocks each, as expected).
    assert max(run([make_seq(4, arrival=2 + i, max_tokens=40) for i in range(6)])) == 6
    assert sched.num_preemptions == 0 and sched.blocks.used_blocks() == 0


def test_projected_peak_admits_a_lone_request_whose_projection_overfills_the_pool():
    # Four samples of a 3-token prompt: counted apart, each with a partial last block, the
    # projection wants 6 of the 4 blocks, though the samples share one block. Nothing else
    # runs, so holding the request back would stall the engine for good (CI hit this).
    sched = Scheduler(BlockManager(4, BLOCK, prefix_caching=False), max_num_tokens=64, max_batch_size=4)
    request = Request("r", [3, 4, 5], SamplingParams(n=4, max_tokens=1), arrival=0)
    seq = Sequence(request, 0, list(request.prompt_ids), None)
    request.seqs.append(seq)
    sched.add(seq)
    assert step(sched) == [(seq, 3, True)]
    later = make_seq(2, arrival=1, max_tokens=2)
    sched.add(later)
    run_to_completion(sched, [seq, later])
