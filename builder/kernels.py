"""Kernel compilation: every GPU kernel the plan needs, compiled ahead of time for each GPU
target into a cubin that goes into the engine file.

For each node the plugin's `kernels.aot_kernels(dtype, shapes)` lists the kernels for the
node's shapes (what they are, the plugin's `compile_shapes` says); each is compiled with
`plugins.aot.compile_cubin` (Triton's, or nvcc for CUDA C++ kernels), no GPU needed; a machine
without nvcc builds the Triton kernels alone (`build.py` notes it). Identical kernels (same
source, signature, constants, options and target) are compiled once per build and kept in an
on-disk cache keyed by their content hash, so rebuilding is quick. An op that has no GPU kernel (no
`compile_shapes`) is a build error naming it and the module it came from: nothing falls back
silently: an FP8 op (compile shape `fp8`) needs a kernels module whose `FP8_TARGETS` names every
GPU target of the build. A cubin that needs more shared memory than its target gives a
block is a build error too: it would compile, and then fail to load on that GPU.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
import types
from pathlib import Path
from typing import Any, Callable

from kiln.atomic import write_bytes
from kiln.builder.ir import Graph
from kiln.plugins import get_plugin, nvcc
from kiln.plugins.aot import MAX_SHARED_BYTES, AotKernel, Cubin, compile_cubin


class KernelError(ValueError):
    """The plan cannot be compiled for a GPU target."""


def _cache_dir() -> Path:
    root = os.environ.get("KILN_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "kiln")
    return Path(root).expanduser() / "kernels"


def _triton_source(fn: Any) -> str:
    """A Triton kernel's source, with that of every @triton.jit helper it calls (by name or through a
    module, transitively) and the constants it reads: the kernel's own text stays the same when they change."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    parts: list[str] = []
    seen: set = set()

    def names(code: types.CodeType) -> set[str]:
        nested = (names(c) for c in code.co_consts if isinstance(c, types.CodeType))
        return set(code.co_names).union(*nested)

    def visit(f: Any) -> None:
        while hasattr(f, "fn"):  # JITFunction, InterpretedFunction, heuristics and autotune wrappers
            f = f.fn
        if f in seen:
            return
        seen.add(f)
        parts.append(inspect.getsource(f))
        used = sorted(names(f.__code__))
        scopes = [f.__globals__] + [vars(m) for m in map(f.__globals__.get, used) if inspect.ismodule(m)]
        for name in used:
            for scope in scopes:
                value = scope.get(name)
                if isinstance(value, (JITFunction, InterpretedFunction)):
                    visit(value)
                elif isinstance(value, (tl.constexpr, bool, int, float, str)):
                    parts.append(f"{name} = {value!r}")

    visit(fn)
    return "\n".join(parts)


def kernel_key(kernel: AotKernel | nvcc.NvccKernel, target: str) -> str:
    """Content hash of everything that decides the cubin, and of its launch rule (two ops that
    share a kernel may launch it differently, so each keeps its own entry). A Triton kernel's text
    includes the helpers it calls, so a change there never reuses a cached cubin."""
    if isinstance(kernel, nvcc.NvccKernel):
        ident = json.dumps([nvcc.source_text(kernel), kernel.entry, kernel.signature, kernel.num_warps, target,
                            nvcc.nvcc_version(), kernel.options(target), kernel.shared_bytes, kernel.meta],
                           sort_keys=True, default=repr)
        return hashlib.sha256(ident.encode()).hexdigest()[:20]
    import triton
    ident = json.dumps([_triton_source(kernel.fn),
                        kernel.signature, {k: repr(v) for k, v in kernel.constexprs.items()},
                        kernel.num_warps, kernel.num_stages, target, triton.__version__, kernel.meta,
                        kernel.aligned],
                       sort_keys=True, default=repr)
    return hashlib.sha256(ident.encode()).hexdigest()[:20]


def _compile_cached(kernel: AotKernel | nvcc.NvccKernel, target: str, key: str) -> Cubin:
    path = _cache_dir() / f"{key}.cubin"
    meta_path = path.with_suffix(".json")
    if path.is_file() and meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        return Cubin(meta["name"], path.read_bytes(), meta["shared_bytes"], meta["num_warps"],
                     meta.get("global_scratch", 0))
    cubin = compile_cubin(kernel, target)
    # Atomic, so a concurrent build never reads half a file; the metadata last, as it marks the entry.
    write_bytes(path, cubin.binary)
    write_bytes(meta_path, json.dumps(
        {"name": cubin.name, "shared_bytes": cubin.shared_bytes, "num_warps": cubin.num_warps,
         "global_scratch": cubin.global_scratch}).encode())
    return cubin


