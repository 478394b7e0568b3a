"""PyTorch reference for the fused `norm_swiglu`: RMSNorm, one projection against the
gate/up weights, act(gate) * up with act silu (SwiGLU) or tanh-approximated GELU (GeGLU).

`w_gu` holds gate and up rows interleaved in blocks of `block` rows ([g0 u0 g1 u1 ...]) so a
kernel tile sees matching gate and up columns; `block` = 0 means plain [W_gate; W_up]. With
`w_gu_scale` the projection is W8A8 (`linear.reference.project_normed`).
"""
from typing import Optional

import torch

from kiln.plugins.gelu_mul.reference import gelu_mul
from kiln.plugins.linear.reference import project_normed
from kiln.plugins.silu_mul.reference import silu_mul

# activation attr -> the primitive gated op it stands for
ACTIVATIONS = {"silu": silu_mul, "gelu_tanh": gelu_mul}


def split_gate_up(y: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    t, two_i = y.shape
    if block == 0:
        return y[:, : two_i // 2], y[:, two_i // 2:]
    pairs = y.view(t, -1, 2, block)
    return pairs[:, :, 0].reshape(t, -1), pairs[:, :, 1].reshape(t, -1)


def norm_swiglu(x: torch.Tensor, norm_weight: Optional[torch.Tensor], w_gu: torch.Tensor,
                eps: float, block: int, activation: str = "silu",
                w_gu_scale: Optional[torch.Tensor] = None,
                w_gu_input_scale: Optional[torch.Tensor] = None,
                out_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`out_scale` only tells the GPU kernels to hand the output on in e4m3 too (`linear.fp8`)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"norm_swiglu: unknown activation {activation!r}; choose one of {', '.join(ACTIVATIONS)}")
    gate, up = split_gate_up(project_normed(x, norm_weight, eps, w_gu, w_gu_scale, input_scale=w_gu_input_scale),
                             block)
    return ACTIVATIONS[activation](gate, up)
