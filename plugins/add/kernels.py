"""Triton kernel for `add`: y = a + b (residual connections that no fusion took: Gemma's, after
its post-norms), one program per (row, column block), rows of any stride; the sum is formed in
float32 and rounded once, as torch adds bf16 tensors."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.plugins.aot import POINTER_TYPES, AotKernel
from kiln.plugins.take_rows.kernels import column_block


@triton.jit
def _add_kernel(a_ptr, b_ptr, out_ptr, a_stride, b_stride, out_stride, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    a = tl.load(a_ptr + row * a_stride + cols, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + row * b_stride + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (a + b).to(out_ptr.dtype.element_ty), mask=ok)


def check_rows(*tensors: torch.Tensor) -> None:
    if any(t.dim() != 2 or t.stride(-1) != 1 for t in tensors):
        raise ValueError("add's kernel needs [rows, width] tensors with contiguous columns")


def run(inputs: list, attrs: dict, out: torch.Tensor) -> None:
    """inputs: a [R, N], b [R, N]."""
    a, b = inputs
    check_rows(a, b, out)
    width = a.shape[1]
    block = column_block(width)
    _add_kernel[(a.shape[0], triton.cdiv(width, block))](
        a, b, out, a.stride(0), b.stride(0), out.stride(0), width, BLOCK=block)


def aot_kernels(dtype: str, shapes: dict) -> list[AotKernel]:
    """`shapes` key: width (row length). The grid's rows are named R: the launcher binds them
    to a's rows."""
    ptr = POINTER_TYPES[dtype]
    block = column_block(shapes["width"])
    return [AotKernel(
        _add_kernel,
        {"a_ptr": ptr, "b_ptr": ptr, "out_ptr": ptr, "a_stride": "i32", "b_stride": "i32", "out_stride": "i32",
         "width": "i32", "BLOCK": "constexpr"},
        {"BLOCK": block}, num_stages=1, meta={"grid": f"(R, {triton.cdiv(shapes['width'], block)}, 1)"})]
