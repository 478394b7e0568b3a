"""What every plugin's `launch.py` shares: the launcher contract, grid expressions, pointer
arguments and alignment checks for driver launches of AOT-compiled kernels.

The runtime's CUDA executor hands each launcher the op's loaded kernels (`CudaKernel`s, in
`aot_kernels` order) with their launch metadata, the op's input tensors on the GPU, its
attributes, the output view, the step's dims (T, S, L, B, ...), the raw stream handle and the
executor's scratch buffers:

    launch(kernels, metas, inputs, attrs, out, dims, stream, scratch) -> None

and, where the op needs workspace of its own, `scratch_bytes(attrs, limits) -> {name: bytes}`.
A launcher does what the plugin's `kernels.run` does through Triton's JIT, with plain driver
launches: the same variant, grid and arguments (pointers as `data_ptr()`, 0 for an absent
optional pointer; constexpr parameters are baked into the cubin and not passed).

Grids come from the kernels' metadata as expressions in the step dims (`"(T, 3, 1)"`, or the
GEMM buckets' `["cdiv(T, 16)", "8"]`), evaluated here by a small arithmetic interpreter:
integers, names, + - * //, cdiv and min; nothing else is accepted. `SMS`, the GPU's
multiprocessor count, is always a name: a persistent kernel's grid is `min(tiles, SMS)`.
"""
from __future__ import annotations

import ast
from collections.abc import Sequence
from functools import cache, lru_cache

import torch

_BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
           ast.Mult: lambda a, b: a * b, ast.FloorDiv: lambda a, b: a // b}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


_CALLS = {"cdiv": cdiv, "min": min}


@cache
def sm_count() -> int:
    """Streaming multiprocessors of the current GPU: the most programs a persistent kernel runs."""
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


@cache
def _parse(expr: str) -> ast.expr:
    # Parsed once per distinct expression: launches run every step.
    return ast.parse(expr, mode="eval").body


def _evaluate(node: ast.expr, names: dict[str, int]) -> int | tuple:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.Name) and node.id in names:
        return names[node.id]
    if isinstance(node, ast.Name) and node.id == "SMS":
        return sm_count()
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_evaluate(node.left, names), _evaluate(node.right, names))
    if isinstance(node, ast.Tuple):
        return tuple(_evaluate(e, names) for e in node.elts)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _CALLS
            and len(node.args) == 2 and not node.keywords):
        return _CALLS[node.func.id](_evaluate(node.args[0], names), _evaluate(node.args[1], names))
    raise ValueError(f"grid expression element {ast.dump(node)} is not supported (names: {sorted(names)})")


def grid(expr: str | Sequence[str], names: dict[str, int]) -> tuple[int, int, int]:
    """A kernel meta's grid (one expression string or one string per axis) as 3 ints."""
    return _grid(expr if isinstance(expr, str) else tuple(expr), tuple(names.items()))


@lru_cache(maxsize=8192)
def _grid(expr: str | tuple[str, ...], names: tuple[tuple[str, int], ...]) -> tuple[int, int, int]:
    # Remembered per expression and dims: an eager step launches a few hundred kernels, and
    # walking each one's expression again cost more host time than launching it.
    values = dict(names)
    parts = _evaluate(_parse(expr), values) if isinstance(expr, str) else tuple(
        _evaluate(_parse(e), values) for e in expr)
    parts = parts if isinstance(parts, tuple) else (parts,)
    if not 1 <= len(parts) <= 3:
        raise ValueError(f"grid {expr!r} has {len(parts)} axes")
    return tuple(parts) + (1,) * (3 - len(parts))


def ptr(t: torch.Tensor | None) -> int:
    """A kernel pointer argument: the tensor's address, or 0 for an absent optional input."""
    return 0 if t is None else t.data_ptr()


def check_aligned(meta: dict, *tensors: torch.Tensor | None) -> None:
    """An AOT kernel assumes the pointer alignment its meta names (`AotKernel.aligned`)."""
    align = meta.get("pointer_alignment", 1)
    bad = [t.data_ptr() for t in tensors if t is not None and t.data_ptr() % align]
    if bad:
        raise ValueError(f"kernel pointers must be {align}-byte aligned; got addresses {bad}")
