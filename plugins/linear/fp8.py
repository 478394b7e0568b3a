"""The W8A8 (FP8) numerics of every GEMM plugin's FP8 kernels, on the GPU (`plugins.fp8`'s; their
GEMM core is `linear.kernels.fp8_gemm_tile`): e4m3 weights [N, K] with a float32 scale per weight
row, the GEMM input quantized per token (its largest magnitude, as `plugins.fp8` defines it after
an unfolded norm weight, over 448; round to nearest even,
saturating) by `quantize_rows_kernel`, e4m3 products summed in float32, then
acc * x_scale[row] * w_scale[col].

The GEMM input is the exact activation the bf16 kernels multiply: x for `linear`, the RMSNorm'd
row rounded to the activation dtype (times an unfolded norm weight) for the norm plugins. A
row's scale needs the whole row before the first product, so every FP8 GEMM launch is two
kernels: `quantize_rows_kernel` (one program per row: x read once, RMSNorm'd where the plugin
has a norm, e4m3 rows and their scales written to scratch), then the GEMM, whose K loop loads
e4m3 x, half the bytes of bf16. The persistent TMA GEMMs need this anyway: a TMA tile reaches
the tensor cores from shared memory without passing through registers, so it must already be
e4m3 in memory. (Quantizing inside the GEMM instead, each program walking its rows before its K
loop, made the decode GEMMs 3-4x slower than bf16 on an H200: every program repeats the
quantization of all its tile's rows. BENCHMARKS.md, 2026-11-30.)

An op with a static activation scale (calibrated at build time, or a checkpoint's input_scale)
has a pre-pass built to divide by that scale instead, which it writes as every row's scale, so
the GEMMs are the same either way (the norm plugins' RMSNorm still reads the whole row). A
static scale needs no row, so where the op's input is another GEMM plugin's output (the down
projection's, from norm_swiglu) the producer's epilogue can quantize it as it stores it: its
kernels for HANDOFF_ROWS rows also write the e4m3 rows and their scales into the scratch
buffers HANDOFF names (`store_handoff`), and the consumer's GEMM reads them there without a
pre-pass of its own (attr "fp8_handoff", `builder.passes.quantize`). Those are the same bytes
the pre-pass would have written from the stored output, so nothing changes but a launch. At one
row, where the CUDA GEMVs serve both (`linear.gemv.one_row_handoff`), the producer's GEMV writes
the row into HANDOFF[0] as the consumer's would stage it for itself (f16 e4m3 values in
`gemv_fp8.cu`'s layout), and the consumer's multiplies it without staging; o_proj's GEMV reads the
row so on sm_90 on, where the EARLY decode attention of a one-sequence step stages it (`attention.flash`).

Quantizing divides each element by its row's scale with a correctly rounded division, as
`plugins.fp8.to_e4m3` does: multiplying by the reciprocal is off by a float32 ulp at times, and
bf16 rows land on e4m3 rounding ties often enough (0.1% of elements) for that to show. The cast
to e4m3 is not always right either: on sm_89 Triton 3.6 converts float32 to e4m3 through
float16, rounding twice (a value just above a midpoint between two e4m3 values can land on it
in float16, then go to the even side), and Triton's interpreter drops a carry out of the
mantissa (124.2 becomes 64). There (ROUND_E4M3) the value is first rounded to the e4m3 grid in
float32 arithmetic, after which the cast is exact. The interpreter also truncates float32 to
bf16, so there (`EMULATE`, the GEMM kernels' UPCAST_DOT) bf16 rounding is done in float32 as
well, and the dot takes float32 tiles: products of e4m3 values are exact in float32 either way.

The dots are e4m3 tensor-core MMAs (mma.sync on sm_89, wgmma on sm_90 from the small bucket
on); for the 16-row decode tiles Triton 3.6 on sm_90 converts both tiles to float16 and uses
float16 mma.sync, which is exact too. In the TMA buckets sm_90 and sm_100 run the persistent TMA
GEMM of `linear.tma`. sm_80 has no FP8 tensor cores: FP8 kernels are built
for FP8_TARGETS only (the builder refuses an FP8 engine for sm_80).
"""
from __future__ import annotations

import triton
import triton.language as tl

from kiln.plugins.aot import FP8_POINTER, POINTER_TYPES, AotKernel, pointer_params
from kiln.plugins.fp8 import E4M3_MAX, FP8_TARGETS, MIN_SCALE

