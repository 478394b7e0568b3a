"""PyTorch reference for `attention` over a paged KV cache.

One step holds several sequences, each with `query_lens[s]` new tokens (a prefill chunk or one
decode token) at the end of `context_lens[s]` tokens in the cache. New k/v, when given, are
first written to their cache slots; then every query attends causally to its sequence's cache
(optionally within a sliding window), with grouped-query heads. Softmax is in float32.

kv_cache: [layers, 2, num_blocks, block_size, kv_heads, head_dim].
"""
from typing import Optional

import torch


def write_kv(kv_cache: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    kvh, hd = kv_cache.shape[-2:]
    slots = slot_mapping.long()
    for which, x in ((0, k), (1, v)):
        kv_cache[layer, which].view(-1, kvh, hd).index_copy_(0, slots, x.view(-1, kvh, hd).to(kv_cache.dtype))


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_lens: torch.Tensor, context_lens: torch.Tensor, layer: int,
                    num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                    window: int) -> torch.Tensor:
    block_size = kv_cache.shape[3]
    out = torch.empty_like(q)
    start = 0
    for s, (n, ctx) in enumerate(zip(query_lens.tolist(), context_lens.tolist())):
        blocks = block_tables[s, : (ctx + block_size - 1) // block_size].long()
        k = kv_cache[layer, 0, blocks].reshape(-1, num_kv_heads, head_dim)[:ctx].float()
        v = kv_cache[layer, 1, blocks].reshape(-1, num_kv_heads, head_dim)[:ctx].float()
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
              num_kv_heads: int, head_dim: int, scale: float, window: int) -> torch.Tensor:
    # k and v are absent when a fused NormQKVRope already wrote them into the cache.
    if k is not None and v is not None:
        write_kv(kv_cache, layer, k, v, slot_mapping)
    return paged_attention(q, kv_cache, block_tables, query_lens, context_lens, layer,
                           num_heads, num_kv_heads, head_dim, scale, window)
