"""The decode GEMVs for one and two rows of x (`gemv.cu`, CUDA C++ built by nvcc): buckets "gemv1"
and "gemv2" ahead of the Triton decode tiles in linear and linear_residual (so attention_o_proj's
o_proj and the LM head too), and "gemv1" in norm_qkv_rope and norm_swiglu.

On an H200 (scripts/probe_cuda_gemv.py, Llama-3-8B's projections, weights cycled beyond the L2) a
chain of 32 layers of plain GEMVs of the four shapes took 3.41 ms at T = 1 against 3.72 for the
Triton decode tiles (3.55 against 3.76 at T = 2; from T = 4 on the FMAs on the CUDA cores cost more
than Triton's MMA tiles: 4.15 against 3.77). The engine's kernels through their launchers, in us,
GEMV against Triton (sessions 21 and 22 of BENCHMARKS.md; the two-row qkv and SwiGLU GEMVs are not
built: those figures are their first forms'):

| kernel | T = 1 | T = 2 |
| --- | ---: | ---: |
| o_proj + residual | 10.0 / 12.1 | 10.4 / 12.0 |
| down (linear) | 28.8 / 31.7 | 29.1 / 31.4 |
| norm + qkv + RoPE + KV write | 15.5 / 17.1 | 21.1 / 17.2 |
| norm + gate/up + SwiGLU | 55.0 / 59.6 | 60.5 / 58.4 |

So the fused qkv and gate/up take a GEMV at one row only. (The SwiGLU GEMV at two rows with the norm
flag as a template argument took 56.2 against 59.0 through its launcher, not yet measured in a step.)
The FP8 GEMVs (one row) took an FP8 engine's decode at batch 1 from 304 to 347 tok/s, 1.39x the bf16
engine's in the same run (session 23).

They serve bf16 engines, where K % 8 == 0 (16-byte pieces of a row) and the rows divide among the
warps; norm_qkv_rope's only without q/k norm (which needs whole heads), and with a bf16 cache unless
the weights are FP8 too (the FP8 GEMV writes an e4m3 cache with its scales: "fp8_kv" in its meta). With
FP8 weights (`gemv_fp8.cu`, compiled appended to `gemv.cu`, for the FP8 targets only) each plugin
gets a "gemv1" bucket where K % 16 == 0 and K <= FP8_KMAX (each block stages x, quantized, in shared
memory), in place of the quantize pre-pass and Triton tile at one row; its meta carries "fp8" too
and its launch the weight scales after the weight, then the static activation scale: a plugin with one
("fp8_static") gets entries built to divide by it (meta "static"), the others find each row's scale
and take 0 there. Where norm_swiglu hands its output on to a static down projection (`linear.fp8`'s
handoff) and both get a GEMV (`one_row_handoff`), norm_swiglu's stages its output for down's too (meta
"handoff": the handoff's scratch and down's scale after its output), and down's reads x staged there
instead of staging it (meta "prestaged": that scratch in place of x); so does o_proj's on sm_90 on, staged
by the EARLY decode attention (`attention_o_proj`'s "staged_targets"). Each bucket's meta carries "gemv",
"pdl" (its kernel waits in the kernel for the one before: `runtime.cuda_driver` launches it so) and the
constant grid; the launchers pass the kernel's parameters (the .cu files' entry points) with absent
optional pointers as 0.
"""
from __future__ import annotations

from pathlib import Path

from kiln.plugins.fp8 import FP8_TARGETS
from kiln.plugins.linear.fp8 import staged_scratch
from kiln.plugins.nvcc import NvccKernel

SOURCE = Path(__file__).with_name("gemv.cu")
FP8_SOURCE = Path(__file__).with_name("gemv_fp8.cu")
FP8_QKV_SOURCE = Path(__file__).with_name("gemv_fp8_qkv.cu")   # norm_qkv_rope's, appended after FP8_SOURCE
WARPS = 8
# Weight rows per warp of the plain GEMV at each row count it serves (one bucket each). Two at T = 1:
# on an H200 (probe_cuda_gemv.py, 2026-12-02) o_proj 9.84 us against 10.48 with one, down 28.75
# against 29.80 (a run the day before had o_proj 10.0 against 10.3 the other way round).
LINEAR_ROWS_PER_WARP = {1: 2, 2: 2}
LINEAR_SIGNATURE = {"x": "*bf16", "w": "*bf16", "bias": "*bf16", "residual": "*bf16", "out": "*bf16",
                    "N": "i32", "K": "i32"}
