"""Tensor-parallel sharding: the graph of one rank out of `world_size`.

Each op's plugin says what a rank keeps of it (`PluginSpec.shard`, see `plugins.sharding`):
column-parallel projections (q/k/v, gate/up) keep a slice of their output features, whole heads
at a time; row-parallel ones (o, down) keep a slice of their input features and all-reduce their
result before the residual add; kv heads are replicated when there are fewer than ranks. Ops
without a rule (embedding, norms, per-head ops, the LM head) run whole on every rank. This pass
applies the rules, checks that ops sharing a weight cut it alike, and sizes the KV cache for the
rank's kv heads.
"""
from __future__ import annotations

from kiln.builder.ir import Graph
from kiln.plugins import get_plugin
from kiln.plugins.sharding import ShardError, Split


def shard(graph: Graph, rank: int, world_size: int) -> Graph:
    g = graph.copy()
    if world_size == 1:
        return g
    done: dict[str, str] = {}
    for node in g.nodes:
        rule = get_plugin(node.op).shard
        if rule is None:
            continue
        part = rule(g.input_shapes(node), node.attrs, rank, world_size, node.source)
        node.attrs.update(part.attrs)
        for input_name, split in part.weights.items():
            weight = node.inputs.get(input_name)
            if weight is not None:
                _put(g, weight, split, done)
    kv = g.tensors["kv_cache"]
    kv_heads = {n.attrs["num_kv_heads"] for n in g.nodes if "num_kv_heads" in n.attrs}
    if kv_heads:
        kv.shape = kv.shape[:4] + (kv_heads.pop(),) + kv.shape[5:]
    g.infer_shapes()
    g.meta["rank"], g.meta["world_size"] = rank, world_size
    return g


def _put(g: Graph, weight: str, split: Split, done: dict[str, str]) -> None:
    """Replace a weight by this rank's part, once, however many ops read it."""
    if weight in done:
        if done[weight] != split.how:
            raise ShardError(f"weight {weight} is used by ops that shard it differently ({done[weight]} vs {split.how})")
        return
    done[weight] = split.how
    g.add_weight(weight, split.take(g.weights[weight]))
