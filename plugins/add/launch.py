"""Driver launch of `add`'s AOT kernel. See `plugins.driver_launch` for the launcher contract."""
from __future__ import annotations

import torch

from kiln.plugins.add.kernels import check_rows
from kiln.plugins.driver_launch import grid


def launch(kernels: list, metas: list[dict], inputs: list, attrs: dict, out: torch.Tensor,
           dims: dict[str, int], stream: int, scratch: dict[str, torch.Tensor]) -> None:
    """inputs: a [R, N], b [R, N]."""
    a, b = inputs
    check_rows(a, b, out)
    kernels[0].launch(grid(metas[0]["grid"], {"R": a.shape[0]}),
                      [a.data_ptr(), b.data_ptr(), out.data_ptr(), a.stride(0), b.stride(0), out.stride(0),
                       a.shape[1]], stream)
