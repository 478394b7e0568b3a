"""Block manager for the paged KV cache: hands out ids of fixed-size blocks from a preallocated pool.

The cache tensor itself lives in the executor; this module only does the bookkeeping
(per-sequence block tables, ref counts for blocks shared after `fork`, copy-on-write
on append) and the size of one block; `runtime/kv_pool.py` decides how many there are.
"""
from __future__ import annotations


class OutOfBlocks(Exception):
    """The pool has too few free blocks for the request; nothing was allocated."""


class BlockManager:
    """Per-sequence block tables over a pool of `num_blocks` blocks of `block_size` tokens."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
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

    @property
    def num_free(self) -> int:
        return len(self._free)

    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= len(self._free)

    def allocate(self, seq_id: int, num_tokens: int) -> list[int]:
        """Create the table of a new sequence covering `num_tokens` tokens; returns a copy of it."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} already has a block table")
        needed = self.blocks_needed(num_tokens)
        if needed > len(self._free):
            raise OutOfBlocks(f"sequence {seq_id} needs {needed} blocks, {len(self._free)} free")
        self._tables[seq_id] = [self._take() for _ in range(needed)]
        self._num_tokens[seq_id] = num_tokens
        return list(self._tables[seq_id])

    def can_append(self, seq_id: int, new_num_tokens: int) -> bool:
        return self._append_cost(seq_id, new_num_tokens)[0] <= len(self._free)

    def append(self, seq_id: int, new_num_tokens: int) -> list[tuple[int, int]]:
        """Grow the table to cover `new_num_tokens` tokens in total.

        Returns the (src, dst) block copies the executor must do before writing. Atomic:
        on OutOfBlocks nothing changes.
        """
        cost, cow = self._append_cost(seq_id, new_num_tokens)
        if cost > len(self._free):
            raise OutOfBlocks(f"sequence {seq_id} needs {cost} more blocks, {len(self._free)} free")
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
        table.extend(self._take() for _ in range(extra))
        self._num_tokens[seq_id] = new_num_tokens
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

    def free(self, seq_id: int) -> None:
        """Drop the sequence's table; unknown ids are ignored since cancel may race completion."""
        table = self._tables.pop(seq_id, None)
        if table is None:
            return
        del self._num_tokens[seq_id]
        # Reverse order so the LIFO stack gives the sequence's first block back first next time.
        for block in reversed(table):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free.append(block)

    def table(self, seq_id: int) -> list[int]:
        if seq_id not in self._tables:
            raise KeyError(f"unknown sequence {seq_id}")
        return list(self._tables[seq_id])

    def ref_count(self, block: int) -> int:
        if not 0 <= block < self.num_blocks:
            raise IndexError(f"block {block} out of range [0, {self.num_blocks})")
        return self._refs[block]

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

    def _take(self) -> int:
        block = self._free.pop()
        self._refs[block] = 1
        return block
