"""Driver launch of `rms_norm`'s AOT kernels. Two variants are compiled, with a weight and
folded (no weight); the meta's `weight` flag tells them apart. See `plugins.driver_launch`
for the launcher contract."""
from __future__ import annotations

import torch

from kiln.plugins.driver_launch import grid, ptr


def launch(kernels: list, metas: list[dict], inputs: list, attrs: dict, out: torch.Tensor,
           dims: dict[str, int], stream: int, scratch: dict[str, torch.Tensor]) -> None:
    """inputs: x [rows, H], weight? [H]."""
    x, weight = inputs
    if x.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("rms_norm needs rows with contiguous columns")
    i = next(i for i, m in enumerate(metas) if m["weight"] == (weight is not None))
    # The meta's grid says T, but the kernel runs one program per row of x, whatever dim
    # names them (the final norm's rows are L).
    kernels[i].launch(grid(metas[i]["grid"], {**dims, "T": x.shape[0]}),
                      [x.data_ptr(), ptr(weight), out.data_ptr(), x.stride(0), out.stride(0), x.shape[-1],
                       attrs["eps"]], stream)
