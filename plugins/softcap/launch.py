"""Driver launch of `softcap`'s AOT kernel. See `plugins.driver_launch` for the launcher contract."""
from __future__ import annotations

import torch

from kiln.plugins.driver_launch import grid


def launch(kernels: list, metas: list[dict], inputs: list, attrs: dict, out: torch.Tensor,
           dims: dict[str, int], stream: int, scratch: dict[str, torch.Tensor]) -> None:
    """inputs: x [R, N]; attr cap."""
    (x,) = inputs
    if x.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("softcap needs rows with contiguous columns")
    kernels[0].launch(grid(metas[0]["grid"], {"R": x.shape[0]}),
                      [x.data_ptr(), out.data_ptr(), x.stride(0), out.stride(0), x.shape[1], attrs["cap"]], stream)
