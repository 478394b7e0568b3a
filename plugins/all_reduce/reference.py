"""PyTorch reference for `all_reduce`: the plain sum of every rank's partial, in rank order,
accumulated in float32 and rounded once to the partials' dtype (what the kernel computes)."""
from __future__ import annotations

import torch


def all_reduce(partials: list[torch.Tensor]) -> torch.Tensor:
    total = partials[0].float()
    for partial in partials[1:]:
        total = total + partial.float()
    return total.to(partials[0].dtype)
