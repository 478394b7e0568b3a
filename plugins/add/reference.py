"""PyTorch reference for `add`: elementwise sum (residual connections)."""
import torch


def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a + b
