"""W8A8 references for the GEMM plugins' FP8 kernel tests: each plugin's PyTorch reference with
its projection done by `plugins.fp8.fp8_linear` (the GEMM input quantized per token, e4m3
weights with per-row scales), built from the same pieces as the plugins' own references."""
from __future__ import annotations

import torch

from kiln.plugins.attention.reference import write_kv
from kiln.plugins.fp8 import fp8_linear
from kiln.plugins.head_rms_norm.reference import head_rms_norm
from kiln.plugins.norm_swiglu.reference import ACTIVATIONS, split_gate_up
from kiln.plugins.rms_norm.reference import rms_norm
from kiln.plugins.rope.reference import apply_rope


def project(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = fp8_linear(x, wq, w_scale)
    return y + bias if bias is not None else y


def linear(x, wq, bias, w_scale, residual=None) -> torch.Tensor:
    y = project(x, wq, w_scale, bias)
    return y if residual is None else residual + y


def norm_swiglu(x, norm_weight, wq, w_scale, eps: float, block: int, activation: str) -> torch.Tensor:
    gate, up = split_gate_up(project(rms_norm(x, norm_weight, eps), wq, w_scale, None), block)
    return ACTIVATIONS[activation](gate, up)


def norm_qkv_rope(x, norm_weight, wq, b_qkv, q_norm, k_norm, positions, rope_cache, kv_cache, slot_mapping,
                  w_scale, eps: float, layer: int, num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    qkv = project(rms_norm(x, norm_weight, eps), wq, w_scale, b_qkv)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    if q_norm is not None and k_norm is not None:
        q, k = head_rms_norm(q, q_norm, eps, head_dim), head_rms_norm(k, k_norm, eps, head_dim)
    q = apply_rope(q, positions, rope_cache, head_dim)
    k = apply_rope(k, positions, rope_cache, head_dim)
    write_kv(kv_cache, layer, k, v, slot_mapping)
    return q.contiguous()
