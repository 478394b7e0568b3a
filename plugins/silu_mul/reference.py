"""PyTorch reference for `silu_mul`: SwiGLU's silu(gate) * up."""
import torch


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up
