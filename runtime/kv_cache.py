"""Block manager for the paged KV cache: hands out ids of fixed-size blocks from a preallocated pool.

The cache tensor itself lives in the executor; this module only does the bookkeeping
(per-sequence block tables, ref counts for blocks shared after `fork` or through the prefix
cache, copy-on-write on append) and the size of one block; `runtime/kv_pool.py` decides how
many there are.

With prefix caching (runtime/prefix_cache.py) a block is cached as soon as the step that fills
it is scheduled: a request admitted in that same step may already reuse it, since every layer
writes all of a step's keys and values into the cache before its attention reads any. It may not
copy it, though: a step's block copies are done before its layers run. So until the scheduler
calls `step_scheduled`, such a block is not copied (a prompt cached to its end recomputes that
block instead). Freeing a sequence parks its cached blocks (idle, still reusable) instead of
returning them to the free list; an idle block counts as free and is evicted, least recently used
first, only when no plain free block is left.
"""
from __future__ import annotations

from kiln.runtime.prefix_cache import NO_MATCH, ROOT_KEY, PrefixCache, PrefixMatch, block_key


class OutOfBlocks(Exception):
    """The pool has too few free blocks for the request; nothing was allocated."""


class BlockManager:
    """Per-sequence block tables over a pool of `num_blocks` blocks of `block_size` tokens."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # LIFO stack; reversed so a fresh manager hands out 0, 1, 2, ... in order.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refs: list[int] = [0] * num_blocks
        self._tables: dict[int, list[int]] = {}
        # Token count per sequence is needed to tell whether the last block is partial,
        # which decides whether an append writes into it (and so must copy-on-write).
        self._num_tokens: dict[int, int] = {}
        self._cache = PrefixCache() if prefix_caching else None
        # The keys of each sequence's leading full blocks, in table order, cached or not.
        self._keys: dict[int, list[bytes]] = {}
        # Blocks cached by the step being scheduled: no step has written them yet.
        self._unwritten: set[int] = set()
        # Tokens of admitted sequences looked up in the prefix cache, and how many were found.
        self.cache_queries = 0
        self.cache_hits = 0

    @property
    def prefix_caching(self) -> bool:
        return self._cache is not None

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: unused ones and cached ones no sequence holds."""
        return len(self._free) + self.cached_blocks()

    def used_blocks(self) -> int:
        """Blocks some sequence holds (an idle engine holds none)."""
        return self.num_blocks - self.num_free

    def cached_blocks(self) -> int:
        """Cached blocks that no sequence holds: kept for reuse, evicted when blocks run out."""
        return self._cache.num_idle if self._cache is not None else 0

    def blocks_needed(self, num_tokens: int) -> int:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.block_size)

    def match(self, token_ids: list[int]) -> PrefixMatch:
        """The cached blocks that `token_ids`' first full blocks can reuse (see `PrefixMatch`);
        nothing changes until `allocate` takes them."""
        if self._cache is None or not token_ids:
            return NO_MATCH
        blocks, keys, key, size = [], [], ROOT_KEY, self.block_size
        for start in range(0, len(token_ids) - size + 1, size):
            key = block_key(key, token_ids[start:start + size])
            block = self._cache.find(key)
            if block is None:
                break
            blocks.append(block)
            keys.append(key)
        if len(blocks) * size == len(token_ids) and blocks[-1] in self._unwritten:
            blocks.pop()  # the last block would be copied before this step writes it: computed again instead
            keys.pop()
        return PrefixMatch(tuple(blocks), tuple(keys), min(len(blocks) * size, len(token_ids) - 1))

    def can_allocate(self, num_tokens: int, match: PrefixMatch = NO_MATCH) -> bool:
        return self._allocate_cost(num_tokens, match) <= self.num_free

    def allocate(self, seq_id: int, token_ids: list[int], num_tokens: int,
                 match: PrefixMatch = NO_MATCH) -> list[tuple[int, int]]:
        """Create the table of a new sequence covering its first `num_tokens` tokens, reusing the
        cached blocks of `match` (from `match(token_ids)` just before). Returns the (src, dst)
        block copies the executor must do before the step. Atomic: on OutOfBlocks nothing changes."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} already has a block table")
        cost = self._allocate_cost(num_tokens, match)
        if cost > self.num_free:
            raise OutOfBlocks(f"sequence {seq_id} needs {cost} blocks, {self.num_free} free")
        copy = match.needs_copy(self.block_size)
        table = list(match.blocks[:-1] if copy else match.blocks)
        for block in table:
            self._hold(block)
        copies = []
        if copy:
            src = match.blocks[-1]
            if self._cache.is_idle(src):
                self._cache.touch(src)  # evicted last, should taking the copy's block need an eviction
            copies.append((src, self._take()))
            table.append(copies[0][1])
        table.extend(self._take() for _ in range(self.blocks_needed(num_tokens) - len(table)))
        self._tables[seq_id] = table
        self._num_tokens[seq_id] = num_tokens
        self._keys[seq_id] = list(match.keys[:len(match.blocks) - copy])
        if self._cache is not None:
            self.cache_queries += len(token_ids)
            self.cache_hits += match.num_tokens
        self._seal(seq_id, token_ids, scheduled=True)
        return copies

    def can_append(self, seq_id: int, new_num_tokens: int) -> bool:
        return self._append_cost(seq_id, new_num_tokens)[0] <= self.num_free

    def append(self, seq_id: int, token_ids: list[int], new_num_tokens: int) -> list[tuple[int, int]]:
        """Grow the table to cover `new_num_tokens` tokens in total (`token_ids` are the ones the
        host knows: a pending token may be missing).

        Returns the (src, dst) block copies the executor must do before writing. Atomic: on
        OutOfBlocks nothing changes.
        """
        copies = self.try_append(seq_id, token_ids, new_num_tokens)
        if copies is None:
            cost = self._append_cost(seq_id, new_num_tokens)[0]
            raise OutOfBlocks(f"sequence {seq_id} needs {cost} more blocks, {self.num_free} free")
        return copies

    def try_append(self, seq_id: int, token_ids: list[int], new_num_tokens: int) -> list[tuple[int, int]] | None:
        """`append`, or None (and nothing changes) when the free blocks do not cover it: the
        check and the append in one pass, as the scheduler makes them for every sequence of
        every step."""
        cost, cow = self._append_cost(seq_id, new_num_tokens)
        if cost and cost > self.num_free:
            return None
        table = self._tables[seq_id]
        copies: list[tuple[int, int]] = []
        if cow:
            src = table[-1]
            dst = self._take()
            # Other holders keep src; it cannot reach 0 here because its count was > 1.
            self._refs[src] -= 1
            table[-1] = dst
            copies.append((src, dst))
        extra = self.blocks_needed(new_num_tokens) - len(table)
        if extra:  # one step in block_size of a decoding sequence
            table.extend(self._take() for _ in range(extra))
        self._num_tokens[seq_id] = new_num_tokens
        self._seal(seq_id, token_ids, scheduled=True)
        return copies

    def fork(self, parent_id: int, child_id: int) -> None:
        """Give `child_id` the parent's blocks, shared (used for n > 1 samples of one prompt)."""
        if parent_id not in self._tables:
            raise KeyError(f"unknown sequence {parent_id}")
        if child_id in self._tables:
            raise ValueError(f"sequence {child_id} already has a block table")
        table = self._tables[parent_id]
        for block in table:
            self._refs[block] += 1
        self._tables[child_id] = list(table)
        self._num_tokens[child_id] = self._num_tokens[parent_id]
        self._keys[child_id] = list(self._keys[parent_id])

    def free(self, seq_id: int, token_ids: list[int]) -> None:
        """Drop the sequence's table (`token_ids`: its tokens, so blocks filled since its last
        step are cached too); unknown ids are ignored since cancel may race completion."""
        if seq_id not in self._tables:
            return
        self._seal(seq_id, token_ids)
        table = self._tables.pop(seq_id)
        del self._num_tokens[seq_id], self._keys[seq_id]
        # Reverse order: the LIFO stack then gives the sequence's first block back first next
        # time, and of its cached blocks the last ones, least likely to be shared, are evicted first.
        for block in reversed(table):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if self._cache is not None and self._cache.holds(block):
                    self._cache.park(block)
                else:
                    self._free.append(block)

    def table(self, seq_id: int) -> list[int]:
        if seq_id not in self._tables:
            raise KeyError(f"unknown sequence {seq_id}")
        return list(self._tables[seq_id])

    def ref_count(self, block: int) -> int:
        if not 0 <= block < self.num_blocks:
            raise IndexError(f"block {block} out of range [0, {self.num_blocks})")
        return self._refs[block]

    def is_cached(self, block: int) -> bool:
        """Whether the block is in the prefix cache (held or idle)."""
        return self._cache is not None and self._cache.holds(block)

    def _allocate_cost(self, num_tokens: int, match: PrefixMatch) -> int:
        """Free blocks an allocation takes: new ones, and the idle cached ones it holds again."""
        if match.blocks and num_tokens <= match.num_tokens:
            raise ValueError(f"num_tokens {num_tokens} must cover the {match.num_tokens} cached tokens and at least "
                             "one to compute")
        reused = match.blocks[:-1] if match.needs_copy(self.block_size) else match.blocks
        idle = sum(self._cache.is_idle(b) for b in reused) if reused else 0
        return self.blocks_needed(num_tokens) - len(reused) + idle

    def _append_cost(self, seq_id: int, new_num_tokens: int) -> tuple[int, bool]:
        """Free blocks an append needs, and whether the last block must be copied first."""
        if seq_id not in self._tables:
            raise KeyError(f"unknown sequence {seq_id}")
        old = self._num_tokens[seq_id]
        if new_num_tokens < old:
            raise ValueError(f"sequence {seq_id} has {old} tokens; cannot shrink to {new_num_tokens}")
        table = self._tables[seq_id]
        grow = self.blocks_needed(new_num_tokens) - len(table)
        # New tokens land in the last block only if it is partially filled; sharing it
        # would let this sequence overwrite what the other holders still read.
        cow = (new_num_tokens > old and old % self.block_size != 0
               and self._refs[table[-1]] > 1)
        return grow + int(cow), cow

    def step_scheduled(self) -> None:
        """The step whose blocks were allocated and appended since the last call is scheduled:
        it writes them before any later step reads them, so they may now be copied."""
        self._unwritten.clear()

    def _seal(self, seq_id: int, token_ids: list[int], scheduled: bool = False) -> None:
        """Cache the sequence's blocks that are now full of known tokens (computed in a step
        already scheduled, or being scheduled) and have no key yet."""
        if self._cache is None:
            return
        keys, size = self._keys[seq_id], self.block_size
        full = min(self._num_tokens[seq_id], len(token_ids)) // size
        if full <= len(keys):
            return  # no block filled since the last call: most calls, at most steps
        table = self._tables[seq_id]
        key = keys[-1] if keys else ROOT_KEY
        for i in range(len(keys), full):
            key = block_key(key, token_ids[i * size:(i + 1) * size])
            keys.append(key)
            self._cache.add(table[i], key)
            if scheduled:
                self._unwritten.add(table[i])

    def _hold(self, block: int) -> None:
        if self._refs[block] == 0:
            self._cache.revive(block)
        self._refs[block] += 1

    def _take(self) -> int:
        block = self._free.pop() if self._free else self._cache.evict()
        self._refs[block] = 1
        return block
