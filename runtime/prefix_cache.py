"""Prefix caching: which full KV blocks hold which token prefix, so requests that share a prefix
(a system prompt, the earlier turns of a conversation, a preempted sequence's own tokens) reuse
its keys and values instead of computing them again.

A full block's key is a digest of its tokens chained with the key of the block before it, so
two blocks have the same key only when everything up to and including them is the same. Only
full blocks get keys: a partial block is still being written, so it is never shared this way.
A block that no sequence holds any more stays cached ("idle") until the block manager needs a
block and has no plain free one; then the least recently used idle block is evicted.

`BlockManager` (runtime/kv_cache.py) owns the blocks and their ref counts; this class only
knows keys, which blocks are idle, and in what order they were last used.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

# The key "before" a sequence's first block.
ROOT_KEY = b""


def block_key(previous: bytes, tokens: list[int]) -> bytes:
    """The key of a full block holding `tokens`, after the block whose key is `previous`.

    128 bits of BLAKE2b: a collision would silently hand one request another's keys and values,
    and Python's 64-bit `hash` of a tuple can be collided on purpose by a crafted prompt."""
    return hashlib.blake2b(previous + array("q", tokens).tobytes(), digest_size=16).digest()


@dataclass(frozen=True)
class PrefixMatch:
    """The cached blocks a sequence's first tokens can reuse, found by `BlockManager.match`.

    `blocks` and `keys` are the leading full blocks found in the cache; `num_tokens` is how many
    of the sequence's tokens need no computing. It is less than the sequence's length, so the
    last token is always computed (its logits give the next token): when every token is in a
    cached block, the last block is copied and its last token recomputed (`needs_copy`), unless
    that block is written by the step being scheduled (see runtime/kv_cache.py)."""

    blocks: tuple[int, ...] = ()
    keys: tuple[bytes, ...] = ()
    num_tokens: int = 0

    def needs_copy(self, block_size: int) -> bool:
        return len(self.blocks) * block_size > self.num_tokens


NO_MATCH = PrefixMatch()


class PrefixCache:
    """Key -> block for every cached full block, and the idle ones in least-recently-used order."""

    def __init__(self) -> None:
        self._block_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        # Cached blocks no sequence holds, oldest first: the first is evicted first.
        self._idle: OrderedDict[int, None] = OrderedDict()

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def find(self, key: bytes) -> int | None:
        return self._block_of.get(key)

    def holds(self, block: int) -> bool:
        return block in self._key_of

    def add(self, block: int, key: bytes) -> None:
        """Cache a block that has just been filled. A key that is cached already keeps its block
        (two sequences computed the same prefix at once): this one stays uncached."""
        if key not in self._block_of:
            self._block_of[key] = block
            self._key_of[block] = key

    def is_idle(self, block: int) -> bool:
        return block in self._idle

    def park(self, block: int) -> None:
        """A cached block that its last holder let go: idle, the most recently used."""
        self._idle[block] = None

    def touch(self, block: int) -> None:
        """An idle block read without being held (copied): now the most recently used."""
        self._idle.move_to_end(block)

    def revive(self, block: int) -> None:
        """An idle block that a sequence holds again."""
        del self._idle[block]

    def evict(self) -> int:
        """Forget the least recently used idle block and hand it back for reuse."""
        block, _ = self._idle.popitem(last=False)
        del self._block_of[self._key_of.pop(block)]
        return block
