"""Triton kernels for `linear`: y = x W^T (+ bias) (+ residual), and the GEMM core that the
fused plugins (linear_residual, norm_swiglu, norm_qkv_rope) share.

Layout: x [T, K], W [N, K] and the output [T, N] are row-major and contiguous. N and K are
constexprs (an engine knows its weight shapes when it is built), T is the only runtime size.
Each program computes one [BLOCK_M, BLOCK_N] output tile over the whole K loop, with fp32
accumulation. The grid is (cdiv(T, BLOCK_M), cdiv(N, BLOCK_N)) with the row blocks varying
fastest, so the programs that share a weight tile run together: with T <= BLOCK_M (the
decode tiles) every weight tile is streamed from memory exactly once, and for prefill the
neighbours of a weight tile find it in L2. `linear.tiles` holds the shape buckets (decode
T <= 16, small T <= 64, medium, prefill); `aot_kernels` gives one kernel per bucket, its meta
naming the rows it serves and the grid.

`all_reduce` is not the kernel's business: a kernel computes one rank's partial product and
the runtime sums the partials across ranks afterwards. The reference adds the bias (and, for
linear_residual, the residual) once, after the sum, so on more than one rank the runtime
passes bias and residual to one rank's kernel only and None to the others.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kiln import dtypes
from kiln.plugins.aot import POINTER_TYPES, AotKernel, absent_as_none, pointer_params
from kiln.plugins.linear import cute_gemm, fp8, gemv
from kiln.plugins.linear.tiles import Tile, block_k, num_stages, pick_tile, pipelined, split_k, tiles_for
from kiln.plugins.linear.tma import POINTER_TARGETS, row_scales, tma_linear_aot
from kiln.plugins.nvcc import NvccKernel

# The builder refuses FP8 plans for GPU targets not named here (`builder.kernels`).
FP8_TARGETS = fp8.FP8_TARGETS

def split_workspace(rows: int, block_m: int, width: int, column_tiles: int, split: int) -> dict[str, int]:
    """Scratch bytes a split-K launch over `rows` rows needs (none unsplit) with [block_m, width]
    accumulator tiles: each program's partial tile and row sums, and one arrival count per
    output tile, which starts at zero and is left at zero by the tile's last program."""
    if split == 1:
        return {}
    tiles = -(-rows // block_m) * column_tiles
    return {"gemm_split_part": tiles * split * (block_m * width + block_m) * 4, "gemm_split_count": tiles * 4}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def upcast_dot(x: torch.Tensor, fp8_weight: bool = False) -> bool:
    """Triton's interpreter multiplies bf16 tiles as their raw uint16 bits (triton-lang/triton
    #11584), so there the tiles go to fp32 before tl.dot. The result is the same: a product
    of two bf16 values is exact in fp32 and the sums are fp32 either way. FP8 kernels always
    do so in the interpreter, which also rounds to e4m3 wrongly (see `linear.fp8`)."""
    return interpreting() and (fp8_weight or x.dtype == torch.bfloat16)


def split_signature(split: int) -> dict[str, str]:
    """The split-K workspace parameters: pointers when split, else constexpr None."""
    kind = "*fp32" if split > 1 else "constexpr"
    return {"part_ptr": kind, "count_ptr": "*i32" if split > 1 else kind}


def launch_meta(tile: Tile, column_tiles: int, split: int, width: int | None = None) -> dict:
    """What a launcher that only knows T needs: the bucket's row range, the grid as expressions
    in T, (row blocks, column tiles, K parts) with the row blocks varying fastest, and the
    split-K workspace it must pass (sized for the bucket's largest T; `width`: accumulator
    columns per tile, tile.block_n unless the kernel says otherwise)."""
    workspace = split_workspace(tile.max_rows or 0, tile.block_m, width or tile.block_n, column_tiles, split)
    return {"bucket": tile.name, "max_rows": tile.max_rows, "pointer_alignment": 16, "split_k": split,
            "scratch": workspace, "grid": (f"cdiv(T, {tile.block_m})", str(column_tiles), str(split))}


@triton.jit
def gemm_tile(x_ptr, norm_ptr, w_ptr, offs_m, mask_m, rows, mask_n,
              K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              ROW_SCALE: tl.constexpr, UPCAST_DOT: tl.constexpr, SPLIT_K: tl.constexpr):
    """x[offs_m] (times norm_ptr's weights when given) against the weight rows `rows`: returns
    (acc [BLOCK_M, BLOCK_N] in fp32, the sum of x^2 per row when ROW_SCALE). With SPLIT_K > 1
    only over part program_id(2) of K's SPLIT_K equal parts (K % (SPLIT_K * BLOCK_K) == 0):
    `split_k_sum` then adds the parts.

    The fused kernels gather the two row sets they pair (gate and up, a head's two halves)
    into one tile and split the accumulator afterwards, rather than run two dots on one x
    tile: one wider MMA, and on sm_90 Triton 3.6 got the second of two such dots wrong."""
    K_PART: tl.constexpr = K // SPLIT_K
    k_lo = 0
    if SPLIT_K > 1:
        k_lo = tl.program_id(2) * K_PART
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * K + k_lo + offs_k[None, :]
    w_ptrs = w_ptr + rows.to(tl.int64)[None, :] * K + k_lo + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    sumsq = tl.zeros((BLOCK_M,), tl.float32)
    # The row sum reads x through loads of its own, one iteration ahead so their latency
    # hides behind a step of the GEMM (the cache modifier keeps them apart from the dot's
    # loads): on sm_90, Triton 3.6 races when one pipelined tile feeds both the wgmma and
    # register arithmetic (wrong results at BLOCK_M = 128 on an H200).
    if ROW_SCALE:
        x_sq = tl.load(x_ptrs, mask=mask_m[:, None] & (offs_k < K_PART)[None, :], other=0.0,
                       cache_modifier=".cg")
    for k0 in range(0, K_PART, BLOCK_K):
        mask_k = offs_k < K_PART - k0
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if ROW_SCALE:
            x_next = tl.load(x_ptrs + BLOCK_K, mask=mask_m[:, None] & (offs_k < K_PART - k0 - BLOCK_K)[None, :],
                             other=0.0, cache_modifier=".cg")
            xf = x_sq.to(tl.float32)
            sumsq += tl.sum(xf * xf, axis=1)
            x_sq = x_next
        if norm_ptr is not None:
            # Unfolded RMSNorm weight: the reference multiplies the normalised x by it, and
            # scaling columns commutes with the row scale applied after the loop.
            g = tl.load(norm_ptr + k_lo + k0 + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            x = (x.to(tl.float32) * g[None, :]).to(x_ptr.dtype.element_ty)
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if UPCAST_DOT:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        # "ieee" only affects fp32 tiles: fp32 engines exist for exact parity, so no TF32.
        acc = tl.dot(x, w, acc, input_precision="ieee")
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc, sumsq


@triton.jit
def fp8_gemm_tile(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, offs_m, mask_m, rows, mask_n, K: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST_DOT: tl.constexpr,
                  SPLIT_K: tl.constexpr):
    """`gemm_tile` in e4m3 (`linear.fp8`): the quantize pre-pass's rows offs_m of x (their scales
    at x_scale_ptr) against the weight rows `rows`, the [BLOCK_M, BLOCK_N] float32 tile returned
    already scaled by x_scale[row] * w_scale[col]."""
    acc, _ = gemm_tile(x_ptr, None, w_ptr, offs_m, mask_m, rows, mask_n, K, BLOCK_M, BLOCK_N, BLOCK_K, False,
                       UPCAST_DOT, SPLIT_K)
    x_scale = tl.load(x_scale_ptr + offs_m, mask=mask_m, other=0.0)
    w_scale = tl.load(w_scale_ptr + rows, mask=mask_n, other=0.0)
    return acc * x_scale[:, None] * w_scale[None, :]


@triton.jit
def split_k_sum(acc, sumsq, part_ptr, count_ptr, mask_m, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                SPLIT_K: tl.constexpr, ROW_SCALE: tl.constexpr):
    """Adds the SPLIT_K partial results of this program's output tile (grid axis 2): each
    program stores its part, and the last to arrive (an atomic count per tile) reads them all
    back. Returns (acc, sumsq, last); only where `last` holds do they hold the sums, and only
    that program may write the tile. The count is reset for the next launch, so the workspace
    needs zeroing once, when it is allocated."""
    PART: tl.constexpr = BLOCK_M * BLOCK_N + BLOCK_M
    tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    local = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    sums = BLOCK_M * BLOCK_N + tl.arange(0, BLOCK_M)
    mine = part_ptr + (tile * SPLIT_K + tl.program_id(2)) * PART
    tl.store(mine + local, acc, mask=mask_m[:, None])
    if ROW_SCALE:
        tl.store(mine + sums, sumsq, mask=mask_m)
    # Every thread's stores come before the count that publishes them (the atomic is
    # acquire-release at GPU scope; the barrier orders the block's threads before it).
    tl.debug_barrier()
    last = tl.atomic_add(count_ptr + tile, 1) == SPLIT_K - 1
    if last:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        sumsq = tl.zeros((BLOCK_M,), tl.float32)
        # Unrolled, so that the parts' loads are in flight together: a decode step's narrow GEMMs
        # are a few microseconds long, and each serial L2 round trip here shows.
        for s in tl.static_range(SPLIT_K):
            part = part_ptr + (tile * SPLIT_K + s) * PART
            # .cg: read from L2, where the other programs' stores are, never a stale L1 line.
            acc += tl.load(part + local, mask=mask_m[:, None], other=0.0, cache_modifier=".cg")
            if ROW_SCALE:
                sumsq += tl.load(part + sums, mask=mask_m, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(count_ptr + tile, 0)
    return acc, sumsq, last


@triton.jit
def split_halves(acc, BLOCK_M: tl.constexpr, HALF: tl.constexpr):
    """[BLOCK_M, 2 * HALF] -> (its first HALF columns, its last HALF columns)."""
    return tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF)), (0, 2, 1)))


