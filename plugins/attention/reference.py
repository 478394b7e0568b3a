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
    """The first `length` k (which 0) or v (1) rows held in `blocks`, [length, kv_heads, head_dim] in float32."""
    block_size, kvh, hd = kv_cache.shape[-3:]
    rows = kv_cache[layer, which].view(torch.uint8)[blocks].view(kv_cache.dtype) if kv_cache.dtype == FP8 \
        else kv_cache[layer, which, blocks]
    if _transposed(kv_cache, which):
        rows = rows.reshape(-1, kvh, hd, block_size).permute(0, 3, 1, 2)
    rows = rows.reshape(-1, kvh, hd)[:length].float()
    return rows if kv_scales is None else rows * kv_scales[layer, which][None, :, None]


def _transposed(kv_cache: torch.Tensor, which: int) -> bool:
    """Whether part `which` (0 k, 1 v) holds its blocks transposed: v of an e4m3 cache."""
    return which == 1 and kv_cache.dtype == FP8


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_lens: torch.Tensor, context_lens: torch.Tensor, layer: int,
                    num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                    window: int, kv_scales: Optional[torch.Tensor] = None) -> torch.Tensor:
    block_size = kv_cache.shape[3]
    out = torch.empty_like(q)
    start = 0
    for s, (n, ctx) in enumerate(zip(query_lens.tolist(), context_lens.tolist())):
        blocks = block_tables[s, : (ctx + block_size - 1) // block_size].long()
        k = read_kv(kv_cache, layer, 0, blocks, ctx, kv_scales)
        v = read_kv(kv_cache, layer, 1, blocks, ctx, kv_scales)
        qs = q[start:start + n].view(n, num_kv_heads, num_heads // num_kv_heads, head_dim).float()
        scores = torch.einsum("qhgd,khd->hgqk", qs, k) * scale
        q_pos = torch.arange(ctx - n, ctx)[:, None]
        k_pos = torch.arange(ctx)[None, :]
        allowed = k_pos <= q_pos
        if window > 0:
            allowed &= q_pos - k_pos < window
        scores = scores.masked_fill(~allowed, float("-inf"))
        o = torch.einsum("hgqk,khd->qhgd", scores.softmax(-1), v)
        out[start:start + n] = o.reshape(n, -1).to(q.dtype)
        start += n
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
