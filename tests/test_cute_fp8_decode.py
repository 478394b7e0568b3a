"""The e4m3 CuTe decode GEMM as an FP8 engine's sm_90 kernel of linear and linear_residual's 17-64-row bucket
(`plugins.linear.cute_gemm.fp8_decode_kernels`), on the CPU: an FP8 sm_90 engine holds it ahead of that
bucket's pointer kernel, so steps of 17 to 64 rows take it and every other row count keeps its bucket;
bf16 engines, other targets, a bias, wide weights and shapes that are not whole tiles keep the pointer
kernel; its K parts' workspace is part of the bucket's scratch; and the launcher runs the quantize pre-pass,
then passes what the kernel's signature declares: TMA descriptors of the e4m3 weight (in boxes of 64 rows)
and of the pre-pass's rows (in boxes of the bucket's 64 rows, over 64 rows where its buffer holds them),
the weight's and the rows' scales, the residual (0 when absent), out, the workspace, T, N and K, on a
grid of 64-row weight tiles by K parts. A recorder stands in for libcuda's descriptor encoder and the
kernels; tests/test_cute_fp8_decode_gpu.py runs the real ones on an H200."""
from __future__ import annotations

import pytest
import torch

from descriptor_recording import Recorder, recorded_descriptors
from interpreted_launch import targeted
from kiln.plugins.linear import cute_gemm, launch as linear_launch
from kiln.plugins.linear.launch import pick_bucket
from kiln.plugins.linear.tiles import WIDE_N
from kiln.plugins.linear_residual import kernels as linear_residual
from kiln.plugins.nvcc import cutlass_available

DOWN = {"K": 14336, "N": 4096, "fp8": True}
needs_cutlass = pytest.mark.skipif(not cutlass_available(), reason="CUTLASS's headers are not installed")


def served_by(shapes: dict, target: str, rows: int) -> dict:
    kernels = targeted(linear_residual.aot_kernels("bfloat16", shapes), target)
    return kernels[pick_bucket([k.meta for k in kernels], rows)].meta


@needs_cutlass
@pytest.mark.parametrize("rows, cute", [(16, False), (17, True), (40, True), (64, True), (65, False)])
def test_fp8_sm90_steps_of_17_to_64_rows_take_the_cute_decode_gemm(rows, cute):
    meta = served_by(DOWN, "sm_90", rows)
    assert bool(meta.get("cute_decode")) == cute
    assert meta["fp8"] and meta["bucket"] == ("small" if cute else "decode" if rows <= 16 else "medium")


@pytest.mark.parametrize("shapes, target", [({**DOWN, "fp8": False}, "sm_90"), (DOWN, "sm_89"), (DOWN, "sm_100"),
                                            ({**DOWN, "bias": True}, "sm_90"), ({**DOWN, "N": WIDE_N}, "sm_90"),
                                            ({**DOWN, "N": 4096 + 32}, "sm_90"), ({**DOWN, "K": 4096 + 64}, "sm_90")])
def test_what_it_does_not_serve_keeps_the_pointer_kernel(shapes, target):
    assert not served_by(shapes, target, 64).get("cute_decode")


@needs_cutlass
def test_its_k_parts_workspace_is_in_the_buckets_scratch():
    meta = served_by(DOWN, "sm_90", 64)
    stages, parts = cute_gemm.FP8_DECODE_TILING
    assert meta["parts"] == parts > 1 and meta["pdl"]
    assert meta["scratch"] == {"gemm_split_part": 4096 * parts * 64 * 4, "gemm_split_count": 4096 // 64 * 4}


@needs_cutlass
@pytest.mark.parametrize("residual, held, described", [(True, 8192, 64), (False, 50, 50)])
def test_the_launcher_quantizes_then_passes_descriptors_pointers_and_sizes(residual, held, described):
    rows, n, k = 40, 4096, 14336
    kernels = targeted(linear_residual.aot_kernels("bfloat16", DOWN), "sm_90")
    metas = [kn.meta for kn in kernels]
    log = []
    fns = [Recorder("quantize" if m.get("quantize") else "cute" if m.get("cute_decode") else "other", log)
           for m in metas]
    x, w = torch.empty(rows, k, dtype=torch.bfloat16), torch.empty(n, k, dtype=torch.float8_e4m3fn)
    w_scale, out = torch.empty(n), torch.empty(rows, n, dtype=torch.bfloat16)
    r = torch.empty(rows, n, dtype=torch.bfloat16) if residual else None
    scratch = {"fp8_x": torch.empty(held * k, dtype=torch.uint8), "fp8_x_scale": torch.empty(held * 4, dtype=torch.uint8),
               "gemm_split_part": torch.empty(8, dtype=torch.uint8), "gemm_split_count": torch.empty(8, dtype=torch.uint8)}
    with recorded_descriptors() as encoded:
        linear_launch.launch_gemm(fns, metas, x, w, None, r, out, 7, scratch, w_scale)
    assert [name for name, _, _ in log] == ["quantize", "cute"]
    _, grid, args = log[1]
    parts = cute_gemm.FP8_DECODE_TILING[1]
    assert grid == (n // 64, parts, 1)
    kt = cute_gemm.k_tile("fp8e4nv")
    assert encoded == [(w.data_ptr(), "fp8e4nv", (n, k), (64, kt)),
                       (scratch["fp8_x"].data_ptr(), "fp8e4nv", (described, k), (64, kt))]
    assert args == [bytes([1]) * 128, bytes([2]) * 128, w_scale.data_ptr(), scratch["fp8_x_scale"].data_ptr(),
                    r.data_ptr() if residual else 0, out.data_ptr(), scratch["gemm_split_part"].data_ptr(),
                    scratch["gemm_split_count"].data_ptr(), rows, n, k]
    assert len(args) == len(next(kn for kn in kernels if kn.meta.get("cute_decode")).signature)