SWIGLU_SIGNATURE = {"x": "*bf16", "norm": "*bf16", "w": "*bf16", "out": "*bf16", "I": "i32", "block": "i32",
                    "eps": "fp32", "K": "i32"}
# FP8: the longest row a block stages (as f16: 32 KiB of shared memory); the weight rows a warp takes in
# the linear GEMV, the output columns in the SwiGLU one, and the pieces a row per lane an iteration.
# Chosen on an H200 with weights cycled beyond the L2 (scripts/probe_fp8_gemv.py, BENCHMARKS.md sessions
# 23 and 24), in us: o_proj 5.79 with 2 rows and 4 pieces against 8.11 with 2 and 2, 5.83 with 1 and 4;
# down 16.70 with 2 and 4 against 19.01 with 2 and 2 and 21.38 with 1 and 4; gate/up 31.51 with 4
# columns and 1 piece against 32.32 with 2 and 2 and 30.68 with 1 and 4 (in the engine's step 4
# columns gave decode b=1 347 tok/s, 1 column and 4 pieces 314, session 23); qkv 9.18 with 2 pieces
# against 10.34 with 4 and 11.20 with 1. On an H100 (session 45), 4 rows x 4 pieces and 2 columns x 2
# pieces, faster alone, gave the same b=1 step, and lost alone once x was read after the PDL wait.
FP8_KMAX = 16384
FP8_LINEAR_ROWS, FP8_LINEAR_PIECES, FP8_SWIGLU_COLS, FP8_SWIGLU_PIECES, FP8_QKV_PIECES = 2, 4, 4, 1, 2
FP8_LINEAR_SIGNATURE = {"x": "*bf16", "w": "*fp8e4nv", "w_scale": "*fp32", "x_static": "*fp32", "bias": "*bf16",
                        "residual": "*bf16", "out": "*bf16", "N": "i32", "K": "i32"}
FP8_SWIGLU_SIGNATURE = {"x": "*bf16", "norm": "*bf16", "w": "*fp8e4nv", "w_scale": "*fp32", "x_static": "*fp32",
                        "out": "*bf16", "I": "i32", "block": "i32", "eps": "fp32", "K": "i32"}
# The one-row handoff's entries: the SwiGLU GEMV's also takes the staged row and down's static scale after its
# output, and down's takes the staged row (f16, `gemv_fp8.cu`'s layout) in place of x.
FP8_SWIGLU_HANDOFF_SIGNATURE = {"x": "*bf16", "norm": "*bf16", "w": "*fp8e4nv", "w_scale": "*fp32",
                                "x_static": "*fp32", "out": "*bf16", "staged": "*fp16", "out_scale": "*fp32",
                                "I": "i32", "block": "i32", "eps": "fp32", "K": "i32"}
FP8_LINEAR_PRESTAGED_SIGNATURE = {"staged": "*fp16", **{k: v for k, v in FP8_LINEAR_SIGNATURE.items() if k != "x"}}
QKV_SIGNATURE = {"x": "*bf16", "norm": "*bf16", "w": "*bf16", "bias": "*bf16", "positions": "*i32",
                 "rope": "*fp32", "kv": "*bf16", "slots": "*i32", "out": "*bf16", "num_slots": "i32",
                 "layer": "i32", "eps": "fp32", "H": "i32", "KVH": "i32", "D": "i32", "K": "i32"}
FP8_QKV_SIGNATURE = {"x": "*bf16", "norm": "*bf16", "w": "*fp8e4nv", "w_scale": "*fp32", "x_static": "*fp32",
                     "bias": "*bf16", "positions": "*i32", "rope": "*fp32", "kv": "*bf16", "slots": "*i32", "out": "*bf16",
                     "num_slots": "i32", "layer": "i32", "eps": "fp32", "H": "i32", "KVH": "i32", "D": "i32",
                     "K": "i32"}


def _with_e4m3_cache(signature: dict) -> dict:
    """A qkv signature for an e4m3 cache: its pointer, and its scales and block size after the slots."""
    out = {}
    for name, kind in signature.items():
        out[name] = "*fp8e4nv" if name == "kv" else kind
        if name == "slots":
            out["kv_scales"] = "*fp32"
            out["kv_block"] = "i32"
    return out