def compile_kernels(graph: Graph, dtype: str, targets: list[str], block_size: int,
                    progress: Callable[[str], None] = lambda _: None) -> tuple[dict, dict[str, dict]]:
    """Compile the graph's kernels for every GPU target.

    Returns the engine's kernel blobs `{key: (cubin, index entry)}` and, per node output, the
    keys of its kernels per target (`{output: {target: [key, ...]}}`) for the plan.
    """
    gpu_targets = _gpu_targets(targets)
    blobs: dict[str, tuple[bytes, dict]] = {}
    per_node: dict[str, dict] = {}
    if not gpu_targets:
        return blobs, per_node
    for node in graph.nodes:
        spec = get_plugin(node.op)
        if spec.compile_shapes is None:
            raise KernelError(f"op {node.op!r} in module {node.source!r} has no GPU kernel: it cannot run on "
                              f"{', '.join(gpu_targets)} (only fused Llama-family plans can for now); "
                              "build with --target cpu")
        shapes = spec.compile_shapes(graph.input_shapes(node), node.attrs, block_size)
        kernels = spec.module("kernels")
        if shapes.get("fp8"):
            _check_fp8_targets(spec.name, getattr(kernels, "FP8_TARGETS", ()), gpu_targets)
    _check_compiler()
    has_nvcc = nvcc.nvcc_path() is not None
    for node in graph.nodes:
        spec = get_plugin(node.op)
        shapes = spec.compile_shapes(graph.input_shapes(node), node.attrs, block_size)
        module = spec.module("kernels")
        if module is None:
            raise KernelError(f"plugin {spec.name!r} gives compile shapes but has no kernels module "
                              f"({spec.package}.kernels)")
        # Without nvcc the CUDA C++ kernels are left out: the Triton buckets after them serve their rows.
        kernels = [k for k in module.aot_kernels(dtype, shapes) if has_nvcc or not isinstance(k, nvcc.NvccKernel)]
        per_node[node.output] = {}
        for target in gpu_targets:
            per_node[node.output][target] = [_add(blobs, kernel, target, node.op, progress) for kernel in kernels
                                              if kernel.targets is None or target in kernel.targets]
    return blobs, per_node


def _check_fp8_targets(plugin: str, fp8_targets: tuple[str, ...], gpu_targets: list[str]) -> None:
    """An FP8 op's plugin must have FP8 kernels for every GPU target of the build."""
    missing = [t for t in gpu_targets if t not in fp8_targets]
    if not missing:
        return
    have = f" (it has them for {', '.join(fp8_targets)} only)" if fp8_targets else ""
    instead = f"build for {' or '.join(fp8_targets)}, " if fp8_targets else ""
    raise KernelError(f"plugin {plugin!r} has no FP8 GPU kernels for {', '.join(missing)}{have}: {instead}"
                      "build --quantization fp8 engines for --target cpu, or build without --quantization fp8")


def compile_all_reduce(dtype: str, targets: list[str], world_size: int,
                       progress: Callable[[str], None] = lambda _: None) -> tuple[dict, dict[str, list[str]]]:
    """A tensor-parallel engine's custom all-reduce kernel (`plugins/all_reduce`) for every GPU
    target: its blobs and `{target: [key]}`. None for one rank, or for more ranks than the
    kernel serves (those sum with NCCL alone)."""
    from kiln.plugins.all_reduce import kernels as all_reduce
    from kiln.plugins.all_reduce.launch import MAX_WORLD

    gpu_targets = _gpu_targets(targets)
    blobs: dict[str, tuple[bytes, dict]] = {}
    if not gpu_targets or not 2 <= world_size <= MAX_WORLD:
        return blobs, {}
    _check_compiler()
    kernels = all_reduce.aot_kernels(dtype, world_size)
    return blobs, {target: [_add(blobs, k, target, "all_reduce", progress) for k in kernels] for target in gpu_targets}


def _gpu_targets(targets: list[str]) -> list[str]:
    return [t for t in targets if t != "cpu"]


def _check_compiler() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise KernelError("TRITON_INTERPRET=1 is set: Triton's interpreter cannot compile cubins; "
                          "unset it to build for a GPU target")


def _add(blobs: dict[str, tuple[bytes, dict]], kernel: AotKernel, target: str, plugin: str,
         progress: Callable[[str], None]) -> str:
    """Compile `kernel` for `target` into `blobs` unless it is there; returns its key."""
    key = kernel_key(kernel, target)
    if key not in blobs:
        progress(f"{plugin} for {target}")
        cubin = _compile_cached(kernel, target, key)
        check_shared_memory(cubin, target, plugin)
        blobs[key] = (cubin.binary, {
            "plugin": plugin, "target": target, "entry": cubin.name,
            "signature": [t for t in kernel.signature.values() if t != "constexpr"],
            "num_warps": cubin.num_warps, "shared_bytes": cubin.shared_bytes,
            "launch": kernel.meta,
            **({"global_scratch": cubin.global_scratch} if cubin.global_scratch else {})})
    return key


def check_shared_memory(cubin: Cubin, target: str, plugin: str) -> None:
    """Refuse a cubin that asks for more shared memory per block than `target` has."""
    limit = MAX_SHARED_BYTES[target]
    if cubin.shared_bytes > limit:
        raise KernelError(f"plugin {plugin!r}'s kernel {cubin.name} needs {cubin.shared_bytes:,} bytes of shared "
                          f"memory per block, more than {target} gives ({limit:,}): the engine would not load "
                          f"there. Its tiles are too large for this dtype and target (a bug in the plugin's "
                          f"tiling); build for the other targets, or shrink the plugin's tiles")
