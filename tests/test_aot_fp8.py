"""The FP8 GEMM kernels compile ahead of time for every target with FP8 tensor cores (sm_89,
sm_90, sm_100) at Llama-3-8B's shapes, within each target's shared memory, and sm_80 gets none
(the builder refuses an FP8 engine for it). Each target holds one kernel per GEMM bucket and
the quantize pre-pass, and the PTX shows what the design relies on: the dots are e4m3 MMAs
(mma.sync on sm_89, wgmma from the small bucket on sm_90), sm_90 casts float32 to e4m3 in one
rounding, and sm_89, whose cast rounds through float16, rounds in float32 first (ROUND_E4M3).
On sm_90 and sm_100 the TMA buckets run the persistent TMA GEMM with e4m3 operands. (The CUDA
GEMVs that lead the FP8 buckets at one row are nvcc's: test_gemv builds those.)"""
import pytest

from gpu_build import compiled_json
from kiln.plugins.aot import MAX_SHARED_BYTES
from kiln.plugins.fp8 import FP8_TARGETS

SCRIPT = """
import importlib, json, re, sys
from kiln.plugins.aot import TARGET_CC, AotKernel, compile_kernel

SHAPES = {
    "linear": {"K": 4096, "N": 6144, "fp8": True},
    "linear_residual": {"K": 14336, "N": 4096, "fp8": True},
    "norm_swiglu": {"K": 4096, "I": 14336, "block": 64, "fp8": True},
    "norm_qkv_rope": {"K": 4096, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "fp8": True},
    # every optional input: unfolded norms, a bias, q/k norm
    "norm_qkv_rope_all": {"K": 2048, "num_heads": 16, "num_kv_heads": 2, "head_dim": 128, "bias": True,
                          "qk_norm": True, "norm_weight": True, "fp8": True},
    # with an e4m3 KV cache too: kv_scale_ptr beside w_scale_ptr
    "norm_qkv_rope_kv": {"K": 4096, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "fp8": True,
                         "fp8_kv": True, "block_size": 16},
    # a static activation scale: only the pre-pass differs (its GEMMs are those above), so only it is built
    "linear_static": {"K": 14336, "N": 4096, "fp8": True, "fp8_static": True},
    "norm_swiglu_static": {"K": 4096, "I": 14336, "block": 64, "fp8": True, "norm_weight": True, "fp8_static": True},
}
out = {}
for name, shapes in SHAPES.items():
    plugin = importlib.import_module(f"kiln.plugins.{re.sub('_(all|kv|static)$', '', name)}.kernels")
    kernels = [k for k in plugin.aot_kernels("bfloat16", shapes) if isinstance(k, AotKernel)
               and (k.meta.get("quantize") or not shapes.get("fp8_static"))]
    for target in TARGET_CC:
        rows = []
        for k in kernels:
            if k.targets is not None and target not in k.targets:
                continue
            row = {"fn": k.fn.__name__, "bucket": k.meta.get("bucket"), "fp8": k.meta.get("fp8"),
                   "quantize": bool(k.meta.get("quantize")), "static": bool(k.meta.get("static")),
                   "round": k.constexprs.get("ROUND_E4M3"),
                   "params": sorted(k.signature) == sorted(k.fn.arg_names)}
            compiled = compile_kernel(k, target)
            ptx = compiled.asm["ptx"]
            row.update(shared=compiled.metadata.shared, scratch=compiled.metadata.global_scratch_size,
                       elf=compiled.asm["cubin"].startswith(b"\\x7fELF"),
                       mma=sorted(set(re.findall(r"(?:mma\\.sync|wgmma\\.mma_async)[\\w.]*", ptx))),
                       cvt=sorted(set(re.findall(r"cvt[\\w.]*e4m3x2\\.f(?:16x2|32)", ptx))),
                       magic="0f4B400000" in ptx)
            rows.append(row)
        out[f"{name} {target}"] = rows
sys.stdout.write(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled() -> dict:
    return compiled_json(SCRIPT, timeout=1500)


NAMES = ["linear", "linear_residual", "norm_swiglu", "norm_qkv_rope", "norm_qkv_rope_all", "norm_qkv_rope_kv"]
STATIC = ["linear_static", "norm_swiglu_static"]
# The e4m3 KV write adds its own casts (test_kernels_fp8_kv checks those).
GEMM_INPUT_CASTS = NAMES[:-1] + STATIC


def test_sm80_gets_no_fp8_kernels(compiled):
    assert all(compiled[f"{name} sm_80"] == [] for name in NAMES + STATIC)


@pytest.mark.parametrize("target", FP8_TARGETS)
@pytest.mark.parametrize("name", STATIC)
def test_the_pre_pass_that_takes_a_static_scale_compiles(compiled, name, target):
    (row,) = compiled[f"{name} {target}"]
    assert row["fn"] == "quantize_rows_kernel" and row["static"] and row["params"] and row["elf"], row
    assert row["scratch"] == 0 and row["shared"] <= MAX_SHARED_BYTES[target], row
    assert row["round"] == (target == "sm_89"), row


@pytest.mark.parametrize("target", FP8_TARGETS)
@pytest.mark.parametrize("name", NAMES)
def test_every_bucket_and_the_pre_pass_compile(compiled, name, target):
    rows = compiled[f"{name} {target}"]
    # Narrow weights have an xlarge bucket (64-row TMA tiles up to 512 rows); gate/up's wide one not.
    buckets = ["decode", "small", "medium", "large"] + ([] if name == "norm_swiglu" else ["xlarge"]) + ["prefill"]
    assert [r["bucket"] for r in rows if r["bucket"]] == buckets
    assert [r["fp8"] for r in rows if r["bucket"]] == [True] * len(buckets)
    assert [r["fn"] for r in rows if r["quantize"]] == ["quantize_rows_kernel"]
    assert len(rows) == len(buckets) + 1
    # The prefill bucket runs the persistent TMA GEMM on sm_90 and later (with the norm weight
    # folded into the projection); its descriptors live in global scratch. Only the pre-pass
    # rounds to e4m3: every GEMM reads its rows.
    prefill = next(r for r in rows if r["bucket"] == "prefill")
    assert prefill["fn"].startswith("tma_") == (target != "sm_89" and name != "norm_qkv_rope_all"), prefill
    for r in rows:
        tma = r["fn"].startswith("tma_")
        assert r["params"] and r["elf"] and (r["scratch"] > 0) == tma, r
        assert r["shared"] <= MAX_SHARED_BYTES[target], r
        assert r["round"] == (target == "sm_89" if r["quantize"] else None), r


@pytest.mark.parametrize("name", NAMES)
def test_dots_are_e4m3_tensor_core_ops(compiled, name):
    for r in compiled[f"{name} sm_89"]:
        if r["bucket"]:
            assert r["mma"] == ["mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32"], r
    for r in compiled[f"{name} sm_90"]:
        if r["bucket"] and r["bucket"] != "decode":   # 16-row decode tiles take mma.sync from f16
            assert r["mma"] and all(m.startswith("wgmma.mma_async") and "e4m3.e4m3" in m for m in r["mma"]), r


@pytest.mark.parametrize("name", GEMM_INPUT_CASTS)
def test_casts_to_e4m3_round_once(compiled, name):
    """Where x is quantized (the pre-pass): sm_90 and sm_100 cast float32 directly; sm_89 casts
    through float16 and so rounds in float32 first (the magic constant of
    `linear.fp8._round_grid` survives compilation). The GEMMs never cast to e4m3."""
    for target in ("sm_90", "sm_100"):
        for r in compiled[f"{name} {target}"]:
            if r["quantize"]:
                assert r["cvt"] == ["cvt.rn.satfinite.e4m3x2.f32"] and not r["magic"], (target, r)
    for r in compiled[f"{name} sm_89"]:
        if r["quantize"]:
            assert r["cvt"] == ["cvt.rn.satfinite.e4m3x2.f16x2"] and r["magic"], r
    for target in ("sm_89", "sm_90", "sm_100"):
        assert all(r["cvt"] == [] for r in compiled[f"{name} {target}"] if not r["quantize"]), target


FLOAT32_SCRIPT = """
from kiln.plugins.aot import compile_kernel
from kiln.plugins.linear_residual.kernels import aot_kernels
tma = [k for k in aot_kernels("float32", {"K": 256, "N": 512, "fp8": True}) if k.meta.get("tma")]
print([len(tma), max(compile_kernel(k, "sm_90").metadata.shared for k in tma)])
"""


def test_a_float32_engines_fp8_tma_gemm_fits_sm90_shared_memory():
    """A float32 engine with e4m3 weights (what the GPU parity test builds) keeps its TMA GEMMs
    within sm_90's shared memory, the residual epilogue's float32 tile included: at 256 weight
    rows it needed 278,552 bytes and the H200 refused to load it."""
    count, shared = compiled_json(FLOAT32_SCRIPT)
    assert count and shared <= MAX_SHARED_BYTES["sm_90"], shared