FP8_QKV_FP8_KV_SIGNATURE = _with_e4m3_cache(FP8_QKV_SIGNATURE)


def _serves(dtype: str, k: int, fp8_weight: bool) -> bool:
    if fp8_weight:
        return dtype == "bfloat16" and k % 16 == 0 and k <= FP8_KMAX
    return dtype == "bfloat16" and k % 8 == 0


def _fp8_kernel(name: str, macro: str, args: str, signature: dict, meta: dict, static: bool,
                sources: tuple[Path, ...] = (FP8_SOURCE,), targets: tuple[str, ...] = FP8_TARGETS) -> NvccKernel:
    """An FP8 entry point: `sources` (gemv_fp8.cu and the files after it) and the call `macro(name, args,
    static)` appended to `gemv.cu` (the last argument: whether it divides by a static activation scale,
    meta "static")."""
    call = f"{macro}({name}, {args}, {_cpp(static)})"
    meta = {**meta, "fp8": True, **({"static": True} if static else {})}
    text = "\n".join(source.read_text() for source in sources)
    return NvccKernel(SOURCE, name, f"{text}\n{call}", signature, WARPS, meta, targets=targets)


def _cpp(flag: bool) -> str:
    """A template argument: whether the SwiGLU GEMV was built for GELU, or for an unfolded norm weight."""
    return "true" if flag else "false"


def _meta(rows: int, programs: int, **extra) -> dict:
    return {"bucket": f"gemv{rows}", "max_rows": rows, "gemv": True, "pointer_alignment": 16, "split_k": 1,
            "grid": (str(programs), "1", "1"), "pdl": True, **extra}


def one_row_handoff(dtype: str, hidden: int, inter: int) -> bool:
    """Whether an FP8 norm_swiglu of `hidden` to `inter` features that hands its output on to a static down
    projection of `inter` to `hidden` (`builder.passes.quantize.hand_off_fp8`) does so at one row too: where
    both get a GEMV. Each side asks it of the same two sizes (norm_swiglu's K and I, down's N and K), so
    norm_swiglu's GEMV stages the row exactly when down's reads it."""
    return (_serves(dtype, hidden, True) and inter % (WARPS * FP8_SWIGLU_COLS) == 0
            and _serves(dtype, inter, True) and hidden % (WARPS * FP8_LINEAR_ROWS) == 0)


