"""The Hopper GEMM core for prefill chunks and large batches: TMA loads into shared memory,
wgmma, and a persistent grid.

`linear.kernels` streams weights with pointer loads, which is what decode wants (few rows,
split-K, any gathered row set). At hundreds of rows and more the work is compute-bound, and
on sm_90 the tensor cores are only kept fed when the tiles arrive by TMA (the copy engine
writes shared memory without registers or address arithmetic) in tiles of 128x256. Each
program is persistent: it walks output tiles `tile, tile + programs, ...` in a grouped order
(GROUP_M row tiles take each weight tile in turn while it is in L2), so a launch is one wave
with no tail of short programs. Measured on an H200 with scripts/tune_prefill_gemm.py
(2026-11-30, Llama-3-8B's projections, weights cycled beyond the L2): 0.93-1.01x cuBLAS at
1,024 to 8,192 rows, against 0.63-0.80x for the pointer-load tiles.

The tensor descriptors are made on the device from the kernel's pointer arguments and T, so
a cubin takes plain pointers like every other kernel; Triton keeps them in a global scratch
buffer of `Cubin.global_scratch` bytes per program, which the CUDA executor allocates for
`SMS` programs. TMA needs 16-byte aligned bases and row strides, which the arena and the
hidden sizes give.

The fused plugins share this core (`tma_dot`, `tile_coords`) and, since a TMA tile goes to
the tensor cores without passing through registers, take the RMSNorm row scale from
`row_scale_kernel`'s pre-pass (one read of x, under 3% of the GEMM at 1,024 rows) instead of
summing x^2 inside the K loop as the decode kernels do.

FP8 engines run the same kernels with e4m3 operands (K tiles of 128 elements, the same bytes),
x quantized before the load by `linear.fp8`'s pre-pass rather than in registers: a TMA tile goes
from memory to shared memory to the tensor cores, and quantizing in the kernel would mean a trip
through registers and back to shared memory for every x tile of every output tile, where the
pre-pass reads x once and halves the bytes the GEMM loads. `scale_tile` applies the scales.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.plugins.aot import POINTER_TYPES, AotKernel, absent_as_none, pointer_params

# sm_80 and sm_89 have no TMA: there the buckets keep the pointer-load (mma.sync) tiles.
TMA_TARGETS = ("sm_90", "sm_100")
POINTER_TARGETS = ("sm_80", "sm_89")
# 128x256 tiles, 64-wide K tiles, 8 warps, a 3-deep pipeline, groups of 8 row tiles: the
# sweep's best at every shape from 1,024 rows on. fp32 engines (exact parity, FMA dots) take
# 32-wide K tiles and 128 weight rows, so that the pipeline and the output tile fit in shared
# memory.
BLOCK_M, GROUP_M = 128, 8
ROW_SCALE_WARPS = 8
# (num_warps, num_stages) by row tile. 64-row tiles serve the wide weights' buckets where 128-row tiles
# would pad T by most of a tile (`tiles.WIDE_TILES`): on an H200 (scripts/tune_prefill_gemm.py,
# 2026-12-01, gate/up 28672x4096, weights cycled beyond the L2) 64x256 tiles with 4 warps and 4
# stages took 89.5 us at 130 rows, 89.7 at 160 and 90.3 at 192, against 120.0, 103.1 and
# 95.8 for 128x256 tiles; at 256 rows the 128-row tiles won (100.2 us).
LAUNCH = {128: (8, 3), 64: (4, 4)}


def tile_shape(dtype: str, fp8: bool = False, block_m: int = BLOCK_M) -> tuple[int, int, int]:
    """(block_m, block_n, block_k) of the TMA GEMM for an engine dtype; e4m3 operands (`fp8`)
    take K tiles of 128 elements, the same 128 bytes per row as bf16's 64. A float32 engine's
    FP8 tiles keep 128 weight rows: its float32 epilogue with a residual took 278,552 bytes of
    shared memory at 256 (sm_90 has 232,448), and the H200 refused to load it."""
    if fp8:
        return block_m, 256 if dtype != "float32" else 128, 128
    return (block_m, 256, 64) if dtype != "float32" else (block_m, 128, 32)


@triton.jit
def tile_coords(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """Row tile and column tile of output tile `tile`, in groups of GROUP_M row tiles that
    take the column tiles in turn (the programs working at once share weight tiles)."""
    per_group = GROUP_M * tiles_n
    first_m = (tile // per_group) * GROUP_M
    rows_in_group = min(tiles_m - first_m, GROUP_M)
    return first_m + tile % rows_in_group, (tile % per_group) // rows_in_group


@triton.jit
def tma_dot(x_desc, w_desc, off_m, off_n, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """x[off_m:, :] W[off_n:, :]^T over the whole K, as a [BLOCK_M, BLOCK_N] fp32 tile."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, K, BLOCK_K):
        x = x_desc.load([off_m, k])
        w = w_desc.load([off_n, k])
        if UPCAST_DOT:  # see linear.kernels.upcast_dot
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, w.T, acc, input_precision="ieee")
    return acc


