"""Triton kernel for `linear_residual`: y = residual + x W^T (+ bias).

It is `linear`'s kernel with the residual read in the epilogue (the kernel's `residual_ptr`
given instead of None), so the sum costs one extra read of [T, N] and no extra pass. As for
`linear`, `all_reduce` is left to the runtime: with more than one rank it passes residual and
bias to one rank's kernel only, since the reference adds them once, after the reduction.
"""
from __future__ import annotations

import torch

from kiln.plugins.aot import AotKernel
from kiln.plugins.linear import fp8, gemv
from kiln.plugins.linear.kernels import launch_linear, linear_aot_kernels
from kiln.plugins.nvcc import NvccKernel

# The builder refuses FP8 plans for GPU targets not named here (`builder.kernels`).
FP8_TARGETS = fp8.FP8_TARGETS


def run(inputs: list, attrs: dict, out: torch.Tensor) -> None:
    """inputs: x [T, K], weight [N, K], bias [N] or None, residual [T, N], then weight_scale [N]
    (FP8) and weight_input_scale (a static activation scale) when given."""
    x, weight, bias, residual, w_scale, x_static = (*inputs, None, None)[:6]
    launch_linear(x, weight, bias, residual, out, w_scale, x_static)


def aot_kernels(dtype: str, shapes: dict) -> list[AotKernel | NvccKernel]:
    """shapes: {"K": in features, "N": out features, "bias": bool (default False), "fp8": bool
    (default False), "fp8_static": bool (default False), "fp8_handoff": bool (default False: x's
    producer, an FP8 norm_swiglu, does not hand x on), "staged_targets": the targets where x's producer
    stages x at one row otherwise (attention_o_proj's: its EARLY decode attention; default none)}. The
    kernels are `linear_kernel` with a residual pointer, one per shape bucket (and for FP8 the quantize
    pre-pass), after the GEMVs (`linear.gemv`)."""
    n, k = shapes["N"], shapes["K"]
    staged = tuple(shapes.get("staged_targets", ()))
    if shapes.get("fp8_handoff") and gemv.one_row_handoff(dtype, n, k):
        staged = FP8_TARGETS   # norm_swiglu's GEMV stages x on every FP8 target
    return linear_aot_kernels(dtype, n, k, shapes.get("bias", False), residual=True,
                              fp8_weight=shapes.get("fp8", False), fp8_static=shapes.get("fp8_static", False),
                              staged_targets=staged)
