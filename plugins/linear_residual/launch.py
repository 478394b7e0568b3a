"""Driver launch of `linear_residual`'s AOT kernels: `linear`'s GEMM with the residual read in
its epilogue (see `plugins.driver_launch` for the launcher contract)."""
from __future__ import annotations

import torch

from kiln.plugins.linear.launch import launch_gemm


def launch(kernels: list, metas: list[dict], inputs: list, attrs: dict, out: torch.Tensor,
           dims: dict[str, int], stream: int, scratch: dict[str, torch.Tensor]) -> None:
    """inputs: x [T, K], weight [N, K], bias [N] or None, residual [T, N], then weight_scale [N]
    (FP8) and weight_input_scale (a static activation scale) when given. With attr fp8_handoff, x's
    producer also wrote x's e4m3 rows where `linear.fp8.handoff_rows` holds, or at one row x staged
    where both are GEMVs (`linear.gemv.one_row_handoff`), and the GEMM reads them (`launch_gemm`)."""
    x, weight, bias, residual, w_scale, x_static = (*inputs, None, None)[:6]
    launch_gemm(kernels, metas, x, weight, bias, residual, out, stream, scratch, w_scale, x_static,
                bool(attrs.get("fp8_handoff")))
