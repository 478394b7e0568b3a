"""The CUDA GEMVs (`plugins/linear/gemv.cu` and `gemv_fp8.cu`, `plugins.linear.gemv`) without a GPU: which shapes and
rows get them, that each entry point's C++ parameters are its declared signature, and that a build without nvcc
leaves them out. What each launcher passes them is test_gemv_launch.py's; their cubins for every target, and the
order their SASS keeps around programmatic dependent launch, are test_gemv_sass.py's; their numerics run on the
GPU (test_gemv_gpu.py)."""
from __future__ import annotations

import re

from kiln.plugins import get_plugin, nvcc
from kiln.plugins.fp8 import FP8_TARGETS
from kiln.plugins.linear import gemv
from kiln.plugins.linear.fp8 import HANDOFF
from kiln.plugins.linear.launch import pick_bucket
from kiln.plugins.norm_qkv_rope import kernels as qkv_kernels
from kiln.plugins.norm_swiglu import kernels as swiglu_kernels
from kiln.plugins.linear_residual import kernels as residual_kernels

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
