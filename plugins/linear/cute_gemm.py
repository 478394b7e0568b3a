"""The CUTLASS route of the prefill and large-batch GEMMs: a Hopper GEMM on CuTe's building blocks
(`cute_gemm_sm90.cu`: TMA loads, wgmma, a producer warpgroup and two consumers, persistent tiles),
built by nvcc for sm_90a with `nvidia-cutlass`'s headers.

A candidate, not yet an engine kernel: scripts/tune_prefill_gemm.py sweeps it beside the Triton TMA
GEMM that the prefill bucket runs and beside cuBLAS, and the builder takes it for the shapes where it
measures faster. Its TMA descriptors are parameters the host makes (`runtime.cuda_driver.
encode_tensor_map`: x as [rows, K] in boxes of [BLOCK_M, BLOCK_K], w as [N, K] in boxes of [block_n,
BLOCK_K]), so a launch needs no global scratch and no descriptor is made on the device.
"""
from __future__ import annotations

from pathlib import Path

from kiln.plugins.nvcc import NvccKernel, cutlass_include

SOURCE = Path(__file__).with_name("cute_gemm_sm90.cu")
SIGNATURE = {"x_map": "tensormap", "w_map": "tensormap", "out": "*bf16", "M": "i32", "N": "i32", "K": "i32"}
BLOCK_M, BLOCK_K = 128, 64   # fixed by the kernel: two consumer warpgroups of 64 rows, one 128-byte bf16 row
WARPS = 12                   # three warpgroups
TARGETS = ("sm_90",)         # wgmma and setmaxnreg: Hopper's alone (sm_90a)


def shared_bytes(block_n: int, stages: int) -> int:
    """Dynamic shared memory of a tiling: its stages, and 2 KiB for the barriers and the 1 KiB alignment
    of the base (the kernel's static_assert checks it is enough)."""
    return stages * (BLOCK_M + block_n) * BLOCK_K * 2 + 2048


def kernel(block_n: int, stages: int, group_m: int) -> NvccKernel:
    """The GEMM at tiles of BLOCK_M x `block_n`, `stages` K tiles in flight, `group_m` row tiles a group.
    Launch: grid (min(row tiles x N / block_n, SMs), 1, 1)."""
    entry = f"kiln_cute_gemm_n{block_n}_s{stages}_g{group_m}"
    shared = shared_bytes(block_n, stages)
    return NvccKernel(SOURCE, entry, f"KILN_CUTE_GEMM({entry}, {block_n}, {stages}, {group_m}, {shared})", SIGNATURE,
                      WARPS, targets=TARGETS, shared_bytes=shared, includes=(cutlass_include(),), arch_specific=True)
