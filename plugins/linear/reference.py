"""PyTorch reference for `linear`: y = x W^T (+ b), optionally all-reduced across TP ranks."""
from typing import Optional

import torch
import torch.distributed as dist


def all_reduce_if(y: torch.Tensor, all_reduce: bool) -> torch.Tensor:
    """Sum partial results of a row-parallel projection over the tensor-parallel group."""
    if all_reduce and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(y)
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
           parallel: str, heads: int, all_reduce: bool) -> torch.Tensor:
    y = all_reduce_if(torch.nn.functional.linear(x, weight), all_reduce)
    # The bias goes after the reduction so that it is added once, not once per rank.
    return y + bias if bias is not None else y