@triton.jit
def linear_kernel(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, residual_ptr, out_ptr, part_ptr, count_ptr, T,
                  N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, UPCAST_DOT: tl.constexpr, SPLIT_K: tl.constexpr):
    """w_scale_ptr given: W8A8 (`fp8_gemm_tile`: x holds the quantize pre-pass's e4m3
    rows, x_scale_ptr their scales); None: x and W in the activation dtype."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < T
    mask_n = offs_n < N
    out_offs = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    # The epilogue's operands load before the K loop, where their latency hides: after it they
    # would be one more DRAM round trip at the end of kernels that last a few microseconds.
    if bias_ptr is not None:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0)
    if residual_ptr is not None:
        residual = tl.load(residual_ptr + out_offs, mask=mask, other=0.0)
    if w_scale_ptr is not None:
        acc = fp8_gemm_tile(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, offs_m, mask_m, offs_n, mask_n,
                            K, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST_DOT, SPLIT_K)
        sumsq = tl.zeros((BLOCK_M,), tl.float32)
    else:
        acc, sumsq = gemm_tile(x_ptr, None, w_ptr, offs_m, mask_m, offs_n, mask_n,
                               K, BLOCK_M, BLOCK_N, BLOCK_K, False, UPCAST_DOT, SPLIT_K)
    last = True
    if SPLIT_K > 1:
        acc, sumsq, last = split_k_sum(acc, sumsq, part_ptr, count_ptr, mask_m, BLOCK_M, BLOCK_N, SPLIT_K, False)
    if last:
        if bias_ptr is not None:
            acc += bias.to(tl.float32)[None, :]
        if residual_ptr is not None:
            acc += residual.to(tl.float32)
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def split_buffers(rows: int, block_m: int, width: int, column_tiles: int, split: int,
                  device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A JIT launch's own split-K workspace (partials, zeroed counts), or (None, None) unsplit."""
    sizes = split_workspace(rows, block_m, width, column_tiles, split)
    if not sizes:
        return None, None
    return (torch.empty(sizes["gemm_split_part"] // 4, dtype=torch.float32, device=device),
            torch.zeros(sizes["gemm_split_count"] // 4, dtype=torch.int32, device=device))


def quantize_rows(x: torch.Tensor, norm_weight: torch.Tensor | None, norm: bool, eps: float,
                  static: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantize pre-pass through Triton's JIT: x's GEMM input rows in e4m3 and their scales
    (each row's own, or the static per-tensor `static` [1] for every row)."""
    t, k = x.shape
    xq = torch.empty(t, k, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(t, dtype=torch.float32, device=x.device)
    fp8.quantize_rows_kernel[(t,)](x, norm_weight, xq, scales, static, t, eps, K=k, BLOCK_K=fp8.quantize_block_k(k),
                                   NORM=norm, EMULATE=interpreting(), ROUND_E4M3=interpreting(),
                                   num_warps=fp8.quantize_warps(k))
    return xq, scales


def gemm_input(x: torch.Tensor, w_scale: torch.Tensor | None, norm_weight: torch.Tensor | None = None,
               norm: bool = False, eps: float = 0.0, with_row_scales: bool = False,
               x_static: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x operand, x scales) of a JIT launch: for FP8 weights the quantize pre-pass's e4m3 rows and
    their scales (x_static: the static activation scale, if any); else x, and with `with_row_scales`
    the row-scale pre-pass's RMSNorm scales (a fused norm GEMM's bucket that reads them,
    `tiles.prescaled`)."""
    if w_scale is not None:
        return quantize_rows(x, norm_weight, norm, eps, x_static)
    return x, row_scales(x, eps) if with_row_scales else None


def launch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  residual: torch.Tensor | None, out: torch.Tensor, w_scale: torch.Tensor | None = None,
                  x_static: torch.Tensor | None = None) -> None:
    """out = x weight^T (+ bias) (+ residual), through Triton's JIT launch; W8A8 with w_scale (and
    the static activation scale x_static, if any)."""
    t, k = x.shape
    n = weight.shape[0]
    tile = pick_tile(t, n)
    x, weight = x.contiguous(), weight.contiguous()
    bk = block_k(tile, weight.element_size())
    split, columns = split_k(tile, k, bk), triton.cdiv(n, tile.block_n)
    part, count = split_buffers(t, tile.block_m, tile.block_n, columns, split, x.device)
    xa, x_scale = gemm_input(x, w_scale, x_static=x_static)
    linear_kernel[(triton.cdiv(t, tile.block_m), columns, split)](
        xa, x_scale, weight, w_scale, bias, None if residual is None else residual.contiguous(), out, part, count,
        t, N=n, K=k, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=bk,
        UPCAST_DOT=upcast_dot(x, w_scale is not None), SPLIT_K=split, num_warps=tile.num_warps,
        num_stages=num_stages(tile.block_m, tile.block_n, bk, weight.element_size(), tile.stages, xa.element_size()))


def linear_aot_kernels(dtype: str, n: int, k: int, bias: bool, residual: bool, fp8_weight: bool = False,
                       fp8_static: bool = False, staged_targets: tuple[str, ...] = ()) -> list[AotKernel | NvccKernel]:
    """The CUDA GEMVs for one and two rows where they serve the shape (`linear.gemv`), then one
    linear_kernel per shape bucket of TILES, and for the TMA buckets the persistent TMA GEMM for
    sm_90 and later beside it (the pointer kernel then serves sm_80 and sm_89); ahead of the
    "large" bucket's pointer kernel the CuTe GEMM for sm_90 where it serves (`linear.cute_gemm`). FP8
    (`fp8_weight`): kernels for fp8.FP8_TARGETS only, the TMA buckets' e4m3 TMA GEMM beside
    sm_89's pointer kernel, and the quantize pre-pass whose rows they all read (`fp8_static`: the one
    that takes a static activation scale; `staged_targets`: where x's producer stages x at one row,
    `linear.gemv.linear_kernels`)."""
    ptr, size = POINTER_TYPES[dtype], dtypes.element_bytes(dtype)
    kernels: list[AotKernel | NvccKernel] = gemv.linear_kernels(dtype, n, k, fp8_weight, fp8_static,
                                                                          staged_targets)
    for tile in tiles_for(n):
        kernels += cute_gemm.linear_kernels(dtype, n, k, tile, fp8_weight)
        bk = block_k(tile, 1 if fp8_weight else size)
        split = split_k(tile, k, bk)
        x_ptr, x_scale, w_ptr, w_scale = ptr, "constexpr", ptr, "constexpr"
        if fp8_weight:
            x_ptr, x_scale, w_ptr, w_scale = fp8.FP8_POINTER, "*fp32", fp8.FP8_POINTER, "*fp32"
        signature = {"x_ptr": x_ptr, "x_scale_ptr": x_scale, "w_ptr": w_ptr, "w_scale_ptr": w_scale,
                     "bias_ptr": ptr, "residual_ptr": ptr, "out_ptr": ptr,
                     **split_signature(split), "T": "i32", "N": "constexpr", "K": "constexpr",
                     "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
                     "UPCAST_DOT": "constexpr", "SPLIT_K": "constexpr"}
        constexprs = {"N": n, "K": k, "BLOCK_M": tile.block_m, "BLOCK_N": tile.block_n, "BLOCK_K": bk,
                      "UPCAST_DOT": False, "SPLIT_K": split}
        for name, present in (("bias_ptr", bias), ("residual_ptr", residual)):
            if not present:
                signature[name] = "constexpr"
        meta = launch_meta(tile, triton.cdiv(n, tile.block_n), split)
        targets = POINTER_TARGETS if tile.tma else None
        if fp8_weight:
            meta["fp8"] = True
            targets = fp8.POINTER_ONLY if tile.tma else fp8.FP8_TARGETS
        kernel = AotKernel(linear_kernel, signature, absent_as_none(signature, constexprs), num_warps=tile.num_warps,
                           aligned=pointer_params(signature), meta=meta, targets=targets)
        kernels += pipelined(kernel, tile.block_m, tile.block_n, bk, 1 if fp8_weight else size, tile.stages)
        if tile.tma:
            kernels.append(tma_linear_aot(dtype, n, k, bias, residual, tile.name, tile.max_rows, fp8_weight,
                                          tile.block_m))
    if fp8_weight:
        kernels += fp8.quantize_aot(dtype, k, norm=False, norm_weight=False, static=fp8_static)
    return kernels


def run(inputs: list, attrs: dict, out: torch.Tensor) -> None:
    """inputs: x [T, K], weight [N, K], bias [N] or None, then weight_scale [N] (FP8) and
    weight_input_scale (a static activation scale) when given. `all_reduce` is left to the caller
    (see the module docstring); `parallel` and `heads` only matter to the shard pass."""
    x, weight, bias, w_scale, x_static = (*inputs, None, None)[:5]
    launch_linear(x, weight, bias, None, out, w_scale, x_static)


def aot_kernels(dtype: str, shapes: dict) -> list[AotKernel | NvccKernel]:
    """shapes: {"K": in features, "N": out features, "bias": bool (default False), "fp8": bool
    (default False: weights in the activation dtype), "fp8_static": bool (a static activation
    scale; default False)}."""
    return linear_aot_kernels(dtype, shapes["N"], shapes["K"], shapes.get("bias", False), residual=False,
                              fp8_weight=shapes.get("fp8", False), fp8_static=shapes.get("fp8_static", False))
