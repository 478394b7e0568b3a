"""The CUDA GEMVs (`plugins/linear/gemv.cu` and `gemv_fp8.cu`, `plugins.linear.gemv`) without a GPU: which shapes and
rows get them, that each entry point's C++ parameters are its declared signature, what each launcher
passes them at one and two rows, and that a build without nvcc leaves them out. Their cubins for every
target, and the order their SASS keeps around programmatic dependent launch, are test_gemv_sass.py's;
their numerics run on the GPU (test_gemv_gpu.py)."""
from __future__ import annotations

import re

import pytest
import torch

from kiln.plugins import get_plugin, nvcc
from kiln.plugins.fp8 import FP8_TARGETS, quantize_rows
from kiln.plugins.linear import gemv
from kiln.plugins.linear.fp8 import HANDOFF
from kiln.plugins.linear.launch import pick_bucket
from kiln.plugins.norm_qkv_rope import kernels as qkv_kernels
from kiln.plugins.norm_qkv_rope import launch as qkv_launch
from kiln.plugins.norm_swiglu import kernels as swiglu_kernels
from kiln.plugins.norm_swiglu import launch as swiglu_launch
from kiln.plugins.linear_residual import kernels as residual_kernels
from kiln.plugins.linear_residual import launch as residual_launch

QKV = {"K": 4096, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128}
SWIGLU = {"K": 4096, "I": 14336, "block": 64}
C_TYPES = {"const __nv_bfloat16*": "*bf16", "__nv_bfloat16*": "*bf16", "const int*": "*i32", "const float*": "*fp32",
           "const uint8_t*": "*fp8e4nv", "uint8_t*": "*fp8e4nv", "const __half*": "*fp16", "__half*": "*fp16",
           "int": "i32", "float": "fp32"}


def every_kernel() -> list[nvcc.NvccKernel]:
    return (gemv.linear_kernels("bfloat16", 4096, 14336) + gemv.qkv_kernels("bfloat16", QKV)
            + gemv.swiglu_kernels("bfloat16", SWIGLU)
            + gemv.swiglu_kernels("bfloat16", {**SWIGLU, "activation": "gelu_tanh"})
            + gemv.linear_kernels("bfloat16", 4096, 14336, fp8_weight=True)
            + gemv.qkv_kernels("bfloat16", {**QKV, "fp8": True, "norm_weight": True})
            + gemv.qkv_kernels("bfloat16", {**QKV, "fp8": True, "fp8_kv": True})
            + gemv.swiglu_kernels("bfloat16", {**SWIGLU, "fp8": True, "activation": "gelu_tanh"})
            + gemv.linear_kernels("bfloat16", 4096, 14336, fp8_weight=True, fp8_static=True)
            + gemv.qkv_kernels("bfloat16", {**QKV, "fp8": True, "fp8_static": True, "norm_weight": True})
            + gemv.swiglu_kernels("bfloat16", {**SWIGLU, "fp8": True, "fp8_static": True})
            + gemv.swiglu_kernels("bfloat16", {**SWIGLU, "fp8": True, "out_scale": True})
            + gemv.linear_kernels("bfloat16", 4096, 14336, fp8_weight=True, fp8_static=True,
                                  staged_targets=FP8_TARGETS))


