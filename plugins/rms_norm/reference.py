"""PyTorch reference for `rms_norm`, computed in float32 like Hugging Face's LlamaRMSNorm."""
from typing import Optional

import torch


def rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    """rsqrt(mean(x^2) + eps) over the last dim in float32, kept as a trailing dim of 1."""
    return torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)


def normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rstd(x) in float32, cast back to x's dtype."""
    return (x.float() * rstd(x, eps)).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """The normalised row in x's dtype, times the weight (a float32 one, as models hold it, or
    one in x's dtype), the product rounded once to x's dtype."""
    y = normalize(x, eps)
    # A folded norm (weight None) leaves the scale to the projection that follows.
    return (y * weight).to(x.dtype) if weight is not None else y
