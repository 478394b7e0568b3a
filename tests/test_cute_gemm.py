"""The CuTe GEMM (`plugins.linear.cute_gemm`, the CUTLASS route of the prefill GEMMs) on the CPU:
nvcc builds it for sm_90a with CUTLASS's headers, its entry point takes exactly the parameters the
driver launch packs (two 128-byte TMA descriptors by value, then out, M, N, K), it is made of
Hopper's own instructions (TMA loads, wgmma, register reallocation between warpgroups) at its
declared block size, and a TMA descriptor the host cannot make is refused before the driver is
called. Its numerics and speed are measured on an H200 (scripts/tune_prefill_gemm.py)."""
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


@pytest.fixture(scope="module")
def kernel() -> nvcc.NvccKernel:
    return cute_gemm.kernel(128, 6, 8)


@pytest.fixture(scope="module")
def ptx(kernel) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.cu"
        src.write_text(nvcc.source_text(kernel))
        subprocess.run([nvcc.nvcc_path(), "-ptx", *kernel.options("sm_90"), "-o", f"{tmp}/k.ptx", str(src)],
                       check=True, capture_output=True)
        return (Path(tmp) / "k.ptx").read_text()


def test_entry_takes_two_descriptors_by_value_then_out_and_the_sizes(kernel, ptx):
    params = re.search(rf"\.entry {kernel.entry}\(([^)]*)\)", ptx).group(1)
    kinds = [re.sub(rf"\s*{kernel.entry}_param_\d+", "", p).strip() for p in params.split(",")]
    assert kinds == [".param .align 128 .b8[128]"] * 2 + [".param .u64"] + [".param .u32"] * 3
    assert list(kernel.signature.values()) == ["tensormap", "tensormap", "*bf16", "i32", "i32", "i32"]


def test_it_is_built_of_hoppers_own_instructions(kernel, ptx):
    assert re.search(r"^\.target sm_90a", ptx, re.M)
    assert f".maxntid {32 * kernel.num_warps}, 1, 1" in ptx
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor.2d" in ptx
    assert "setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx


def test_cubin_builds_within_the_targets_shared_memory(kernel):
    cubin = compile_cubin(kernel, "sm_90")
    assert cubin.binary.startswith(b"\x7fELF") and kernel.entry.encode() in cubin.binary
    assert cubin.shared_bytes == cute_gemm.shared_bytes(128, 6) <= MAX_SHARED_BYTES["sm_90"]
    assert cubin.num_warps == 12


def test_a_tiling_whose_stages_outgrow_its_shared_memory_does_not_compile():
    too_small = nvcc.NvccKernel(cute_gemm.SOURCE, "small", "KILN_CUTE_GEMM(small, 128, 6, 8, 100000)",
                                cute_gemm.SIGNATURE, 12, includes=(nvcc.cutlass_include(),), arch_specific=True)
    with pytest.raises(RuntimeError, match="too little shared memory"):
        compile_cubin(too_small, "sm_90")


@pytest.mark.parametrize("address, shape, box", [(0x1008, (64, 4096), (128, 64)),   # address not 16-byte aligned
                                                 (0x1000, (64, 4100), (128, 64)),   # row pitch not 16-byte aligned
                                                 (0x1000, (64, 4096), (128, 128))])  # a box row of 256 bytes
def test_a_descriptor_the_driver_would_refuse_is_refused_first(address, shape, box):
    with pytest.raises(ValueError, match="no TMA descriptor"):
        encode_tensor_map(address, "bf16", shape, box)
