"""Shared by the GEMM-family kernel tests (test_kernels_gemm.py, test_kernels_gemm_aot.py): which
Triton mode this process's kernels were built in, and running a test in the other mode.

Parity runs under Triton's interpreter and AOT compilation needs compiled-mode kernels; the
mode is fixed when the kernel modules are first imported, by whichever test module comes
first. A test whose mode this process does not have runs in one child pytest process per
(module, mode) with TRITON_INTERPRET set accordingly, and reports the child's outcome for the
same test. A module importing this one sets TRITON_INTERPRET's default first.
"""
import functools
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

import kiln.plugins.linear.kernels as linear_kernels
import kiln.plugins.linear.tma as tma
import kiln.plugins.linear_residual.kernels as linear_residual_kernels
import kiln.plugins.norm_qkv_rope.kernels as norm_qkv_rope_kernels
import kiln.plugins.norm_swiglu.kernels as norm_swiglu_kernels
from kiln.plugins import get_plugin

KERNELS = {"linear": linear_kernels, "linear_residual": linear_residual_kernels,
           "norm_swiglu": norm_swiglu_kernels, "norm_qkv_rope": norm_qkv_rope_kernels}
# True: every kernel was imported in interpreter mode; False: none was; None: a mix.
_MODES = {isinstance(f, InterpretedFunction) for f in (
    linear_kernels.gemm_tile, linear_kernels.linear_kernel, norm_swiglu_kernels.norm_swiglu_kernel,
    norm_qkv_rope_kernels.norm_qkv_rope_kernel, tma.tma_linear_kernel)}
INTERPRETED = _MODES.pop() if len(_MODES) == 1 else None
CHILD = "KILN_GEMM_TEST_CHILD"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-5


@functools.cache
def child_outcomes(module: str, interpret: bool) -> tuple[dict[str, str], str]:
    """Run `module`'s tests that need the other Triton mode in a fresh process; returns
    {test name: "passed" or the failure text} and the child's output."""
    if os.environ.get(CHILD):
        pytest.fail(f"the kernels were imported with TRITON_INTERPRET={os.environ['TRITON_INTERPRET']} "
                    "in a child process that set it: something imported them before this module")
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        env = {**os.environ, "TRITON_INTERPRET": "1" if interpret else "0", CHILD: "1"}
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", module,
             "-k", "parity" if interpret else "aot", f"--junitxml={report}"],
            env=env, cwd=Path(module).parents[1], capture_output=True, text=True, timeout=600)
        outcomes = {}
        if report.exists():
            for case in ET.parse(report).iter("testcase"):
                problems = [f"{p.tag}: {p.get('message')}" for p in case]
                outcomes[case.get("name")] = "; ".join(problems) or "passed"
    return outcomes, proc.stdout[-4000:] + proc.stderr[-2000:]


def in_mode(request, interpret: bool, body) -> None:
    """Run `body` here when this process has the wanted Triton mode, else take this test's
    outcome from a child process that has it."""
    if INTERPRETED is interpret:
        body()
        return
    outcomes, log = child_outcomes(str(request.path), interpret)
    outcome = outcomes.get(request.node.name, "not run")
    assert outcome == "passed", f"in a TRITON_INTERPRET={int(interpret)} child: {outcome}\n{log}"


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    else:
        err = (out.float() - ref.float()).abs().max().item()
        assert err <= 2e-2 * ref.float().abs().max().item(), f"max error {err}"


def rand(*shape, dtype, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape) * scale).to(dtype)


def check(name: str, inputs: list, attrs: dict, out_shape: tuple, ref_inputs: list | None = None) -> None:
    """Run the kernel on `inputs` and the reference on `ref_inputs` (default: the same)."""
    ref = get_plugin(name).call_reference(inputs if ref_inputs is None else ref_inputs, attrs)
    out = torch.full(out_shape, float("nan"), dtype=ref.dtype)
    KERNELS[name].run(inputs, attrs, out)
    assert_matches(out, ref)


def with_norm(w: torch.Tensor, folded: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(norm_weight, projection): the RMSNorm weight given, or multiplied into W as fold does."""
    g = 1 + 0.2 * torch.randn(w.shape[1])
    if folded:
        return None, (w.float() * g).to(w.dtype)
    return g.to(w.dtype), w
