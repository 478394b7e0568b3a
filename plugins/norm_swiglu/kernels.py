"""Triton kernel for `norm_swiglu`: y = act(g) * u with [g u] = RMSNorm(x) W_gu^T, act silu or
tanh-approximated GELU (a constexpr: one kernel per activation).

One GEMM pass: the K loop that multiplies x by the gate and up weights also sums x^2 per
row, and the epilogue applies the row scale rsqrt(mean(x^2) + eps) to the accumulator
(scaling rows commutes with the product), then forms act(g) * u. A folded norm weight is
already inside W_gu; an unfolded one (norm_weight given) multiplies each x tile as it is
loaded.

Each program owns BLOCK_N output columns and gathers their gate and up rows into one weight
tile: output column j's gate row is (j // block) * 2 * block + j % block of the interleaved
W_gu ([g0 u0 g1 u1 ...], blocks of `block` rows) and its up row is `block` after it. One dot
gives [gate | up] for the tile's columns, split in the epilogue. Every row of W_gu is read
once per row block; when BLOCK_N is a multiple of `block` the gathered rows are runs of whole
blocks. This works for any `block` and BLOCK_N, and `block` = 0 (plain [W_gate; W_up]) is
the same rule with block = I.

On sm_90 and later the wide buckets run `tma_norm_swiglu_kernel`: the persistent TMA GEMM of
`linear.tma` over whole runs of W_gu's rows (a tile of 2 * BLOCK_N rows holds BLOCK_N // block
pairs of gate and up blocks, so it needs an interleaved W_gu), with the row scale from the
`row_scale_kernel` pre-pass. At one row of bf16, the CUDA GEMV of `linear.gemv` leads the buckets.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.dtypes import element_bytes
from kiln.plugins.aot import POINTER_TYPES, AotKernel, absent_as_none, pointer_params
from kiln.plugins.linear import fp8, gemv, tma
from kiln.plugins.linear.kernels import (fp8_gemm_tile, gemm_input, gemm_tile, launch_meta, split_buffers,
                                         split_halves, split_k_sum, split_signature, upcast_dot)
from kiln.plugins.linear.tiles import (WIDE_N, block_k, num_stages, pick_tile, pipelined, prescaled, split_k,
                                       tiles_for, with_bucket)
from kiln.plugins.nvcc import NvccKernel

# The builder refuses FP8 plans for GPU targets not named here (`builder.kernels`).
FP8_TARGETS = fp8.FP8_TARGETS


def swiglu_tiles(weight_rows: int, fp8_weight: bool = False) -> tuple:
    """The GEMM buckets for gate/up; for up to 64 rows of a wide W_gu (bf16), tiles of 128
    weight rows (64 of gate, 64 of up), 128-deep K tiles, 4 stages (which only sm_90's shared
    memory holds, `pipelined`) and 8 warps, with x's row scales from the row-scale pre-pass
    (`linear.tiles.prescaled`). Measured on an H200 with scripts/tune_gemm.py (session 16, T = 64,
    the engine's interleaved W_gu, weights cycled beyond the L2): TP 1's 28,672 rows take 60.2 us
    and TP 2's 14,336 take 32.2, plus 1.7 for the pre-pass, against 66.0 and 35.1 for the best
    tiles that sum x^2 in their K loops. FP8 reads no x for a norm (the quantize pre-pass applied
    it) and x is e4m3: there 64 rows and K tiles of 128 e4m3 values take 31.9 us against 34.9
    (`KILN_TUNE_FP8=1`, 2026-11-30)."""
    if weight_rows < WIDE_N:
        return tiles_for(weight_rows)
    if fp8_weight:
        return with_bucket(tiles_for(weight_rows), "small", block_n=64, block_k=64, stages=3)
    return with_bucket(tiles_for(weight_rows), "small", block_n=128, block_k=128, num_warps=8, stages=4)


# constexpr GELU_TANH of each activation attr
GELU_TANH = {"silu": False, "gelu_tanh": True}


@triton.jit
def _gate(g, GELU_TANH: tl.constexpr):
    """silu(g), or gelu_tanh(g) = g * (1 + tanh(z)) / 2 = g * sigmoid(2z) with z = sqrt(2/pi) (g + 0.044715 g^3)."""
    if GELU_TANH:
        return g * tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))
    return g * tl.sigmoid(g)


@triton.jit
def norm_swiglu_kernel(x_ptr, x_scale_ptr, norm_ptr, w_ptr, w_scale_ptr, out_ptr, q_ptr, q_scale_ptr, q_static_ptr,
                       part_ptr, count_ptr, T, eps,
                       I: tl.constexpr, K: tl.constexpr, GU_BLOCK: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       UPCAST_DOT: tl.constexpr, SPLIT_K: tl.constexpr, GELU_TANH: tl.constexpr,
                       ROUND_E4M3: tl.constexpr = False):
    """w_scale_ptr given: W8A8 (`linear.kernels.fp8_gemm_tile` on the quantize pre-pass's rows, which
    are RMSNorm'd already: its tile comes row-scaled). Else x_scale_ptr given: x's RMSNorm row
    scales from the row-scale pre-pass; neither: the K loop sums x^2 itself. q_ptr given: the
    output also goes to the next op's GEMM in e4m3, divided by the static scale at q_static_ptr
    (`linear.fp8.store_handoff`)."""
    FP8: tl.constexpr = w_scale_ptr is not None
    SUMS: tl.constexpr = not FP8 and x_scale_ptr is None
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < T
    # Tile rows: the gate rows of the tile's columns, then their up rows.
    i = tl.arange(0, 2 * BLOCK_N)
    cols = tl.program_id(1) * BLOCK_N + i % BLOCK_N
    rows = (cols // GU_BLOCK) * (2 * GU_BLOCK) + cols % GU_BLOCK + (i // BLOCK_N) * GU_BLOCK
    if FP8:
        acc = fp8_gemm_tile(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, offs_m, mask_m, rows, cols < I,
                            K, BLOCK_M, 2 * BLOCK_N, BLOCK_K, UPCAST_DOT, SPLIT_K)
        sumsq = tl.zeros((BLOCK_M,), tl.float32)
    else:
        acc, sumsq = gemm_tile(x_ptr, norm_ptr, w_ptr, offs_m, mask_m, rows, cols < I,
                               K, BLOCK_M, 2 * BLOCK_N, BLOCK_K, SUMS, UPCAST_DOT, SPLIT_K)
    last = True
    if SPLIT_K > 1:
        acc, sumsq, last = split_k_sum(acc, sumsq, part_ptr, count_ptr, mask_m, BLOCK_M, 2 * BLOCK_N, SPLIT_K,
                                       SUMS)
    if last:
        if SUMS:
            acc = acc * tl.rsqrt(sumsq / K + eps)[:, None]
        elif not FP8:
            acc = acc * tl.load(x_scale_ptr + offs_m, mask=mask_m, other=0.0)[:, None]
        gate, up = split_halves(acc, BLOCK_M, BLOCK_N)
        y = (_gate(gate, GELU_TANH) * up).to(out_ptr.dtype.element_ty)
        mask = mask_m[:, None] & (offs_n < I)[None, :]
        tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * I + offs_n[None, :], y, mask=mask)
        if q_ptr is not None:
            fp8.store_handoff(y, offs_m, offs_m.to(tl.int64)[:, None] * I + offs_n[None, :], mask,
                              mask_m & (tl.program_id(1) == 0), q_ptr, q_scale_ptr, q_static_ptr, ROUND_E4M3)


@triton.jit
def tma_norm_swiglu_kernel(x_ptr, scale_ptr, w_ptr, w_scale_ptr, out_ptr, T,
                           I: tl.constexpr, K: tl.constexpr, GU_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                           UPCAST_DOT: tl.constexpr, GELU_TANH: tl.constexpr):
    """BLOCK_N output columns per tile from 2 * BLOCK_N contiguous rows of the interleaved W_gu;
    scale_ptr holds the row scales of x's T rows. W8A8 with w_scale_ptr: x holds the quantize
    pre-pass's e4m3 rows (RMSNorm'd) and scale_ptr their scales."""
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[T, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[2 * I, K], strides=[K, 1], block_shape=[2 * BLOCK_N, BLOCK_K])
    out_desc = tl.make_tensor_descriptor(out_ptr, shape=[T, I], strides=[I, 1], block_shape=[BLOCK_M, BLOCK_N])
    PAIRS: tl.constexpr = BLOCK_N // GU_BLOCK
    tiles_m = tl.cdiv(T, BLOCK_M)
    tiles_n: tl.constexpr = triton.cdiv(I, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, tl.num_programs(0), flatten=True):
        pid_m, pid_n = tma.tile_coords(tile, tiles_m, tiles_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        acc = tma.tma_dot(x_desc, w_desc, off_m, pid_n * 2 * BLOCK_N, K, BLOCK_M, 2 * BLOCK_N, BLOCK_K, UPCAST_DOT)
        acc = tma.scale_tile(acc, scale_ptr, w_scale_ptr, off_m + tl.arange(0, BLOCK_M),
                             pid_n * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N), T, 2 * I)
        # Columns [g0 u0 g1 u1 ...] in blocks of GU_BLOCK: (pair, gate/up, column) -> gate, up.
        pairs = tl.permute(tl.reshape(acc, (BLOCK_M, PAIRS, 2, GU_BLOCK)), (0, 1, 3, 2))
        gate, up = tl.split(pairs)
        gate = tl.reshape(gate, (BLOCK_M, BLOCK_N))
        up = tl.reshape(up, (BLOCK_M, BLOCK_N))
        out_desc.store([off_m, pid_n * BLOCK_N], (_gate(gate, GELU_TANH) * up).to(out_ptr.dtype.element_ty))


def uses_tma(tile, shapes: dict, dtype: str) -> bool:
    """Whether a bucket runs the TMA kernel on sm_90+: with the norm weight folded, and tiles
    that hold whole gate/up block pairs."""
    return (tile.tma and not shapes.get("norm_weight", False) and shapes["block"] > 0
            and tma.tile_shape(dtype)[1] // 2 % shapes["block"] == 0)


def tma_aot(dtype: str, shapes: dict, tile) -> AotKernel:
    """The TMA kernel of a bucket; FP8: e4m3 operands, x from the quantize pre-pass."""
    fp8_weight = shapes.get("fp8", False)
    bm, bn, bk = tma.tile_shape(dtype, fp8_weight, tile.block_m)
    warps, stages = tma.LAUNCH[bm]
    ptr = POINTER_TYPES[dtype]
    operand = fp8.FP8_POINTER if fp8_weight else ptr
    signature = {"x_ptr": operand, "scale_ptr": "*fp32", "w_ptr": operand,
                 "w_scale_ptr": "*fp32" if fp8_weight else "constexpr", "out_ptr": ptr, "T": "i32", "I": "constexpr",
                 "K": "constexpr", "GU_BLOCK": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
                 "BLOCK_K": "constexpr", "GROUP_M": "constexpr", "UPCAST_DOT": "constexpr", "GELU_TANH": "constexpr"}
    constexprs = {"I": shapes["I"], "K": shapes["K"], "GU_BLOCK": shapes["block"], "BLOCK_M": bm, "BLOCK_N": bn // 2,
                  "BLOCK_K": bk, "GROUP_M": tma.GROUP_M, "UPCAST_DOT": False,
                  "GELU_TANH": GELU_TANH[shapes.get("activation", "silu")]}
    meta = tma.tma_meta(tile.name, tile.max_rows, triton.cdiv(shapes["I"], bn // 2), bm)
    if fp8_weight:
        meta["fp8"] = True
    return AotKernel(tma_norm_swiglu_kernel, signature, absent_as_none(signature, constexprs), num_warps=warps,
                     num_stages=stages, aligned=pointer_params(signature), targets=tma.TMA_TARGETS, meta=meta)


def hands_off(tile, shapes: dict) -> bool:
    """Whether a bucket's kernel also writes its output in e4m3 for the next op's GEMM (`linear.fp8`'s
    handoff): with a static scale to divide by ("out_scale"), in the pointer buckets of at most
    HANDOFF_ROWS' largest row count, which together serve all of HANDOFF_ROWS."""
    return (shapes.get("fp8", False) and shapes.get("out_scale", False) and tile.max_rows is not None
            and tile.max_rows <= fp8.HANDOFF_ROWS[1])


def run(inputs: list, attrs: dict, out: torch.Tensor) -> None:
    """inputs: x [T, K], norm_weight [K] or None (folded), w_gu [2I, K], then w_gu_scale [2I]
    (FP8) and w_gu_input_scale (a static activation scale) when given; attrs eps, block, activation."""
    x, norm_weight, w_gu, w_scale, x_static = (*inputs, None, None)[:5]
    x, w_gu = x.contiguous(), w_gu.contiguous()
    t, k = x.shape
    inter = w_gu.shape[0] // 2
    tile = pick_tile(t, tiles=swiglu_tiles(2 * inter, w_scale is not None))
    bk = block_k(tile, w_gu.element_size())
    # Half of the tile's weight rows are gate rows, half up rows.
    bn = tile.block_n // 2
    split, columns = split_k(tile, k, bk), triton.cdiv(inter, bn)
    part, count = split_buffers(t, tile.block_m, 2 * bn, columns, split, x.device)
    xa, x_scale = gemm_input(x, w_scale, norm_weight, True, attrs["eps"], prescaled(tile, w_scale is not None),
                             x_static)
    norm_swiglu_kernel[(triton.cdiv(t, tile.block_m), columns, split)](
        xa, x_scale, None if w_scale is not None else norm_weight, w_gu, w_scale, out, None, None, None, part, count,
        t, attrs["eps"],
        I=inter, K=k, GU_BLOCK=attrs["block"] or inter, BLOCK_M=tile.block_m, BLOCK_N=bn, BLOCK_K=bk,
        UPCAST_DOT=upcast_dot(x, w_scale is not None), SPLIT_K=split, GELU_TANH=GELU_TANH[attrs["activation"]],
        ROUND_E4M3=None,
        num_warps=tile.num_warps,
        num_stages=num_stages(tile.block_m, tile.block_n, bk, w_gu.element_size(), tile.stages, xa.element_size()))


def aot_kernels(dtype: str, shapes: dict) -> list[AotKernel | NvccKernel]:
    """shapes: {"K": hidden size, "I": intermediate size (this rank's), "block": gate/up
    interleave block (0: not interleaved), "norm_weight": bool (default False: folded),
    "activation": "silu" (default) or "gelu_tanh", "fp8": bool, "fp8_static": bool (both default
    False)}. One kernel per shape bucket; eps is a runtime argument. FP8: pointer kernels for
    fp8.FP8_TARGETS in every bucket, and the quantize pre-pass (RMSNorm included; with fp8_static
    the one that takes a static activation scale) whose rows they read."""
    ptr, size = POINTER_TYPES[dtype], element_bytes(dtype)
    k, inter, norm = shapes["K"], shapes["I"], shapes.get("norm_weight", False)
    fp8_weight = shapes.get("fp8", False)
    kernels: list[AotKernel | NvccKernel] = gemv.swiglu_kernels(dtype, shapes)
    tiles = swiglu_tiles(2 * inter, fp8_weight)
    if shapes.get("out_scale") and not any(t.max_rows == fp8.HANDOFF_ROWS[1] for t in tiles):
        raise ValueError(f"norm_swiglu's buckets {[t.max_rows for t in tiles]} do not end one at "
                         f"{fp8.HANDOFF_ROWS[1]} rows, where the FP8 handoff to the next GEMM stops")
    for tile in tiles:
        bk, bn = block_k(tile, 1 if fp8_weight else size), tile.block_n // 2
        split = split_k(tile, k, bk)
        x_ptr, w_ptr, w_scale, norm_ptr = ptr, ptr, "constexpr", ptr if norm else "constexpr"
        x_scale = "*fp32" if prescaled(tile, fp8_weight) else "constexpr"
        if fp8_weight:   # the pre-pass applies the norm weight
            x_ptr, x_scale, norm_ptr, w_ptr, w_scale = fp8.FP8_POINTER, "*fp32", "constexpr", fp8.FP8_POINTER, "*fp32"
        handoff = hands_off(tile, shapes)
        q = ("constexpr",) * 3 if not handoff else (fp8.FP8_POINTER, "*fp32", "*fp32")
        signature = {"x_ptr": x_ptr, "x_scale_ptr": x_scale, "norm_ptr": norm_ptr, "w_ptr": w_ptr,
                     "w_scale_ptr": w_scale, "out_ptr": ptr, **dict(zip(("q_ptr", "q_scale_ptr", "q_static_ptr"), q)),
                     **split_signature(split), "T": "i32", "eps": "fp32",
                     "I": "constexpr", "K": "constexpr", "GU_BLOCK": "constexpr", "BLOCK_M": "constexpr",
                     "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "UPCAST_DOT": "constexpr",
                     "SPLIT_K": "constexpr", "GELU_TANH": "constexpr", "ROUND_E4M3": "constexpr"}
        constexprs = {"I": inter, "K": k, "GU_BLOCK": shapes["block"] or inter, "BLOCK_M": tile.block_m,
                      "BLOCK_N": bn, "BLOCK_K": bk, "UPCAST_DOT": False, "SPLIT_K": split,
                      "GELU_TANH": GELU_TANH[shapes.get("activation", "silu")]}
        meta = launch_meta(tile, triton.cdiv(inter, bn), split, 2 * bn)
        if prescaled(tile, fp8_weight):
            meta["row_scale_input"] = True
        targets = tma.POINTER_TARGETS if uses_tma(tile, shapes, dtype) else None
        if fp8_weight:
            meta["fp8"] = True
            targets = fp8.POINTER_ONLY if uses_tma(tile, shapes, dtype) else fp8.FP8_TARGETS
        if handoff:
            meta.update(handoff=True, scratch={**meta["scratch"], **fp8.handoff_scratch(inter)})
        # A handoff's e4m3 cast rounds as the pre-pass's does on each target (`linear.fp8.TARGET_GROUPS`).
        groups = [(tuple(t for t in g if t in targets), {"ROUND_E4M3": r}) for g, r in fp8.TARGET_GROUPS] if handoff \
            else [(targets, {})]
        for group, rounding in [(g, r) for g, r in groups if g != ()]:
            kernel = AotKernel(norm_swiglu_kernel, signature, absent_as_none(signature, {**constexprs, **rounding}),
                               num_warps=tile.num_warps, aligned=pointer_params(signature), meta=meta, targets=group)
            kernels += pipelined(kernel, tile.block_m, tile.block_n, bk, 1 if fp8_weight else size, tile.stages)
        if uses_tma(tile, shapes, dtype):
            kernels.append(tma_aot(dtype, shapes, tile))
    if fp8_weight:
        kernels += fp8.quantize_aot(dtype, k, norm=True, norm_weight=norm, static=shapes.get("fp8_static", False))
    else:   # for the TMA buckets and the pointer ones that read its scales (`prescaled`)
        kernels.append(tma.row_scale_aot(dtype, k))
    return kernels
