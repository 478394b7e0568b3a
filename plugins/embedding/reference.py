"""PyTorch reference for `embedding`: gather rows of the token table."""
import torch


def embedding(input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight.index_select(0, input_ids.long())
