"""Building blocks for model definitions, each a thin nn.Module over one Kiln op.

Model code is written only with these (or with `plugins.op`), so a `torch.fx` trace of a model
is a graph of Kiln ops. Parameters are created empty; the checkpoint loader fills them.
"""
from __future__ import annotations

import torch
from torch import nn

from kiln.plugins import op


class Linear(nn.Module):
    """y = x W^T (+ b). `parallel` ("column", "row" or "none") and `heads` tell the sharding
    pass how to split the weight for tensor parallelism. A pre-quantized FP8 checkpoint's
    projection has a float8_e4m3fn weight and its float32 `weight_scale` [out_features], and may
    have a static activation scale `input_scale` [1] (`set_fp8`); otherwise both are None."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 parallel: str = "none", heads: int = 0, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.register_parameter("weight_scale", None)
        self.register_parameter("input_scale", None)
        self.parallel = parallel
        self.heads = heads

    def set_fp8(self, weight: torch.Tensor, scale: torch.Tensor, input_scale: torch.Tensor | None = None) -> None:
        """Hold a float8 weight [out, in], its float32 scale per output feature and, when the
        checkpoint has one, the static float32 scale [1] of its input."""
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        if input_scale is not None:
            self.input_scale = nn.Parameter(input_scale, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return op("linear")(x, self.weight, self.bias, self.parallel, self.heads, False, self.weight_scale,
                            self.input_scale)


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight. The weight is float32 whatever the model's dtype: it
    holds the checkpoint's values rounded to that dtype (exactly), or a value computed from them
    that the dtype cannot hold (Gemma's 1 + w), and a fold into a projection multiplies in
    float32 anyway. Norm kernels read it as float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=torch.float32), requires_grad=False)
        self.eps = eps
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return op("rms_norm")(x, self.weight, self.eps)


class HeadRMSNorm(RMSNorm):
    """RMSNorm over each head of a [T, heads*head_dim] tensor (Qwen3's and Gemma 3's q_norm and k_norm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return op("head_rms_norm")(x, self.weight, self.eps, self.dim)


class Embedding(nn.Module):
    """Rows of the token table, times `scale` rounded to the table's dtype (Gemma's sqrt(hidden))."""

    def __init__(self, num: int, dim: int, dtype: torch.dtype = torch.float32, scale: float = 1.0):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num, dim, dtype=dtype), requires_grad=False)
        # An explicit device: the model may be built on the meta device.
        self.scale = float(torch.tensor(scale, dtype=dtype, device="cpu"))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return op("embedding")(ids, self.weight, self.scale)
