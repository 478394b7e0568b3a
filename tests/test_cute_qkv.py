"""The CuTe qkv GEMM as norm_qkv_rope's sm_90 kernel of the 129-256-row bucket
(`plugins.linear.cute_gemm.qkv_kernels`), on the CPU: an sm_90 engine holds it ahead of that bucket's
pointer kernel, so steps of 129 to 256 rows take it and every other row count keeps its bucket; other
targets, FP8 weights, an e4m3 cache, q/k norm, an unfolded norm weight, fp32 and heads whose rotary pairs
do not fill whole tiles keep the pointer kernel; and the launcher runs the row-scale pre-pass, then passes
what the kernel's signature declares: TMA descriptors of x (in boxes of the tile's rows, over T rows
rounded up to whole tiles where x's buffer holds them) and of w_qkv (in boxes of the tile's head-aligned
rows), the scales, bias (0 when absent), positions, rope, cache, slots, q out, T, the cache's slots, the
layer, the heads and K, on the persistent grid. A recorder stands in for libcuda's descriptor encoder and
the kernels; tests/test_cute_qkv_gpu.py runs the real ones on an H200."""
from __future__ import annotations

from unittest import mock

import pytest
import torch

from descriptor_recording import Recorder, recorded_descriptors
from interpreted_launch import targeted
from kiln.plugins.linear import cute_gemm
from kiln.plugins.linear.launch import pick_bucket
from kiln.plugins.norm_qkv_rope import kernels as norm_qkv_rope, launch as launcher
from kiln.plugins.nvcc import cutlass_available

LLAMA = {"K": 4096, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": 16}
needs_cutlass = pytest.mark.skipif(not cutlass_available(), reason="CUTLASS's headers are not installed")


def served_by(shapes: dict, target: str, rows: int, dtype: str = "bfloat16") -> dict:
    kernels = targeted(norm_qkv_rope.aot_kernels(dtype, shapes), target)
    return kernels[pick_bucket([k.meta for k in kernels], rows)].meta


@needs_cutlass
@pytest.mark.parametrize("rows, cute", [(128, False), (129, True), (256, True), (257, False)])
def test_sm90_steps_of_129_to_256_rows_take_the_cute_qkv(rows, cute):
    meta = served_by(LLAMA, "sm_90", rows)
    assert bool(meta.get("cute")) == cute
    assert meta["bucket"] == ("large" if cute else "medium" if rows <= 128 else "xlarge")


@pytest.mark.parametrize("shapes, target, dtype", [
    (LLAMA, "sm_80", "bfloat16"), (LLAMA, "sm_100", "bfloat16"), (LLAMA, "sm_90", "float32"),
    ({**LLAMA, "fp8": True}, "sm_90", "bfloat16"), ({**LLAMA, "fp8_kv": True}, "sm_90", "bfloat16"),
    ({**LLAMA, "qk_norm": True}, "sm_90", "bfloat16"), ({**LLAMA, "norm_weight": True}, "sm_90", "bfloat16"),
    ({**LLAMA, "num_heads": 2, "num_kv_heads": 1}, "sm_90", "bfloat16")])   # 256 pairs: not whole tiles of 48
def test_what_it_does_not_serve_keeps_the_pointer_kernel(shapes, target, dtype):
    assert not served_by(shapes, target, 256, dtype).get("cute")


@needs_cutlass
@pytest.mark.parametrize("bias, held, described", [(False, 8192, 256), (True, 230, 230)])
def test_the_launcher_runs_the_row_scales_then_passes_descriptors_pointers_and_sizes(bias, held, described):
    rows, k, heads, kv_heads, d = 200, 1024, 32, 8, 128
    shapes = {**LLAMA, "K": k, "bias": bias}
    kernels = targeted(norm_qkv_rope.aot_kernels("bfloat16", shapes), "sm_90")
    metas = [kn.meta for kn in kernels]
    log = []
    fns = [Recorder("row_scale" if m.get("row_scale") else "cute" if m.get("cute") else "other", log) for m in metas]
    n = (heads + 2 * kv_heads) * d
    x, w = torch.empty(held, k, dtype=torch.bfloat16)[:rows], torch.empty(n, k, dtype=torch.bfloat16)
    b = torch.empty(n, dtype=torch.bfloat16) if bias else None
    positions, slots = torch.zeros(rows, dtype=torch.int32), torch.zeros(rows, dtype=torch.int32)
    rope, cache = torch.empty(4096, d), torch.empty(2, 2, 64, 16, kv_heads, d, dtype=torch.bfloat16)
    out = torch.empty(rows, heads * d, dtype=torch.bfloat16)
    scratch = {"row_scale": torch.empty(rows * 4, dtype=torch.uint8)}
    attrs = {"eps": 1e-5, "layer": 1, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": d}
    with recorded_descriptors() as encoded, mock.patch("kiln.plugins.driver_launch.sm_count", lambda: 132):
        launcher.launch(fns, metas, [x, None, w, b, None, None, positions, rope, cache, slots], attrs, out,
                        {"T": rows}, 7, scratch)
    assert [name for name, _, _ in log] == ["row_scale", "cute"]
    _, grid, args = log[1]
    block_m, pairs = cute_gemm.QKV_TILING[:2]
    assert grid == (128, 1, 1)   # 2 row tiles x 64 tiles of 48 of the 48 heads' 3,072 pairs
    kt = cute_gemm.k_tile()
    assert encoded == [(x.data_ptr(), "bf16", (described, k), (block_m, kt)),
                       (w.data_ptr(), "bf16", (n, k), (cute_gemm.qkv_box(pairs, d), kt))]
    assert args == [bytes([1]) * 128, bytes([2]) * 128, scratch["row_scale"].data_ptr(), b.data_ptr() if bias else 0,
                    positions.data_ptr(), rope.data_ptr(), cache.data_ptr(), slots.data_ptr(), out.data_ptr(), rows,
                    64 * 16, 1, heads, kv_heads, k]
    assert len(args) == len(next(kn for kn in kernels if kn.meta.get("cute")).signature)
