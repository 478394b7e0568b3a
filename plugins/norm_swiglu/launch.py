"""Driver launch of `norm_swiglu`'s AOT kernels, one per GEMM shape bucket. See
`plugins.driver_launch` for the launcher contract."""
from __future__ import annotations

import torch

from kiln.plugins.driver_launch import check_aligned, grid
from kiln.plugins.linear.launch import launch_row_scale, pick_bucket, row_scale_bytes, split_args


def scratch_bytes(attrs: dict, limits: dict[str, int]) -> dict[str, int]:
    return row_scale_bytes(limits)


def launch(kernels: list, metas: list[dict], inputs: list, attrs: dict, out: torch.Tensor,
           dims: dict[str, int], stream: int, scratch: dict[str, torch.Tensor]) -> None:
    """inputs: x [T, K], norm_weight [K] or None (folded: not a kernel parameter), w_gu [2I, K]."""
    x, norm_weight, w_gu = inputs[:3]
    rows = x.shape[0]
    i = pick_bucket(metas, rows)
    check_aligned(metas[i], x, norm_weight, w_gu, out)
    if metas[i].get("tma"):
        scales = launch_row_scale(kernels, metas, x, attrs["eps"], stream, scratch)
        kernels[i].launch(grid(metas[i]["grid"], {"T": rows}), [x.data_ptr(), scales, w_gu.data_ptr(),
                                                                 out.data_ptr(), rows], stream)
        return
    args = [x.data_ptr()] + ([norm_weight.data_ptr()] if norm_weight is not None else [])
    args += [w_gu.data_ptr(), out.data_ptr(), *split_args(metas[i], scratch), rows, attrs["eps"]]
    kernels[i].launch(grid(metas[i]["grid"], {"T": rows}), args, stream)