@triton.jit
def scale_tile(acc, row_scale_ptr, col_scale_ptr, offs_m, offs_n, T, N):
    """acc [BLOCK_M, BLOCK_N] times the row scales of its rows (when given) and the column
    scales of its columns (the FP8 GEMMs: x's per-token and W's per-feature scales)."""
    if row_scale_ptr is not None:
        acc = acc * tl.load(row_scale_ptr + offs_m, mask=offs_m < T, other=0.0)[:, None]
    if col_scale_ptr is not None:
        acc = acc * tl.load(col_scale_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
    return acc


@triton.jit
def tma_linear_kernel(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, residual_ptr, out_ptr, T,
                      N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """out = x W^T (+ bias) (+ residual) for x [T, K], W [N, K], out [T, N]; W8A8 with
    w_scale_ptr, x then holding the quantize pre-pass's e4m3 rows and x_scale_ptr their scales.
    The epilogue works on the two column halves of the tile in turn: with a residual, the whole
    tile's layout conversions would not fit in shared memory beside the pipeline's buffers."""
    HALF: tl.constexpr = BLOCK_N // 2
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[T, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    out_desc = tl.make_tensor_descriptor(out_ptr, shape=[T, N], strides=[N, 1], block_shape=[BLOCK_M, HALF])
    tiles_m = tl.cdiv(T, BLOCK_M)
    tiles_n: tl.constexpr = triton.cdiv(N, BLOCK_N)
    # flatten: the epilogue of one tile overlaps the loads of the next (2-6% in the sweep).
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, tl.num_programs(0), flatten=True):
        pid_m, pid_n = tile_coords(tile, tiles_m, tiles_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tma_dot(x_desc, w_desc, off_m, off_n, K, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST_DOT)
        acc = scale_tile(acc, x_scale_ptr, w_scale_ptr, off_m + tl.arange(0, BLOCK_M), off_n + tl.arange(0, BLOCK_N),
                         T, N)
        left, right = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF)), (0, 2, 1)))
        _linear_epilogue(left, bias_ptr, residual_ptr, out_desc, off_m, off_n, T, N, BLOCK_M, HALF)
        _linear_epilogue(right, bias_ptr, residual_ptr, out_desc, off_m, off_n + HALF, T, N, BLOCK_M, HALF)


@triton.jit
def _linear_epilogue(acc, bias_ptr, residual_ptr, out_desc, off_m, off_n, T, N: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_n = off_n + tl.arange(0, BLOCK_N)
    if bias_ptr is not None:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    if residual_ptr is not None:
        offs_m = off_m + tl.arange(0, BLOCK_M)
        acc += tl.load(residual_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :],
                       mask=(offs_m < T)[:, None] & (offs_n < N)[None, :], other=0.0).to(tl.float32)
    out_desc.store([off_m, off_n], acc.to(out_desc.dtype))


