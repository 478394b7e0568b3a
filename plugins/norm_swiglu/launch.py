"""Driver launch of `norm_swiglu`'s AOT kernels, one per GEMM shape bucket. See
`plugins.driver_launch` for the launcher contract."""
from __future__ import annotations

import torch

from kiln.plugins.driver_launch import check_aligned, grid
from kiln.plugins.linear import fp8
from kiln.plugins.linear.gemv import address
from kiln.plugins.linear.launch import (check_fp8, gemv_scale_args, norm_gemm_input_args, pick_bucket, row_scale_bytes,
                                        split_args)


def scratch_bytes(attrs: dict, limits: dict[str, int]) -> dict[str, int]:
    return row_scale_bytes(limits)


def launch(kernels: list, metas: list[dict], inputs: list, attrs: dict, out: torch.Tensor,
           dims: dict[str, int], stream: int, scratch: dict[str, torch.Tensor]) -> None:
    """inputs: x [T, K], norm_weight [K] or None (folded: not a kernel parameter), w_gu [2I, K],
    then w_gu_scale [2I] (FP8), w_gu_input_scale (a static activation scale) and out_scale (the next
    GEMM's, for the handoff) when given. An FP8 bucket that reads e4m3 rows gets them from the quantize
    pre-pass, which applies the norm (and its weight); one built to hand its output on writes it to
    the handoff's scratch too (at one row, the GEMV built for it stages it there for down's GEMV)."""
    x, norm_weight, w_gu, w_scale, x_static, out_scale = (*inputs, None, None, None)[:6]
    rows = x.shape[0]
    i = pick_bucket(metas, rows)
    if out_scale is not None and fp8.handoff_rows(rows) and not metas[i].get("handoff"):
        raise ValueError(f"norm_swiglu's kernel for {rows} rows does not hand its output on in e4m3, which the "
                         "next GEMM expects: the engine's kernels and plan disagree; rebuild the engine")
    check_fp8(metas[i], w_scale)
    check_aligned(metas[i], x, norm_weight, w_gu, w_scale, out)
    if metas[i].get("handoff") and out_scale is None:
        raise ValueError("norm_swiglu's kernel hands its output on, and the plan gives it no out_scale: the "
                         "engine's kernels and plan disagree; rebuild the engine")
    if metas[i].get("gemv"):
        staged = [scratch[fp8.HANDOFF[0]].data_ptr(), out_scale.data_ptr()] if metas[i].get("handoff") else []
        args = [x.data_ptr(), address(norm_weight), w_gu.data_ptr(), *gemv_scale_args(metas[i], w_scale, x_static),
                out.data_ptr(), *staged, out.shape[1], metas[i]["block"], attrs["eps"], x.shape[1]]
        kernels[i].launch(grid(metas[i]["grid"], {}), args, stream)
        return
    args = norm_gemm_input_args(kernels, metas, i, x, norm_weight, attrs["eps"], stream, scratch, x_static)
    args += [t.data_ptr() for t in (w_gu, w_scale) if t is not None] + [out.data_ptr()]
    if metas[i].get("handoff"):
        args += [scratch[name].data_ptr() for name in fp8.HANDOFF] + [out_scale.data_ptr()]
    if metas[i].get("tma"):
        args.append(rows)
    else:
        args += [*split_args(metas[i], scratch), rows, attrs["eps"]]
    kernels[i].launch(grid(metas[i]["grid"], {"T": rows}), args, stream)
