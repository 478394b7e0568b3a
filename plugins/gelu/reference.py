"""PyTorch reference for `gelu` (tanh approximation, as in GPT-style MLPs)."""
import torch


def gelu(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x, approximate="tanh")
