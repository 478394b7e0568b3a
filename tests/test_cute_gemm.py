"""The CuTe kernels of `plugins.linear.cute_gemm` (the CUTLASS route of the linear plugin's GEMMs) on
the CPU: nvcc builds them for sm_90a with CUTLASS's headers; each entry point takes exactly the
parameters its signature declares, as the driver launch packs them (128-byte TMA descriptors by
value, then pointers and sizes); each is made of Hopper's own instructions (TMA loads, wgmma; the
decode kernel programmatic dependent launch) at its declared block size and shared memory; a tiling
whose stages outgrow the shared memory it is given does not compile; and a TMA descriptor the host
cannot make is refused before the driver is called. Their numerics and speed are measured on an H200
(scripts/tune_prefill_gemm.py, scripts/probe_cuda_gemv.py)."""
from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import pytest

from kiln.plugins import nvcc
from kiln.plugins.aot import MAX_SHARED_BYTES, compile_cubin
from kiln.plugins.linear import cute_gemm
from kiln.runtime.cuda_driver import encode_tensor_map

pytestmark = pytest.mark.skipif(nvcc.nvcc_path() is None, reason="nvcc is not installed")

PTX_PARAM = {"tensormap": ".param .align 128 .b8[128]", "i32": ".param .u32"}


@pytest.fixture(scope="module")
def kernels() -> dict[str, nvcc.NvccKernel]:
    return {"gemm": cute_gemm.gemm(128, 128, 6, 8), "gemm_one_warpgroup": cute_gemm.gemm(64, 128, 8, 8),
            "gemm_split": cute_gemm.gemm(128, 128, 6, 8, 2),
            "qkv": cute_gemm.qkv(128, 48, 128, 8, 8), "decode": cute_gemm.decode(8, 8),
            "decode_fp8": cute_gemm.decode(8, 8, "fp8e4nv")}