def test_which_shapes_get_the_gemv_buckets():
    assert [k.meta["bucket"] for k in gemv.linear_kernels("bfloat16", 4096, 4096)] == ["gemv1", "gemv2"]
    assert [k.meta["grid"] for k in gemv.linear_kernels("bfloat16", 4096, 4096)] == [("256", "1", "1"),
                                                                                    ("256", "1", "1")]
    # Other dtypes, K off the 16-byte pieces: none.
    assert gemv.linear_kernels("float32", 4096, 4096) == gemv.linear_kernels("float16", 4096, 4096) == []
    assert gemv.linear_kernels("bfloat16", 4096, 4100) == []
    # Rows that do not fill the warps of a block (a warp takes 2 rows): 16 at least.
    assert gemv.linear_kernels("bfloat16", 8, 64) == []
    assert [k.meta["bucket"] for k in gemv.linear_kernels("bfloat16", 16, 64)] == ["gemv1", "gemv2"]
    # q/k norm needs whole heads, an e4m3 cache another store: the Triton tiles serve those.
    # The fused qkv at one row only (at two its GEMV lost to Triton's tile on an H200).
    assert [k.meta["bucket"] for k in gemv.qkv_kernels("bfloat16", QKV)] == ["gemv1"]
    assert gemv.qkv_kernels("bfloat16", {**QKV, "qk_norm": True}) == []
    assert gemv.qkv_kernels("bfloat16", {**QKV, "fp8_kv": True}) == []
    assert gemv.qkv_kernels("bfloat16", {**QKV, "num_heads": 3, "num_kv_heads": 1, "head_dim": 4}) == []  # 10 pairs
    # In the plugins they lead the buckets, so rows 1 and 2 pick them and 3 the Triton decode tile.
    metas = [k.meta for k in residual_kernels.aot_kernels("bfloat16", {"K": 14336, "N": 4096})]
    assert [metas[pick_bucket(metas, t)]["bucket"] for t in (1, 2, 3)] == ["gemv1", "gemv2", "decode"]
    metas = [k.meta for k in qkv_kernels.aot_kernels("bfloat16", QKV)]
    assert [metas[pick_bucket(metas, t)]["bucket"] for t in (1, 2)] == ["gemv1", "decode"]
    # gate/up + SwiGLU at one row, a warp per output column; its block is I when W_gu is not interleaved.
    metas = [k.meta for k in swiglu_kernels.aot_kernels("bfloat16", SWIGLU)]
    assert [metas[pick_bucket(metas, t)]["bucket"] for t in (1, 2)] == ["gemv1", "decode"]
    assert metas[0]["grid"] == ("1792", "1", "1") and metas[0]["block"] == 64
    assert gemv.swiglu_kernels("bfloat16", {**SWIGLU, "block": 0})[0].meta["block"] == 14336
    assert [k.instance for k in gemv.swiglu_kernels("bfloat16", {**SWIGLU, "activation": "gelu_tanh"})] == [
        "KILN_GEMV_SWIGLU(kiln_gemv_swiglu_t1, 1, true, false)"]
    # An unfolded norm weight is built in (a runtime null check cost 2.5 us of 58 on an H200).
    assert gemv.swiglu_kernels("bfloat16", {**SWIGLU, "norm_weight": True})[0].instance.endswith(", false, true)")
    assert gemv.swiglu_kernels("bfloat16", {**SWIGLU, "I": 12}) == []   # columns do not fill a block's warps


def test_fp8_weights_get_one_row_gemvs_for_the_fp8_targets():
    """With e4m3 weights: one "gemv1" bucket a plugin (x quantized in each block), built for the FP8
    targets only, where K is whole 16-byte pieces and fits the staging buffer; 2 weight rows a warp in
    the plain GEMV with 4 pieces of each in flight a lane, all built for programmatic dependent launch."""
    (linear,) = gemv.linear_kernels("bfloat16", 4096, 14336, fp8_weight=True)
    assert linear.meta["bucket"] == "gemv1" and linear.meta["fp8"] and linear.targets == FP8_TARGETS
    assert linear.meta["grid"] == ("256", "1", "1") and linear.instance.endswith("KILN_GEMV_FP8_LINEAR("
                                                                                  "kiln_gemv_fp8_linear_t1, 2, 4, 14336, false)")
    (short,) = gemv.linear_kernels("bfloat16", 4096, 4096, fp8_weight=True)
    assert short.instance.endswith("KILN_GEMV_FP8_LINEAR(kiln_gemv_fp8_linear_t1, 2, 4, 4096, false)")
    assert linear.meta["pdl"] and short.meta["pdl"]
    assert gemv.linear_kernels("bfloat16", 4096, 4104, fp8_weight=True) == []        # K % 16
    assert gemv.linear_kernels("bfloat16", 4096, 2 * 16384, fp8_weight=True) == []   # past FP8_KMAX
    assert gemv.linear_kernels("bfloat16", 8, 64, fp8_weight=True) == []             # 16 rows a block
    assert gemv.linear_kernels("float32", 4096, 4096, fp8_weight=True) == []
    (swiglu,) = gemv.swiglu_kernels("bfloat16", {**SWIGLU, "fp8": True})
    assert swiglu.meta["grid"] == ("448", "1", "1") and swiglu.meta["fp8"] and swiglu.targets == FP8_TARGETS
    (qkv,) = gemv.qkv_kernels("bfloat16", {**QKV, "fp8": True, "norm_weight": True})
    assert qkv.instance.endswith("KILN_GEMV_FP8_QKV_ROPE(kiln_gemv_fp8_qkv_rope_t1, 2, 4096, true, false)")
    (fp8_kv,) = gemv.qkv_kernels("bfloat16", {**QKV, "fp8": True, "fp8_kv": True})   # writes e4m3, scaled
    assert fp8_kv.instance.endswith("KILN_GEMV_FP8_QKV_ROPE_FP8_KV(kiln_gemv_fp8_qkv_rope_t1, 2, 4096, false, false)")
    assert fp8_kv.meta["fp8_kv"] and fp8_kv.signature["kv"] == "*fp8e4nv" and fp8_kv.targets == FP8_TARGETS
    # In the plugins the GEMV serves one row; two go to the quantize pre-pass and the Triton tile.
    for kernels in (residual_kernels.aot_kernels("bfloat16", {"K": 14336, "N": 4096, "fp8": True}),
                    qkv_kernels.aot_kernels("bfloat16", {**QKV, "fp8": True}),
                    swiglu_kernels.aot_kernels("bfloat16", {**SWIGLU, "fp8": True})):
        metas = [k.meta for k in kernels]
        assert [metas[pick_bucket(metas, t)]["bucket"] for t in (1, 2)] == ["gemv1", "decode"]
        assert metas[0].get("gemv") and metas[pick_bucket(metas, 2)]["fp8"]


