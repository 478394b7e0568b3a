"""The CUDA GEMVs' cubins without a GPU: nvcc builds every entry point for every target, and the order
their machine code keeps around programmatic dependent launch, read from the SASS (`nvdisasm`, from the
nvidia-cuda-nvdisasm wheel) of their sm_90 and sm_100 cubins. Each cubin is compiled once (`built`).

Under PDL a GEMV starts while the kernel before it still runs, and `griddepcontrol.wait` (ACQBULK in
SASS) is where it waits for that kernel's writes. Every load issued before the wait must read only the
engine's constants (weights and their scales, bias, the norm weight, RoPE's table), and the first weight
loads should go out before it, to overlap the kernel before. The PTX had both right while ptxas moved the
FP8 GEMVs' x loads (`ld.global.nc`) ahead of the wait and the weight loads behind it (session 45), so
the check is on the SASS."""
from __future__ import annotations

from functools import cache

import pytest

from sass import LAUNCH_DEPENDENTS, WAIT, address_params, disassemble, is_load, nvdisasm, param_offsets
from test_gemv import every_kernel

from kiln.plugins import nvcc
from kiln.plugins.aot import TARGET_CC, Cubin, compile_cubin
from kiln.plugins.linear import gemv

# Parameters a step writes: no load of them may come before the wait. ("staged": the one-row handoff's row.)
STEP_WRITTEN = {"x", "residual", "positions", "slots", "kv", "out", "staged"}
WEIGHT_LOAD = "LDG.E.NA."   # the weights' stream loads do not allocate in L1
# A lane's weight loads an iteration of `stream_rows` (rows x pieces) in each entry, and how many iterations
# go out before the wait: two in the FP8 GEMVs, one in the bf16 ones (BENCHMARKS.md session 46).
BF16_PIECES = 4   # gemv.cu's U
ITERATION_LOADS = {
    "kiln_gemv_linear_t1": (gemv.LINEAR_ROWS_PER_WARP[1] * BF16_PIECES, 1),
    "kiln_gemv_linear_t2": (gemv.LINEAR_ROWS_PER_WARP[2] * BF16_PIECES, 1),
    "kiln_gemv_qkv_rope_t1": (2 * BF16_PIECES, 1),
    "kiln_gemv_swiglu_t1": (2 * BF16_PIECES, 1),
    "kiln_gemv_fp8_linear_t1": (gemv.FP8_LINEAR_ROWS * gemv.FP8_LINEAR_PIECES, 2),
    "kiln_gemv_fp8_qkv_rope_t1": (2 * gemv.FP8_QKV_PIECES, 2),
    "kiln_gemv_fp8_swiglu_t1": (2 * gemv.FP8_SWIGLU_COLS * gemv.FP8_SWIGLU_PIECES, 2),
    "kiln_gemv_fp8_linear_prestaged_t1": (gemv.FP8_LINEAR_ROWS * gemv.FP8_LINEAR_PIECES, 2),
    "kiln_gemv_fp8_swiglu_handoff_t1": (2 * gemv.FP8_SWIGLU_COLS * gemv.FP8_SWIGLU_PIECES, 2),
}


needs_nvcc = pytest.mark.skipif(nvcc.nvcc_path() is None, reason="nvcc is not installed")
needs_nvdisasm = pytest.mark.skipif(nvcc.nvcc_path() is None or nvdisasm() is None,
                                    reason="needs nvcc and nvdisasm (make install puts nvidia-cuda-nvdisasm in)")


@cache
def built(target: str) -> list[tuple[nvcc.NvccKernel, Cubin]]:
    """Every GEMV entry built for `target` (those whose targets include it), with its cubin."""
    return [(kernel, compile_cubin(kernel, target)) for kernel in every_kernel()
            if not kernel.targets or target in kernel.targets]


