"""PyTorch reference for the fused `norm_qkv_rope`.

One projection against the concatenated [Wq; Wk; Wv] (norm weight folded in once the fold
pass has run), bias, optional per-head q/k norm, RoPE on q and k; k and v go straight into
their KV cache slots and only q is returned. With `w_qkv_scale` the projection is W8A8
(`linear.reference.project_normed`): the normalized rows are quantized per token.
"""
from typing import Optional

import torch

from kiln.plugins.attention.reference import write_kv
from kiln.plugins.head_rms_norm.reference import head_rms_norm
from kiln.plugins.linear.reference import project_normed
from kiln.plugins.rope.reference import apply_rope


def norm_qkv_rope(x: torch.Tensor, norm_weight: Optional[torch.Tensor], w_qkv: torch.Tensor,
                  b_qkv: Optional[torch.Tensor], q_norm: Optional[torch.Tensor],
                  k_norm: Optional[torch.Tensor], positions: torch.Tensor, rope_cache: torch.Tensor,
                  kv_cache: torch.Tensor, slot_mapping: torch.Tensor, eps: float, layer: int,
                  num_heads: int, num_kv_heads: int, head_dim: int,
                  kv_scales: Optional[torch.Tensor] = None,
                  w_qkv_scale: Optional[torch.Tensor] = None,
                  w_qkv_input_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    qkv = project_normed(x, norm_weight, eps, w_qkv, w_qkv_scale, b_qkv, w_qkv_input_scale)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    if q_norm is not None and k_norm is not None:
        q, k = head_rms_norm(q, q_norm, eps, head_dim), head_rms_norm(k, k_norm, eps, head_dim)
    q = apply_rope(q, positions, rope_cache, head_dim)
    k = apply_rope(k, positions, rope_cache, head_dim)
    write_kv(kv_cache, layer, k, v, slot_mapping, kv_scales)
    return q.contiguous()
