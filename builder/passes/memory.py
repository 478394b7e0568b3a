"""Activation memory planning: one arena, an offset per tensor, from lifetimes in plan order.

Step inputs and activations are sized for the largest value of each symbolic dim of their
shapes (`engines.manifest.symbol_bounds`: tokens, sequences, logit rows and blocks per sequence
of the build's limits). Two tensors share bytes only when their lifetimes [first write, last
read] do not overlap; an op's output never aliases its inputs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kiln.builder.ir import Graph
from kiln.dtypes import element_bytes
from kiln.engines.manifest import Slot

ALIGN = 256


@dataclass(frozen=True)
class MemoryPlan:
    arena_bytes: int
    slots: dict[str, Slot]  # every step input and activation


def nbytes(shape: tuple, dtype: str, bounds: dict[str, int]) -> int:
    return math.prod(bounds[d] if isinstance(d, str) else d for d in shape) * element_bytes(dtype)


def plan_memory(graph: Graph, bounds: dict[str, int]) -> MemoryPlan:
    """Place every step input and activation of `graph`, with its symbolic dims at `bounds`."""
    end = len(graph.nodes)
    life: dict[str, list[int]] = {}
    # The step inputs go first, smallest first: the CUDA executor uploads them up to the last byte a step
    # fills, so the largest (the block tables, sequences x blocks) goes last, where a small step's few
    # rows of it end the copy early.
    inputs = [name for name in graph.inputs if graph.tensors[name].kind == "input"]
    for name in sorted(inputs, key=lambda n: nbytes(graph.tensors[n].shape, graph.tensors[n].dtype, bounds)):
        life[name] = [-1, -1]
    for i, node in enumerate(graph.nodes):
        for t in node.tensor_inputs():
            if t in life:
                life[t][1] = i
        life[node.output] = [i, i]
    for name in graph.outputs:
        life[name][1] = end
    placed: list[tuple[int, int, int, int]] = []  # offset, size, first, last
    tensors = {}
    for name, (first, last) in life.items():
        info = graph.tensors[name]
        size = -(-nbytes(info.shape, info.dtype, bounds) // ALIGN) * ALIGN
        offset = 0
        for o, s, f, l in sorted((p for p in placed if not (p[3] < first or last < p[2]))):
            if offset + size <= o:
                break
            offset = max(offset, o + s)
        placed.append((offset, size, first, last))
        tensors[name] = Slot(offset, size)
    arena = max((o + s for o, s, _, _ in placed), default=0)
    return MemoryPlan(arena, tensors)