# Where a bucket runs the TMA GEMM on TMA targets, sm_89 keeps the pointer kernel.
POINTER_ONLY = ("sm_89",)
# (targets, ROUND_E4M3) of the quantize pre-pass: sm_89's float32 -> e4m3 cast rounds twice.
TARGET_GROUPS = ((("sm_89",), True), (("sm_90", "sm_100"), False))
QUANTIZE_WARPS = 8

_MAX = tl.constexpr(E4M3_MAX)
_MIN_SCALE = tl.constexpr(MIN_SCALE)


@triton.jit
def _round_grid(v, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr):
    """float32 v rounded to the nearest value (ties to even) of a float format with MANTISSA
    stored bits whose steps stop shrinking below 2^MIN_EXP, in float32 arithmetic: the step at
    v's binade is 2^(exponent - MANTISSA), and adding and subtracting 1.5 * 2^23 rounds v / step
    to an integer (scaling by powers of two is exact, so only that addition rounds)."""
    bits = v.to(tl.int32, bitcast=True)
    a = tl.abs(v)
    exponent = tl.maximum((bits >> 23) & 0xFF, 127 + MIN_EXP)
    step = ((exponent - MANTISSA) << 23).to(tl.float32, bitcast=True)
    inverse = ((254 + MANTISSA - exponent) << 23).to(tl.float32, bitcast=True)
    r = ((a * inverse + 12582912.0) - 12582912.0) * step
    return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def round_to(v, dtype: tl.constexpr, EMULATE: tl.constexpr):
    """float32 v rounded to `dtype`. The interpreter truncates float32 to bf16, so there
    (EMULATE) bf16 rounding is done in float32 arithmetic and the value stays float32; its
    float16 conversion is right. (Emulated bf16 ignores subnormals, which the tests never meet.)"""
    if EMULATE and dtype == tl.bfloat16:
        return _round_grid(v, 7, -119)
    return v.to(dtype)


@triton.jit
def to_e4m3(v, scale, ROUND_E4M3: tl.constexpr):
    """v / scale (per row) clamped to +-448 and rounded to e4m3 (subnormals below 2^-6): by the
    cast, or with ROUND_E4M3 in float32 arithmetic first (see the module docstring)."""
    v = tl.clamp(tl.math.div_rn(v.to(tl.float32), scale[:, None]), -_MAX, _MAX)
    if ROUND_E4M3:
        v = _round_grid(v, 3, -6)
    return v.to(tl.float8e4nv)


@triton.jit
def normalized(x, rstd, norm_ptr, cols, mask_k, NORM: tl.constexpr, EMULATE: tl.constexpr):
    """The GEMM input of a tile of x as the bf16 path has it: x itself, or with NORM the row
    times its RMSNorm scale rounded to x's dtype, then times an unfolded norm weight and rounded
    again (`rms_norm.reference`)."""
    if NORM:
        dtype: tl.constexpr = x.dtype
        x = round_to(x.to(tl.float32) * rstd[:, None], dtype, EMULATE)
        if norm_ptr is not None:
            g = tl.load(norm_ptr + cols, mask=mask_k, other=0.0).to(tl.float32)
            x = round_to(x.to(tl.float32) * g[None, :], dtype, EMULATE)
    return x


@triton.jit
def magnitudes(x, norm_ptr, cols, mask_k, NORM: tl.constexpr):
    """The largest |x| of each row of a tile of x, or with NORM and an unfolded norm weight the
    largest |x * g|: times rstd and rounded to x's dtype, the normalized row's largest magnitude
    as `plugins.fp8` defines it (`normed_row_scales`), found in the pass that finds rstd."""
    x = x.to(tl.float32)
    if NORM and norm_ptr is not None:
        x = x * tl.load(norm_ptr + cols, mask=mask_k, other=0.0).to(tl.float32)[None, :]
    return tl.max(tl.abs(x), axis=1)


@triton.jit
def scale_of(amax, rstd, dtype: tl.constexpr, NORM: tl.constexpr, EMULATE: tl.constexpr):
    """The e4m3 scale of a row from `magnitudes`' largest value and its RMSNorm factor."""
    if NORM:
        amax = round_to(amax * rstd, dtype, EMULATE).to(tl.float32)
    return tl.maximum(tl.math.div_rn(amax, _MAX), _MIN_SCALE)