def test_a_static_activation_scale_gets_static_fp8_gemvs():
    """With a static activation scale (fp8_static) each plugin's FP8 GEMV is built to divide by it (meta
    "static", the macros' last argument); two rows go to the quantize pre-pass, built to take it too."""
    (linear,) = gemv.linear_kernels("bfloat16", 4096, 14336, fp8_weight=True, fp8_static=True)
    assert linear.meta["static"] and linear.instance.endswith("(kiln_gemv_fp8_linear_t1, 2, 4, 14336, true)")
    for kernels in (residual_kernels.aot_kernels("bfloat16", {"K": 14336, "N": 4096, "fp8": True, "fp8_static": True}),
                    qkv_kernels.aot_kernels("bfloat16", {**QKV, "fp8": True, "fp8_static": True}),
                    swiglu_kernels.aot_kernels("bfloat16", {**SWIGLU, "fp8": True, "fp8_static": True})):
        metas = [k.meta for k in kernels]
        assert metas[0]["bucket"] == "gemv1" and metas[0]["static"] and kernels[0].instance.endswith(", true)")
        assert kernels[0].signature["x_static"] == "*fp32"
        assert metas[pick_bucket(metas, 2)]["bucket"] == "decode"
        assert [m.get("static") for m in metas if m.get("quantize")] == [True, True]   # sm_89's and the others'
        assert all(k.signature["static_ptr"] == "*fp32" for k in kernels if k.meta.get("quantize"))
    for kernels in (residual_kernels.aot_kernels("bfloat16", {"K": 14336, "N": 4096, "fp8": True}),
                    swiglu_kernels.aot_kernels("bfloat16", {**SWIGLU, "fp8": True})):
        assert "static" not in kernels[0].meta and kernels[0].instance.endswith(", false)")


