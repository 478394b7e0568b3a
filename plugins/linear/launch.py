"""Driver launches of `linear`'s AOT-compiled kernels, and the helpers every launcher shares.

The runtime's CUDA executor hands each launcher the op's loaded kernels (`CudaKernel`s, in
`aot_kernels` order) with their launch metadata, the op's input tensors on the GPU, its
attributes, the output view, the step's dims (T, S, L, B, ...), the raw stream handle and the
executor's scratch buffers. A launcher does what the plugin's `kernels.run` does through
Triton's JIT, with plain driver launches: the same variant, grid and arguments (pointers as
`data_ptr()`, 0 for an absent optional pointer; constexpr parameters are baked into the cubin
and not passed).

Grids come from the kernels' metadata as expressions in the step dims (`"(T, 3, 1)"`, or the
GEMM buckets' `["cdiv(T, 16)", "8"]`), evaluated here by a small arithmetic interpreter:
integers, names, + - * //, and cdiv; nothing else is accepted.
"""
from __future__ import annotations

import ast
from collections.abc import Sequence
from functools import cache

import torch

_BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
           ast.Mult: lambda a, b: a * b, ast.FloorDiv: lambda a, b: a // b}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@cache
def _parse(expr: str) -> ast.expr:
    # Parsed once per distinct expression: launches run every step.
    return ast.parse(expr, mode="eval").body


def _evaluate(node: ast.expr, names: dict[str, int]) -> int | tuple:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.Name) and node.id in names:
        return names[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_evaluate(node.left, names), _evaluate(node.right, names))
    if isinstance(node, ast.Tuple):
        return tuple(_evaluate(e, names) for e in node.elts)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "cdiv"
            and len(node.args) == 2 and not node.keywords):
        return cdiv(_evaluate(node.args[0], names), _evaluate(node.args[1], names))
    raise ValueError(f"grid expression element {ast.dump(node)} is not supported (names: {sorted(names)})")


def grid(expr: str | Sequence[str], names: dict[str, int]) -> tuple[int, int, int]:
    """A kernel meta's grid (one expression string or one string per axis) as 3 ints."""
    parts = _evaluate(_parse(expr), names) if isinstance(expr, str) else tuple(
        _evaluate(_parse(e), names) for e in expr)
    parts = parts if isinstance(parts, tuple) else (parts,)
    if not 1 <= len(parts) <= 3:
        raise ValueError(f"grid {expr!r} has {len(parts)} axes")
    return tuple(parts) + (1,) * (3 - len(parts))


def ptr(t: torch.Tensor | None) -> int:
    """A kernel pointer argument: the tensor's address, or 0 for an absent optional input."""
    return 0 if t is None else t.data_ptr()


def pick_bucket(metas: list[dict], rows: int) -> int:
    """Index of the GEMM shape bucket serving `rows` rows: the first whose max_rows admits
    them, as `plugins.linear.kernels.pick_tile` chooses (buckets are in TILES order)."""
    for i, meta in enumerate(metas):
        if "bucket" in meta and (meta["max_rows"] is None or rows <= meta["max_rows"]):
            return i
    raise ValueError(f"no GEMM bucket serves {rows} rows among {[m.get('bucket') for m in metas]}")


def check_aligned(meta: dict, *tensors: torch.Tensor | None) -> None:
    """An AOT kernel assumes the pointer alignment its meta names (`AotKernel.aligned`)."""
    align = meta.get("pointer_alignment", 1)
    bad = [t.data_ptr() for t in tensors if t is not None and t.data_ptr() % align]
    if bad:
        raise ValueError(f"kernel pointers must be {align}-byte aligned; got addresses {bad}")


def split_args(meta: dict, scratch: dict[str, torch.Tensor]) -> list[int]:
    """The split-K workspace pointers a GEMM bucket kernel takes after its output (none when
    it does not split K). The executor sizes these scratch buffers from the metas' "scratch"
    and allocates them zeroed, as the arrival counts need."""
    if meta.get("split_k", 1) == 1:
        return []
    return [scratch["gemm_split_part"].data_ptr(), scratch["gemm_split_count"].data_ptr()]


def launch_gemm(kernels: list, metas: list[dict], x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, residual: torch.Tensor | None, out: torch.Tensor,
                stream: int, scratch: dict[str, torch.Tensor]) -> None:
    """out = x weight^T (+ bias) (+ residual) with the bucket kernel for x's row count.
    `linear_kernel` takes bias and residual pointers only when built with them."""
    rows = x.shape[0]
    i = pick_bucket(metas, rows)
    check_aligned(metas[i], x, weight, bias, residual, out)
    args = [x.data_ptr(), weight.data_ptr()]
    args += [t.data_ptr() for t in (bias, residual) if t is not None]
    args += [out.data_ptr(), *split_args(metas[i], scratch), rows]
    kernels[i].launch(grid(metas[i]["grid"], {"T": rows}), args, stream)


def launch(kernels: list, metas: list[dict], inputs: list, attrs: dict, out: torch.Tensor,
           dims: dict[str, int], stream: int, scratch: dict[str, torch.Tensor]) -> None:
    """inputs: x [T, K], weight [N, K], bias [N] or None. Summing partials over ranks
    (`all_reduce`) is the executor's business."""
    x, weight, bias = inputs
    launch_gemm(kernels, metas, x, weight, bias, None, out, stream, scratch)
