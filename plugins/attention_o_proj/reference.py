"""PyTorch reference for the fused `attention_o_proj`: paged attention, output projection
(row-parallel under tensor parallelism) and the residual add."""
from typing import Optional

import torch

from kiln.plugins.attention.reference import attention
from kiln.plugins.linear.reference import linear


def attention_o_proj(q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                     kv_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                     query_lens: torch.Tensor, context_lens: torch.Tensor, w_o: torch.Tensor,
                     b_o: Optional[torch.Tensor], residual: torch.Tensor, layer: int, num_heads: int,
                     num_kv_heads: int, head_dim: int, scale: float, window: int,
                     all_reduce: bool, kv_scales: Optional[torch.Tensor] = None,
                     w_o_scale: Optional[torch.Tensor] = None,
                     w_o_input_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    a = attention(q, k, v, kv_cache, slot_mapping, block_tables, query_lens, context_lens,
                  layer, num_heads, num_kv_heads, head_dim, scale, window, kv_scales)
    return residual + linear(a, w_o, b_o, "row", 0, all_reduce, w_o_scale, w_o_input_scale)
