"""Which steps replay a captured CUDA graph, and how a decode step is padded to one.

A pure decode step (every sequence brings one token and wants its logits) of n sequences
replays the graph captured for the smallest batch size b >= n. Graphs bake in every kernel
argument that depends on the step's shape (grids, GEMM buckets, split-KV counts), so the
b - n padding sequences must be real work: each gets one token at position 0 whose KV entry
goes to a spare block that the block manager never hands out, so real caches are untouched.
"""
from __future__ import annotations

import torch

from kiln.runtime.step import StepInputs


def decode_batch_limit(max_num_tokens: int, max_batch_size: int, num_kv_blocks: int) -> int:
    """The most sequences a pure decode step can hold: the engine's limits on tokens and
    sequences (one logit row each), and the KV pool's blocks, since every sequence of a step
    writes its new KV into a block that no other sequence holds (copy-on-write sees to it).
    Graphs for larger batches would never be replayed."""
    return min(max_num_tokens, max_batch_size, num_kv_blocks)


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to 256, and beyond it a stride that doubles
    with the batch (16 to 512, 32 to 1024, ...), and `max_batch` itself: at most 7 padding rows
    per step up to 256 and under 1/16 of the batch beyond, with 83 graphs for a 2048-sequence
    engine instead of 256 (each capture costs start-up time)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch]
    size, stride = 8, 8
    while size <= max_batch:
        sizes.append(size)
        if size >= 256 and size & (size - 1) == 0:  # a power of two from 256 on doubles the stride
            stride *= 2
        size += stride
    return sorted(set(sizes) | {max_batch})


def is_pure_decode(step: StepInputs) -> bool:
    """One token per sequence, and the logits of every token, in order."""
    n = step.num_tokens
    return (step.query_lens.shape[0] == n and step.logits_indices.shape[0] == n
            and torch.equal(step.logits_indices, torch.arange(n, dtype=step.logits_indices.dtype)))


def padding_step(batch: int, pad_block: int, block_size: int, blocks_per_seq: int) -> StepInputs:
    """A decode step of `batch` padding sequences (what graphs are captured with)."""
    empty = torch.zeros(0, dtype=torch.int32)
    step = StepInputs(empty, empty, empty, torch.zeros(0, blocks_per_seq, dtype=torch.int32), empty, empty, empty)
    return pad_decode(step, batch, pad_block, block_size)


def pad_decode(step: StepInputs, batch: int, pad_block: int, block_size: int) -> StepInputs:
    """`step` with padding sequences appended up to `batch` sequences."""
    extra = batch - step.num_tokens
    if extra < 0:
        raise ValueError(f"cannot pad a step of {step.num_tokens} sequences down to {batch}")
    if extra == 0 and step.num_tokens:
        return step  # already a pure decode step of `batch` sequences (the caller checked)

    def pad(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.cat([t, t.new_full((extra, *t.shape[1:]), value)])

    return StepInputs(pad(step.input_ids, 0), pad(step.positions, 0), pad(step.slot_mapping, pad_block * block_size),
                      pad(step.block_tables, pad_block), pad(step.query_lens, 1), pad(step.context_lens, 1),
                      torch.arange(batch, dtype=torch.int32))
