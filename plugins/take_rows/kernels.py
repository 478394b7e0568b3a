"""Triton kernel for `take_rows`: out[i] = x[indices[i]], one program per (row, column block).

`embedding` is the same gather over its token table, so it launches `gather_rows` too, with the
row scale Gemma's embedding multiplies by (1.0 for every other op: exact).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.plugins.aot import POINTER_TYPES, AotKernel

MAX_BLOCK = 1024  # columns per program: 2 KiB of bf16, a few vector loads per thread


@triton.jit
def _gather_rows_kernel(src_ptr, indices_ptr, out_ptr, src_stride, out_stride, width, scale,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    # int64: a vocab-sized table can hold more than 2**31 elements.
    src = tl.load(indices_ptr + row).to(tl.int64) * src_stride
    values = tl.load(src_ptr + src + cols, mask=ok).to(tl.float32) * scale
    out = out_ptr + row.to(tl.int64) * out_stride
    tl.store(out + cols, values.to(out_ptr.dtype.element_ty), mask=ok)


def column_block(width: int) -> int:
    return min(triton.next_power_of_2(width), MAX_BLOCK)


def gather_rows(src: torch.Tensor, indices: torch.Tensor, out: torch.Tensor, scale: float = 1.0) -> None:
    """out[i, :] = src[indices[i], :] * scale, rounded once to out's dtype. Indices must lie in
    range: the runtime checks token ids where they enter, and the kernel does not bound-check
    them again."""
    width = src.shape[1]
    block = column_block(width)
    if src.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("gather_rows needs rows with contiguous columns")
    _gather_rows_kernel[(indices.shape[0], triton.cdiv(width, block))](
        src, indices, out, src.stride(0), out.stride(0), width, scale, BLOCK=block)


def gather_rows_aot(dtype: str, width: int, rows: str) -> AotKernel:
    """The gather for rows of `width` elements; `rows` names the grid's first dim in meta."""
    ptr = POINTER_TYPES[dtype]
    block = column_block(width)
    return AotKernel(
        _gather_rows_kernel,
        {"src_ptr": ptr, "indices_ptr": "*i32", "out_ptr": ptr, "src_stride": "i32",
         "out_stride": "i32", "width": "i32", "scale": "fp32", "BLOCK": "constexpr"},
        {"BLOCK": block}, num_stages=1,
        meta={"grid": f"({rows}, {triton.cdiv(width, block)}, 1)"})


def run(inputs: list, attrs: dict, out: torch.Tensor) -> None:
    """inputs: x [T, H], indices [L]."""
    x, indices = inputs
    gather_rows(x, indices, out)


def aot_kernels(dtype: str, shapes: dict) -> list[AotKernel]:
    """`shapes` key: hidden (row width)."""
    return [gather_rows_aot(dtype, shapes["hidden"], "L")]
