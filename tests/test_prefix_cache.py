"""Prefix caching in the block manager (runtime/kv_cache.py with runtime/prefix_cache.py): full
blocks found again by their chained key, kept after their sequence ends, evicted least recently
used first, never a partial block shared, and the counts the pool and `Session.stats` report."""
from __future__ import annotations

import random

import pytest

from kiln.runtime.kv_cache import BlockManager, OutOfBlocks
from kiln.runtime.prefix_cache import block_key

BLOCK = 4


def admit(bm: BlockManager, seq_id: int, tokens: list[int], num_tokens: int | None = None) -> tuple[int, list]:
    """What the scheduler does for a waiting sequence, alone in its step: match, allocate the cached
    prefix plus the rest (or `num_tokens` in all), schedule the step. Returns the cached token
    count and the block copies."""
    match = bm.match(tokens)
    copies = bm.allocate(seq_id, tokens, len(tokens) if num_tokens is None else num_tokens, match)
    bm.step_scheduled()
    return match.num_tokens, copies


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_a_freed_prefix_is_found_again_and_shared():
    bm = BlockManager(16, BLOCK)
    a = seq(100, 14)  # three full blocks and a partial one
    admit(bm, 1, a)
    first = bm.table(1)
    bm.free(1, a)
    assert bm.used_blocks() == 0 and bm.num_free == 16
    assert bm.cached_blocks() == 3 and all(bm.is_cached(b) for b in first[:3]) and not bm.is_cached(first[3])

    b = a[:12] + [7, 8, 9]
    assert admit(bm, 2, b) == (12, [])
    assert bm.table(2)[:3] == first[:3] and bm.ref_count(first[0]) == 1
    # A second holder while the first still runs: the blocks are shared, not copied.
    assert admit(bm, 3, a[:8] + [5]) == (8, [])
    assert bm.table(3)[:2] == first[:2] and [bm.ref_count(b) for b in first[:3]] == [2, 2, 1]
    assert (bm.cache_queries, bm.cache_hits) == (14 + 15 + 9, 0 + 12 + 8)


def test_a_partial_block_is_never_shared():
    bm = BlockManager(8, BLOCK)
    a = seq(100, 6)
    admit(bm, 1, a)
    assert admit(bm, 2, a)[0] == 4  # the full block only; the two tokens after it are computed
    assert bm.table(1)[1] != bm.table(2)[1]
    bm.free(1, a)
    bm.free(2, a)
    assert bm.cached_blocks() == 1
    # Filling the partial block later (a decode) caches it then.
    admit(bm, 3, a)
    bm.append(3, a + [1, 2], 8)
    assert bm.is_cached(bm.table(3)[1])
    assert bm.match(a + [1, 2, 3]).num_tokens == 8


