"""Kiln IR: a flat, ordered graph of plugin ops over named tensors.

Every tensor has a name, a shape whose dims are ints or symbols ("T", "S", "L", "B", "N") and a
dtype. A node runs one plugin: its inputs map the plugin's input names to tensor names (None
for an absent optional input), its attrs are the plugin's attributes, and it defines one output
tensor. Node order is execution order; the passes keep it valid.
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.plugins import get_plugin

Shape = tuple[int | str, ...]
KINDS = ("input", "state", "weight", "activation")


@dataclass
class TensorInfo:
    shape: Shape
    dtype: str
    kind: str


@dataclass
class Node:
    op: str
    inputs: dict[str, str | None]
    attrs: dict[str, Any]
    output: str
    source: str = ""

    def tensor_inputs(self) -> list[str]:
        return [t for t in self.inputs.values() if t is not None]


@dataclass
class Graph:
    nodes: list[Node]
    tensors: dict[str, TensorInfo]
    weights: dict[str, torch.Tensor]
    inputs: list[str]
    outputs: list[str]
    meta: dict[str, Any] = field(default_factory=dict)

    def copy(self) -> "Graph":
        """A graph that can be rewritten without touching this one (weight tensors are shared,
        never modified in place)."""
        return Graph([copy.deepcopy(n) for n in self.nodes], copy.deepcopy(self.tensors),
                     dict(self.weights), list(self.inputs), list(self.outputs), copy.deepcopy(self.meta))

    def producer(self, name: str | None) -> Node | None:
        return next((n for n in self.nodes if n.output == name), None) if name else None

    def users(self, name: str) -> list[Node]:
        return [n for n in self.nodes if name in n.tensor_inputs()]

    def only_user(self, name: str) -> Node | None:
        users = self.users(name)
        return users[0] if len(users) == 1 and name not in self.outputs else None

    def add_weight(self, name: str, tensor: torch.Tensor) -> str:
        self.weights[name] = tensor
        self.tensors[name] = TensorInfo(tuple(tensor.shape), dtype_name(tensor.dtype), "weight")
        return name

    def replace(self, pattern: list[Node], fused: Node) -> None:
        """Put `fused` where the last node of `pattern` was and drop the pattern's nodes.

        The last position is safe: every input of the pattern is defined before it, and
        every user of the fused output comes after it.
        """
        ids = {id(n) for n in pattern}
        last = max(i for i, n in enumerate(self.nodes) if id(n) in ids)
        fused.inputs = in_spec_order(fused.op, fused.inputs)
        self.nodes[last] = fused
        self.nodes = [n for n in self.nodes if id(n) not in ids]
        self.prune()
        self.infer_node(fused)

    def prune(self) -> None:
        """Forget tensors and weights that no node reads or writes any more."""
        live = set(self.inputs) | set(self.outputs)
        for n in self.nodes:
            live.update(n.tensor_inputs())
            live.add(n.output)
        self.tensors = {k: v for k, v in self.tensors.items() if k in live}
        self.weights = {k: v for k, v in self.weights.items() if k in live}

    def input_shapes(self, node: Node) -> dict[str, tuple | None]:
        """The node's input shapes by input name; None for an absent optional input."""
        return {k: (self.tensors[v].shape if v else None) for k, v in node.inputs.items()}

    def infer_node(self, node: Node) -> None:
        spec = get_plugin(node.op)
        shapes = self.input_shapes(node)
        dtypes = {k: (self.tensors[v].dtype if v else None) for k, v in node.inputs.items()}
        self.tensors[node.output] = TensorInfo(tuple(spec.shape(shapes, node.attrs)),
                                               spec.output_dtype(dtypes), "activation")

    def infer_shapes(self) -> None:
        for node in self.nodes:
            self.infer_node(node)

    def count_ops(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for n in self.nodes:
            counts[n.op] = counts.get(n.op, 0) + 1
        return counts


def layer_of(source: str) -> int | None:
    """The decoder layer a node comes from, by its module path ("model.layers.3.mlp" -> 3)."""
    m = re.search(r"\blayers\.(\d+)\b", source)
    return int(m.group(1)) if m else None


def in_spec_order(op: str, inputs: dict[str, str | None]) -> dict[str, str | None]:
    """A node's inputs in its plugin's order, absent optional ones as None: the order the CUDA
    launchers unpack them in."""
    spec = get_plugin(op)
    unknown = sorted(set(inputs) - set(spec.input_names))
    if unknown:
        raise ValueError(f"plugin {op!r} has no input {unknown[0]!r}; its inputs are {', '.join(spec.inputs)}")
    return {name: inputs.get(name) for name in spec.input_names}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