@pytest.fixture(scope="module")
def ptx(kernels) -> dict[str, str]:
    """Each kernel's PTX."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, kernel in kernels.items():
            (Path(tmp) / "k.cu").write_text(nvcc.source_text(kernel))
            subprocess.run([nvcc.nvcc_path(), "-ptx", *kernel.options("sm_90"), "-o", f"{tmp}/k.ptx", f"{tmp}/k.cu"],
                           check=True, capture_output=True)
            out[name] = (Path(tmp) / "k.ptx").read_text()
    return out


def entry_ptx(ptx: str, entry: str) -> str:
    start = ptx.index(f".entry {entry}(")
    end = ptx.find(".entry ", start + 1)
    return ptx[start:end if end > 0 else len(ptx)]


@pytest.mark.parametrize("name", ["gemm", "gemm_one_warpgroup", "gemm_split", "qkv", "decode", "decode_fp8"])
def test_entry_takes_its_signature_as_the_launch_packs_it(kernels, ptx, name):
    kernel = kernels[name]
    params = re.search(rf"\.entry {kernel.entry}\(([^)]*)\)", ptx[name]).group(1)
    kinds = [re.sub(rf"\s*{kernel.entry}_param_\d+", "", p).strip() for p in params.split(",")]
    assert kinds == [PTX_PARAM.get(kind, ".param .u64") for kind in kernel.signature.values()]


@pytest.mark.parametrize("name, mma", [("gemm", "m64n128k16.f32.bf16.bf16"),
                                       ("gemm_one_warpgroup", "m64n128k16.f32.bf16.bf16"),
                                       ("gemm_split", "m64n128k16.f32.bf16.bf16"),
                                       ("qkv", "m64n96k16.f32.bf16.bf16"), ("decode", "m64n8k16.f32.bf16.bf16"),
                                       ("decode_fp8", "m64n8k32.f32.e4m3.e4m3")])
def test_it_is_built_of_hoppers_own_instructions(kernels, ptx, name, mma):
    kernel, code = kernels[name], entry_ptx(ptx[name], kernels[name].entry)
    assert re.search(r"^\.target sm_90a", ptx[name], re.M)
    assert f".maxntid {32 * kernel.num_warps}, 1, 1" in code
    assert "wgmma.mma_async" in code and mma in code and "cp.async.bulk.tensor.2d" in code
    if not name.startswith("decode"):   # the producer warpgroup gives its registers to the consumers
        assert "setmaxnreg.dec" in code and "setmaxnreg.inc" in code
    else:                # programmatic dependent launch
        assert kernel.meta["pdl"] and "griddepcontrol.wait" in code and "griddepcontrol.launch_dependents" in code
    # the split-K count, where K is split
    assert ("atom.global.add" in code or "red.global.add" in code) == (name == "gemm_split" or
                                                                       name.startswith("decode"))


@pytest.mark.parametrize("name, rows, stages", [("gemm", 128 + 128, 6), ("gemm_split", 128 + 128, 6),
                                                ("qkv", 128 + 2 * 48, 8),
                                                ("decode", cute_gemm.WEIGHT_ROWS + 8, 8)])
def test_cubin_builds_within_the_targets_shared_memory(kernels, name, rows, stages):
    kernel = kernels[name]
    assert kernel.targets == ("sm_90",)
    cubin = compile_cubin(kernel, "sm_90")
    assert cubin.binary.startswith(b"\x7fELF") and kernel.entry.encode() in cubin.binary
    assert cubin.shared_bytes == cute_gemm.shared_bytes(rows, stages) <= MAX_SHARED_BYTES["sm_90"]
    assert cubin.num_warps == kernel.num_warps


def test_a_tiling_whose_stages_outgrow_its_shared_memory_does_not_compile(kernels):
    call = "KILN_CUTE_DECODE(small, kiln_cute::bf16, 8, 8, 40000)"
    small = nvcc.NvccKernel(cute_gemm.SOURCE, "small", f"{cute_gemm.DECODE_SOURCE.read_text()}\n{call}",
                            cute_gemm.DECODE_SIGNATURE, 5, includes=kernels["decode"].includes, arch_specific=True)
    with pytest.raises(RuntimeError, match="too little shared memory"):
        compile_cubin(small, "sm_90")


@pytest.mark.parametrize("address, shape, box", [(0x1008, (64, 4096), (128, 64)),   # address not 16-byte aligned
                                                 (0x1000, (64, 4100), (128, 64)),   # row pitch not 16-byte aligned
                                                 (0x1000, (64, 4096), (128, 128))])  # a box row of 256 bytes
def test_a_descriptor_the_driver_would_refuse_is_refused_first(address, shape, box):
    with pytest.raises(ValueError, match="no TMA descriptor"):
        encode_tensor_map(address, "bf16", shape, box)


def test_grids_refuse_shapes_the_kernels_would_get_wrong():
    assert cute_gemm.gemm_grid(300, 4096, 4096, 128, 128, 132) == (96, 1, 1)   # 3 row tiles x 32 column tiles
    assert cute_gemm.gemm_grid(300, 4096, 4096, 64, 128, 132) == (132, 1, 1)   # 5 x 32, persistent
    assert cute_gemm.gemm_grid(8192, 4096, 4096, 128, 128, 132) == (132, 1, 1)
    # split-K: o_proj at 256 rows in 128x128 tiles over halves of K, 128 work items; their workspaces
    assert cute_gemm.gemm_grid(256, 4096, 4096, 128, 128, 132, 2) == (128, 1, 1)
    assert cute_gemm.split_workspace(256, 4096, 128, 128, 2) == (2 * 32 * 2 * 2 * 64 * 128 * 4, 2 * 32 * 2 * 4)
    with pytest.raises(ValueError, match="in 1 to K / 64 parts"):
        cute_gemm.gemm_grid(256, 4096, 4096, 128, 128, 132, 65)
    # Llama-3-8B's 48 heads of 64 rotary pairs: 64 tiles of 48 pairs for each 128-row tile
    assert cute_gemm.qkv_grid(129, 32, 8, 128, 4096, 128, 48, 200) == (128, 1, 1)
    assert cute_gemm.decode_grid(8, 4096, 14336, 8, 4) == (64, 4, 1)
    with pytest.raises(ValueError, match="multiple of 128 rows"):
        cute_gemm.gemm_grid(256, 4160, 4096, 128, 128, 132)
    with pytest.raises(ValueError, match="64 or 128 rows"):
        cute_gemm.gemm(256, 64, 4, 8)
    with pytest.raises(ValueError, match="pairs fill whole tiles"):   # 4 heads x 64 pairs in tiles of 48 pairs
        cute_gemm.qkv_grid(256, 2, 1, 128, 4096, 128, 48, 132)
    # A box is the most rows that divide a tile's pairs and a head's half, whole 8-row swizzle atoms.
    assert [cute_gemm.qkv_box(pairs, 128) for pairs in (48, 64, 96)] == [16, 64, 32]
    with pytest.raises(ValueError, match="head_dim 72"):   # 36 pairs a head and 48 a tile share 12 rows
        cute_gemm.qkv_box(48, 72)
    for rows, n, k, parts in ((9, 4096, 4096, 1),      # more rows than the kernel computes
                              (8, 4100, 4096, 1),      # a partial 64-row weight tile
                              (8, 4096, 4096, 65)):    # more parts than K tiles
        with pytest.raises(ValueError, match="the CuTe decode GEMM built for 8 rows"):
            cute_gemm.decode_grid(rows, n, k, 8, parts)
