"""PyTorch reference for `gelu_mul`: GeGLU's gelu(gate) * up, GELU with the tanh approximation
(transformers' `gelu_pytorch_tanh`)."""
import torch


def gelu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(gate, approximate="tanh") * up
