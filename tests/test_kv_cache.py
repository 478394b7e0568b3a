"""Tests for the KV cache block manager (runtime/kv_cache.py) without prefix caching: tables, ref
counts, fork and copy-on-write. tests/test_prefix_cache.py covers what the prefix cache adds."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from kiln.runtime.kv_cache import BlockManager, OutOfBlocks


def ids(n: int) -> list[int]:
    """Token ids for a sequence of n tokens (only their number matters without prefix caching)."""
    return list(range(n))


def check_invariants(bm: BlockManager, seq_ids: list[int]) -> None:
    tables = [bm.table(s) for s in seq_ids]
    entries = Counter(b for t in tables for b in t)
    refs = [bm.ref_count(b) for b in range(bm.num_blocks)]
    assert sum(refs) == sum(len(t) for t in tables)
    for block in range(bm.num_blocks):
        assert refs[block] == entries[block]
    free = [b for b in range(bm.num_blocks) if refs[b] == 0]
    assert len(free) == bm.num_free
    assert not set(free) & set(entries)
    assert bm.num_free + len(entries) == bm.num_blocks
    assert bm.used_blocks() == bm.num_blocks - bm.num_free


def test_blocks_needed_rounds_up() -> None:
    bm = BlockManager(8, 4, prefix_caching=False)
    assert [bm.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_free_round_trip_returns_every_block() -> None:
    bm = BlockManager(10, 4, prefix_caching=False)
    for _ in range(3):
        assert bm.allocate(1, ids(13), 13) == bm.allocate(2, ids(24), 24) == []
        a, b = bm.table(1), bm.table(2)
        assert len(a) == 4 and len(b) == 6 and not set(a) & set(b)
        assert bm.num_free == 0 and bm.used_blocks() == 10
        bm.free(1, [])
        bm.free(2, [])
        assert bm.num_free == 10
        assert all(bm.ref_count(i) == 0 for i in range(10))
    check_invariants(bm, [])
    first, second = BlockManager(6, 2, prefix_caching=False), BlockManager(6, 2, prefix_caching=False)
    first.allocate(0, ids(5), 5)
    second.allocate(0, ids(5), 5)
    assert first.table(0) == second.table(0)


def test_allocation_that_does_not_fit_changes_nothing() -> None:
    bm = BlockManager(4, 4, prefix_caching=False)
    bm.allocate(1, ids(8), 8)
    assert not bm.can_allocate(9)
    with pytest.raises(OutOfBlocks):
        bm.allocate(2, ids(9), 9)
    assert bm.num_free == 2
    with pytest.raises(KeyError):
        bm.table(2)
    assert bm.can_allocate(8)
    bm.allocate(2, ids(8), 8)
    with pytest.raises(ValueError, match="1"):
        bm.allocate(1, ids(0), 0)
    check_invariants(bm, [1, 2])


def test_append_adds_blocks_only_across_boundaries() -> None:
    bm = BlockManager(8, 4, prefix_caching=False)
    bm.allocate(1, ids(3), 3)
    start = bm.table(1)
    assert bm.append(1, ids(4), 4) == [] and bm.table(1) == start
    assert bm.append(1, ids(5), 5) == []
    assert len(bm.table(1)) == 2 and bm.table(1)[0] == start[0]
    assert bm.append(1, ids(8), 8) == [] and len(bm.table(1)) == 2
    bm.append(1, ids(17), 17)
    assert len(bm.table(1)) == 5
    assert bm.append(1, ids(17), 17) == [] and len(bm.table(1)) == 5
    with pytest.raises(ValueError):
        bm.append(1, ids(16), 16)
    check_invariants(bm, [1])


def test_append_out_of_blocks_is_atomic() -> None:
    bm = BlockManager(3, 4, prefix_caching=False)
    bm.allocate(1, ids(4), 4)
    before = bm.table(1)
    assert not bm.can_append(1, 13)
    with pytest.raises(OutOfBlocks):
        bm.append(1, ids(13), 13)
    assert bm.table(1) == before and bm.num_free == 2
    assert bm.can_append(1, 12)
    # The failed append must not have recorded the larger token count.
    assert bm.append(1, ids(12), 12) == []
    check_invariants(bm, [1])


def test_fork_shares_blocks() -> None:
    bm = BlockManager(8, 4, prefix_caching=False)
    bm.allocate(1, ids(10), 10)
    parent = bm.table(1)
    bm.fork(1, 2)
    assert bm.table(2) == parent
    assert all(bm.ref_count(b) == 2 for b in parent)
    bm.fork(2, 3)
    assert all(bm.ref_count(b) == 3 for b in parent)
    assert bm.num_free == 8 - len(parent)
    with pytest.raises(ValueError):
        bm.fork(1, 3)
    with pytest.raises(KeyError):
        bm.fork(99, 4)
    check_invariants(bm, [1, 2, 3])


def test_append_on_forked_partial_block_copies_on_write() -> None:
    bm = BlockManager(8, 4, prefix_caching=False)
    bm.allocate(1, ids(10), 10)  # two full blocks and one holding 2 of 4 tokens
    parent = bm.table(1)
    bm.fork(1, 2)
    copies = bm.append(2, ids(11), 11)
    child = bm.table(2)
    assert copies == [(parent[-1], child[-1])]
    assert child[-1] != parent[-1]
    assert child[:-1] == parent[:-1] == bm.table(1)[:-1]
    assert all(bm.ref_count(b) == 2 for b in parent[:-1])
    assert bm.ref_count(parent[-1]) == 1 and bm.ref_count(child[-1]) == 1
    # The parent now owns its last block alone, so it writes in place.
    assert bm.append(1, ids(12), 12) == [] and bm.table(1) == parent
    check_invariants(bm, [1, 2])
    bm.free(1, [])
    bm.free(2, [])
    assert bm.num_free == 8
    check_invariants(bm, [])


def test_append_on_forked_full_block_needs_no_copy() -> None:
    bm = BlockManager(8, 4, prefix_caching=False)
    bm.allocate(1, ids(8), 8)
    parent = bm.table(1)
    bm.fork(1, 2)
    assert bm.append(2, ids(9), 9) == []
    assert bm.table(2)[:2] == parent and len(bm.table(2)) == 3
    check_invariants(bm, [1, 2])


def test_cow_copy_and_growth_in_one_append() -> None:
    bm = BlockManager(8, 4, prefix_caching=False)
    bm.allocate(1, ids(6), 6)
    parent = bm.table(1)
    bm.fork(1, 2)
    copies = bm.append(2, ids(13), 13)
    child = bm.table(2)
    assert copies == [(parent[1], child[1])]
    assert len(child) == 4 and child[0] == parent[0]
    check_invariants(bm, [1, 2])


def test_can_append_counts_the_copy_on_write_block() -> None:
    bm = BlockManager(3, 4, prefix_caching=False)
    bm.allocate(1, ids(6), 6)  # 2 blocks, last one partial
    bm.fork(1, 2)
    assert bm.num_free == 1
    # Filling the partial block needs no new slot for the parent alone, but the shared
    # block must be copied first, which takes the single free block.
    assert bm.can_append(2, 8)
    assert not bm.can_append(2, 9)
    with pytest.raises(OutOfBlocks):
        bm.append(2, ids(9), 9)
    assert bm.num_free == 1 and bm.table(2) == bm.table(1)
    assert bm.can_append(2, 6)  # no new tokens, nothing written, no copy
    assert bm.append(2, ids(6), 6) == []
    bm.append(2, ids(8), 8)
    assert bm.num_free == 0
    # The copy left the parent sole owner of its partial block: it fills it with no free block.
    assert bm.can_append(1, 8) and bm.append(1, ids(8), 8) == []
    check_invariants(bm, [1, 2])


def test_free_of_unknown_id_is_noop_but_lookups_raise() -> None:
    bm = BlockManager(4, 4, prefix_caching=False)
    bm.allocate(1, ids(5), 5)
    bm.free(42, [])
    bm.free(1, [])
    bm.free(1, [])
    assert bm.num_free == 4
    for call in (lambda: bm.table(5), lambda: bm.append(5, ids(1), 1), lambda: bm.can_append(5, 1)):
        with pytest.raises(KeyError):
            call()
    with pytest.raises(IndexError):
        bm.ref_count(4)


def test_randomized_ops_keep_invariants() -> None:
    rng = random.Random(1234)
    bm = BlockManager(32, 4, prefix_caching=False)
    tokens: dict[int, int] = {}
    next_id = 0
    for _ in range(500):
        op = rng.choice(["allocate", "append", "fork", "free"])
        live = sorted(tokens)
        if op == "allocate" or not live:
            n = rng.randint(0, 20)
            if bm.can_allocate(n):
                assert bm.allocate(next_id, ids(n), n) == []
                assert len(bm.table(next_id)) == bm.blocks_needed(n)
                tokens[next_id] = n
            else:
                free_before = bm.num_free
                with pytest.raises(OutOfBlocks):
                    bm.allocate(next_id, ids(n), n)
                assert bm.num_free == free_before
            next_id += 1
        elif op == "append":
            seq = rng.choice(live)
            n = tokens[seq] + rng.randint(0, 9)
            before = bm.table(seq)
            if bm.can_append(seq, n):
                copies = bm.append(seq, ids(n), n)
                assert len(copies) <= 1
                assert len(bm.table(seq)) == bm.blocks_needed(n)
                tokens[seq] = n
            else:
                with pytest.raises(OutOfBlocks):
                    bm.append(seq, ids(n), n)
                assert bm.table(seq) == before
        elif op == "fork":
            parent = rng.choice(live)
            bm.fork(parent, next_id)
            assert bm.table(next_id) == bm.table(parent)
            tokens[next_id] = tokens[parent]
            next_id += 1
        else:
            seq = rng.choice(live)
            bm.free(seq, [])
            del tokens[seq]
        check_invariants(bm, sorted(tokens))
    for seq in list(tokens):
        bm.free(seq, [])
    assert bm.num_free == bm.num_blocks
