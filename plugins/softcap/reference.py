"""PyTorch reference for `softcap`: cap * tanh(x / cap), computed in float32 and rounded once
to x's dtype."""
import torch


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    if not cap > 0:
        raise ValueError(f"softcap: cap must be positive, got {cap}")
    return (torch.tanh(x.float() / cap) * cap).to(x.dtype)
