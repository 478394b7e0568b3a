"""The GEMM-family Triton kernels' AOT compilation to cubins for every target: one kernel per
row bucket, the CUDA GEMVs and CuTe GEMMs where they lead, the row-scale pre-pass, shared
memory within each target's limit. Compiling needs compiled-mode kernels: where this process
built them for the interpreter, `gemm_modes` runs each test in a child process without it.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402

import pytest  # noqa: E402

import kiln.plugins.linear.tiles as linear_tiles  # noqa: E402
import kiln.plugins.linear.tma as tma  # noqa: E402
import kiln.plugins.norm_swiglu.kernels as norm_swiglu_kernels  # noqa: E402
from kiln.plugins.aot import MAX_SHARED_BYTES, compile_cubin, kernel_name  # noqa: E402
from kiln.plugins.linear import cute_gemm  # noqa: E402
from kiln.plugins.nvcc import NvccKernel, cutlass_available  # noqa: E402
from gemm_modes import KERNELS, in_mode  # noqa: E402

# Llama-3-8B-like shapes, one projection of each kind.
LLAMA = {"linear": {"K": 4096, "N": 4096},
         "linear_residual": {"K": 14336, "N": 4096},
         "norm_swiglu": {"K": 4096, "I": 14336, "block": 64},
         "norm_qkv_rope": {"K": 4096, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128}}
# Every optional input present (Qwen2/Qwen3-like, unfolded norms), on one target.
ALL_OPTIONAL = {"linear": {"K": 4096, "N": 1024, "bias": True},
                "norm_swiglu": {"K": 4096, "I": 1536, "block": 0, "norm_weight": True},
                "norm_qkv_rope": {"K": 2048, "num_heads": 16, "num_kv_heads": 2, "head_dim": 128, "bias": True,
                                  "qk_norm": True, "norm_weight": True}}


def check_cubins(name: str, shapes: dict, targets) -> None:
    """Every target gets one kernel per bucket (the TMA ones on sm_90 and later, which need
    global scratch for their descriptors) and, with TMA norm GEMMs or a bucket that reads row
    scales, the row-scale pre-pass."""
    kernels = KERNELS[name].aot_kernels("bfloat16", shapes)
    for target in targets:
        mine = [k for k in kernels if k.targets is None or target in k.targets]
        buckets = [k for k in mine if "bucket" in k.meta]
        # The CUDA GEMVs lead: for one and two rows in the plain GEMMs, one row in the fused qkv
        # (without q/k norm, which needs whole heads) and in gate/up (`linear.gemv`).
        gemv = {"linear": ["gemv1", "gemv2"], "linear_residual": ["gemv1", "gemv2"],
                "norm_qkv_rope": [] if shapes.get("qk_norm") else ["gemv1"], "norm_swiglu": ["gemv1"]}[name]
        # A wide weight (gate/up) has no xlarge bucket: its 128-row tiles fill the GPU from 257 rows.
        weight_rows = 2 * shapes["I"] if name == "norm_swiglu" else shapes.get("N", 0)
        # On sm_90 the plain GEMMs of narrow weights, and qkv with a folded norm weight and no q/k norm,
        # take a CuTe GEMM ahead of the 129-256-row bucket's pointer kernel, where CUTLASS's headers are
        # installed (`linear.cute_gemm`).
        served = (name in ("linear", "linear_residual") and weight_rows < linear_tiles.WIDE_N
                  or name == "norm_qkv_rope" and not shapes.get("qk_norm") and not shapes.get("norm_weight"))
        cute = [cute_gemm.BUCKET] if target == "sm_90" and served and cutlass_available() else []
        assert [k.meta["bucket"] for k in buckets if k.meta.get("cute")] == cute
        assert [k.meta["bucket"] for k in buckets] == gemv + [b for t in linear_tiles.tiles_for(weight_rows)
                                                              for b in [t.name] * (1 + (t.name in cute))]
        uses_tma = any(k.meta.get("tma") for k in buckets)
        # The TMA norm GEMMs need the norm weight folded, and norm_swiglu an interleaved W_gu.
        assert uses_tma == (target in tma.TMA_TARGETS and not shapes.get("norm_weight")
                            and shapes.get("block", 1) > 0), target
        # The fused norm GEMMs' small bucket reads the row-scale pre-pass's scales on every target.
        prescaled = any(k.meta.get("row_scale_input") for k in buckets)
        assert prescaled == name.startswith("norm_"), target
        assert len(mine) == len(buckets) + ((uses_tma and name.startswith("norm_")) or prescaled)
        for kernel in mine:
            # (the CUDA kernels' parameters are checked against their source by test_gemv.py)
            assert isinstance(kernel, NvccKernel) or set(kernel.signature) == set(kernel.fn.arg_names)
            if "bucket" in kernel.meta and not kernel.meta.get("tma") and not kernel.meta.get("cute"):
                assert len(kernel.meta["grid"]) == 3 and kernel.meta["grid"][2] == str(kernel.meta["split_k"])
            cubin = compile_cubin(kernel, target)
            assert cubin.binary.startswith(b"\x7fELF") and cubin.name == kernel_name(kernel)
            assert cubin.shared_bytes <= MAX_SHARED_BYTES[target], (kernel.meta, target, cubin.shared_bytes)
            # Device-made TMA descriptors live in global scratch; nothing else asks for any.
            assert (cubin.global_scratch > 0) == bool(kernel.meta.get("tma")), (kernel.meta, target)


@pytest.mark.parametrize("name", list(LLAMA))
def test_aot_llama_shapes(request, name):
    in_mode(request, False, lambda: check_cubins(name, LLAMA[name], list(MAX_SHARED_BYTES)))


def test_aot_tp2_gate_up_gets_the_deep_pipeline_on_sm_90(request):
    """TP 2's gate/up (7,168 intermediate rows a rank) up to 64 rows: 128-deep K tiles of 128
    weight rows, 48 KiB a stage, get 2 stages on sm_80/sm_89 and 4 on sm_90/sm_100
    (`linear.tiles.pipelined`), 8 warps and the pre-pass's row scales, and every cubin fits its
    target's shared memory."""
    shapes = {"K": 4096, "I": 7168, "block": 64}

    def body():
        check_cubins("norm_swiglu", shapes, list(MAX_SHARED_BYTES))
        small = [k for k in norm_swiglu_kernels.aot_kernels("bfloat16", shapes) if k.meta.get("bucket") == "small"]
        assert [(k.targets, k.num_stages) for k in small] == [(("sm_80", "sm_89"), 2), (("sm_90", "sm_100"), 4)]
        assert all(k.num_warps == 8 and k.meta["row_scale_input"] for k in small)
    in_mode(request, False, body)


def test_pipelined_splits_a_kernel_only_where_the_depths_differ():
    kernel = next(k for k in norm_swiglu_kernels.aot_kernels("bfloat16", LLAMA["norm_swiglu"])
                  if not k.meta.get("gemv"))
    (one,) = linear_tiles.pipelined(kernel, 16, 64, 128, 2, cap=3)      # 20 KiB a stage: 3 everywhere
    assert one.targets == kernel.targets and one.num_stages == 3
    ada_only = dataclasses.replace(kernel, targets=("sm_89",))
    (shallow,) = linear_tiles.pipelined(ada_only, 64, 128, 128, 2, cap=3)
    assert shallow.targets == ("sm_89",) and shallow.num_stages == 2


@pytest.mark.parametrize("name", list(ALL_OPTIONAL))
def test_aot_all_optional_inputs(request, name):
    in_mode(request, False, lambda: check_cubins(name, ALL_OPTIONAL[name], ["sm_90"]))