@triton.jit
def row_scale_kernel(x_ptr, scale_ptr, T, eps, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """scale[t] = rsqrt(mean(x[t]^2) + eps): the RMSNorm row scale, one program per row."""
    row = tl.program_id(0).to(tl.int64)
    squares = tl.zeros([BLOCK_K], tl.float32)
    for k in range(0, K, BLOCK_K):
        cols = k + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * K + cols, mask=cols < K, other=0.0).to(tl.float32)
        squares += x * x
    tl.store(scale_ptr + row, tl.rsqrt(tl.sum(squares, 0) / K + eps))


def tma_meta(bucket: str, max_rows: int | None, column_tiles: int, block_m: int = BLOCK_M) -> dict:
    """Launch meta of a persistent TMA kernel serving a GEMM bucket's rows: one program per SM
    at most, each walking the output tiles."""
    return {"bucket": bucket, "max_rows": max_rows, "pointer_alignment": 16, "split_k": 1, "tma": True,
            "grid": f"min(cdiv(T, {block_m}) * {column_tiles}, SMS)"}


def tma_linear_aot(dtype: str, n: int, k: int, bias: bool, residual: bool, bucket: str,
                   max_rows: int | None, fp8: bool = False, block_m: int = BLOCK_M) -> AotKernel:
    """The persistent TMA GEMM serving a bucket on TMA_TARGETS; `fp8`: e4m3 operands, x from
    the quantize pre-pass (meta "fp8": True)."""
    bm, bn, bk = tile_shape(dtype, fp8, block_m)
    warps, stages = LAUNCH[bm]
    ptr = POINTER_TYPES[dtype]
    operand, scale = ("*fp8e4nv", "*fp32") if fp8 else (ptr, "constexpr")
    signature = {"x_ptr": operand, "x_scale_ptr": scale, "w_ptr": operand, "w_scale_ptr": scale,
                 "bias_ptr": ptr if bias else "constexpr",
                 "residual_ptr": ptr if residual else "constexpr", "out_ptr": ptr, "T": "i32",
                 "N": "constexpr", "K": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
                 "BLOCK_K": "constexpr", "GROUP_M": "constexpr", "UPCAST_DOT": "constexpr"}
    constexprs = {"N": n, "K": k, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": GROUP_M,
                  "UPCAST_DOT": False}
    meta = tma_meta(bucket, max_rows, triton.cdiv(n, bn), bm)
    if fp8:
        meta["fp8"] = True
    return AotKernel(tma_linear_kernel, signature, absent_as_none(signature, constexprs), num_warps=warps,
                     num_stages=stages, aligned=pointer_params(signature), targets=TMA_TARGETS, meta=meta)


def row_scale_block(k: int) -> int:
    return min(triton.next_power_of_2(k), 4096)


def row_scale_aot(dtype: str, k: int) -> AotKernel:
    """The row-scale pre-pass of the fused norm GEMMs (meta "row_scale": no bucket), for every
    target: the TMA kernels and the pointer kernels of the `tiles.prescaled` buckets read it."""
    signature = {"x_ptr": POINTER_TYPES[dtype], "scale_ptr": "*fp32", "T": "i32", "eps": "fp32",
                 "K": "constexpr", "BLOCK_K": "constexpr"}
    return AotKernel(row_scale_kernel, signature, {"K": k, "BLOCK_K": row_scale_block(k)},
                     num_warps=ROW_SCALE_WARPS, num_stages=1, aligned=pointer_params(signature),
                     meta={"row_scale": True, "grid": "(T, 1, 1)", "pointer_alignment": 16})


def row_scales(x, eps: float):
    """The row-scale pre-pass through Triton's JIT: x's RMSNorm row scales, float32 [T]."""
    scales = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    row_scale_kernel[(x.shape[0],)](x, scales, x.shape[0], eps, K=x.shape[1], BLOCK_K=row_scale_block(x.shape[1]),
                                    num_warps=ROW_SCALE_WARPS)
    return scales
