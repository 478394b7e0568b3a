"""PyTorch reference for `head_rms_norm`: RMSNorm applied to each head (Qwen3's q/k norm)."""
import torch

from kiln.plugins.rms_norm.reference import rms_norm


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, head_dim: int) -> torch.Tensor:
    t = x.shape[0]
    return rms_norm(x.view(t, -1, head_dim), weight, eps).reshape(t, -1)
