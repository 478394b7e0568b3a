"""PyTorch reference for the fused `norm_swiglu`: RMSNorm, one projection against the
gate/up weights, silu(gate) * up.

`w_gu` holds gate and up rows interleaved in blocks of `block` rows ([g0 u0 g1 u1 ...]) so a
kernel tile sees matching gate and up columns; `block` = 0 means plain [W_gate; W_up].
"""
from typing import Optional

import torch

from kiln.plugins.rms_norm.reference import rms_norm
from kiln.plugins.silu_mul.reference import silu_mul


def split_gate_up(y: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    t, two_i = y.shape
    if block == 0:
        return y[:, : two_i // 2], y[:, two_i // 2:]
    pairs = y.view(t, -1, 2, block)
    return pairs[:, :, 0].reshape(t, -1), pairs[:, :, 1].reshape(t, -1)


def norm_swiglu(x: torch.Tensor, norm_weight: Optional[torch.Tensor], w_gu: torch.Tensor,
                eps: float, block: int) -> torch.Tensor:
    gate, up = split_gate_up(torch.nn.functional.linear(rms_norm(x, norm_weight, eps), w_gu), block)
    return silu_mul(gate, up)
