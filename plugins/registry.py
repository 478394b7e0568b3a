"""Plugin specs and the registry that maps op names to them.

A plugin is one op the engine can run: its spec (inputs, attributes, output shape and dtype
rules, version) and its PyTorch reference implementation. The reference is also registered as
a torch custom op `kiln::<name>`, so a `torch.fx` trace of a model stops at it. The spec mirrors
TensorRT's IPluginV3 ideas (name, version, attribute fields, shape rule) so a port stays possible.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

Dim = int | str
Shape = tuple[Dim, ...]

NAMESPACE = "kiln"


@dataclass(frozen=True)
class PluginSpec:
    """What the builder and runtime need to know about one op.

    `inputs` are tensor arguments in call order; a trailing "?" marks an optional one (None
    allowed). `attrs` are the non-tensor arguments that follow them, with their Python types.
    `shape` maps input shapes (None for absent inputs) and attrs to the output shape, in
    symbolic dims. `dtype` is the output dtype rule: the name of an input whose dtype the
    output takes, or a fixed dtype name.
    """

    name: str
    version: int
    inputs: tuple[str, ...]
    attrs: dict[str, type]
    shape: Callable[[dict[str, Shape | None], dict], Shape]
    reference: Callable[..., torch.Tensor]
    dtype: str
    mutates: tuple[str, ...] = ()
    fused: bool = False
    doc: str = field(default="", compare=False)

    @property
    def input_names(self) -> list[str]:
        return [n.rstrip("?") for n in self.inputs]

    def is_optional(self, input_name: str) -> bool:
        return f"{input_name}?" in self.inputs

    def output_dtype(self, input_dtypes: dict[str, str | None]) -> str:
        return input_dtypes[self.dtype] if self.dtype in input_dtypes else self.dtype

    def call_reference(self, inputs: Sequence[torch.Tensor | None], attrs: dict) -> torch.Tensor:
        return self.reference(*inputs, **attrs)


_REGISTRY: dict[str, PluginSpec] = {}


def register(spec: PluginSpec) -> PluginSpec:
    """Add a plugin and register its reference as the custom op `kiln::<name>`."""
    if spec.name in _REGISTRY:
        raise ValueError(f"plugin {spec.name!r} registered twice")
    _REGISTRY[spec.name] = spec
    torch.library.custom_op(f"{NAMESPACE}::{spec.name}", spec.reference, mutates_args=spec.mutates)
    return spec


def get_plugin(name: str) -> PluginSpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"no Kiln plugin named {name!r}; known plugins: {', '.join(sorted(_REGISTRY))}") from None


def all_plugins() -> dict[str, PluginSpec]:
    return dict(_REGISTRY)


def op(name: str) -> Callable[..., torch.Tensor]:
    """The torch custom op for a plugin, for model code to call (and fx to record)."""
    return getattr(getattr(torch.ops, NAMESPACE), name)
