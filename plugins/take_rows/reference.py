"""PyTorch reference for `take_rows`: keep the rows whose logits are wanted."""
import torch


def take_rows(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return x.index_select(0, indices.long())
