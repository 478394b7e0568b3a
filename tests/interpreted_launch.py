"""Driving a plugin's driver launcher (`launch.py`) without a GPU: each loaded kernel is a
stand-in that runs the AOT kernel's own Triton function in the interpreter with the arguments
the launcher passed. Pointers are mapped back to the tensors they are the addresses of (viewed
as the signature's type), scalars are passed as they are, and the constexprs are the cubin's."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kiln.plugins.aot import AotKernel

POINTER_DTYPES = {"*fp32": torch.float32, "*bf16": torch.bfloat16, "*fp16": torch.float16, "*i32": torch.int32,
                  "*fp8e4nv": torch.float8_e4m3fn}


def interpreted_only() -> list:
    """`pytestmark` of a module whose kernels run in Triton's interpreter: skipped where they
    were built for a GPU (conftest.py sets the interpreter when torch sees none)."""
    from triton.runtime.interpreter import InterpretedFunction

    from kiln.plugins.linear.kernels import linear_kernel

    return [pytest.mark.skipif(not isinstance(linear_kernel, InterpretedFunction),
                               reason="runs the kernels in Triton's interpreter (set when torch sees no GPU)"),
            # The interpreter converts 1-element scalar arrays with int(), which numpy deprecates.
            pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")]


class Running:
    """A loaded kernel's stand-in: `launch` runs the AOT kernel's function in the interpreter."""

    def __init__(self, kernel: AotKernel, tensors: list[torch.Tensor], log: list) -> None:
        self.kernel = kernel
        self.tensors = {t.data_ptr(): t for t in tensors}
        self.log = log   # (kernel name, grid) of every launch, in order

    def launch(self, grid: tuple[int, int, int], args: list, stream: int) -> None:
        params = [n for n, kind in self.kernel.signature.items() if kind != "constexpr"]
        assert len(args) == len(params), (self.kernel.fn.__name__, args)
        values = {}
        for name, arg in zip(params, args):
            kind = self.kernel.signature[name]
            if kind.startswith("*"):  # 0: an absent optional pointer
                values[name] = self.tensors[arg].view(POINTER_DTYPES[kind]) if arg else None
            else:
                values[name] = arg
        self.log.append((self.kernel.fn.__name__, grid))
        # The interpreter runs launches one after another and has no griddepcontrol: a kernel built for
        # programmatic dependent launch runs without it here.
        pdl = {"PDL": False} if "PDL" in self.kernel.constexprs else {}
        self.kernel.fn[grid](**values, **{**self.kernel.constexprs, **pdl})


def targeted(kernels: list[AotKernel], target: str) -> list[AotKernel]:
    """The kernels an engine built for `target` holds, in order."""
    return [k for k in kernels if k.targets is None or target in k.targets]


def interpretable(kernel: AotKernel) -> AotKernel:
    """The kernel with the constexprs that work around the interpreter's float conversions
    (`linear.fp8`) set, as `kernels.run` sets them there; launch arguments do not depend on them."""
    fixes = {name: True for name in ("UPCAST_DOT", "INTERPRETER", "EMULATE", "ROUND_E4M3")
             if name in kernel.constexprs}
    return dataclasses.replace(kernel, constexprs={**kernel.constexprs, **fixes})
