"""The shape buckets of the GEMM kernels and their pipeline depths: which tiling serves how many
rows for a weight of how many rows (`Tile`, `TILES`, `WIDE_TILES`), and how deep a software
pipeline each target's shared memory holds (`num_stages`, `pipelined`), and where the fused norm
GEMMs take their row scales from a pre-pass (`prescaled`). `linear.kernels` and the
fused plugins that share its GEMM core (norm_swiglu, norm_qkv_rope, linear_residual) pick their
tiles here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kiln.plugins.aot import TARGET_CC, AotKernel

# Shared memory for the software pipeline's x and W buffers: sm_89 has 99 KiB per block, the
# smallest of the targets; the rest is left for the epilogue's layout conversions. sm_90 and
# sm_100 have 227 KiB, of which DEEP_PIPELINE_SMEM, and their kernels get the deeper pipeline it
# allows (`pipelined`): tune_gemm's sweeps time stage counts that only fit there (the fused qkv's
# 6 stages of 32 KiB at T = 64 load on an H200, its epilogue's 16 KiB beside them).
PIPELINE_SMEM = 80 * 1024
DEEP_PIPELINE_SMEM = 192 * 1024
DEEP_PIPELINE_TARGETS = ("sm_90", "sm_100")


@dataclass(frozen=True)
class Tile:
    """One shape bucket's tiling. `block_n` counts weight rows per tile (a fused kernel that
    pairs rows gives each side half of them); `block_k` is for 2-byte types and halves for
    fp32 so the shared-memory footprint does not depend on the dtype; `stages` caps the
    software pipeline's depth; `split_k` programs share each output tile's K range when K
    divides evenly among them (see `gemm_tile`); `tma`: on sm_90 and later the bucket runs the
    persistent TMA GEMM of `linear.tma` instead (these tiles stay for sm_80 and sm_89)."""

    name: str
    max_rows: int | None     # largest T the bucket serves; None: no limit
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    stages: int
    split_k: int = 1
    tma: bool = False


# Measured on an H200 with scripts/tune_gemm.py (2026-11-29, bf16; BENCHMARKS.md has the table):
# - Narrow weights (N = 4096, 6144) give too few programs to keep enough loads in flight:
#   splitting K in 4 at T=1 fixes that. At T=1, o_proj (4096x4096) reaches 4.3 TB/s and qkv 3.8
#   (against 3.5 unsplit). At T=64 a pipeline of 6 stages keeps enough in flight unsplit, and
#   the split-K partials cost more: on an H100 (session 44, weights cycled beyond the L2, warm
#   clocks) o_proj took 14.3 us in bf16 against 16.7 split in 2 with 4 stages, down 43.2 against
#   46.1; in e4m3 8.6 against 11.0 and 23.8 against 26.2; the 16-layer 8B decode step at b=64
#   0.980x (bf16) and 0.963x (calibrated FP8).
# - Wide weights (gate/up, LM head) already put several programs on every SM; shallow
#   pipelines leave shared memory for more of them: 28672x4096 reaches 4.1 TB/s at T=1 with 3
#   stages (3.2 with 6), and 3.9 TB/s at T=64 with 64x64 tiles.
TILES = (
    # Decode: the 16 rows are tl.dot's minimum; long K tiles keep many loads in flight.
    Tile("decode", 16, 16, 64, 128, 4, stages=3, split_k=4),
    Tile("small", 64, 64, 32, 128, 4, stages=6),
    # Up to 128 rows (a prefill chunk of a short prompt, decode batches beyond 64): 64x128 tiles
    # with K split in 4, 256 programs for a 4096-row weight. On an H200 (2026-12-01,
    # `KILN_TUNE_MEDIUM_ROWS=128 scripts/tune_gemm.py`, weights cycled beyond the L2) down took
    # 44.4 us at T=128 against 57.8 for the large bucket's tiles, o_proj 20.3 against 21.8.
    Tile("medium", 128, 64, 128, 64, 4, stages=4, split_k=4),
    # Up to 256 rows: 128x128 tiles with K split in 2, 128 programs for a 4096-row weight at
    # T=256. On an H200 (session 16, the same sweep at T=256) down took 59.8 us against 75.7 for
    # 64x64 tiles unsplit (cuBLAS 47.7), o_proj 24.4 against 23.6; from 129 rows on the medium
    # tiles lose (down 67.1 us at 130 rows against 57.6, 2026-12-01).
    Tile("large", 256, 128, 128, 64, 8, stages=4, split_k=2),
    # Up to 512 rows (decode batches of 257-512, short prefill chunks): 64x256 TMA tiles, so that
    # a narrow weight's tiles fill the GPU: 128-row tiles give 4 x 16 = 64 tiles for a 4096-row
    # weight at T = 448 on 132 SMs, 64-row ones 112. On an H200 (session 29,
    # `KILN_TUNE_ROWS=320,448,512,640 scripts/tune_prefill_gemm.py`, weights cycled beyond the
    # L2): bf16 down took 84 us at T = 448 against 150 with 128x256 tiles (cuBLAS 76), o_proj 29
    # against 45; e4m3 down 46 against 73 (cuBLAS FP8 61), o_proj 17 against 26. From 640 rows on
    # the 64-row tiles run two waves and 128-row ones win again. (sm_80 and sm_89 run the pointer
    # tile of the same rows.)
    Tile("xlarge", 512, 64, 128, 64, 4, stages=4, tma=True),
    Tile("prefill", None, 128, 128, 64, 8, stages=4, tma=True),
)
# At 256 rows the TMA GEMM takes gate/up (28672x4096) in 100 us against 130 for the pointer
# tiles; for narrow weights it gives too few tiles at that size and the pointer tiles stay.
# From 129 to 192 rows, 128-row tiles would pad T to 256 rows and run two waves of them: a
# 128-token prefill chunk with a few decode rows beside it took 120.0 us in gate/up against 69.5
# at 128 rows. 64-row tiles pad less and take 89.5 us at 130 rows (`linear.tma.LAUNCH`). From 193
# rows on, the prefill bucket's kernel (the same as "medium"'s) serves. The bucket names are
# TILES' (the rows each serves differ). At 256 rows its 224 tiles fill 85% of two waves on 132 SMs, and
# nothing that fills them better has won on an H100 (session 54): 64x128 tiles (896, 97%) took 127 us
# against 118-120, and a stream-K tail 158, its partial tiles costing more than the idle SMs.
WIDE_TILES = (
    Tile("decode", 16, 16, 32, 128, 4, stages=3),
    Tile("small", 64, 64, 64, 64, 4, stages=3),
    Tile("medium", 128, 128, 128, 64, 8, stages=4, tma=True),
    Tile("large", 192, 64, 128, 64, 4, stages=4, tma=True),
    Tile("prefill", None, 128, 128, 64, 8, stages=4, tma=True),
)
# Weight rows from which WIDE_TILES apply. TP 2's gate/up (14,336 rows) counts as wide: on an H200
# (2026-11-30, .gpu profile of a TP 2 decode step, BENCHMARKS.md) its fused norm+SwiGLU took 83 us
# a layer at T = 64 with the narrow tiles, more than TP 1's whole 28,672 rows (73 us): 32-row
# programs each re-read their 64 rows of x for half as many weight bytes.
WIDE_N = 12288


def tiles_for(weight_rows: int) -> tuple[Tile, ...]:
    """The shape buckets for a weight of `weight_rows` rows."""
    return WIDE_TILES if weight_rows >= WIDE_N else TILES


def pick_tile(rows: int, weight_rows: int = 0, tiles: tuple[Tile, ...] | None = None) -> Tile:
    """The bucket of `tiles` (default: those for a weight of `weight_rows` rows) serving `rows`."""
    return next(t for t in tiles or tiles_for(weight_rows) if t.max_rows is None or rows <= t.max_rows)


def with_bucket(tiles: tuple[Tile, ...], name: str, **changes) -> tuple[Tile, ...]:
    """`tiles` with bucket `name` changed: a fused kernel whose epilogue or extra loads want
    other proportions than the plain GEMM's keeps the same buckets."""
    return tuple(dataclasses.replace(t, **changes) if t.name == name else t for t in tiles)


