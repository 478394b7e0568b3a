"""Driver launch of `take_rows`'s AOT gather (out[i] = x[indices[i]]); `embedding` uses the
same gather. See `plugins.driver_launch` for the launcher contract."""
from __future__ import annotations

import torch

from kiln.plugins.driver_launch import grid


def launch_gather(kernel, meta: dict, src: torch.Tensor, indices: torch.Tensor, out: torch.Tensor,
                  stream: int, scale: float = 1.0) -> None:
    """`_gather_rows_kernel`: one program row per index, rows multiplied by `scale`. The engine stores identical kernels
    once, so the meta may be the other op's (embedding's grid names T, take_rows' L): the
    row count is taken from `indices`, never from the dim the meta names."""
    if src.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("gather_rows needs rows with contiguous columns")
    rows = indices.shape[0]
    kernel.launch(grid(meta["grid"], {"T": rows, "L": rows}),
                  [src.data_ptr(), indices.data_ptr(), out.data_ptr(), src.stride(0), out.stride(0), src.shape[1], scale],
                  stream)


def launch(kernels: list, metas: list[dict], inputs: list, attrs: dict, out: torch.Tensor,
           dims: dict[str, int], stream: int, scratch: dict[str, torch.Tensor]) -> None:
    """inputs: x [T, H], indices [L]."""
    x, indices = inputs
    launch_gather(kernels[0], metas[0], x, indices, out, stream)
