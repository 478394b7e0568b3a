"""The CUTLASS route of the linear plugin's GEMMs: Hopper kernels on CuTe's building blocks
(`cute_sm90.cu`: TMA loads into a ring of shared-memory stages, wgmma, a producer and consumer
warpgroups), built by nvcc for sm_90a with `nvidia-cutlass`'s headers.

- `gemm` (`cute_gemm_sm90.cu`): prefill chunks and large batches in bf16, persistent tiles of block_m
  (64 or 128: one or two consumer warpgroups) rows of x by block_n weight rows, K in `parts` (split-K: the
  last part of a tile to finish adds the others' sums from a workspace);
- `qkv` (the same file): that GEMM with norm_qkv_rope's epilogue (row scale, bias, RoPE, q to the
  output and k and v into the paged cache), its weight tiles made of rotary pairs (`pairs` first-half
  rows of heads, then their second-half rows);
- `decode` (`cute_decode_sm90.cu`): decode steps of up to `rows` rows of x, in bf16 or e4m3 (x and w
  quantized per row), the weights as wgmma's 64-row operand ("swap AB", no MMA spent on padding rows), K
  split in parts over the grid's y when the weight has too few 64-row tiles to fill the GPU, launched
  for programmatic dependent launch.

`linear_kernels` makes `gemm` the sm_90 kernel of linear and linear_residual's "large" bucket (129-256
rows) for narrow weights, where it measured faster than the pointer tile (`LINEAR_TILING`); the Triton
kernels serve every other bucket and target, and this one where nvcc is missing. `qkv` and `decode` are
candidates: scripts/tune_prefill_gemm.py sweeps `gemm`'s and `qkv`'s tilings beside the Triton kernels
and cuBLAS, scripts/probe_cuda_gemv.py `decode` beside the decode GEMVs and Triton's decode tiles
(session 33: equal to Triton's at T = 8, slower than the GEMVs at T = 1). Their TMA descriptors are
parameters the host makes (`runtime.cuda_driver.encode_tensor_map`): boxes one K tile (128 bytes,
`k_tile` elements) wide, of block_m (`gemm`, `qkv`) or `rows` (`decode`) rows of x and block_n
(`gemm`), `qkv_box` (`qkv`) or WEIGHT_ROWS (`decode`) rows of w. A launch needs no global scratch.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from kiln.plugins.linear.tiles import Tile
from kiln.plugins.nvcc import NvccKernel, cutlass_available, cutlass_include

SOURCE = Path(__file__).with_name("cute_sm90.cu")             # every kernel is compiled appended to it
GEMM_SOURCE = Path(__file__).with_name("cute_gemm_sm90.cu")
DECODE_SOURCE = Path(__file__).with_name("cute_decode_sm90.cu")
# bias [N] and residual [M, N] may be null.
GEMM_SIGNATURE = {"x_map": "tensormap", "w_map": "tensormap", "bias": "*bf16", "residual": "*bf16", "out": "*bf16",
                  "M": "i32", "N": "i32", "K": "i32"}
# split-K: part [tiles x warpgroups, parts, 64 x block_n] fp32 (in `gather_parts`' order) and count [tiles x
# warpgroups] int32, zeroed once (the kernel leaves them so; `split_workspace` says how large).
GEMM_SPLIT_SIGNATURE = {**{name: kind for name, kind in GEMM_SIGNATURE.items() if name not in ("M", "N", "K")},
                        "part": "*fp32", "count": "*i32", "M": "i32", "N": "i32", "K": "i32"}
# row_scale [M] (fp32, the row-scale pre-pass's), bias [rows of w_qkv] or null, positions and slots [M], rope
# [positions, head_dim] (cos, then sin), the bf16 cache [layers, 2, num_slots, kv_heads, head_dim], q out
# [M, heads x head_dim].
QKV_SIGNATURE = {"x_map": "tensormap", "w_map": "tensormap", "row_scale": "*fp32", "bias": "*bf16",
                 "positions": "*i32", "rope": "*fp32", "kv": "*bf16", "slots": "*i32", "out": "*bf16", "M": "i32",
                 "num_slots": "i32", "layer": "i32", "heads": "i32", "kv_heads": "i32", "K": "i32"}
# w_scale [N] and x_scale [T] for e4m3 (else null); part [N / WEIGHT_ROWS, parts, WEIGHT_ROWS x rows] fp32 (in
# `gather_parts`' order) and count [N / WEIGHT_ROWS] int32, zeroed once (the kernel leaves them so), when the grid
# has parts.
DECODE_SIGNATURE = {"w_map": "tensormap", "x_map": "tensormap", "w_scale": "*fp32", "x_scale": "*fp32",
                    "residual": "*bf16", "out": "*bf16", "part": "*fp32", "count": "*i32", "T": "i32", "N": "i32",
                    "K": "i32"}
K_TILE_BYTES = 128           # a K tile is one 128-byte swizzle row
ELEMENTS = {"bf16": ("kiln_cute::bf16", 2), "fp8e4nv": ("kiln_cute::e4m3", 1)}
WEIGHT_ROWS = 64             # decode: weight rows a block (one consumer warpgroup)
TARGETS = ("sm_90",)         # wgmma and setmaxnreg: Hopper's alone (sm_90a)
# `gemm`'s tiling in the engine (block_m, block_n, stages, group_m, parts of K). On an H200 (session 36,
# scripts/tune_prefill_gemm.py, weights cycled beyond the L2) 64x128 tiles took o_proj (4096x4096) 15.5 us at
# T = 160 and 16.1 at 256, and down (4096x14336) 45.7 and 47.0, against 16.1/16.6 and 48.0/50.2 for 128x64
# tiles (session 33's choice) and 18.8/16.3 and 39.3/49.2 for cuBLAS; 128x128 tiles (64 of them on 132 SMs)
# took 24.2/24.5 and 70.7/70.5, and the same in two K parts 20.8/21.0 and 47.9/50.2.
LINEAR_TILING = (64, 128, 8, 8, 1)
# `qkv`'s tiling in the engine (block_m, rotary pairs a tile, stages, group_m): at 129-256 rows, 128 tiles for
# Llama-3-8B's 48 heads of 64 pairs, one wave on 132 SMs. On an H200 (session 36) 25.7 us at T = 160 and 26.7 at
# 256, against 27.6 and 28.4 with 64-row tiles of 96 pairs, and the pointer tile's 30.4 at 160.
QKV_TILING = (128, 48, 8, 8)
BUCKET = "large"


def k_tile(element: str = "bf16") -> int:
    """Elements of `element` in a K tile (the width of every TMA box)."""
    return K_TILE_BYTES // ELEMENTS[element][1]


def shared_bytes(rows: int, stages: int) -> int:
    """Dynamic shared memory of a kernel whose stages hold `rows` rows of K tile (x's and w's together),
    and 2 KiB for the barriers and the 1 KiB alignment of the base (the kernel's static_assert checks)."""
    return stages * rows * K_TILE_BYTES + 2048


def gemm(block_m: int, block_n: int, stages: int, group_m: int, parts: int = 1) -> NvccKernel:
    """`gemm` at tiles of `block_m` (64 or 128) x `block_n`, `stages` K tiles in flight, `group_m` row tiles
    a group, K in `parts` (with more than one its signature is GEMM_SPLIT_SIGNATURE). Launch: grid
    `gemm_grid`."""
    warpgroups = _warpgroups(block_m)
    shared = shared_bytes(block_m + block_n, stages)
    entry = f"kiln_cute_gemm_m{block_m}_n{block_n}_s{stages}_g{group_m}"
    if parts == 1:
        call = f"KILN_CUTE_GEMM({entry}, {warpgroups}, {block_n}, {stages}, {group_m}, {shared})"
        return _kernel(GEMM_SOURCE, entry, call, GEMM_SIGNATURE, 4 * (warpgroups + 1), shared)
    entry += f"_p{parts}"
    call = f"KILN_CUTE_GEMM_SPLIT({entry}, {warpgroups}, {block_n}, {stages}, {group_m}, {parts}, {shared})"
    return _kernel(GEMM_SOURCE, entry, call, GEMM_SPLIT_SIGNATURE, 4 * (warpgroups + 1), shared)


def split_workspace(rows: int, n: int, block_m: int, block_n: int, parts: int) -> tuple[int, int]:
    """Bytes of `gemm`'s split-K workspaces (part, count) for `rows` rows of x and a weight of `n` rows."""
    subtiles = -(-rows // block_m) * (n // block_n) * _warpgroups(block_m)
    return subtiles * parts * (block_n // 2) * 128 * 4, subtiles * 4


def qkv_box(pairs: int, head_dim: int) -> int:
    """Rows of each of the qkv GEMM's weight boxes: the most that divide both `pairs` and head_dim / 2 (a box
    never straddles a head); refuses a shape whose boxes would not fill whole 8-row swizzle atoms."""
    box = math.gcd(pairs, head_dim // 2)
    if head_dim % 2 or box % 8:
        raise ValueError(f"the CuTe qkv GEMM serves heads of an even dimension whose halves and {pairs} pairs a "
                         f"tile share a multiple of 8 rows, not head_dim {head_dim}")
    return box


def qkv(block_m: int, pairs: int, head_dim: int, stages: int, group_m: int) -> NvccKernel:
    """`qkv` at tiles of `block_m` (64 or 128) rows x `pairs` rotary pairs of heads of `head_dim`, `stages` K
    tiles in flight, `group_m` row tiles a group. Launch: grid `qkv_grid`."""
    box = qkv_box(pairs, head_dim)
    entry = f"kiln_cute_qkv_m{block_m}_p{pairs}_d{head_dim}_s{stages}_g{group_m}"
    shared = shared_bytes(block_m + 2 * pairs, stages)
    call = f"KILN_CUTE_QKV({entry}, {_warpgroups(block_m)}, {pairs}, {box}, {head_dim}, {stages}, {group_m}, {shared})"
    return _kernel(GEMM_SOURCE, entry, call, QKV_SIGNATURE, 4 * (_warpgroups(block_m) + 1), shared)


def decode(rows: int, stages: int, element: str = "bf16") -> NvccKernel:
    """`decode` of `element`s ("bf16" or "fp8e4nv") for up to `rows` rows of x (8, 16, 32 or 64), `stages`
    K tiles in flight. Launch: grid `decode_grid` (the K tiles shared by the parts in nearly equal runs)."""
    entry = f"kiln_cute_decode_{element}_t{rows}_s{stages}"
    shared = shared_bytes(WEIGHT_ROWS + rows, stages)
    call = f"KILN_CUTE_DECODE({entry}, {ELEMENTS[element][0]}, {rows}, {stages}, {shared})"
    return _kernel(DECODE_SOURCE, entry, call, DECODE_SIGNATURE, 5, shared, pdl=True)


def gemm_grid(rows: int, n: int, k: int, block_m: int, block_n: int, sms: int,
              parts: int = 1) -> tuple[int, int, int]:
    """`gemm`'s grid for `rows` rows of x and an [n, k] weight, K in `parts`, on a GPU of `sms` SMs; refuses
    a shape the kernel does not serve (it would leave columns out or read past K, or split K finer than its
    tiles)."""
    if n % block_n or k % k_tile() or not 1 <= parts <= k // k_tile():
        raise ValueError(f"the CuTe GEMM at {block_n}-column tiles serves weights of a multiple of {block_n} rows "
                         f"and {k_tile()} columns in 1 to K / {k_tile()} parts, not [{n}, {k}] in {parts}")
    return min(-(-rows // block_m) * (n // block_n) * parts, sms), 1, 1


def qkv_grid(rows: int, heads: int, kv_heads: int, head_dim: int, k: int, block_m: int, pairs: int,
             sms: int) -> tuple[int, int, int]:
    """`qkv`'s grid for `rows` rows of x and the heads' w_qkv [(heads + 2 kv_heads) x head_dim, k]; refuses a
    shape the kernel does not serve (pairs that do not fill whole tiles, K not whole K tiles)."""
    qkv_box(pairs, head_dim)
    all_pairs = (heads + 2 * kv_heads) * head_dim // 2
    if all_pairs % pairs or k % k_tile():
        raise ValueError(f"the CuTe qkv GEMM at {pairs} pairs a tile serves heads whose rotary pairs fill whole "
                         f"tiles and K of a multiple of {k_tile()}, not {all_pairs} pairs and K {k}")
    return min(-(-rows // block_m) * (all_pairs // pairs), sms), 1, 1


def decode_grid(rows: int, n: int, k: int, served: int, parts: int, element: str = "bf16") -> tuple[int, int, int]:
    """`decode`'s grid for `rows` rows of x and an [n, k] weight, built for `served` rows, K in `parts`;
    refuses what it does not serve (rows past `served` would be left out)."""
    tiles = k // k_tile(element)
    if rows > served or n % WEIGHT_ROWS or k % k_tile(element) or not 1 <= parts <= tiles:
        raise ValueError(f"the CuTe decode GEMM built for {served} rows serves up to {served} rows of x, weights of a "
                         f"multiple of {WEIGHT_ROWS} rows and {k_tile(element)} columns and 1 to {max(tiles, 1)} "
                         f"parts, not {rows} rows, [{n}, {k}] and {parts} parts")
    return n // WEIGHT_ROWS, parts, 1


def linear_kernels(dtype: str, n: int, k: int, tile: Tile, fp8_weight: bool = False) -> list[NvccKernel]:
    """`gemm` at LINEAR_TILING as the sm_90 kernel of `tile`'s bucket for out = x W^T (+ bias) (+ residual)
    with W [n, k], where it serves: bucket BUCKET of the pointer tiles (not a TMA one), bf16, n and k whole
    tiles, and CUTLASS's headers installed (without them the pointer kernel serves, as without nvcc); bias
    and residual are passed or null. Its meta names the bucket and the persistent grid as linear's launcher
    reads them, "cute", and with K in parts the split-K workspace (linear's `gemm_split_part` and
    `gemm_split_count`, sized for the bucket's most rows)."""
    block_m, block_n, stages, group_m, parts = LINEAR_TILING
    if (tile.name != BUCKET or tile.tma or fp8_weight or dtype != "bfloat16" or n % block_n or k % k_tile()
            or not cutlass_available()):
        return []
    kernel = gemm(block_m, block_n, stages, group_m, parts)
    part, count = split_workspace(tile.max_rows, n, block_m, block_n, parts)
    meta = {"bucket": tile.name, "max_rows": tile.max_rows, "cute": True, "block_m": block_m, "block_n": block_n,
            "pointer_alignment": 16, "split_k": parts,
            "scratch": {"gemm_split_part": part, "gemm_split_count": count} if parts > 1 else {},
            "grid": f"min(cdiv(T, {block_m}) * {n // block_n * parts}, SMS)"}
    return [dataclasses.replace(kernel, meta=meta)]


def qkv_kernels(dtype: str, shapes: dict, tile: Tile) -> list[NvccKernel]:
    """`qkv` as the sm_90 kernel of `tile`'s bucket for norm_qkv_rope (its compile `shapes`), where it serves:
    bucket BUCKET of the pointer tiles, bf16 weights with the norm weight folded (the row-scale pre-pass
    gives the scales), no q/k norm (it needs whole heads), a bf16 cache, heads whose rotary pairs fill
    whole tiles of QKV_TILING's, K whole K tiles, and CUTLASS's headers installed. Its meta names the
    bucket, the persistent grid, the tile's rows and pairs, and "cute" and
    "row_scale_input" as norm_qkv_rope's launcher reads them."""
    block_m, pairs = QKV_TILING[:2]
    heads, kv_heads, d, k = shapes["num_heads"], shapes["num_kv_heads"], shapes["head_dim"], shapes["K"]
    unserved = (tile.name != BUCKET or tile.tma or dtype != "bfloat16" or d % 2 or math.gcd(pairs, d // 2) % 8
                or any(shapes.get(flag, False) for flag in ("fp8", "fp8_kv", "qk_norm", "norm_weight")))
    rotary_pairs = (heads + 2 * kv_heads) * d // 2
    if unserved or rotary_pairs % pairs or k % k_tile() or not cutlass_available():
        return []
    n_tiles = rotary_pairs // pairs
    meta = {"bucket": tile.name, "max_rows": tile.max_rows, "cute": True, "row_scale_input": True,
            "block_m": block_m, "pairs": pairs, "pointer_alignment": 16, "split_k": 1,
            "grid": f"min(cdiv(T, {block_m}) * {n_tiles}, SMS)"}
    return [dataclasses.replace(qkv(block_m, pairs, d, *QKV_TILING[2:]), meta=meta)]


def _warpgroups(block_m: int) -> int:
    """Consumer warpgroups of a tile of `block_m` rows: 64 rows each."""
    if block_m not in (64, 128):
        raise ValueError(f"the CuTe GEMM's tiles have 64 or 128 rows, not {block_m}")
    return block_m // 64


def _kernel(source: Path, entry: str, call: str, signature: dict, warps: int, shared: int,
            pdl: bool = False) -> NvccKernel:
    """An entry point of `source`, compiled appended to SOURCE (the building blocks) with its macro call."""
    return NvccKernel(SOURCE, entry, f"{source.read_text()}\n{call}", signature, warps,
                      meta={"pdl": True} if pdl else {}, targets=TARGETS, shared_bytes=shared,
                      includes=(cutlass_include(),), arch_specific=True)