def block_k(tile: Tile, element_bytes: int) -> int:
    return tile.block_k * 2 // element_bytes


def split_k(tile: Tile, k: int, bk: int) -> int:
    """The tile's K split where every part is a whole number of K tiles, else 1."""
    return tile.split_k if k % (tile.split_k * bk) == 0 else 1


def num_stages(block_m: int, weight_rows: int, bk: int, element_bytes: int, cap: int = 4,
               x_bytes: int | None = None, deep: bool = False) -> int:
    """Pipeline depth, at most `cap`, that keeps the x and W buffers within PIPELINE_SMEM on
    sm_80/sm_89, where Triton keeps num_stages - 1 of them, or with `deep` within
    DEEP_PIPELINE_SMEM on sm_90/sm_100, where it keeps num_stages. `x_bytes`: x's element size
    where it differs from W's (FP8 weights)."""
    per_stage = (block_m * (x_bytes or element_bytes) + weight_rows * element_bytes) * bk
    if deep:
        return max(2, min(cap, DEEP_PIPELINE_SMEM // per_stage))
    return max(2, min(cap, 1 + PIPELINE_SMEM // per_stage))


def pipelined(kernel: AotKernel, block_m: int, weight_rows: int, bk: int, element_bytes: int, cap: int,
              x_bytes: int | None = None) -> list[AotKernel]:
    """`kernel` with the deepest pipeline (`num_stages`) each of its targets has room for: one
    kernel, or one for sm_80/sm_89 and one for sm_90/sm_100 (same launch meta) where the depths
    differ."""
    depth = {deep: num_stages(block_m, weight_rows, bk, element_bytes, cap, x_bytes, deep) for deep in (False, True)}
    if depth[False] == depth[True]:
        return [dataclasses.replace(kernel, num_stages=depth[False])]
    targets = kernel.targets or tuple(TARGET_CC)
    groups = {deep: tuple(t for t in targets if (t in DEEP_PIPELINE_TARGETS) == deep) for deep in (False, True)}
    return [dataclasses.replace(kernel, num_stages=depth[deep], targets=groups[deep]) for deep in (False, True)
            if groups[deep]]


# Buckets in which the fused norm GEMMs' bf16 pointer kernels take x's row scales from the
# row-scale pre-pass (`linear.tma.row_scale_kernel`) instead of summing x^2 in their K loops,
# where every program re-reads its rows of x. On an H200 (session 16, scripts/tune_gemm.py,
# Llama-3-8B, weights cycled beyond the L2) the fused qkv took 23.7 us at T = 64 at its best
# tile summing and 17.3 reading the scales (the plain GEMM of its shape: 16.4), and 52.8 against
# 32.3 at T = 256; the pre-pass takes 1.7 and 2.1 us. At T = 1 the sums cost less than the
# extra launch.
PRESCALED_BUCKETS = ("small", "medium", "large")


def prescaled(tile: Tile, fp8_weight: bool) -> bool:
    """Whether a bucket's pointer kernel reads the row-scale pre-pass's scales (bf16 only: FP8
    rows come RMSNorm'd from the quantize pre-pass)."""
    return tile.name in PRESCALED_BUCKETS and not fp8_weight
