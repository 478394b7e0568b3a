"""Triton kernel for `softcap`: y = cap * tanh(x / cap) in float32, one program per (row,
column block), rows of any stride.

tanh(u) is written 2 sigmoid(2u) - 1 (Triton has no tanh of its own that its interpreter also
runs); near u = 0 that loses a few bits of relative precision, a few 1e-8 of `cap` absolute.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.plugins.aot import POINTER_TYPES, AotKernel
from kiln.plugins.take_rows.kernels import column_block


@triton.jit
def _softcap_kernel(x_ptr, out_ptr, x_stride, out_stride, width, cap, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    x = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0).to(tl.float32)
    y = (2.0 * tl.sigmoid(2.0 * x / cap) - 1.0) * cap
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def _check(x: torch.Tensor, out: torch.Tensor) -> None:
    if x.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("softcap needs rows with contiguous columns")


def run(inputs: list, attrs: dict, out: torch.Tensor) -> None:
    """inputs: x [R, N]; attr cap."""
    (x,) = inputs
    _check(x, out)
    width = x.shape[1]
    block = column_block(width)
    _softcap_kernel[(x.shape[0], triton.cdiv(width, block))](
        x, out, x.stride(0), out.stride(0), width, attrs["cap"], BLOCK=block)


def aot_kernels(dtype: str, shapes: dict) -> list[AotKernel]:
    """`shapes` key: width (row length). The grid's rows are named R: the launcher binds them
    to x's rows, whichever step dim those are."""
    ptr = POINTER_TYPES[dtype]
    block = column_block(shapes["width"])
    return [AotKernel(
        _softcap_kernel,
        {"x_ptr": ptr, "out_ptr": ptr, "x_stride": "i32", "out_stride": "i32", "width": "i32", "cap": "fp32",
         "BLOCK": "constexpr"},
        {"BLOCK": block}, num_stages=1, meta={"grid": f"(R, {triton.cdiv(shapes['width'], block)}, 1)"})]
