"""The build's cubin cache key (`builder.kernels.kernel_key`) changes with everything that decides a
Triton cubin, the helpers a kernel calls included: a stale key would load an old cubin silently."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from kiln.builder.kernels import kernel_key
from kiln.plugins.aot import AotKernel

SOURCE = '''
import triton
import triton.language as tl

import {helpers} as helpers

SCALE = tl.constexpr({scale})


@triton.jit
def helper(x):
    return x * {factor}


@triton.jit
def kernel(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, helpers.shift(helper(tl.load(x_ptr + offs))) * SCALE)
'''

HELPERS = '''
import triton


@triton.jit
def shift(x):
    return x + {shift}
'''


def _load(path: Path, name: str, text: str):
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # Triton resolves a kernel's globals through its module
    spec.loader.exec_module(module)
    return module


def _kernel(tmp_path: Path, name: str, factor: int = 2, scale: int = 1, shift: int = 1) -> AotKernel:
    _load(tmp_path / f"{name}_helpers.py", f"{name}_helpers", HELPERS.format(shift=shift))
    module = _load(tmp_path / f"{name}.py", name, SOURCE.format(factor=factor, scale=scale, helpers=f"{name}_helpers"))
    return AotKernel(module.kernel, {"x_ptr": "*fp32", "out_ptr": "*fp32", "N": "constexpr"}, {"N": 16})


@pytest.fixture
def kernels(tmp_path: Path):
    made = []

    def make(**kwargs) -> AotKernel:
        made.append(f"kiln_key_probe_{len(made)}")
        return _kernel(tmp_path, made[-1], **kwargs)
    yield make
    for name in made:
        sys.modules.pop(name, None)
        sys.modules.pop(f"{name}_helpers", None)


def test_same_source_same_key(kernels):
    assert kernel_key(kernels(), "sm_90") == kernel_key(kernels(), "sm_90")


def test_key_changes_with_a_called_helper(kernels):
    # The kernel's own text is the same; only the helper it calls differs.
    assert kernel_key(kernels(factor=2), "sm_90") != kernel_key(kernels(factor=3), "sm_90")


def test_key_changes_with_a_helper_called_through_a_module(kernels):
    assert kernel_key(kernels(shift=1), "sm_90") != kernel_key(kernels(shift=2), "sm_90")


def test_key_changes_with_a_global_constant(kernels):
    assert kernel_key(kernels(scale=1), "sm_90") != kernel_key(kernels(scale=2), "sm_90")


def test_key_changes_with_target_and_options(kernels):
    k = kernels()
    assert kernel_key(k, "sm_90") != kernel_key(k, "sm_80")
    wider = AotKernel(k.fn, k.signature, k.constexprs, num_warps=8)
    assert kernel_key(k, "sm_90") != kernel_key(wider, "sm_90")