def test_the_one_row_handoff_gets_its_two_gemvs_where_both_sides_have_one():
    """norm_swiglu with the down projection's scale (out_scale) and down with attr fp8_handoff (a compile shape)
    get the entries that stage x in one and read it staged in the other, at one row, exactly where both would
    have a GEMV; elsewhere each keeps its own (down stages x itself), and two rows go to the Triton handoff."""
    handing = {**SWIGLU, "fp8": True, "out_scale": True}
    (swiglu,) = gemv.swiglu_kernels("bfloat16", handing)
    assert swiglu.entry == "kiln_gemv_fp8_swiglu_handoff_t1" and swiglu.meta["handoff"]
    assert swiglu.instance.endswith("KILN_GEMV_FP8_SWIGLU_HANDOFF(kiln_gemv_fp8_swiglu_handoff_t1, 4, 1, 4096, false, "
                                    "false, false)")
    assert swiglu.meta["scratch"] == {HANDOFF[0]: 2 * 14336} and swiglu.targets == FP8_TARGETS
    assert list(swiglu.signature)[5:8] == ["out", "staged", "out_scale"]
    (down,) = residual_kernels.aot_kernels("bfloat16", {"K": 14336, "N": 4096, "fp8": True, "fp8_static": True,
                                                         "fp8_handoff": True})[:1]
    assert down.entry == "kiln_gemv_fp8_linear_prestaged_t1" and down.meta["prestaged"] and down.meta["static"]
    assert down.instance.endswith("KILN_GEMV_FP8_LINEAR_PRESTAGED(kiln_gemv_fp8_linear_prestaged_t1, 2, 4, 14336, "
                                  "true)")
    assert list(down.signature) == ["staged", *list(gemv.FP8_LINEAR_SIGNATURE)[1:]] and down.targets == FP8_TARGETS
    # Where either side has no GEMV, neither hands on at one row: a hidden size off the linear GEMV's 16 rows a
    # block, an intermediate size past FP8_KMAX (down's K) or off the SwiGLU GEMV's 32 columns a block.
    for hidden, inter in ((4104, 14336), (4096, 2 * 16384), (4096, 14352)):
        assert not gemv.one_row_handoff("bfloat16", hidden, inter)
        assert all("handoff" not in k.meta for k in gemv.swiglu_kernels("bfloat16", {**handing, "K": hidden,
                                                                                      "I": inter}))
        assert all("prestaged" not in k.meta for k in residual_kernels.aot_kernels(
            "bfloat16", {"K": inter, "N": hidden, "fp8": True, "fp8_static": True, "fp8_handoff": True}))
    assert gemv.one_row_handoff("bfloat16", 4096, 14336)
    # Without the plan's handoff, or without a static scale, the entries are the plain ones.
    assert gemv.swiglu_kernels("bfloat16", {**SWIGLU, "fp8": True})[0].entry == "kiln_gemv_fp8_swiglu_t1"
    assert gemv.linear_kernels("bfloat16", 4096, 14336, True, True)[0].entry == "kiln_gemv_fp8_linear_t1"
    assert gemv.linear_kernels("bfloat16", 4096, 14336, True, False, FP8_TARGETS)[0].entry == "kiln_gemv_fp8_linear_t1"
    # Staged on some targets only (o_proj's, by the EARLY attention on sm_90 on): the plain entry for the others.
    staged, own = gemv.linear_kernels("bfloat16", 4096, 4096, True, True, ("sm_90", "sm_100"))
    assert (staged.entry, staged.targets, own.entry, own.targets) == (
        "kiln_gemv_fp8_linear_prestaged_t1", ("sm_90", "sm_100"), "kiln_gemv_fp8_linear_t1", ("sm_89",))
    # In the plugins: linear_residual's compile shapes carry the attr, and each GEMV serves one row.
    shapes = {"weight": (4096, 14336), "bias": None, "weight_scale": (4096,), "weight_input_scale": (1,)}
    assert get_plugin("linear_residual").compile_shapes(shapes, {"fp8_handoff": True}, 16)["fp8_handoff"]
    assert "fp8_handoff" not in get_plugin("linear_residual").compile_shapes(shapes, {}, 16)
    for kernels, entry in ((swiglu_kernels.aot_kernels("bfloat16", {**handing, "fp8_static": True}),
                            "kiln_gemv_fp8_swiglu_handoff_t1"),
                           (residual_kernels.aot_kernels("bfloat16", {"K": 14336, "N": 4096, "fp8": True,
                                                                      "fp8_static": True, "fp8_handoff": True}),
                            "kiln_gemv_fp8_linear_prestaged_t1")):
        metas = [k.meta for k in kernels]
        assert kernels[pick_bucket(metas, 1)].entry == entry and metas[pick_bucket(metas, 2)]["bucket"] == "decode"


def test_entry_points_take_their_signatures():
    """Each macro's C++ parameter list, in order, is the signature the runtime packs arguments by."""
    source = "".join(path.read_text() for path in (gemv.SOURCE, gemv.FP8_SOURCE, gemv.FP8_QKV_SOURCE))
    params = {}
    for macro, body in re.findall(r"#define (KILN_GEMV_\w+)\(NAME[^)]*\)(.*?)\{", source, re.S):
        text = re.search(r"NAME\((.*)\)", body.replace("\\\n", " "), re.S).group(1)
        params[macro] = [C_TYPES[" ".join(p.split()[:-1])] for p in text.split(",")]
    assert set(params) == {"KILN_GEMV_LINEAR", "KILN_GEMV_QKV_ROPE", "KILN_GEMV_SWIGLU", "KILN_GEMV_FP8_LINEAR",
                           "KILN_GEMV_FP8_QKV_ROPE", "KILN_GEMV_FP8_QKV_ROPE_FP8_KV", "KILN_GEMV_FP8_SWIGLU",
                           "KILN_GEMV_FP8_LINEAR_PRESTAGED", "KILN_GEMV_FP8_SWIGLU_HANDOFF"}
    for kernel in every_kernel():
        call = kernel.instance.splitlines()[-1]
        macro = call.split("(")[0]
        assert list(kernel.signature.values()) == params[macro], kernel.entry
        assert call.startswith(f"{macro}({kernel.entry},")


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


def test_a_build_without_nvcc_leaves_the_gemvs_out(factory, tmp_path, monkeypatch):
    from gpu_build import build_cli
    from kiln.runtime.engine import load_engine

    monkeypatch.setenv("KILN_NVCC", "")   # as on a machine without the CUDA toolkit
    done = build_cli(factory.checkpoint("llama3"), tmp_path / "engine", ["sm_89"], tmp_path / "cache")
    assert done.returncode == 0, done.stderr
    assert "nvcc not found" in done.stdout + done.stderr and "KILN_NVCC" in done.stdout + done.stderr
    engine = load_engine(tmp_path / "engine", target="sm_89", verify=False)
    buckets = {k.launch.get("bucket") for k in engine.manifest.kernels.values()}
    assert "decode" in buckets and not buckets & {"gemv1", "gemv2"}
