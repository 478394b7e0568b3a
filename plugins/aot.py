"""Ahead-of-time compilation of a plugin's Triton kernels into cubins, without a GPU (and the one
entry, `compile_cubin`, for its CUDA C++ kernels too: `plugins.nvcc`).

A plugin's `kernels.py` describes each kernel it needs for given shapes as an `AotKernel`
(the jit function, the signature, the constexpr values, launch options); `compile_cubin`
turns one into a cubin for a target such as "sm_90" with `triton.compile`, which needs no GPU.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TARGET_CC = {"sm_80": 80, "sm_89": 89, "sm_90": 90, "sm_100": 100}
# The most shared memory one block may ask for on each target (the opt-in limit, CUDA's
# sharedMemPerBlockOptin): a cubin that needs more compiles but does not load there.
MAX_SHARED_BYTES = {"sm_80": 166_912, "sm_89": 101_376, "sm_90": 232_448, "sm_100": 232_448}
# Triton's pointer type in a signature for each engine dtype.
POINTER_TYPES = {"float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16"}
# Triton's pointer to e4m3 (torch.float8_e4m3fn) values, such as an FP8 KV cache's.
FP8_POINTER = "*fp8e4nv"


@dataclass(frozen=True)
class AotKernel:
    fn: Any                          # a @triton.jit function
    signature: dict[str, str]        # every parameter: "*bf16", "*fp32", "*i32", "i32", "fp32", or "constexpr"
    constexprs: dict[str, Any]       # values of the constexpr parameters
    num_warps: int = 4
    num_stages: int = 3
    meta: dict[str, Any] = field(default_factory=dict)  # what a launcher needs (grid rule, block sizes)
    # Pointer parameters the launcher promises are 16-byte aligned (an integer parameter named
    # here: divisible by 16). The JIT learns alignment from its arguments; a cubin only knows
    # what it is told, and without it every load of those pointers is a scalar load.
    aligned: tuple[str, ...] = ()
    # The GPU targets this kernel is built for; None: every target. A bucket whose best kernel
    # differs by architecture lists one kernel per group of targets, with the same launch meta.
    targets: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Cubin:
    name: str          # entry point in the cubin
    binary: bytes
    shared_bytes: int
    num_warps: int
    global_scratch: int = 0   # bytes of global scratch per program (TMA descriptors made on the device)


def absent_as_none(signature: dict[str, str], constexprs: dict[str, Any]) -> dict[str, Any]:
    """`constexprs` with None for every constexpr parameter it gives no value: the optional
    pointers (bias, split-K workspace, ...) a kernel is built without."""
    return {**{name: None for name, kind in signature.items() if kind == "constexpr"}, **constexprs}


def pointer_params(signature: dict[str, str]) -> tuple[str, ...]:
    """The pointer parameters of a signature: what `AotKernel.aligned` names when every tensor a
    kernel takes comes from an arena (whose regions and planned tensors all start on 256 bytes)."""
    return tuple(name for name, kind in signature.items() if kind.startswith("*"))


def kernel_name(kernel) -> str:
    """The entry point an AotKernel or `plugins.nvcc.NvccKernel` compiles to."""
    return getattr(kernel, "entry", None) or kernel.fn.__name__


def compile_kernel(kernel: AotKernel, target: str):
    """Triton's compiled kernel for `target` (its `asm` holds the PTX and the cubin)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if target not in TARGET_CC:
        raise ValueError(f"no GPU target {target!r}; choose one of {', '.join(TARGET_CC)}")
    attrs = {(kernel.fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in kernel.aligned}
    src = ASTSource(fn=kernel.fn, signature=kernel.signature, constexprs=kernel.constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", TARGET_CC[target], 32),
                          options={"num_warps": kernel.num_warps, "num_stages": kernel.num_stages})


def compile_cubin(kernel, target: str) -> Cubin:
    """`kernel` (an AotKernel, or a CUDA C++ `plugins.nvcc.NvccKernel`) compiled for `target`."""
    from kiln.plugins import nvcc   # nvcc's module builds on this one's Cubin

    if isinstance(kernel, nvcc.NvccKernel):
        return nvcc.compile_cubin(kernel, target)
    compiled = compile_kernel(kernel, target)
    md = compiled.metadata
    return Cubin(md.name, compiled.asm["cubin"], md.shared, md.num_warps, md.global_scratch_size)
