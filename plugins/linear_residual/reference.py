"""PyTorch reference for the fused `linear_residual`: residual + x W^T (+ b), the projection
all-reduced first when it is row-parallel."""
from typing import Optional

import torch

from kiln.plugins.linear.reference import linear


def linear_residual(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                    residual: torch.Tensor, parallel: str, heads: int, all_reduce: bool,
                    weight_scale: Optional[torch.Tensor] = None,
                    weight_input_scale: Optional[torch.Tensor] = None, fp8_handoff: bool = False) -> torch.Tensor:
    """`fp8_handoff` (set by `builder.passes.quantize.hand_off_fp8`) only tells the GPU launcher that x's
    producer wrote x's e4m3 rows for it."""
    return residual + linear(x, weight, bias, parallel, heads, all_reduce, weight_scale, weight_input_scale)
