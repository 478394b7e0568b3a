"""Driver launch of `attention_o_proj`'s AOT kernels: `attention`'s kernels into a scratch
buffer [T, heads*head_dim], then `linear_residual`'s GEMM (o_proj + residual) from it.

Its kernels are attention's (their metas carry a `role`) followed by the GEMM buckets (their
metas carry a `bucket`). See `plugins.driver_launch` for the launcher contract.
"""
from __future__ import annotations

import torch

from kiln.plugins.attention import launch as attention
from kiln.plugins.attention.kernels import padded
from kiln.plugins.linear.launch import launch_gemm


def scratch_bytes(attrs: dict, limits: dict[str, int]) -> dict[str, int]:
    """attention's split-KV workspaces plus the attention output between the two stages."""
    width = attrs["num_heads"] * attrs["head_dim"]
    return {**attention.scratch_bytes(attrs, limits),
            "attention_o_proj_attn": limits["T"] * width * limits["element_bytes"]}


def launch(kernels: list, metas: list[dict], inputs: list, attrs: dict, out: torch.Tensor,
           dims: dict[str, int], stream: int, scratch: dict[str, torch.Tensor]) -> None:
    """inputs: the first 8 of `attention`, then w_o [hidden, heads*head_dim], b_o? [hidden],
    residual, attention's kv_scales?, then w_o_scale [hidden] (FP8) and w_o_input_scale (a static
    activation scale) when given. Built with the handoff (`linear.fp8`: a static scale and a bf16
    cache), a pure decode step of HANDOFF_ROWS rows gives o_proj's GEMM its e4m3 rows from the decode
    kernels, with no pre-pass."""
    q, w_o, b_o, residual, kv_scales, w_scale, x_static = inputs[0], *padded(inputs[8:], 6)
    attn = scratch["attention_o_proj_attn"][:q.numel() * q.element_size()].view(q.dtype).view(q.shape)
    attention_idx = [i for i, m in enumerate(metas) if "role" in m]
    gemm_idx = [i for i, m in enumerate(metas) if "bucket" in m or "quantize" in m]
    attention_metas = [metas[i] for i in attention_idx]
    handing = any(m.get("handoff") for m in attention_metas)
    attention.launch([kernels[i] for i in attention_idx], attention_metas, list(inputs[:8]) + [kv_scales], attrs,
                     attn, dims, stream, scratch, x_static if handing else None)
    # A pure decode step's attention output comes whole from the decode kernels, which handed it on (e4m3
    # rows at HANDOFF_ROWS rows, at one row on sm_90 on staged by the EARLY kernels: `launch_gemm` takes each).
    handoff = handing and q.shape[0] == inputs[6].shape[0]
    launch_gemm([kernels[i] for i in gemm_idx], [metas[i] for i in gemm_idx], attn, w_o, b_o, residual, out, stream,
                scratch, w_scale, x_static, handoff)