def test_keys_chain_the_whole_prefix():
    bm = BlockManager(8, BLOCK)
    admit(bm, 1, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    # Same second block after a different first one: no hit at all.
    assert bm.match([0, 2, 3, 4, 5, 6, 7, 8, 9]).num_tokens == 0
    assert bm.match([1, 2, 3, 4, 5, 6, 7, 0, 9]).num_tokens == 4
    assert block_key(block_key(b"", [1, 2, 3, 4]), [5, 6, 7, 8]) != block_key(block_key(b"", [0, 2, 3, 4]),
                                                                               [5, 6, 7, 8])


def test_a_fully_cached_prompt_copies_its_last_block_and_recomputes_its_last_token():
    bm = BlockManager(8, BLOCK)
    a = seq(100, 8)
    admit(bm, 1, a)
    cached = bm.table(1)
    bm.free(1, a)
    match = bm.match(a)
    assert match.blocks == tuple(cached) and match.num_tokens == 7 and match.needs_copy(BLOCK)
    assert bm.allocate(2, a, 8, match) == [(cached[1], bm.table(2)[1])]
    table = bm.table(2)
    assert table[0] == cached[0] and table[1] not in cached
    # The copy holds the same prefix: the block it was copied from stays the cached one.
    assert bm.is_cached(cached[1]) and not bm.is_cached(table[1]) and bm.ref_count(cached[1]) == 0
    assert bm.cached_blocks() == 1 and bm.used_blocks() == 2
    assert (bm.cache_queries, bm.cache_hits) == (16, 7)
    with pytest.raises(ValueError, match="at least one to compute"):
        bm.allocate(3, a, 7, bm.match(a))


def test_a_block_is_not_copied_in_the_step_that_writes_it():
    bm = BlockManager(8, BLOCK)
    a = seq(100, 8)
    bm.allocate(1, a, 8, bm.match(a))  # its step is being scheduled: both blocks cached, unwritten
    match = bm.match(a)
    assert match.blocks == tuple(bm.table(1)[:1]) and match.num_tokens == 4 and not match.needs_copy(BLOCK)
    assert bm.match(a + [1]).num_tokens == 8  # reused in place, with no copy, it may be
    bm.step_scheduled()
    assert bm.match(a).needs_copy(BLOCK) and bm.match(a).num_tokens == 7


def test_idle_blocks_are_evicted_least_recently_used_first():
    bm = BlockManager(6, BLOCK)
    a, b, c = seq(100, 8), seq(200, 8), seq(300, 8)
    for i, tokens in enumerate((a, b, c)):
        admit(bm, i, tokens)  # two full blocks each
        bm.free(i, tokens)
    # Freed in order a, b, c, each sequence's last block first: a's second block is the oldest.
    assert bm.cached_blocks() == 6 and bm.num_free == 6
    admit(bm, 10, seq(400, 3))
    assert bm.match(a + [1]).num_tokens == 4 and bm.match(b + [1]).num_tokens == 8
    bm.free(10, seq(400, 3))
    # b is used again, so it becomes the most recent; the three blocks taken next are the plain
    # free one (10's), then a's first block and c's second.
    admit(bm, 11, b + [2])
    bm.free(11, b + [2])
    admit(bm, 12, seq(500, 12))
    assert [bm.match(t + [1]).num_tokens for t in (a, b, c)] == [0, 8, 4]
    assert bm.used_blocks() == 3 and bm.cached_blocks() == 3


def test_plain_free_blocks_go_before_cached_ones():
    bm = BlockManager(8, BLOCK)
    a = seq(100, 8)
    admit(bm, 1, a + [1])
    bm.free(1, a + [1])
    cached = {b for b in range(8) if bm.is_cached(b)}
    assert len(cached) == 2
    admit(bm, 2, seq(200, 24))  # six blocks: all the uncached ones
    assert not set(bm.table(2)) & cached and bm.match(a + [1]).num_tokens == 8
    admit(bm, 3, seq(300, 4))  # only now is a cached block evicted
    assert bm.match(a + [1]).num_tokens == 4


def test_allocation_counts_the_idle_blocks_it_holds_again_and_is_atomic():
    bm = BlockManager(4, BLOCK)
    a = seq(100, 8)
    admit(bm, 1, a)
    bm.free(1, a)
    admit(bm, 2, seq(200, 4))  # holds one of the two uncached blocks: 1 free + 2 idle left
    assert bm.num_free == 3
    longer = a + seq(300, 8)  # 4 blocks: 2 cached (idle, so they count), 2 new
    match = bm.match(longer)
    assert match.num_tokens == 8 and not bm.can_allocate(16, match)
    with pytest.raises(OutOfBlocks):
        bm.allocate(3, longer, 16, match)
    assert bm.num_free == 3 and bm.cached_blocks() == 2 and bm.match(longer).blocks == match.blocks
    assert (bm.cache_queries, bm.cache_hits) == (8 + 4, 0)
    assert bm.can_allocate(12, match)
    bm.allocate(3, longer, 12, match)
    assert bm.num_free == 0 and bm.table(3)[:2] == list(match.blocks)


def test_forked_samples_cache_their_own_blocks():
    bm = BlockManager(12, BLOCK)
    prompt = seq(100, 10)  # two full blocks and a partial one, shared after the fork
    admit(bm, 1, prompt)
    bm.fork(1, 2)
    parent, child = prompt + [1, 2], prompt + [3, 4]
    assert bm.append(1, parent, 12) == [(bm.table(2)[2], bm.table(1)[2])]  # copy on write
    assert bm.append(2, child, 12) == []
    assert all(bm.is_cached(b) for b in bm.table(1) + bm.table(2))
    assert bm.table(1)[:2] == bm.table(2)[:2] and bm.table(1)[2] != bm.table(2)[2]
    bm.free(1, parent)
    bm.free(2, child)
    assert bm.cached_blocks() == 4 and bm.used_blocks() == 0
    for tokens in (parent, child):
        assert bm.match(tokens + [9]).num_tokens == 12
    assert bm.match(parent + [9]).blocks[:2] == bm.match(child + [9]).blocks[:2]


def test_blocks_are_cached_only_once_their_tokens_are_known():
    bm = BlockManager(8, BLOCK)
    a = seq(100, 7)
    admit(bm, 1, a)
    # The overlapped loop computes a token the host does not know yet: the block it fills is
    # not cached until the token is known, here when the sequence is freed with it.
    bm.append(1, a, 8)
    assert bm.cached_blocks() == 0 and not bm.is_cached(bm.table(1)[1])
    bm.free(1, a + [5])
    assert bm.match(a + [5, 6]).num_tokens == 8
    # Freed before the token arrived (a cancel): the block is not cached.
    b = seq(200, 7)
    admit(bm, 2, b)
    bm.append(2, b, 8)
    bm.free(2, b)
    assert bm.match(b + [5, 6]).num_tokens == 4


def test_without_prefix_caching_nothing_is_cached_or_counted():
    bm = BlockManager(8, BLOCK, prefix_caching=False)
    a = seq(100, 9)
    admit(bm, 1, a)
    bm.free(1, a)
    assert bm.match(a).num_tokens == 0 and bm.cached_blocks() == 0 and bm.num_free == 8
    assert (bm.cache_queries, bm.cache_hits) == (0, 0)
    assert not bm.prefix_caching and BlockManager(8, BLOCK).prefix_caching


def test_random_workload_reads_back_what_was_written():
    """Steps on a small pool: each admits sequences drawn from a few shared prefixes (in chunks,
    with whatever of them is cached) and decodes others; between steps sequences are forked,
    freed or preempted (freed, then waiting to be admitted again). A model of the KV cache does a
    step as the executor does: every block copy first, then every write, each slot recording the
    prefix it was computed for. Every sequence must always read its own tokens back through its
    block table: a block wrongly reused, evicted, overwritten or copied before it was written
    shows up as a wrong token."""
    rng = random.Random(7)
    bm = BlockManager(24, BLOCK)
    slots: dict[tuple[int, int], tuple[int, ...]] = {}  # (block, offset) -> the prefix computed there
    live: dict[int, list[int]] = {}
    computed: dict[int, int] = {}
    waiting: list[list[int]] = []
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(3, 14))] for _ in range(4)]
    ids = iter(range(10**6))

    def check() -> None:
        for seq_id, tokens in live.items():
            table = bm.table(seq_id)
            for pos in range(computed[seq_id]):
                assert slots.get((table[pos // BLOCK], pos % BLOCK)) == tuple(tokens[:pos + 1])
        assert bm.used_blocks() + bm.num_free == bm.num_blocks
        held = {b for s in live for b in bm.table(s)}
        assert all(bm.ref_count(b) == 0 for b in range(bm.num_blocks) if b not in held)
        assert len(held) == bm.used_blocks()

    copied = 0
    for _ in range(700):
        for _ in range(rng.randint(0, 2)):  # between steps
            if not live:
                break
            seq_id = rng.choice(sorted(live))
            op = rng.choice(["fork", "free", "preempt"])
            if op == "fork":
                child = next(ids)
                bm.fork(seq_id, child)
                live[child], computed[child] = list(live[seq_id]), computed[seq_id]
            else:
                tokens = live.pop(seq_id)
                bm.free(seq_id, tokens)
                del computed[seq_id]
                if op == "preempt":
                    waiting.append(tokens)
        copies, writes, scheduled = [], [], set()
        for _ in range(rng.randint(1, 3)):  # one step
            decodable = sorted(set(live) - scheduled)
            if rng.random() < 0.5 or not decodable:
                whole = [live[s][:computed[s] // BLOCK * BLOCK] for s in scheduled if computed[s] >= BLOCK]
                if waiting:
                    tokens = waiting.pop(0)
                elif whole and rng.random() < 0.5:  # the blocks this step computes for another one
                    tokens = list(rng.choice(whole))
                else:
                    tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(0, 10))]
                match = bm.match(tokens)
                end = match.num_tokens + rng.randint(1, len(tokens) - match.num_tokens)
                if not bm.can_allocate(end, match):
                    waiting.insert(0, tokens)
                    continue
                seq_id = next(ids)
                copies += bm.allocate(seq_id, tokens, end, match)
                live[seq_id], start = tokens, match.num_tokens
            else:
                seq_id = rng.choice(decodable)
                tokens = live[seq_id]
                if computed[seq_id] == len(tokens):  # prefilled: sample a token and compute it next
                    tokens.append(rng.randrange(50))
                end = min(len(tokens), computed[seq_id] + rng.randint(1, 6))
                if len(tokens) > 40 or not bm.can_append(seq_id, end):
                    continue
                copies += bm.append(seq_id, tokens, end)
                start = computed[seq_id]
            scheduled.add(seq_id)
            table = bm.table(seq_id)
            # A slot's keys and values depend on the token and everything before it.
            writes += [((table[pos // BLOCK], pos % BLOCK), tuple(tokens[:pos + 1])) for pos in range(start, end)]
            computed[seq_id] = end
        bm.step_scheduled()
        for src, dst in copies:
            for off in range(BLOCK):
                if (src, off) in slots:
                    slots[dst, off] = slots[src, off]
        copied += len(copies)
        slots.update(writes)
        check()
    for seq_id, tokens in list(live.items()):
        bm.free(seq_id, tokens)
    assert bm.used_blocks() == 0 and bm.num_free == bm.num_blocks
    assert bm.cache_hits > 0 and bm.cached_blocks() > 0 and copied > 0
