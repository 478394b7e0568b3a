"""What the CUDA GEMVs' launchers pass them (`plugins/linear/gemv.cu`, `gemv_fp8.cu`), without a GPU: each
plugin's launcher at one and two rows, the FP8 weight and activation scales, and the one-row handoffs (the SwiGLU
GEMV's staged row for down, the early attention's for o_proj). Which kernels a build makes, and their signatures,
are test_gemv.py's."""
from __future__ import annotations

import pytest
import torch

from kiln.plugins.fp8 import quantize_rows
from kiln.plugins.linear import gemv
from kiln.plugins.linear.fp8 import HANDOFF
from kiln.plugins.linear.launch import pick_bucket
from kiln.plugins.linear_residual import kernels as residual_kernels
from kiln.plugins.linear_residual import launch as residual_launch
from kiln.plugins.norm_qkv_rope import kernels as qkv_kernels
from kiln.plugins.norm_qkv_rope import launch as qkv_launch
from kiln.plugins.norm_swiglu import kernels as swiglu_kernels
from kiln.plugins.norm_swiglu import launch as swiglu_launch
from test_gemv import QKV, SWIGLU


class Recorder:
    """Stands in for a loaded kernel: records (grid, args)."""

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def launch(self, grid, args, stream=0) -> None:
        self.calls.append((grid, args))


def launched(module, aot: list, inputs: list, attrs: dict, out: torch.Tensor, scratch: dict | None = None):
    """(the kernel the launcher chose, its grid, its arguments) for one launch (`scratch`: the executor's)."""
    calls: list = []
    kernels = [Recorder(calls) for _ in aot]
    module.launch(kernels, [k.meta for k in aot], inputs, attrs, out, {"T": out.shape[0]}, 0, scratch or {})
    (grid, args), = calls
    chosen = aot[pick_bucket([k.meta for k in aot], out.shape[0])]
    assert len(args) == len(chosen.signature)
    return chosen, grid, args


def bf16(*shape) -> torch.Tensor:
    return torch.randn(*shape).to(torch.bfloat16)


@pytest.mark.parametrize("rows", [1, 2])
def test_linear_launcher_passes_the_gemv_parameters(rows):
    # down + residual (bias absent: a null pointer); every row of W covered by the grid.
    x, w, res, out = bf16(rows, 14336), bf16(4096, 14336), bf16(rows, 4096), bf16(rows, 4096)
    kernel, grid, args = launched(residual_launch, residual_kernels.aot_kernels("bfloat16", {"K": 14336, "N": 4096}),
                                  [x, w, None, res], {}, out)
    assert kernel.meta["bucket"] == f"gemv{rows}" and kernel.entry == f"kiln_gemv_linear_t{rows}"
    assert args == [x.data_ptr(), w.data_ptr(), 0, res.data_ptr(), out.data_ptr(), 4096, 14336]
    assert grid[0] * gemv.WARPS * gemv.LINEAR_ROWS_PER_WARP[rows] == 4096 and grid[1:] == (1, 1)



