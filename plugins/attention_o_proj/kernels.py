"""Triton kernels for `attention_o_proj`: the `attention` kernels into a [T, heads*head_dim]
scratch buffer, then `linear_residual`'s GEMM with the residual add in its epilogue.

As for `linear_residual`, `all_reduce` is the runtime's business: each rank's GEMM gives its
partial o_proj, and with more than one rank the runtime passes b_o and the residual to one
rank's launch only, then sums the partials.
"""
from __future__ import annotations

import torch

from kiln.plugins.aot import AotKernel
from kiln.plugins.attention import kernels as attention
from kiln.plugins.linear import fp8
from kiln.plugins.linear_residual import kernels as linear_residual
from kiln.plugins.nvcc import NvccKernel

# The builder refuses FP8 plans for GPU targets not named here (`builder.kernels`).
FP8_TARGETS = fp8.FP8_TARGETS


def run(inputs: list, attrs: dict, out: torch.Tensor) -> None:
    """inputs: the first 8 of `attention` (q, k?, v?, kv_cache, slot_mapping, block_tables,
    query_lens, context_lens), then w_o [hidden, heads*head_dim], b_o? [hidden], residual,
    attention's kv_scales?, then w_o_scale [hidden] (FP8) and w_o_input_scale (a static activation
    scale) when given."""
    q, w_o, b_o, residual, kv_scales, w_scale, x_static = inputs[0], *attention.padded(inputs[8:], 6)
    attn = torch.empty_like(q)
    attention.run(list(inputs[:8]) + [kv_scales], attrs, attn)
    linear_residual.run([attn, w_o, b_o, residual, w_scale, x_static],
                        {"parallel": "row", "heads": 0, "all_reduce": attrs["all_reduce"]}, out)


def aot_kernels(dtype: str, shapes: dict) -> list[AotKernel | NvccKernel]:
    """`shapes` keys: those of `attention.aot_kernels` (heads, kv_heads, head_dim, block_size),
    hidden (o_proj's output width), bias (whether b_o is given; default False), fp8 (w_o in e4m3
    with its scales; default False) and fp8_static (a static activation scale; default False). The
    launcher provides a [T, heads*head_dim] scratch buffer between the two stages."""
    gemm = {"K": shapes["heads"] * shapes["head_dim"], "N": shapes["hidden"], "bias": shapes.get("bias", False),
            "fp8": shapes.get("fp8", False), "fp8_static": shapes.get("fp8_static", False),
            # Where the decode attention hands its output on, a step of one sequence takes the EARLY kernels,
            # which stage it for o_proj's GEMV (`attention.flash`).
            "staged_targets": attention.SM90_TARGETS if shapes.get("handoff") else ()}
    return attention.aot_kernels(dtype, shapes) + linear_residual.aot_kernels(dtype, gemm)
