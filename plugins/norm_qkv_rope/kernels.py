"""Triton kernel for `norm_qkv_rope`: RMSNorm + q/k/v projection + bias + per-head q/k RMSNorm
+ rotate-half RoPE, q to the output and k, v straight into their paged KV-cache slots.

The K loop multiplies x by W_qkv's rows and also sums x^2 per row, except in the buckets that
read the row-scale pre-pass's scales (`linear.tiles.prescaled`); the epilogue applies the row scale
rsqrt(mean(x^2) + eps) (a folded norm weight is inside W_qkv; an unfolded one multiplies the x
tiles as they are loaded). RoPE pairs column j of a head with column
j + D/2, so a program owns matching column chunks of both halves of one head: its weight
tile is the chunk's rows of the first half followed by those of the second, one dot gives
both, and the epilogue splits them and rotates elementwise. The per-head q/k norm needs the
whole head, so with q/k norm a program owns whole heads (HEAD_SPLIT = 1); without it a head
is split over HEAD_SPLIT programs, so that decode has enough programs to stream W_qkv with
the whole GPU. head_dim must be a power of two.

Program (m, h * HEAD_SPLIT + part) writes q head h when h < H, k head h - H when
h < H + KVH, else v head h - H - KVH. The KV cache is
[layers, 2, num_slots / block_size, block_size, KVH, D] and contiguous, so token t's k row
for head g of layer l starts at ((l * 2 + 0) * num_slots + slot_mapping[t]) * KVH * D + g * D.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.dtypes import element_bytes
from kiln.plugins.aot import FP8_POINTER, POINTER_TYPES, AotKernel, absent_as_none, pointer_params
from kiln.plugins.attention.cache_write import to_e4m3, v_offset
from kiln.plugins.attention.kernels import padded
from kiln.plugins.linear import cute_gemm, fp8, gemv, tma
from kiln.plugins.linear.kernels import (fp8_gemm_tile, gemm_input, gemm_tile, launch_meta, split_buffers,
                                         split_halves, split_k_sum, split_signature, upcast_dot)
from kiln.plugins.linear.tiles import (TILES, Tile, block_k, num_stages, pick_tile, pipelined, prescaled, split_k,
                                       with_bucket)
from kiln.plugins.nvcc import NvccKernel

# The builder refuses FP8 plans for GPU targets not named here (`builder.kernels`).
FP8_TARGETS = fp8.FP8_TARGETS

# The narrow-weight tiles, but for up to 64 rows 64 weight rows (half a Llama head) per program,
# 128-wide K tiles, K unsplit and a deep pipeline, with x's row scales from the row-scale
# pre-pass (`linear.tiles.prescaled`). Measured on an H200 with scripts/tune_gemm.py (session 16,
# Llama-3-8B's qkv, T = 64, weights cycled beyond the L2): 17.3 us with 6 stages (18.6 with 4,
# 22.0 with 3), plus 1.7 for the pre-pass; the best tile that sums x^2 in its K loop (64 rows,
# 64-wide K tiles split in 4, 3 stages) took 23.7.
# From 65 to 256 rows, 64x64 tiles unsplit (with the pre-pass's row scales: 32.3 us at T = 256).
_MEDIUM_QKV = {"block_m": 64, "block_n": 64, "num_warps": 4, "split_k": 1}
# The 64-row TMA tiles of the xlarge bucket up to 320 rows only: qkv's 24 tiles of 256 columns
# (Llama-3-8B) give 5 x 24 = 120 of them there, and at T = 448 168, two waves on 132 SMs (H200,
# session 29, e4m3: 28.4 us against 26.0 for 128-row tiles; at T = 320 17.6 against 25.9).
QKV_TILES = with_bucket(with_bucket(with_bucket(with_bucket(TILES, "small", block_n=64, block_k=128, stages=6,
                                                            split_k=1),
                                                "medium", **_MEDIUM_QKV), "large", **_MEDIUM_QKV),
                        "xlarge", max_rows=320)
# With e4m3 weights and rows (H200, 2026-11-30, `KILN_TUNE_FP8=1 scripts/tune_gemm.py`, Llama-3-8B's
# qkv, weights cycled beyond the L2): at T = 64 the unsplit 128-deep tile takes 10.8 us against
# 14.4 for QKV_TILES' (its split-K partials cost more than e4m3's halved weight bytes save); at
# T = 1 K tiles of 128 e4m3 values and 4 stages take 10.6 against 11.2.
QKV_FP8_TILES = with_bucket(with_bucket(QKV_TILES, "decode", block_k=64, stages=4), "small", block_k=128, stages=4,
                            split_k=1)


def qkv_tiles(fp8_weight: bool) -> tuple[Tile, ...]:
    return QKV_FP8_TILES if fp8_weight else QKV_TILES


@triton.jit
def _store_head(ptrs, lo, hi, mask, HALF: tl.constexpr):
    tl.store(ptrs, lo.to(ptrs.dtype.element_ty), mask=mask)
    tl.store(ptrs + HALF, hi.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def norm_qkv_rope_kernel(x_ptr, x_scale_ptr, norm_ptr, w_ptr, w_scale_ptr, bias_ptr, q_norm_ptr, k_norm_ptr,
                         pos_ptr, rope_ptr, kv_ptr, slot_ptr, kv_scale_ptr, out_ptr, part_ptr, count_ptr, T, num_slots,
                         layer, eps,
                         K: tl.constexpr, H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr,
                         HEAD_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                         UPCAST_DOT: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """w_scale_ptr given: W8A8 (`linear.kernels.fp8_gemm_tile` on the quantize pre-pass's rows, which
    are RMSNorm'd already: its tile comes row-scaled). Else x_scale_ptr given: x's RMSNorm row
    scales from the row-scale pre-pass; neither: the K loop sums x^2 itself."""
    FP8: tl.constexpr = w_scale_ptr is not None
    SUMS: tl.constexpr = not FP8 and x_scale_ptr is None
    HALF: tl.constexpr = D // 2
    CHUNK: tl.constexpr = HALF // HEAD_SPLIT
    h = tl.program_id(1) // HEAD_SPLIT
    j = (tl.program_id(1) % HEAD_SPLIT) * CHUNK + tl.arange(0, CHUNK)   # columns in each half
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < T
    i = tl.arange(0, 2 * CHUNK)
    rows = h * D + (i // CHUNK) * HALF + (tl.program_id(1) % HEAD_SPLIT) * CHUNK + i % CHUNK
    if FP8:
        acc = fp8_gemm_tile(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, offs_m, mask_m, rows,
                            rows < (H + 2 * KVH) * D, K, BLOCK_M, 2 * CHUNK, BLOCK_K, UPCAST_DOT, SPLIT_K)
        sumsq = tl.zeros((BLOCK_M,), tl.float32)
    else:
        acc, sumsq = gemm_tile(x_ptr, norm_ptr, w_ptr, offs_m, mask_m, rows, rows < (H + 2 * KVH) * D,
                               K, BLOCK_M, 2 * CHUNK, BLOCK_K, SUMS, UPCAST_DOT, SPLIT_K)
    last = True
    if SPLIT_K > 1:
        acc, sumsq, last = split_k_sum(acc, sumsq, part_ptr, count_ptr, mask_m, BLOCK_M, 2 * CHUNK, SPLIT_K, SUMS)
    if last:
        if SUMS:
            row_scale = tl.rsqrt(sumsq / K + eps)
        elif FP8:
            row_scale = tl.full((BLOCK_M,), 1.0, tl.float32)
        else:
            row_scale = tl.load(x_scale_ptr + offs_m, mask=mask_m, other=0.0)
        _epilogue(acc, row_scale, bias_ptr, q_norm_ptr, k_norm_ptr, pos_ptr, rope_ptr, kv_ptr, slot_ptr,
                  kv_scale_ptr, out_ptr, rows, offs_m, mask_m, j, h, num_slots, layer, eps, H, KVH, D, BLOCK_M, CHUNK,
                  BLOCK_SIZE)


@triton.jit
def tma_norm_qkv_rope_kernel(x_ptr, scale_ptr, w_ptr, w_scale_ptr, bias_ptr, q_norm_ptr, k_norm_ptr, pos_ptr, rope_ptr,
                             kv_ptr, slot_ptr, kv_scale_ptr, out_ptr, T, num_slots, layer, eps,
                             K: tl.constexpr, H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                             HEADS: tl.constexpr, UPCAST_DOT: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """HEADS (1 or 2) whole heads per tile (HEADS * D contiguous rows of W_qkv, each head's two
    halves in order), through the persistent TMA GEMM of `linear.tma`; scale_ptr holds the row
    scales of x's T rows. Two heads make the 256-row tiles the GEMM is fastest with; a pair
    never straddles q, k and v when H and KVH are even (`heads_per_tile`). W8A8 with w_scale_ptr:
    x holds the quantize pre-pass's e4m3 rows (RMSNorm'd) and scale_ptr their scales."""
    HALF: tl.constexpr = D // 2
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[T, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[(H + 2 * KVH) * D, K], strides=[K, 1],
                                       block_shape=[HEADS * D, BLOCK_K])
    tiles_m = tl.cdiv(T, BLOCK_M)
    tiles_n: tl.constexpr = (H + 2 * KVH) // HEADS
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, tl.num_programs(0), flatten=True):
        pid_m, pid_n = tma.tile_coords(tile, tiles_m, tiles_n, GROUP_M)
        acc = tma.tma_dot(x_desc, w_desc, pid_m * BLOCK_M, pid_n * HEADS * D, K, BLOCK_M, HEADS * D, BLOCK_K,
                          UPCAST_DOT)
        # The row scales are applied by the epilogue; the weight's here.
        acc = tma.scale_tile(acc, None, w_scale_ptr, pid_m * BLOCK_M + tl.arange(0, BLOCK_M),
                             pid_n * HEADS * D + tl.arange(0, HEADS * D), T, (H + 2 * KVH) * D)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < T
        scale = tl.load(scale_ptr + offs_m, mask=mask_m, other=0.0)
        if HEADS == 1:
            _epilogue(acc, scale, bias_ptr, q_norm_ptr, k_norm_ptr, pos_ptr, rope_ptr, kv_ptr, slot_ptr,
                      kv_scale_ptr, out_ptr, pid_n * D + tl.arange(0, D), offs_m, mask_m, tl.arange(0, HALF), pid_n, num_slots, layer,
                      eps, H, KVH, D, BLOCK_M, HALF, BLOCK_SIZE)
        else:
            first, second = split_halves(acc, BLOCK_M, D)
            h = 2 * pid_n
            _epilogue(first, scale, bias_ptr, q_norm_ptr, k_norm_ptr, pos_ptr, rope_ptr, kv_ptr, slot_ptr,
                      kv_scale_ptr, out_ptr, h * D + tl.arange(0, D), offs_m, mask_m, tl.arange(0, HALF), h, num_slots, layer,
                      eps, H, KVH, D, BLOCK_M, HALF, BLOCK_SIZE)
            _epilogue(second, scale, bias_ptr, q_norm_ptr, k_norm_ptr, pos_ptr, rope_ptr, kv_ptr, slot_ptr,
                      kv_scale_ptr, out_ptr, (h + 1) * D + tl.arange(0, D), offs_m, mask_m, tl.arange(0, HALF), h + 1,
                      num_slots, layer, eps, H, KVH, D, BLOCK_M, HALF, BLOCK_SIZE)


@triton.jit
def _epilogue(acc, scale, bias_ptr, q_norm_ptr, k_norm_ptr, pos_ptr, rope_ptr, kv_ptr, slot_ptr, kv_scale_ptr,
              out_ptr, rows, offs_m, mask_m, j, h, num_slots, layer, eps, H: tl.constexpr,
              KVH: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
              BLOCK_SIZE: tl.constexpr):
    """Row scale, bias, then q to the output or k and v (q/k normed and rotated) to the cache,
    as e4m3 value / scale when kv_scale_ptr (the [layers, 2, KVH] scales) is given.
    Branch-free (which head kind h is only selects values and masks; the kv_scale_ptr test is
    settled at compile time), so that the persistent TMA kernel's tile loop can be flattened
    into its K loop: Triton 3.6 cannot flatten around an epilogue with branches."""
    HALF: tl.constexpr = D // 2
    acc *= scale[:, None]
    if bias_ptr is not None:
        acc += tl.load(bias_ptr + rows).to(tl.float32)[None, :]
    lo, hi = split_halves(acc, BLOCK_M, CHUNK)
    is_q = h < H
    is_v = h >= H + KVH
    pos = tl.load(pos_ptr + offs_m, mask=mask_m, other=0)
    if q_norm_ptr is not None:
        # Per-head RMSNorm of q and k (HEAD_SPLIT 1: lo and hi are the head's whole halves).
        norm = tl.rsqrt((tl.sum(lo * lo, axis=1) + tl.sum(hi * hi, axis=1)) / D + eps)[:, None]
        norm = tl.where(is_v, 1.0, norm)
        w_lo = tl.where(is_q, tl.load(q_norm_ptr + j).to(tl.float32), tl.load(k_norm_ptr + j).to(tl.float32))
        w_hi = tl.where(is_q, tl.load(q_norm_ptr + HALF + j).to(tl.float32),
                        tl.load(k_norm_ptr + HALF + j).to(tl.float32))
        lo = lo * norm * tl.where(is_v, 1.0, w_lo)[None, :]
        hi = hi * norm * tl.where(is_v, 1.0, w_hi)[None, :]
    # RoPE for q and k; v's rotation is the identity (cos 1, sin 0).
    rope = mask_m[:, None] & (not is_v)
    row = rope_ptr + pos.to(tl.int64)[:, None] * D + j[None, :]
    cos = tl.load(row, mask=rope, other=1.0)
    sin = tl.load(row + HALF, mask=rope, other=0.0)
    lo, hi = lo * cos - hi * sin, hi * cos + lo * sin
    q_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * (H * D) + h * D + j[None, :]
    _store_head(q_ptrs, lo, hi, mask_m[:, None] & is_q, HALF)
    slot = tl.load(slot_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    # tl.cast, not .to: the JIT passes layer 1 as a constexpr int.
    cache_row = (tl.cast(layer * 2, tl.int64) + is_v.to(tl.int64)) * num_slots + slot
    kv_head = tl.where(is_v, h - H - KVH, h - H)
    kv_mask = mask_m[:, None] & (not is_q)
    if kv_scale_ptr is not None:
        # q heads (kv_head < 0) store nothing here; they read a valid scale all the same.
        kv_scale = tl.load(kv_scale_ptr + (layer * 2 + is_v.to(tl.int32)) * KVH + tl.where(is_q, 0, kv_head))
        lo, hi = to_e4m3(lo, kv_scale), to_e4m3(hi, kv_scale)
        # An e4m3 cache holds v's blocks transposed (attention.cache_write.v_offset).
        cols = kv_head * D + j[None, :]
        v_part = (tl.cast(layer * 2 + 1, tl.int64) * num_slots) * (KVH * D)
        off = tl.where(is_v, v_part + v_offset(slot[:, None], cols, KVH * D, BLOCK_SIZE),
                       cache_row[:, None] * (KVH * D) + cols)
        step = tl.where(is_v, HALF * BLOCK_SIZE, HALF)
        tl.store(kv_ptr + off, lo.to(kv_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(kv_ptr + off + step, hi.to(kv_ptr.dtype.element_ty), mask=kv_mask)
    else:
        _store_head(kv_ptr + cache_row[:, None] * (KVH * D) + kv_head * D + j[None, :], lo, hi, kv_mask, HALF)


def head_split(tile: Tile, head_dim: int, qk_norm: bool) -> int:
    """Programs per head: the tile's weight rows per program, unless q/k norm needs it whole."""
    return 1 if qk_norm else max(1, head_dim // tile.block_n)


def run(inputs: list, attrs: dict, out: torch.Tensor) -> None:
    """inputs in the spec's order: x, norm_weight?, w_qkv, b_qkv?, q_norm?, k_norm?, positions,
    rope_cache, kv_cache (written in place), slot_mapping, kv_scales? (an e4m3 cache's), then
    w_qkv_scale (FP8) and w_qkv_input_scale (a static activation scale) when given. q/k norm
    applies when both are given, as in the reference."""
    x, norm_weight, w_qkv, b_qkv, q_norm, k_norm, positions, rope_cache, kv_cache, slot_mapping, kv_scales, \
        w_scale, x_static = padded(inputs, 13)
    if q_norm is None or k_norm is None:
        q_norm = k_norm = None
    if not kv_cache.is_contiguous():
        raise ValueError("norm_qkv_rope's kernel writes a contiguous KV cache")
    x, w_qkv = x.contiguous(), w_qkv.contiguous()
    t, k = x.shape
    heads, kv_heads, d = attrs["num_heads"], attrs["num_kv_heads"], attrs["head_dim"]
    tile = pick_tile(t, tiles=qkv_tiles(w_scale is not None))
    bk = block_k(tile, w_qkv.element_size())
    split = head_split(tile, d, q_norm is not None)
    ksplit, columns = split_k(tile, k, bk), (heads + 2 * kv_heads) * split
    part, count = split_buffers(t, tile.block_m, d // split, columns, ksplit, x.device)
    xa, x_scale = gemm_input(x, w_scale, norm_weight, True, attrs["eps"], prescaled(tile, w_scale is not None),
                             x_static)
    norm_qkv_rope_kernel[(triton.cdiv(t, tile.block_m), columns, ksplit)](
        xa, x_scale, None if w_scale is not None else norm_weight, w_qkv, w_scale, b_qkv, q_norm, k_norm,
        positions.contiguous(), rope_cache.contiguous(), kv_cache, slot_mapping.contiguous(), kv_scales, out, part,
        count, t, kv_cache.shape[2] * kv_cache.shape[3], attrs["layer"], attrs["eps"], K=k, H=heads, KVH=kv_heads,
        D=d, HEAD_SPLIT=split, BLOCK_M=tile.block_m, BLOCK_K=bk, UPCAST_DOT=upcast_dot(x, w_scale is not None),
        SPLIT_K=ksplit, BLOCK_SIZE=kv_cache.shape[3] if kv_scales is not None else 1, num_warps=tile.num_warps,
        num_stages=num_stages(tile.block_m, d // split, bk, w_qkv.element_size(), tile.stages, xa.element_size()))


def uses_tma(tile: Tile, shapes: dict) -> bool:
    """Whether a bucket runs the TMA kernel on sm_90+: with the norm weight folded."""
    return tile.tma and not shapes.get("norm_weight", False)


def heads_per_tile(heads: int, kv_heads: int, head_dim: int, dtype: str) -> int:
    """Heads per TMA tile: two where the pair fills the GEMM's weight tile and never mixes q,
    k and v; else one."""
    pair = heads % 2 == 0 and kv_heads % 2 == 0 and 2 * head_dim <= tma.tile_shape(dtype)[1]
    return 2 if pair else 1


def cache_block(shapes: dict) -> int:
    """The BLOCK_SIZE constexpr: the cache's block size where the kernel needs it (an e4m3 cache's
    transposed v blocks), else 1, so that bf16 engines of any block size share one kernel."""
    return shapes["block_size"] if shapes.get("fp8_kv", False) else 1


def kv_pointer(dtype: str, shapes: dict) -> str:
    """The KV cache's pointer type: e4m3 with fp8_kv, else the model's dtype."""
    return FP8_POINTER if shapes.get("fp8_kv", False) else POINTER_TYPES[dtype]


def tma_aot(dtype: str, shapes: dict, tile: Tile, optional: dict[str, bool]) -> AotKernel:
    """The TMA kernel of a bucket; FP8: e4m3 operands, x from the quantize pre-pass."""
    fp8_weight = shapes.get("fp8", False)
    ptr = POINTER_TYPES[dtype]
    bm, _, bk = tma.tile_shape(dtype, fp8_weight, tile.block_m)
    warps, stages = tma.LAUNCH[bm]
    heads, kv_heads = shapes["num_heads"], shapes["num_kv_heads"]
    operand = FP8_POINTER if fp8_weight else ptr
    signature = {"x_ptr": operand, "scale_ptr": "*fp32", "w_ptr": operand,
                 "w_scale_ptr": "*fp32" if fp8_weight else "constexpr", "bias_ptr": ptr, "q_norm_ptr": "*fp32",
                 "k_norm_ptr": "*fp32", "pos_ptr": "*i32", "rope_ptr": "*fp32", "kv_ptr": kv_pointer(dtype, shapes),
                 "slot_ptr": "*i32", "kv_scale_ptr": "*fp32", "out_ptr": ptr, "T": "i32", "num_slots": "i32",
                 "layer": "i32", "eps": "fp32", "K": "constexpr",
                 "H": "constexpr", "KVH": "constexpr", "D": "constexpr", "BLOCK_M": "constexpr",
                 "BLOCK_K": "constexpr", "GROUP_M": "constexpr", "HEADS": "constexpr", "UPCAST_DOT": "constexpr",
                 "BLOCK_SIZE": "constexpr"}
    for name, present in optional.items():
        if not present and name != "norm_ptr":
            signature[name] = "constexpr"
    constexprs = {"K": shapes["K"], "H": heads, "KVH": kv_heads, "D": shapes["head_dim"], "BLOCK_M": bm,
                  "BLOCK_K": bk, "GROUP_M": tma.GROUP_M, "UPCAST_DOT": False, "BLOCK_SIZE": cache_block(shapes),
                  "HEADS": heads_per_tile(heads, kv_heads, shapes["head_dim"], dtype)}
    meta = tma.tma_meta(tile.name, tile.max_rows, (heads + 2 * kv_heads) // constexprs["HEADS"], bm)
    if fp8_weight:
        meta["fp8"] = True
    return AotKernel(tma_norm_qkv_rope_kernel, signature, absent_as_none(signature, constexprs),
                     num_warps=warps, num_stages=stages, aligned=pointer_params(signature),
                     targets=tma.TMA_TARGETS, meta=meta)


def aot_kernels(dtype: str, shapes: dict) -> list[AotKernel | NvccKernel]:
    """shapes: {"K": hidden size, "num_heads", "num_kv_heads" (this rank's), "head_dim", "block_size" (the
    KV cache's; read with fp8_kv),
    "bias": bool, "qk_norm": bool, "norm_weight": bool, "fp8_kv": bool, "fp8": bool, "fp8_static": bool
    (all default False; False norm_weight means folded; fp8_kv: an e4m3 cache and its scales,
    kv_scale_ptr; fp8: an e4m3 weight and its row scales; fp8_static: a static activation scale)}. One kernel per shape bucket;
    num_slots (KV-cache blocks * block size), layer and eps are runtime arguments, positions and
    slot_mapping int32, rope_cache and the q/k norm weights fp32 (as models hold norm weights).
    FP8: pointer kernels for fp8.FP8_TARGETS in every bucket, and the quantize pre-pass (RMSNorm
    included) whose rows they read. Ahead of the "large" bucket's pointer kernel the CuTe qkv GEMM
    for sm_90 where it serves (`linear.cute_gemm.qkv_kernels`)."""
    ptr, size = POINTER_TYPES[dtype], element_bytes(dtype)
    k, heads, kv_heads, d = shapes["K"], shapes["num_heads"], shapes["num_kv_heads"], shapes["head_dim"]
    qk_norm, fp8_weight = shapes.get("qk_norm", False), shapes.get("fp8", False)
    optional = {"norm_ptr": shapes.get("norm_weight", False), "bias_ptr": shapes.get("bias", False),
                "q_norm_ptr": qk_norm, "k_norm_ptr": qk_norm, "kv_scale_ptr": shapes.get("fp8_kv", False)}
    kernels: list[AotKernel | NvccKernel] = gemv.qkv_kernels(dtype, shapes)
    for tile in qkv_tiles(fp8_weight):
        kernels += cute_gemm.qkv_kernels(dtype, shapes, tile)
        bk, split = block_k(tile, 1 if fp8_weight else size), head_split(tile, d, qk_norm)
        ksplit = split_k(tile, k, bk)
        signature = {"x_ptr": FP8_POINTER if fp8_weight else ptr, "x_scale_ptr": "*fp32", "norm_ptr": ptr,
                     "w_ptr": FP8_POINTER if fp8_weight else ptr, "w_scale_ptr": "*fp32", "bias_ptr": ptr,
                     "q_norm_ptr": "*fp32", "k_norm_ptr": "*fp32", "pos_ptr": "*i32", "rope_ptr": "*fp32",
                     "kv_ptr": kv_pointer(dtype, shapes), "slot_ptr": "*i32", "kv_scale_ptr": "*fp32", "out_ptr": ptr,
                     **split_signature(ksplit), "T": "i32", "num_slots": "i32", "layer": "i32", "eps": "fp32",
                     "K": "constexpr", "H": "constexpr", "KVH": "constexpr", "D": "constexpr",
                     "HEAD_SPLIT": "constexpr", "BLOCK_M": "constexpr", "BLOCK_K": "constexpr",
                     "UPCAST_DOT": "constexpr", "SPLIT_K": "constexpr", "BLOCK_SIZE": "constexpr"}
        constexprs = {"K": k, "H": heads, "KVH": kv_heads, "D": d, "HEAD_SPLIT": split, "BLOCK_M": tile.block_m,
                      "BLOCK_K": bk, "UPCAST_DOT": False, "SPLIT_K": ksplit, "BLOCK_SIZE": cache_block(shapes)}
        # With FP8 weights the pre-pass applies the norm weight.
        present = {**optional, "norm_ptr": optional["norm_ptr"] and not fp8_weight,
                   "x_scale_ptr": fp8_weight or prescaled(tile, fp8_weight), "w_scale_ptr": fp8_weight}
        for name, given in present.items():
            if not given:
                signature[name] = "constexpr"
        meta = launch_meta(tile, (heads + 2 * kv_heads) * split, ksplit, d // split)
        if prescaled(tile, fp8_weight):
            meta["row_scale_input"] = True
        targets = tma.POINTER_TARGETS if uses_tma(tile, shapes) else None
        if fp8_weight:
            meta["fp8"] = True
            targets = fp8.POINTER_ONLY if uses_tma(tile, shapes) else fp8.FP8_TARGETS
        kernel = AotKernel(norm_qkv_rope_kernel, signature, absent_as_none(signature, constexprs),
                           num_warps=tile.num_warps, aligned=pointer_params(signature), meta=meta, targets=targets)
        kernels += pipelined(kernel, tile.block_m, d // split, bk, 1 if fp8_weight else size, tile.stages)
        if uses_tma(tile, shapes):
            kernels.append(tma_aot(dtype, shapes, tile, optional))
    if fp8_weight:
        kernels += fp8.quantize_aot(dtype, k, norm=True, norm_weight=optional["norm_ptr"],
                                    static=shapes.get("fp8_static", False))
    else:   # for the TMA buckets and the pointer ones that read its scales (`prescaled`)
        kernels.append(tma.row_scale_aot(dtype, k))
    return kernels
