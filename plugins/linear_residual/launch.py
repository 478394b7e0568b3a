"""Driver launch of `linear_residual`'s AOT kernels: `linear`'s GEMM with the residual read in
its epilogue (see `plugins.driver_launch` for the launcher contract)."""
from __future__ import annotations

import torch

from kiln.plugins.linear.launch import launch_gemm


def launch(kernels: list, metas: list[dict], inputs: list, attrs: dict, out: torch.Tensor,
           dims: dict[str, int], stream: int, scratch: dict[str, torch.Tensor]) -> None:
    """inputs: x [T, K], weight [N, K], bias [N] or None, residual [T, N]."""
    x, weight, bias, residual = inputs[:4]
    launch_gemm(kernels, metas, x, weight, bias, residual, out, stream, scratch)