@cache
def disassembled(target: str) -> list[tuple[nvcc.NvccKernel, list[str]]]:
    """Every GEMV entry built for `target`, with its cubin's instructions (`disassemble`), read once."""
    return [(kernel, disassemble(cubin.binary)) for kernel, cubin in built(target)]


@needs_nvcc
def test_nvcc_builds_every_entry_for_every_target():
    for target in TARGET_CC:
        for kernel, cubin in built(target):
            assert cubin.binary.startswith(b"\x7fELF") and cubin.name == kernel.entry
            assert kernel.entry.encode() in cubin.binary and cubin.shared_bytes == 0 and cubin.num_warps == 8
    assert sum(len(built(target)) for target in TARGET_CC) == sum(len(k.targets or TARGET_CC) for k in every_kernel())


@needs_nvdisasm
@pytest.mark.parametrize("target", ["sm_90", "sm_100"])
def test_nothing_a_step_writes_is_read_before_the_wait_and_the_weights_go_first(target):
    for kernel, code in disassembled(target):
        offsets = param_offsets(kernel.signature, target)
        waits = [i for i, line in enumerate(code) if line == WAIT]
        assert len(waits) == 1, kernel.entry
        early = set().union(*(address_params(code, i, offsets) for i in range(waits[0]) if is_load(code[i])))
        assert early and not early & STEP_WRITTEN, (kernel.entry, target, early)
        assert "w" in early and any(WEIGHT_LOAD in line for line in code[:waits[0]]), (kernel.entry, target)


@needs_nvdisasm
@pytest.mark.parametrize("target", ["sm_90", "sm_100"])
def test_each_entry_issues_its_iterations_of_weight_loads_before_the_wait(target):
    for kernel, code in disassembled(target):
        early = sum(WEIGHT_LOAD in line for line in code[:code.index(WAIT)])
        loads, iterations = ITERATION_LOADS[kernel.entry]
        assert early == loads * iterations, (kernel.entry, target, early)


@needs_nvdisasm
@pytest.mark.parametrize("target", ["sm_90", "sm_100"])
def test_the_prestaged_gemv_reads_the_staged_row_after_the_wait_without_a_barrier(target):
    """Down's GEMV at one row with the handoff stages nothing: no block barrier, and x comes from the staged
    row, which the kernel before wrote, so by coherent loads (no `ld.global.nc`, LDG...CONSTANT) after the
    wait; the SwiGLU GEMV that stages it keeps its own barrier and stores the row."""
    entries = {kernel.entry: (kernel, code) for kernel, code in disassembled(target)}
    kernel, code = entries["kiln_gemv_fp8_linear_prestaged_t1"]
    offsets = param_offsets(kernel.signature, target)
    wait = code.index(WAIT)
    staged = [line for i, line in enumerate(code) if is_load(line) and "staged" in address_params(code, i, offsets)]
    assert staged and not any(".CONSTANT" in line for line in staged), (target, staged)
    assert all(code.index(line) > wait for line in staged)
    assert not any(line.startswith("BAR") for line in code), target
    kernel, code = entries["kiln_gemv_fp8_swiglu_handoff_t1"]
    assert any(line.startswith("BAR.SYNC") for line in code) and any(line.startswith("STG.E.U16") for line in code)


def test_the_walk_finds_a_load_of_x_ahead_of_the_wait():
    """The check above can fail: a load of x issued before the wait is found as a read of x."""
    code = ["LDC.64 R6, c[0x0][0x210]", "IMAD.WIDE R6, R2, 0x10, R6", "@!P2 LDG.E.128.CONSTANT R44, desc[UR6][R6.64]",
            WAIT]
    assert address_params(code, 2, param_offsets({"x": "*bf16", "w": "*bf16"}, "sm_90")) == {"x"}


@needs_nvdisasm
def test_sm80_builds_have_no_dependent_launch():
    code = [line for _, lines in disassembled("sm_80") for line in lines]
    assert code and not any(line in (WAIT, LAUNCH_DEPENDENTS) for line in code)
