"""The CuTe GEMM as linear and linear_residual's sm_90 kernel of the 129-256-row bucket
(`plugins.linear.cute_gemm.linear_kernels`), on the CPU: an sm_90 engine holds it ahead of that
bucket's pointer kernel, so steps of 129 to 256 rows take it and every other row count keeps its
bucket; other targets, FP8 weights, fp32, wide weights and shapes that are not whole tiles keep the
pointer kernel; and the launcher passes what the kernel's signature declares: TMA descriptors of x
(in boxes of 128 rows, over T rows rounded up to whole boxes where x's buffer holds them) and of the
weight (in boxes of the tile's rows), then bias, residual (0 when absent), out, T, N and K, on the
persistent grid (with K in parts, linear's split-K workspace before T). The descriptors are libcuda's
to make, so here a recorder stands in for `encode_tensor_map`; tests/test_cute_linear_gpu.py runs the
real one and the kernel on an H200."""
from __future__ import annotations

from unittest import mock

import pytest
import torch

from descriptor_recording import Recorder, recorded_descriptors
from interpreted_launch import targeted
from kiln.plugins.linear import cute_gemm, launch as linear_launch
from kiln.plugins.linear.launch import pick_bucket
from kiln.plugins.linear.tiles import WIDE_N
from kiln.plugins.linear_residual import kernels as linear_residual
from kiln.plugins.nvcc import cutlass_available

O_PROJ = {"K": 4096, "N": 4096}
# `make install` puts CUTLASS's headers in the venv; without them the kernel is left out (test_kernels_gemm_aot).
needs_cutlass = pytest.mark.skipif(not cutlass_available(), reason="CUTLASS's headers are not installed")


def sm_kernels(shapes: dict, target: str) -> list:
    return targeted(linear_residual.aot_kernels("bfloat16", shapes), target)


def served_by(kernels: list, rows: int) -> dict:
    return kernels[pick_bucket([k.meta for k in kernels], rows)].meta


@needs_cutlass
@pytest.mark.parametrize("rows, cute", [(128, False), (129, True), (200, True), (256, True), (257, False)])
def test_sm90_steps_of_129_to_256_rows_take_the_cute_gemm(rows, cute):
    meta = served_by(sm_kernels(O_PROJ, "sm_90"), rows)
    assert bool(meta.get("cute")) == cute
    assert meta["bucket"] == ("large" if cute else "medium" if rows <= 128 else "xlarge")


@pytest.mark.parametrize("target", ["sm_80", "sm_89", "sm_100"])
def test_other_targets_keep_the_pointer_kernel(target):
    assert not served_by(sm_kernels(O_PROJ, target), 256).get("cute")


@pytest.mark.parametrize("shapes, dtype", [({**O_PROJ, "fp8": True}, "bfloat16"), (O_PROJ, "float32"),
                                           ({"K": 4096, "N": 4160 + 32}, "bfloat16"),
                                           ({"K": 4096 + 8, "N": 4096}, "bfloat16"),
                                           ({"K": 4096, "N": WIDE_N}, "bfloat16")])
def test_shapes_it_does_not_serve_keep_the_pointer_kernel(shapes, dtype):
    assert not any(k.meta.get("cute") for k in linear_residual.aot_kernels(dtype, shapes))


# (bias, residual, rows x's buffer holds, rows of x's descriptor): T = 200 rounded up to whole 128-row tiles
# where the buffer holds them (as the engine's do), else as many as it holds.
LAUNCHES = [(False, True, 200, 200), (True, False, 8192, 256), (False, False, 230, 230)]


@needs_cutlass
@pytest.mark.parametrize("bias, residual, held, described", LAUNCHES)
def test_the_launcher_passes_descriptors_then_pointers_and_sizes(bias, residual, held, described):
    rows, n, k = 200, 6144, 1024
    kernels = sm_kernels({"K": k, "N": n}, "sm_90")
    metas = [kn.meta for kn in kernels]
    recorders = [Recorder() for _ in kernels]
    x, w, out = torch.empty(held, k, dtype=torch.bfloat16)[:rows], torch.empty(n, k, dtype=torch.bfloat16), \
        torch.empty(rows, n, dtype=torch.bfloat16)
    b = torch.empty(n, dtype=torch.bfloat16) if bias else None
    r = torch.empty(rows, n, dtype=torch.bfloat16) if residual else None
    with recorded_descriptors() as encoded, mock.patch("kiln.plugins.driver_launch.sm_count", lambda: 132):
        linear_launch.launch_gemm(recorders, metas, x, w, b, r, out, 7, {})
    used = [i for i, rec in enumerate(recorders) if rec.launches]
    assert [metas[i].get("cute") for i in used] == [True]
    grid, args = recorders[used[0]].launches[0]
    assert grid == (132, 1, 1)   # 2 row tiles x 96 column tiles, persistent over the SMs
    kt, (block_m, block_n) = cute_gemm.k_tile(), cute_gemm.LINEAR_TILING[:2]
    assert encoded == [(x.data_ptr(), "bf16", (described, k), (block_m, kt)),
                       (w.data_ptr(), "bf16", (n, k), (block_n, kt))]
    assert args == [bytes([1]) * 128, bytes([2]) * 128, b.data_ptr() if bias else 0, r.data_ptr() if residual else 0,
                    out.data_ptr(), rows, n, k]
    assert len(args) == len(kernels[used[0]].signature)


@needs_cutlass
def test_with_k_in_parts_it_asks_for_linears_split_workspace_and_the_launcher_passes_it():
    from kiln.plugins.linear.tiles import pick_tile

    n, k, rows = 4096, 4096, 256
    with mock.patch.object(cute_gemm, "LINEAR_TILING", (128, 128, 6, 8, 2)):
        kernel, = cute_gemm.linear_kernels("bfloat16", n, k, pick_tile(rows, n))
    meta = kernel.meta
    assert kernel.signature == cute_gemm.GEMM_SPLIT_SIGNATURE and meta["split_k"] == 2
    # 2 row tiles x 32 column tiles x 2 warpgroups of 64 rows, each part's 64 x 128 sums a slot
    assert meta["scratch"] == {"gemm_split_part": 2 * 32 * 2 * 2 * 64 * 128 * 4, "gemm_split_count": 2 * 32 * 2 * 4}
    scratch = {"gemm_split_part": torch.empty(meta["scratch"]["gemm_split_part"] // 4),
               "gemm_split_count": torch.zeros(meta["scratch"]["gemm_split_count"] // 4, dtype=torch.int32)}
    x, w, out = torch.empty(rows, k, dtype=torch.bfloat16), torch.empty(n, k, dtype=torch.bfloat16), \
        torch.empty(rows, n, dtype=torch.bfloat16)
    fn = Recorder()
    with recorded_descriptors(), mock.patch("kiln.plugins.driver_launch.sm_count", lambda: 132):
        linear_launch.launch_gemm([fn], [meta], x, w, None, None, out, 7, scratch)
    (grid, args), = fn.launches
    assert grid == (128, 1, 1)   # 64 tiles x 2 parts
    assert args[2:] == [0, 0, out.data_ptr(), scratch["gemm_split_part"].data_ptr(),
                        scratch["gemm_split_count"].data_ptr(), rows, n, k]
    assert len(args) == len(kernel.signature)
