"""Triton kernel for `norm_swiglu`: y = silu(g) * u with [g u] = RMSNorm(x) W_gu^T.

One GEMM pass: the K loop that multiplies x by the gate and up weights also sums x^2 per
row, and the epilogue applies the row scale rsqrt(mean(x^2) + eps) to the accumulator
(scaling rows commutes with the product), then forms silu(g) * u. A folded norm weight is
already inside W_gu; an unfolded one (norm_weight given) multiplies each x tile as it is
loaded.

Each program owns BLOCK_N output columns and gathers their gate and up rows into one weight
tile: output column j's gate row is (j // block) * 2 * block + j % block of the interleaved
W_gu ([g0 u0 g1 u1 ...], blocks of `block` rows) and its up row is `block` after it. One dot
gives [gate | up] for the tile's columns, split in the epilogue. Every row of W_gu is read
once per row block; when BLOCK_N is a multiple of `block` the gathered rows are runs of whole
blocks. This works for any `block` and BLOCK_N, and `block` = 0 (plain [W_gate; W_up]) is
the same rule with block = I.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.dtypes import element_bytes
from kiln.plugins.aot import AotKernel, absent_as_none, pointer_params
from kiln.plugins.linear.kernels import (POINTER, WIDE_N, block_k, gemm_tile,
                                         launch_meta, num_stages, pick_tile, split_buffers, split_halves, split_k,
                                         split_k_sum, split_signature, tiles_for, upcast_dot, with_bucket)


def swiglu_tiles(weight_rows: int) -> tuple:
    """The GEMM buckets for gate/up, with 128 weight rows (64 of gate, 64 of up) and 128-wide K
    tiles for up to 64 rows: each program reads its rows of x twice (the dot and the norm's row
    sum), and wider programs cut that traffic. Measured on an H200 with scripts/tune_gemm.py
    (2026-11-30, Llama-3-8B's gate/up, T = 64, weights cycled beyond the L2): 68.2 us, against
    72.0 with the shared wide tile (64 rows, 64-wide K)."""
    return with_bucket(tiles_for(weight_rows), "small", block_n=128, block_k=128) \
        if weight_rows >= WIDE_N else tiles_for(weight_rows)


@triton.jit
def norm_swiglu_kernel(x_ptr, norm_ptr, w_ptr, out_ptr, part_ptr, count_ptr, T, eps,
                       I: tl.constexpr, K: tl.constexpr, GU_BLOCK: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       UPCAST_DOT: tl.constexpr, SPLIT_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < T
    # Tile rows: the gate rows of the tile's columns, then their up rows.
    i = tl.arange(0, 2 * BLOCK_N)
    cols = tl.program_id(1) * BLOCK_N + i % BLOCK_N
    rows = (cols // GU_BLOCK) * (2 * GU_BLOCK) + cols % GU_BLOCK + (i // BLOCK_N) * GU_BLOCK
    acc, sumsq = gemm_tile(x_ptr, norm_ptr, w_ptr, offs_m, mask_m, rows, cols < I,
                           K, BLOCK_M, 2 * BLOCK_N, BLOCK_K, True, UPCAST_DOT, SPLIT_K)
    last = True
    if SPLIT_K > 1:
        acc, sumsq, last = split_k_sum(acc, sumsq, part_ptr, count_ptr, mask_m, BLOCK_M, 2 * BLOCK_N, SPLIT_K, True)
    if last:
        gate, up = split_halves(acc * tl.rsqrt(sumsq / K + eps)[:, None], BLOCK_M, BLOCK_N)
        y = gate * tl.sigmoid(gate) * up
        mask = mask_m[:, None] & (offs_n < I)[None, :]
        tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * I + offs_n[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=mask)


def run(inputs: list, attrs: dict, out: torch.Tensor) -> None:
    """inputs: x [T, K], norm_weight [K] or None (folded), w_gu [2I, K]; attrs eps, block."""
    x, norm_weight, w_gu = inputs
    x, w_gu = x.contiguous(), w_gu.contiguous()
    t, k = x.shape
    inter = w_gu.shape[0] // 2
    tile = pick_tile(t, tiles=swiglu_tiles(2 * inter))
    bk = block_k(tile, x.element_size())
    # Half of the tile's weight rows are gate rows, half up rows.
    bn = tile.block_n // 2
    split, columns = split_k(tile, k, bk), triton.cdiv(inter, bn)
    part, count = split_buffers(t, tile.block_m, 2 * bn, columns, split, x.device)
    norm_swiglu_kernel[(triton.cdiv(t, tile.block_m), columns, split)](
        x, norm_weight, w_gu, out, part, count, t, attrs["eps"], I=inter, K=k, GU_BLOCK=attrs["block"] or inter,
        BLOCK_M=tile.block_m, BLOCK_N=bn, BLOCK_K=bk, UPCAST_DOT=upcast_dot(x), SPLIT_K=split,
        num_warps=tile.num_warps,
        num_stages=num_stages(tile.block_m, tile.block_n, bk, x.element_size(), tile.stages))


def aot_kernels(dtype: str, shapes: dict) -> list[AotKernel]:
    """shapes: {"K": hidden size, "I": intermediate size (this rank's), "block": gate/up
    interleave block (0: not interleaved), "norm_weight": bool (default False: folded)}.
    One kernel per shape bucket; eps is a runtime argument."""
    ptr, size = POINTER[dtype], element_bytes(dtype)
    k, inter, norm = shapes["K"], shapes["I"], shapes.get("norm_weight", False)
    kernels = []
    for tile in swiglu_tiles(2 * inter):
        bk, bn = block_k(tile, size), tile.block_n // 2
        split = split_k(tile, k, bk)
        signature = {"x_ptr": ptr, "norm_ptr": ptr if norm else "constexpr", "w_ptr": ptr, "out_ptr": ptr,
                     **split_signature(split), "T": "i32", "eps": "fp32", "I": "constexpr", "K": "constexpr",
                     "GU_BLOCK": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
                     "BLOCK_K": "constexpr", "UPCAST_DOT": "constexpr", "SPLIT_K": "constexpr"}
        constexprs = {"I": inter, "K": k, "GU_BLOCK": shapes["block"] or inter, "BLOCK_M": tile.block_m,
                      "BLOCK_N": bn, "BLOCK_K": bk, "UPCAST_DOT": False, "SPLIT_K": split}
        kernels.append(AotKernel(
            norm_swiglu_kernel, signature, absent_as_none(signature, constexprs), num_warps=tile.num_warps, aligned=pointer_params(signature),
            num_stages=num_stages(tile.block_m, tile.block_n, bk, size, tile.stages),
            meta=launch_meta(tile, triton.cdiv(inter, bn), split, 2 * bn)))
    return kernels