def test_qkv_launcher_passes_the_gemv_parameters():
    """norm + qkv + RoPE at one row: q to out, k and v into the cache (layer 3 of 4), bias given."""
    d = QKV["head_dim"]
    n = (QKV["num_heads"] + 2 * QKV["num_kv_heads"]) * d
    x, w, b, out = bf16(1, 4096), bf16(n, 4096), bf16(n), bf16(1, QKV["num_heads"] * d)
    positions, slots = torch.tensor([7], dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
    rope, cache = torch.randn(64, d), bf16(4, 2, 3, 16, QKV["num_kv_heads"], d)
    attrs = {"eps": 1e-6, "layer": 3, "num_heads": 32, "num_kv_heads": 8, "head_dim": d}
    kernel, grid, args = launched(qkv_launch, qkv_kernels.aot_kernels("bfloat16", {**QKV, "bias": True}),
                                  [x, None, w, b, None, None, positions, rope, cache, slots], attrs, out)
    assert kernel.entry == "kiln_gemv_qkv_rope_t1"
    assert args == [x.data_ptr(), 0, w.data_ptr(), b.data_ptr(), positions.data_ptr(), rope.data_ptr(),
                    cache.data_ptr(), slots.data_ptr(), out.data_ptr(), 48, 3, 1e-6, 32, 8, d, 4096]
    assert grid[0] * gemv.WARPS == n // 2   # one (j, j + d/2) pair of one head a warp


def test_swiglu_launcher_passes_the_gemv_parameters():
    """norm + gate/up + SwiGLU at one row, the norm weight unfolded."""
    x, norm, w, out = bf16(1, 4096), bf16(4096), bf16(2 * 14336, 4096), bf16(1, 14336)
    aot = swiglu_kernels.aot_kernels("bfloat16", {**SWIGLU, "norm_weight": True})
    kernel, grid, args = launched(swiglu_launch, aot, [x, norm, w], {"eps": 1e-5, "block": 64, "activation": "silu"},
                                  out)
    assert kernel.entry == "kiln_gemv_swiglu_t1"
    assert args == [x.data_ptr(), norm.data_ptr(), w.data_ptr(), out.data_ptr(), 14336, 64, 1e-5, 4096]
    assert grid == (14336 // gemv.WARPS, 1, 1)   # one output column a warp


def e4m3(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_rows(torch.randn(n, k))


def fp8_qkv_operands() -> tuple:
    """norm_qkv_rope's FP8 GEMV operands at one row: the e4m3 weight and its scales, q out, positions, slots,
    the RoPE table, a bf16 cache [4 layers, 2, 3 blocks, 16, kv heads, head_dim] and the attrs (layer 3)."""
    d = QKV["head_dim"]
    w, scale = e4m3((QKV["num_heads"] + 2 * QKV["num_kv_heads"]) * d, 4096)
    out, positions, slots = bf16(1, QKV["num_heads"] * d), torch.tensor([7], dtype=torch.int32), \
        torch.tensor([5], dtype=torch.int32)
    rope, cache = torch.randn(64, d), bf16(4, 2, 3, 16, QKV["num_kv_heads"], d)
    attrs = {"eps": 1e-6, "layer": 3, "num_heads": 32, "num_kv_heads": 8, "head_dim": d}
    return w, scale, out, positions, slots, rope, cache, attrs


def test_fp8_launchers_pass_the_weight_scales_after_the_weight():
    """FP8 at one row: each GEMV takes bf16 x (it quantizes x itself: no pre-pass is launched), the
    weight's float32 scales right after the weight, then the static activation scale (0: none)."""
    x, res, out = bf16(1, 14336), bf16(1, 4096), bf16(1, 4096)
    w, scale = e4m3(4096, 14336)
    kernel, grid, args = launched(residual_launch, residual_kernels.aot_kernels(
        "bfloat16", {"K": 14336, "N": 4096, "fp8": True}), [x, w, None, res, scale], {}, out)
    assert kernel.entry == "kiln_gemv_fp8_linear_t1"
    assert args == [x.data_ptr(), w.data_ptr(), scale.data_ptr(), 0, 0, res.data_ptr(), out.data_ptr(), 4096, 14336]
    assert grid[0] * gemv.WARPS * gemv.FP8_LINEAR_ROWS == 4096

    x, out = bf16(1, 4096), bf16(1, 14336)
    w, scale = e4m3(2 * 14336, 4096)
    aot = swiglu_kernels.aot_kernels("bfloat16", {**SWIGLU, "fp8": True})
    kernel, grid, args = launched(swiglu_launch, aot, [x, None, w, scale],
                                  {"eps": 1e-5, "block": 64, "activation": "silu"}, out)
    assert kernel.entry == "kiln_gemv_fp8_swiglu_t1"
    assert args == [x.data_ptr(), 0, w.data_ptr(), scale.data_ptr(), 0, out.data_ptr(), 14336, 64, 1e-5, 4096]
    assert grid[0] * gemv.WARPS * gemv.FP8_SWIGLU_COLS == 14336

    d = QKV["head_dim"]
    w, scale, out, positions, slots, rope, cache, attrs = fp8_qkv_operands()
    kernel, grid, args = launched(qkv_launch, qkv_kernels.aot_kernels("bfloat16", {**QKV, "fp8": True}),
                                  [x, None, w, None, None, None, positions, rope, cache, slots, None, scale], attrs,
                                  out)
    assert kernel.entry == "kiln_gemv_fp8_qkv_rope_t1"
    assert args == [x.data_ptr(), 0, w.data_ptr(), scale.data_ptr(), 0, 0, positions.data_ptr(), rope.data_ptr(),
                    cache.data_ptr(), slots.data_ptr(), out.data_ptr(), 48, 3, 1e-6, 32, 8, d, 4096]

    cache, kv_scales = e4m3(4 * 2 * 3 * 16 * QKV["num_kv_heads"], d)[0].view(4, 2, 3, 16, QKV["num_kv_heads"], d), \
        torch.rand(4, 2, QKV["num_kv_heads"])
    kernel, grid, args = launched(qkv_launch, qkv_kernels.aot_kernels("bfloat16", {**QKV, "fp8": True, "fp8_kv": True,
                                                                                  "block_size": 16}),
                                  [x, None, w, None, None, None, positions, rope, cache, slots, kv_scales, scale],
                                  attrs, out)
    assert kernel.entry == "kiln_gemv_fp8_qkv_rope_t1" and kernel.meta["fp8_kv"]
    # the cache's block size (16) after its scales: v's blocks are transposed
    assert args == [x.data_ptr(), 0, w.data_ptr(), scale.data_ptr(), 0, 0, positions.data_ptr(), rope.data_ptr(),
                    cache.data_ptr(), slots.data_ptr(), kv_scales.data_ptr(), 16, out.data_ptr(), 48, 3, 1e-6, 32, 8,
                    d, 4096]


def test_fp8_launchers_pass_the_static_scale_its_gemv_was_built_for():
    """A static GEMV gets the static activation scale after the weight's scales; one built without it
    given one, or one built with it given none, is refused by name before anything launches."""
    x, res, out = bf16(1, 14336), bf16(1, 4096), bf16(1, 4096)
    w, scale = e4m3(4096, 14336)
    static = torch.tensor([0.02])
    aot = residual_kernels.aot_kernels("bfloat16", {"K": 14336, "N": 4096, "fp8": True, "fp8_static": True})
    kernel, _, args = launched(residual_launch, aot, [x, w, None, res, scale, static], {}, out)
    assert kernel.meta["static"]
    assert args[:5] == [x.data_ptr(), w.data_ptr(), scale.data_ptr(), static.data_ptr(), 0]
    with pytest.raises(ValueError, match="FP8 GEMV built with a static activation scale, given none"):
        launched(residual_launch, aot, [x, w, None, res, scale], {}, out)
    plain = residual_kernels.aot_kernels("bfloat16", {"K": 14336, "N": 4096, "fp8": True})
    with pytest.raises(ValueError, match="FP8 GEMV built without a static activation scale, given one"):
        launched(residual_launch, plain, [x, w, None, res, scale, static], {}, out)

    x, out = bf16(1, 4096), bf16(1, 14336)
    w, scale = e4m3(2 * 14336, 4096)
    aot = swiglu_kernels.aot_kernels("bfloat16", {**SWIGLU, "fp8": True, "fp8_static": True})
    _, _, args = launched(swiglu_launch, aot, [x, None, w, scale, static], {"eps": 1e-5, "block": 64,
                                                                           "activation": "silu"}, out)
    assert args[3:5] == [scale.data_ptr(), static.data_ptr()]

    w, scale, out, positions, slots, rope, cache, attrs = fp8_qkv_operands()
    aot = qkv_kernels.aot_kernels("bfloat16", {**QKV, "fp8": True, "fp8_static": True})
    _, _, args = launched(qkv_launch, aot, [x, None, w, None, None, None, positions, rope, cache, slots, None, scale,
                                            static], attrs, out)
    assert args[3:5] == [scale.data_ptr(), static.data_ptr()]


def test_the_one_row_handoff_passes_the_staged_row():
    """At one row with the handoff, norm_swiglu's GEMV takes the handoff's scratch and down's static scale after
    its output, and down's GEMV takes that scratch in place of x; a plan and kernels that disagree are refused.
    Where down's GEMV is its own (no handoff entries), it takes x, attr or not."""
    scratch = {HANDOFF[0]: torch.zeros(64 * 14336, dtype=torch.uint8), HANDOFF[1]: torch.zeros(64 * 4)}
    x, act, static = bf16(1, 4096), bf16(1, 14336), torch.tensor([0.02])
    w_gu, s_gu = e4m3(2 * 14336, 4096)
    attrs = {"eps": 1e-5, "block": 64, "activation": "silu"}
    aot = swiglu_kernels.aot_kernels("bfloat16", {**SWIGLU, "fp8": True, "out_scale": True})
    kernel, grid, args = launched(swiglu_launch, aot, [x, None, w_gu, s_gu, None, static], attrs, act, scratch)
    assert kernel.entry == "kiln_gemv_fp8_swiglu_handoff_t1" and grid[0] * gemv.WARPS * gemv.FP8_SWIGLU_COLS == 14336
    assert args == [x.data_ptr(), 0, w_gu.data_ptr(), s_gu.data_ptr(), 0, act.data_ptr(),
                    scratch[HANDOFF[0]].data_ptr(), static.data_ptr(), 14336, 64, 1e-5, 4096]
    with pytest.raises(ValueError, match="hands its output on, and the plan gives it no out_scale"):
        launched(swiglu_launch, aot, [x, None, w_gu, s_gu], attrs, act, scratch)

    res, out = bf16(1, 4096), bf16(1, 4096)
    w, scale = e4m3(4096, 14336)
    shapes = {"K": 14336, "N": 4096, "fp8": True, "fp8_static": True}
    aot = residual_kernels.aot_kernels("bfloat16", {**shapes, "fp8_handoff": True})
    kernel, grid, args = launched(residual_launch, aot, [act, w, None, res, scale, static], {"fp8_handoff": True}, out,
                                  scratch)
    assert kernel.entry == "kiln_gemv_fp8_linear_prestaged_t1"
    assert args == [scratch[HANDOFF[0]].data_ptr(), w.data_ptr(), scale.data_ptr(), static.data_ptr(), 0,
                    res.data_ptr(), out.data_ptr(), 4096, 14336]
    with pytest.raises(ValueError, match="read x staged by the kernel before, in a plan that does not hand x on"):
        launched(residual_launch, aot, [act, w, None, res, scale, static], {}, out, scratch)
    for attrs in ({"fp8_handoff": True}, {}):
        kernel, _, args = launched(residual_launch, residual_kernels.aot_kernels("bfloat16", shapes),
                                   [act, w, None, res, scale, static], attrs, out, scratch)
        assert kernel.entry == "kiln_gemv_fp8_linear_t1" and args[0] == act.data_ptr()


@pytest.mark.parametrize("target,staged", [("sm_90", True), ("sm_89", False)])
def test_o_proj_reads_its_row_staged_by_the_early_attention_on_sm90(target, staged):
    """attention_o_proj with the handoff (a static FP8 o_proj, a bf16 cache), at one row: on sm_90 the EARLY
    decode attention hands the handoff's scratch its output staged (`attention.flash`), and o_proj's GEMV takes
    that scratch in place of x; on sm_89, which has no EARLY kernels, the GEMV stages the attention output."""
    from interpreted_launch import targeted
    from kiln.plugins.attention_o_proj import kernels as o_proj_kernels
    from kiln.plugins.attention_o_proj import launch as o_proj_launch
    from kiln.runtime.cuda_executor import op_scratch

    shapes = {"heads": 32, "kv_heads": 8, "head_dim": 128, "block_size": 16, "hidden": 4096, "fp8": True,
              "fp8_static": True, "handoff": True}
    aot = targeted(o_proj_kernels.aot_kernels("bfloat16", shapes), target)
    attrs = {"layer": 0, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "scale": 0.1, "window": 0,
             "all_reduce": False}
    limits = {"T": 8, "S": 8, "B": 16, "block_size": 16, "element_bytes": 2}
    scratch = {name: torch.zeros(nbytes, dtype=torch.uint8)
               for name, nbytes in op_scratch(o_proj_launch, attrs, [k.meta for k in aot], limits).items()}
    w, scale = e4m3(4096, 4096)
    q, res, out, static = bf16(1, 4096), bf16(1, 4096), bf16(1, 4096), torch.tensor([0.02])
    step = [torch.zeros(1, dtype=torch.int32), torch.zeros(1, 16, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
            torch.tensor([40], dtype=torch.int32)]
    inputs = [q, None, None, torch.zeros(1, 2, 4, 16, 8, 128, dtype=torch.bfloat16), *step, w, None, res, None, scale,
              static]
    calls: list = []

    class Named:
        def __init__(self, kernel) -> None:
            self.kernel = kernel

        def launch(self, grid, args, stream=0) -> None:
            calls.append((self.kernel, args))

    o_proj_launch.launch([Named(k) for k in aot], [k.meta for k in aot], inputs, attrs, out, {"T": 1}, 0, scratch)
    (attention, _), (gemm, args) = calls
    assert attention.meta["role"].startswith("decode_one" if staged else "decode") and attention.meta["handoff"]
    assert gemm.meta["bucket"] == "gemv1" and bool(gemm.meta.get("prestaged")) == staged
    x = scratch[HANDOFF[0]] if staged else scratch["attention_o_proj_attn"]
    assert args[0] == x.data_ptr() and args[1:4] == [w.data_ptr(), scale.data_ptr(), static.data_ptr()]
