"""How many KV-cache blocks an engine gets when it is loaded.

By default the pool takes a fraction (0.9) of the memory left once the weights and the activation
arena are in place (the GPU's free memory, or the host's available memory for the CPU), capped at
what the build can ever use: `max_batch_size` sequences of `max_seq_len` tokens. `max_kv_tokens`
asks for a size instead. Either way a pool that cannot hold one sequence of `max_seq_len` tokens
is refused here, before anything is allocated, with an error that says what to change.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kiln.engines.manifest import Manifest
from kiln.runtime.arguments import ArgumentError
from kiln.runtime.engine import Engine

DEFAULT_KV_CACHE_FRACTION = 0.9
GIB = 1 << 30


@dataclass(frozen=True)
class KVPool:
    """The chosen pool of one rank, and why it has that size."""

    num_blocks: int
    block_size: int
    bytes_per_block: int  # one rank's block: all layers, K and V
    reason: str

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def describe(self) -> str:
        return (f"KV cache: {self.num_blocks:,} blocks of {self.block_size} tokens ({self.num_tokens:,} tokens, "
                f"{_size(self.nbytes)} per rank): {self.reason}")


def size_kv_pool(engine: Engine, on_gpu: bool, kv_cache_fraction: float | None,
                 max_kv_tokens: int | None) -> KVPool:
    """The pool for `engine` (rank 0 of its folder; every rank gets as many blocks)."""
    m = engine.manifest
    block_size, max_seq_len = m.kv.block_size, m.max_seq_len
    per_block, per_sequence = m.kv.bytes_per_block, m.blocks_per_sequence
    if max_kv_tokens is not None:
        check_max_kv_tokens(max_kv_tokens, m)
        return KVPool(max_kv_tokens // block_size, block_size, per_block, f"max_kv_tokens {max_kv_tokens}")

    fraction = DEFAULT_KV_CACHE_FRACTION if kv_cache_fraction is None else kv_cache_fraction
    world, weights, arena = m.world_size, m.weight_bytes, m.arena_bytes
    if on_gpu:
        # One GPU per rank; the weights and arena are uploaded after this, out of the same memory.
        where, left = "the GPU's free memory", torch.cuda.mem_get_info()[0] - weights - arena
        budget_blocks = int(max(left, 0) * fraction) // per_block
    else:
        # Every rank's weights, arena and pool come out of the same host memory.
        where, left = "available host memory", host_memory_available() - world * (weights + arena)
        budget_blocks = int(max(left, 0) * fraction) // (world * per_block)
    usable = m.max_batch_size * per_sequence
    if budget_blocks < per_sequence:
        raise ArgumentError("kv_cache_fraction", (
            f"{fraction} of the {_size(max(left, 0))} left in {where} after the engine's weights and "
            f"arena holds {budget_blocks} KV blocks, fewer than one sequence of the engine's max_seq_len "
            f"{max_seq_len} needs ({per_sequence} blocks of {_size(per_block)}): raise "
            "kv_cache_fraction (--kv-cache-fraction), free memory, set max_kv_tokens (--max-kv-tokens) to at least "
            f"{per_sequence * block_size}, or rebuild the engine with a smaller --max-seq-len"))
    if budget_blocks >= usable:
        reason = (f"all that {m.max_batch_size} sequences of {max_seq_len} tokens can use "
                  f"(less than {fraction} of the {_size(left)} left in {where})")
        return KVPool(usable, block_size, per_block, reason)
    return KVPool(budget_blocks, block_size, per_block,
                  f"kv_cache_fraction {fraction} of the {_size(left)} left in {where} after weights and arena")


def check_max_kv_tokens(max_kv_tokens: int, manifest: Manifest) -> None:
    """Refuse a pool size that cannot hold one sequence of the engine's `max_seq_len` tokens."""
    block_size, max_seq_len, per_sequence = manifest.kv.block_size, manifest.max_seq_len, manifest.blocks_per_sequence
    if max_kv_tokens // block_size < per_sequence:
        raise ArgumentError("max_kv_tokens", (
            f"is {max_kv_tokens}: the pool must hold at least one sequence of the engine's max_seq_len "
            f"{max_seq_len} ({per_sequence} blocks of {block_size} tokens); give --max-kv-tokens "
            f"{per_sequence * block_size} or more, or rebuild the engine with a smaller --max-seq-len"))


def _size(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / (1 << 20):.2f} MiB"


def host_memory_available() -> int:
    """Bytes the host can hand out without swapping (MemAvailable), or its free pages where there
    is no /proc/meminfo."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