def linear_kernels(dtype: str, n: int, k: int, fp8_weight: bool = False, fp8_static: bool = False,
                   staged_targets: tuple[str, ...] = ()) -> list[NvccKernel]:
    """out = x W^T (+ bias) (+ residual) for W [n, k]; on `staged_targets` (where x's producer stages x at one
    row for a static FP8 GEMM: down's SwiGLU GEMV, `one_row_handoff`, or o_proj's EARLY decode attention) the
    FP8 one reads x staged there, on the other FP8 targets it stages x itself."""
    if not _serves(dtype, k, fp8_weight):
        return []
    if fp8_weight:
        if n % (WARPS * FP8_LINEAR_ROWS):
            return []
        args, meta = f"{FP8_LINEAR_ROWS}, {FP8_LINEAR_PIECES}, {k}", _meta(1, n // (WARPS * FP8_LINEAR_ROWS))
        staged = tuple(t for t in FP8_TARGETS if t in staged_targets) if fp8_static else ()
        own = tuple(t for t in FP8_TARGETS if t not in staged)
        kernels = [_fp8_kernel("kiln_gemv_fp8_linear_prestaged_t1", "KILN_GEMV_FP8_LINEAR_PRESTAGED", args,
                               FP8_LINEAR_PRESTAGED_SIGNATURE, {**meta, "prestaged": True}, fp8_static,
                               targets=staged)] if staged else []
        if own:
            kernels.append(_fp8_kernel("kiln_gemv_fp8_linear_t1", "KILN_GEMV_FP8_LINEAR", args, FP8_LINEAR_SIGNATURE,
                                       meta, fp8_static, targets=own))
        return kernels
    kernels = []
    for t, r in LINEAR_ROWS_PER_WARP.items():
        if n % (WARPS * r) == 0:
            name = f"kiln_gemv_linear_t{t}"
            kernels.append(NvccKernel(SOURCE, name, f"KILN_GEMV_LINEAR({name}, {t}, {r})", LINEAR_SIGNATURE, WARPS,
                                      _meta(t, n // (WARPS * r))))
    return kernels


def qkv_kernels(dtype: str, shapes: dict) -> list[NvccKernel]:
    """norm_qkv_rope's bucket for `shapes` (the plugin's compile shapes), where it serves them: one row
    only (the module docstring says why)."""
    heads, kv_heads, d, k = shapes["num_heads"], shapes["num_kv_heads"], shapes["head_dim"], shapes["K"]
    pairs = (heads + 2 * kv_heads) * d // 2
    fp8_weight, fp8_kv = shapes.get("fp8", False), shapes.get("fp8_kv", False)
    if (not _serves(dtype, k, fp8_weight) or shapes.get("qk_norm") or (fp8_kv and not fp8_weight)
            or d % 2 or pairs % WARPS):
        return []
    meta = _meta(1, pairs // WARPS, heads=heads, kv_heads=kv_heads, head_dim=d)
    if fp8_weight:
        name = "kiln_gemv_fp8_qkv_rope_t1"
        macro = "KILN_GEMV_FP8_QKV_ROPE_FP8_KV" if fp8_kv else "KILN_GEMV_FP8_QKV_ROPE"
        args = f"{FP8_QKV_PIECES}, {k}, {_cpp(shapes.get('norm_weight', False))}"
        return [_fp8_kernel(name, macro, args, FP8_QKV_FP8_KV_SIGNATURE if fp8_kv else FP8_QKV_SIGNATURE,
                            {**meta, "fp8_kv": fp8_kv}, shapes.get("fp8_static", False),
                            (FP8_SOURCE, FP8_QKV_SOURCE))]
    name = "kiln_gemv_qkv_rope_t1"
    return [NvccKernel(SOURCE, name, f"KILN_GEMV_QKV_ROPE({name}, 1)", QKV_SIGNATURE, WARPS, meta)]


def swiglu_kernels(dtype: str, shapes: dict) -> list[NvccKernel]:
    """norm_swiglu's bucket for `shapes` (the plugin's compile shapes), where it serves them: one row,
    a warp per output column (its gate and up rows), FP8_SWIGLU_COLS of them with FP8 weights; with
    "out_scale" (its output handed on to down) the one that stages it for down where `one_row_handoff` holds."""
    inter, k = shapes["I"], shapes["K"]
    activation = shapes.get("activation", "silu")
    fp8_weight = shapes.get("fp8", False)
    cols = FP8_SWIGLU_COLS if fp8_weight else 1
    if not _serves(dtype, k, fp8_weight) or inter % (WARPS * cols) or activation not in ("silu", "gelu_tanh"):
        return []
    flags = f"{_cpp(activation == 'gelu_tanh')}, {_cpp(shapes.get('norm_weight', False))}"
    meta = _meta(1, inter // (WARPS * cols), block=shapes["block"] or inter)
    if fp8_weight:
        args = f"{cols}, {FP8_SWIGLU_PIECES}, {k}, {flags}"
        if shapes.get("out_scale") and one_row_handoff(dtype, k, inter):
            meta = {**meta, "handoff": True, "scratch": staged_scratch(inter)}
            return [_fp8_kernel("kiln_gemv_fp8_swiglu_handoff_t1", "KILN_GEMV_FP8_SWIGLU_HANDOFF", args,
                                FP8_SWIGLU_HANDOFF_SIGNATURE, meta, shapes.get("fp8_static", False))]
        return [_fp8_kernel("kiln_gemv_fp8_swiglu_t1", "KILN_GEMV_FP8_SWIGLU", args, FP8_SWIGLU_SIGNATURE, meta,
                            shapes.get("fp8_static", False))]
    name = "kiln_gemv_swiglu_t1"
    return [NvccKernel(SOURCE, name, f"KILN_GEMV_SWIGLU({name}, 1, {flags})", SWIGLU_SIGNATURE, WARPS, meta)]


def address(tensor) -> int:
    """A kernel argument for an optional tensor: its address, or 0 (the kernel's null) when absent."""
    return 0 if tensor is None else tensor.data_ptr()

