"""Trace a model definition into Kiln IR with `torch.fx`.

Kiln's primitive ops are torch custom ops, so the trace stops at them and records each as a
node. Any other operation in the model has no plugin: that is a build error naming the op and
the module it came from.
"""
from __future__ import annotations

import operator

import torch
import torch.fx
from torch import nn

from kiln.builder.ir import Graph, Node, TensorInfo
from kiln.plugins import STEP_INPUTS, get_plugin
from kiln.plugins.registry import NAMESPACE
from kiln.plugins.step_inputs import KV_CACHE


class TraceError(ValueError):
    """The model uses something Kiln cannot compile."""


def _source(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return next(reversed(stack.values()))[0] if stack else "<top level>"


def _kiln_op_name(target) -> str | None:
    if isinstance(target, torch._ops.OpOverload):
        target = target.overloadpacket
    if isinstance(target, torch._ops.OpOverloadPacket):
        ns, name = target._qualified_op_name.split("::")
        return name if ns == NAMESPACE else None
    return None


def trace(model: nn.Module) -> Graph:
    """Record `model.forward` (taking the step inputs and the KV cache) as Kiln IR."""
    fx = torch.fx.symbolic_trace(model)
    step_inputs = {s.name: s for s in STEP_INPUTS}
    graph = Graph([], {}, {}, [], [])
    names: dict[torch.fx.Node, str] = {}
    taken: set[str] = set()
    for fn in fx.graph.nodes:
        if fn.op == "placeholder":
            if fn.target == KV_CACHE:
                graph.tensors[KV_CACHE] = TensorInfo((), "", "state")  # shape set below
            elif fn.target in step_inputs:
                spec = step_inputs[fn.target]
                graph.tensors[spec.name] = TensorInfo(spec.shape, spec.dtype, "input")
            else:
                raise TraceError(f"forward() argument {fn.target!r} is not a step input; "
                                 f"expected {', '.join(step_inputs)} and {KV_CACHE}")
            graph.inputs.append(fn.target)
            names[fn] = fn.target
        elif fn.op == "get_attr":
            tensor = operator.attrgetter(fn.target)(model)
            names[fn] = graph.add_weight(fn.target, tensor.detach())
        elif fn.op == "call_function" and _kiln_op_name(fn.target):
            node = _to_node(fn, names, taken)
            graph.nodes.append(node)
            graph.infer_node(node)
            names[fn] = node.output
        elif fn.op == "output":
            out = names[fn.args[0]]
            graph.outputs.append(out)
        else:
            what = getattr(fn.target, "__name__", None) or str(fn.target)
            raise TraceError(f"op {what!r} ({fn.op}) in module {_source(fn)!r} has no Kiln plugin: "
                             "write the module with Kiln ops (plugins.op) or add a plugin for it")
    graph.tensors[KV_CACHE] = TensorInfo(_kv_shape(graph), graph.tensors[graph.outputs[0]].dtype, "state")
    graph.prune()
    return graph


def _to_node(fn: torch.fx.Node, names: dict, taken: set[str]) -> Node:
    op_name = _kiln_op_name(fn.target)
    spec = get_plugin(op_name)
    overload = fn.target.default if isinstance(fn.target, torch._ops.OpOverloadPacket) else fn.target
    schema = overload._schema
    args = {a.name: (a.default_value if a.has_default_value() else None) for a in schema.arguments}
    args.update(zip([a.name for a in schema.arguments], fn.args))
    args.update(fn.kwargs)
    inputs = {}
    for name in spec.input_names:
        value = args[name]
        inputs[name] = names[value] if isinstance(value, torch.fx.Node) else None
    attrs = {name: args[name] for name in spec.attrs}
    source = _source(fn)
    base = f"{source}.{op_name}" if source != "<top level>" else op_name
    out, i = base, 1
    while out in taken:
        i += 1
        out = f"{base}.{i}"
    taken.add(out)
    return Node(op_name, inputs, attrs, out, source)


def _kv_shape(graph: Graph) -> tuple:
    """[layers, 2, N blocks, block size, kv heads, head dim] from the attention ops' attributes."""
    layers = [n.attrs for n in graph.nodes if "layer" in n.attrs]
    if not layers:
        return (0, 2, "N", "block_size", 0, 0)
    kvh = {a["num_kv_heads"] for a in layers}
    hd = {a["head_dim"] for a in layers}
    if len(kvh) != 1 or len(hd) != 1:
        raise TraceError("all attention layers must share num_kv_heads and head_dim (one KV cache pool)")
    return (max(a["layer"] for a in layers) + 1, 2, "N", "block_size", kvh.pop(), hd.pop())
