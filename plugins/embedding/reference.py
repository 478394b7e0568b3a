"""PyTorch reference for `embedding`: gather rows of the token table, times `scale`."""
import torch


def embedding(input_ids: torch.Tensor, weight: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    rows = weight.index_select(0, input_ids.long())
    # In the table's dtype, as Gemma scales: a bf16 row times the bf16-rounded scale, rounded once.
    return rows if scale == 1.0 else rows * torch.tensor(scale, dtype=weight.dtype)
