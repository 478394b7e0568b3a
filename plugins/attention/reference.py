"""PyTorch reference for `attention` over a paged KV cache.

One step holds several sequences, each with `query_lens[s]` new tokens (a prefill chunk or one
decode token) at the end of `context_lens[s]` tokens in the cache. New k/v, when given, are
first written to their cache slots; then every query attends causally to its sequence's cache
(optionally within a sliding window), with grouped-query heads. Softmax is in float32.

kv_cache: [layers, 2, num_blocks, block_size, kv_heads, head_dim]. With `kv_scales`
[layers, 2, kv_heads] (float32) the cache is float8_e4m3fn: k and v go in as value / scale
rounded to e4m3 (plugins/fp8.py) and come out as value * scale, and each block of v is held
transposed, [kv_heads, head_dim, block_size] (plugins/attention/cache_write.py says why).
"""
from typing import Optional

import torch

from kiln.plugins.fp8 import FP8, to_e4m3


def write_kv(kv_cache: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, kv_scales: Optional[torch.Tensor] = None) -> None:
    block_size, kvh, hd = kv_cache.shape[-3:]
    slots = slot_mapping.long()
    for which, x in ((0, k), (1, v)):
        rows = x.view(-1, kvh, hd)
        if kv_scales is not None:
            rows = to_e4m3(rows, kv_scales[layer, which][None, :, None])
        rows = rows.to(kv_cache.dtype)
        if kv_cache.dtype == FP8:  # index_copy_ has no float8 kernel on the CPU; the bytes are the same
            dst, rows = kv_cache[layer, which].view(torch.uint8), rows.view(torch.uint8)
        else:
            dst = kv_cache[layer, which]
        if _transposed(kv_cache, which):
            dst.view(-1, kvh, hd, block_size)[slots // block_size, :, :, slots % block_size] = rows
        else:
            dst.view(-1, kvh, hd).index_copy_(0, slots, rows)


def read_kv(kv_cache: torch.Tensor, layer: int, which: int, blocks: torch.Tensor, length: int,
            kv_scales: Optional[torch.Tensor]) -> torch.Tensor:
    """The first `length` k (which 0) or v (1) rows held in each row of `blocks` [S, blocks], [S, length,
    kv_heads, head_dim] in float32."""
    block_size, kvh, hd = kv_cache.shape[-3:]
    rows = kv_cache[layer, which].view(torch.uint8)[blocks].view(kv_cache.dtype) if kv_cache.dtype == FP8 \
        else kv_cache[layer, which, blocks]
    if _transposed(kv_cache, which):
        rows = rows.reshape(len(blocks), -1, kvh, hd, block_size).permute(0, 1, 4, 2, 3)
    rows = rows.reshape(len(blocks), -1, kvh, hd)[:, :length].float()
    return rows if kv_scales is None else rows * kv_scales[layer, which][None, None, :, None]


def _transposed(kv_cache: torch.Tensor, which: int) -> bool:
    """Whether part `which` (0 k, 1 v) holds its blocks transposed: v of an e4m3 cache."""
    return which == 1 and kv_cache.dtype == FP8


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_lens: torch.Tensor, context_lens: torch.Tensor, layer: int,
                    num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                    window: int, kv_scales: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The sequences with the same number of new tokens go through together, padded to the longest
    context among them: all of a step's decode rows at once (one by one, a CPU spent most of a
    decode step on the sequences' own small operations)."""
    block_size = kv_cache.shape[3]
    out = torch.empty_like(q)
    lens, ctxs = query_lens.long(), context_lens.long()
    starts = torch.cumsum(lens, 0) - lens
    for n in lens.unique().tolist():
        if n == 0:
            continue
        seqs = (lens == n).nonzero().flatten()
        ctx = ctxs[seqs]
        length = int(ctx.max())
        used = -(-length // block_size)
        # A table's entries past its sequence's own blocks are not blocks of it: read block 0 there instead.
        blocks = block_tables[seqs, :used].long()
        blocks = blocks.where(torch.arange(used, device=ctx.device) < -(-ctx[:, None] // block_size), 0)
        k_pos = torch.arange(length, device=ctx.device)
        held = (k_pos < ctx[:, None])[:, :, None, None]
        k = read_kv(kv_cache, layer, 0, blocks, length, kv_scales)
        v = read_kv(kv_cache, layer, 1, blocks, length, kv_scales).masked_fill(~held, 0.0)
        positions = torch.arange(n, device=ctx.device)
        rows = (starts[seqs, None] + positions).flatten()
        qs = q[rows].view(len(seqs), n, num_kv_heads, num_heads // num_kv_heads, head_dim).float()
        scores = torch.einsum("sqhgd,skhd->shgqk", qs, k) * scale
        q_pos = (ctx[:, None] - n + positions)[:, :, None]
        allowed = k_pos <= q_pos
        if window > 0:
            allowed &= q_pos - k_pos < window
        scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
        o = torch.einsum("shgqk,skhd->sqhgd", scores.softmax(-1), v)
        out[rows] = o.reshape(len(rows), -1).to(q.dtype)
    return out


def attention(q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
              kv_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
              query_lens: torch.Tensor, context_lens: torch.Tensor, layer: int, num_heads: int,
              num_kv_heads: int, head_dim: int, scale: float, window: int,
              kv_scales: Optional[torch.Tensor] = None) -> torch.Tensor:
    # k and v are absent when a fused NormQKVRope already wrote them into the cache.
    if k is not None and v is not None:
        write_kv(kv_cache, layer, k, v, slot_mapping, kv_scales)
    return paged_attention(q, kv_cache, block_tables, query_lens, context_lens, layer,
                           num_heads, num_kv_heads, head_dim, scale, window, kv_scales)