@triton.jit
def row_stats(x_ptr, norm_ptr, offs_m, mask_m, eps, K: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_K: tl.constexpr, NORM: tl.constexpr, EMULATE: tl.constexpr, AMAX: tl.constexpr = True):
    """(x_scale, rstd) of rows offs_m of x [., K], in one pass: the e4m3 scale of each row's GEMM
    input and, with NORM, its RMSNorm factor (else 1). Without AMAX (the caller has its scale
    already) x_scale is meaningless and the norm weight is not read."""
    offs_k = tl.arange(0, BLOCK_K)
    ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * K + offs_k[None, :]
    sumsq = tl.zeros((BLOCK_M,), tl.float32)
    amax = tl.zeros((BLOCK_M,), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        x = tl.load(ptrs + k0, mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        sumsq += tl.sum(x * x, axis=1)
        if AMAX:
            amax = tl.maximum(amax, magnitudes(x, norm_ptr, k0 + offs_k, mask_k, NORM))
    rstd = tl.full((BLOCK_M,), 1.0, tl.float32)
    if NORM:
        rstd = tl.rsqrt(sumsq / K + eps)
    return scale_of(amax, rstd, x_ptr.dtype.element_ty, NORM, EMULATE), rstd


@triton.jit
def quantize_rows_kernel(x_ptr, norm_ptr, xq_ptr, scale_ptr, static_ptr, T, eps, K: tl.constexpr,
                         BLOCK_K: tl.constexpr, NORM: tl.constexpr, EMULATE: tl.constexpr, ROUND_E4M3: tl.constexpr):
    """Row program_id(0) of x [T, K] (RMSNorm'd with NORM) quantized: e4m3 values to xq [T, K],
    the row's scale to scale[T]. The scale is the row's own, or with static_ptr the static
    per-tensor one it holds ([1], fixed at build time; larger values saturate), copied to every
    row so that the GEMMs read one form. A row that fits one block is read once and kept in
    registers; a longer one is walked twice (`row_stats`, then the quantization). An unfolded norm
    weight's row scale is `plugins.fp8.normed_row_scales`: the largest |x * g| times rstd."""
    row = tl.program_id(0) + tl.zeros((1,), tl.int32)
    mask_m = row < T
    offs_k = tl.arange(0, BLOCK_K)
    offs = row.to(tl.int64)[:, None] * K + offs_k[None, :]
    if BLOCK_K >= K:
        mask_k = offs_k < K
        mask = mask_m[:, None] & mask_k[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        rstd = tl.full((1,), 1.0, tl.float32)
        if NORM:
            wide = x.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(wide * wide, axis=1) / K + eps)
        xn = normalized(x, rstd, norm_ptr, offs_k, mask_k, NORM, EMULATE).to(tl.float32)
        if static_ptr is not None:
            x_scale = tl.load(static_ptr + tl.zeros((1,), tl.int32))
        else:
            x_scale = scale_of(magnitudes(x, norm_ptr, offs_k, mask_k, NORM), rstd, x_ptr.dtype.element_ty, NORM,
                               EMULATE)
        tl.store(xq_ptr + offs, to_e4m3(xn, x_scale, ROUND_E4M3), mask=mask)
    else:
        x_scale, rstd = row_stats(x_ptr, norm_ptr, row, mask_m, eps, K, 1, BLOCK_K, NORM, EMULATE,
                                  static_ptr is None)
        if static_ptr is not None:
            x_scale = tl.load(static_ptr + tl.zeros((1,), tl.int32))
        for k0 in range(0, K, BLOCK_K):
            mask_k = offs_k < K - k0
            mask = mask_m[:, None] & mask_k[None, :]
            x = tl.load(x_ptr + offs + k0, mask=mask, other=0.0)
            q = to_e4m3(normalized(x, rstd, norm_ptr, k0 + offs_k, mask_k, NORM, EMULATE), x_scale, ROUND_E4M3)
            tl.store(xq_ptr + offs + k0, q, mask=mask)
    tl.store(scale_ptr + row, x_scale, mask=mask_m)


# The rows where a static FP8 GEMM's input comes from its producer's epilogue (`store_handoff`): from
# two rows (one row is the GEMVs', which divide by the static scale themselves) to the most the
# decode tiles of both plugins serve, 64 (past it norm_swiglu runs the persistent TMA GEMM on sm_90).
HANDOFF_ROWS = (2, 64)
# The scratch buffers of the handoff: e4m3 rows [T, K] and their scales [T].
HANDOFF = ("fp8_handoff", "fp8_handoff_scale")


def handoff_rows(rows: int) -> bool:
    """Whether a step of `rows` rows hands e4m3 rows on (where the plan has a handoff)."""
    return HANDOFF_ROWS[0] <= rows <= HANDOFF_ROWS[1]


def handoff_scratch(k: int) -> dict[str, int]:
    """The scratch bytes of a handoff of rows of k elements: for HANDOFF_ROWS' most rows only."""
    return {HANDOFF[0]: HANDOFF_ROWS[1] * k, HANDOFF[1]: HANDOFF_ROWS[1] * 4}


def staged_scratch(k: int) -> dict[str, int]:
    """The scratch bytes of the one-row handoff between the GEMVs (`linear.gemv.one_row_handoff`): a row of k
    values staged as f16 in HANDOFF[0], which the other rows' handoff sizes for far more."""
    return {HANDOFF[0]: 2 * k}


@triton.jit
def store_handoff(y, rows, offs, mask, scale_mask, q_ptr, q_scale_ptr, static_ptr, ROUND_E4M3: tl.constexpr):
    """An output tile y [R, C] (rows `rows` [R]), as stored in the activation dtype, quantized with the
    static scale at static_ptr for the next op's GEMM: e4m3 values to q_ptr + offs where `mask`, and the
    scale as the row's to q_scale[rows] where `scale_mask` (one program a row), as the static pre-pass
    writes them."""
    scale = tl.load(static_ptr + tl.zeros_like(rows))
    tl.store(q_ptr + offs, to_e4m3(y.to(tl.float32), scale, ROUND_E4M3), mask=mask)
    tl.store(q_scale_ptr + rows, scale, mask=scale_mask)


# Rows up to this long are quantized from registers in one read, with QUANTIZE_WARPS warps up to
# 4,096 elements and twice as many beyond (32 float32 values a thread, no spills on sm_90). On an
# H200 the two-pass walk of a 14,336-element row (Llama-3-8B's down projection, 4 blocks of
# 4,096) took about 13 us at T = 1, a third of the GEMM it feeds.
ONE_READ_MAX_K = 16384


def quantize_block_k(k: int) -> int:
    return triton.next_power_of_2(k) if k <= ONE_READ_MAX_K else 4096


def quantize_warps(k: int) -> int:
    return QUANTIZE_WARPS * (2 if quantize_block_k(k) > 4096 else 1)


def quantize_aot(dtype: str, k: int, norm: bool, norm_weight: bool, static: bool = False) -> list[AotKernel]:
    """The quantizing pre-pass of an FP8 plugin's GEMMs, once per group of TARGET_GROUPS with that
    group's ROUND_E4M3 (meta "quantize": no bucket); with `static` it takes the static activation
    scale (meta "static") instead of finding each row's."""
    ptr = POINTER_TYPES[dtype]
    signature = {"x_ptr": ptr, "norm_ptr": ptr if norm_weight else "constexpr", "xq_ptr": FP8_POINTER,
                 "scale_ptr": "*fp32", "static_ptr": "*fp32" if static else "constexpr", "T": "i32", "eps": "fp32",
                 "K": "constexpr", "BLOCK_K": "constexpr", "NORM": "constexpr", "EMULATE": "constexpr",
                 "ROUND_E4M3": "constexpr"}
    constexprs = {"K": k, "BLOCK_K": quantize_block_k(k), "NORM": norm, "EMULATE": False}
    for name, given in (("norm_ptr", norm_weight), ("static_ptr", static)):
        if not given:
            constexprs[name] = None
    meta = {"quantize": True, "grid": "(T, 1, 1)", "pointer_alignment": 16,
            "scratch_per_row": {"fp8_x": k, "fp8_x_scale": 4}}
    if static:
        meta["static"] = True
    return [AotKernel(quantize_rows_kernel, signature, {**constexprs, "ROUND_E4M3": round_first}, targets=targets,
                      num_warps=quantize_warps(k), num_stages=1, aligned=pointer_params(signature), meta=meta)
            for targets, round_first in TARGET_GROUPS]
