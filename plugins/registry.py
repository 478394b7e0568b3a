"""Plugin specs and the registry that maps op names to them.

A plugin is one op the engine can run, and its folder (a Python package) owns everything about
it: its spec (inputs, attributes, output shape and dtype rules, version, how it shards, what
only rank 0 adds, the shapes its kernels compile for), its PyTorch reference, when it runs
on GPUs `kernels.py` and `launch.py`, and for ONNX export `onnx.py` (its definition in
standard ONNX ops, see `plugins/onnx_function.py`). The reference is also registered as a
torch custom op `kiln::<name>`, so a `torch.fx` trace of a model stops at it. The spec mirrors
TensorRT's IPluginV3 ideas (name, version, attribute fields, shape rule) so a port stays
possible.

Registering is the one step that makes an op known to the builder and the runtime: the
package's `__init__` calls `register(PluginSpec(...))` when it is imported. Kiln's own op
folders are listed in `BUILTIN`, which `kiln.plugins` imports.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import Callable, Sequence

import torch

from kiln.plugins.sharding import ShardRule

Dim = int | str
Shape = tuple[Dim, ...]

NAMESPACE = "kiln"

# The op folders of this package, imported (so registered) with `kiln.plugins`.
BUILTIN = ("add", "attention", "attention_o_proj", "embedding", "gelu", "gelu_mul", "head_rms_norm", "linear",
           "linear_residual", "norm_qkv_rope", "norm_swiglu", "rms_norm", "rope", "silu_mul", "softcap", "take_rows")


@dataclass(frozen=True)
class PluginSpec:
    """What the builder and runtime need to know about one op.

    `inputs` are the tensor arguments; a trailing "?" marks an optional one (None allowed).
    `attrs` are the non-tensor arguments that follow them, with their Python types. An optional
    input added to an op later (the FP8 weight scales) comes last in `inputs` and, in the
    reference's signature, after the attrs with the default None, so calls written before it
    (model code, engines built before it) stay valid; the reference is called by name.
    `shape` maps input shapes (None for absent inputs) and attrs to the output shape, in
    symbolic dims. `dtype` is the output dtype rule: the name of an input whose dtype the
    output takes, or a fixed dtype name. `package` is the plugin's folder as a module name
    (its `__init__` passes `__name__`): its `kernels` and `launch` modules are found there.

    `compile_shapes` maps input shapes and attrs (and the KV-cache block size) to what the
    plugin's `kernels.aot_kernels` needs to know about one node; None when the op has no GPU
    kernels. `shard` gives one rank's part of the op under tensor parallelism (see
    `plugins.sharding`); None when every rank runs it whole. `added_once` names the inputs a
    row-parallel op (attr `all_reduce`) adds after the sum over ranks: only rank 0 adds them.
    """

    name: str
    version: int
    inputs: tuple[str, ...]
    attrs: dict[str, type]
    shape: Callable[[dict[str, Shape | None], dict], Shape]
    reference: Callable[..., torch.Tensor]
    dtype: str
    package: str
    mutates: tuple[str, ...] = ()
    fused: bool = False
    compile_shapes: Callable[[dict[str, Shape | None], dict, int], dict] | None = None
    shard: ShardRule | None = None
    added_once: tuple[str, ...] = ()
    doc: str = field(default="", compare=False)

    @property
    def input_names(self) -> list[str]:
        return [n.rstrip("?") for n in self.inputs]

    def is_optional(self, input_name: str) -> bool:
        return f"{input_name}?" in self.inputs

    def output_dtype(self, input_dtypes: dict[str, str | None]) -> str:
        return input_dtypes[self.dtype] if self.dtype in input_dtypes else self.dtype

    def call_reference(self, inputs: Sequence[torch.Tensor | None], attrs: dict) -> torch.Tensor:
        """The reference on `inputs` (in `input_names` order; trailing optional ones may be left
        off) and `attrs`, passed by name: an optional input added last (such as attention's
        `kv_scales`) comes after the attrs in the reference's own signature, where models that
        pass the attrs by position do not see it."""
        return self.reference(**dict(zip(self.input_names, inputs)), **attrs)

    def module(self, name: str) -> ModuleType | None:
        """One of the plugin's own modules (`kernels`, `launch`, `onnx`), imported on first use
        (only GPU builds and the CUDA executor need the first two, and Triton; only the ONNX
        export the last), or None when the plugin has no such module. An import that fails
        inside the module is raised, not taken for its absence."""
        try:
            return importlib.import_module(f"{self.package}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{self.package}.{name}":
                raise
            return None


_REGISTRY: dict[str, PluginSpec] = {}


def register(spec: PluginSpec) -> PluginSpec:
    """Add a plugin and register its reference as the custom op `kiln::<name>`."""
    if spec.name in _REGISTRY:
        raise ValueError(f"plugin {spec.name!r} registered twice (by {_REGISTRY[spec.name].package} and "
                         f"{spec.package}): give the new op another name")
    unknown = [n for n in spec.added_once if n not in spec.input_names]
    if unknown:
        raise ValueError(f"plugin {spec.name!r}: added_once names {unknown}, which are not among its inputs "
                         f"{spec.input_names}")
    _REGISTRY[spec.name] = spec
    torch.library.custom_op(f"{NAMESPACE}::{spec.name}", spec.reference, mutates_args=spec.mutates)
    return spec


def get_plugin(name: str) -> PluginSpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"no Kiln plugin named {name!r}; known plugins: {', '.join(sorted(_REGISTRY))} "
                       "(an op kept outside Kiln is registered by importing its package first)") from None


def all_plugins() -> dict[str, PluginSpec]:
    return dict(_REGISTRY)


def op(name: str) -> Callable[..., torch.Tensor]:
    """The torch custom op for a plugin, for model code to call (and fx to record)."""
    return getattr(getattr(torch.ops, NAMESPACE), name)
