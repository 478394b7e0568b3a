"""Tensor-parallel sharding: the graph of one rank out of `world_size`.

Each op's plugin says what a rank keeps of it (`PluginSpec.shard`, see `plugins.sharding`):
column-parallel projections (q/k/v, gate/up) keep a slice of their output features, whole heads
at a time; row-parallel ones (o, down) keep a slice of their input features and all-reduce their
result before the residual add; kv heads are replicated when there are fewer than ranks. Ops
without a rule (embedding, norms, per-head ops) run whole on every rank. This pass applies the
rules, checks that ops sharing a weight cut it alike, and sizes the KV cache for the rank's kv
heads.

The LM head is vocabulary parallel: every rank needs the whole logits (each samples the same
tokens with the same sampler state), but no rank needs to read the whole [vocab, hidden] weight,
the largest of most models. So the pass marks the linear that computes the logits column
parallel with `all_gather` (see `plugins/linear`): each rank keeps an even slice of the
vocabulary's rows (and of their FP8 scales), and the slices of the logits are gathered after the
GEMM, before anything that follows (Gemma 3's soft cap runs on the whole logits). A tied
embedding reads the same weight whole, so the head gets its own copy to cut. A vocabulary that
does not divide evenly over the ranks keeps the head whole on every rank (the build summary says
so), rather than padding the slices and dropping the padding from the logits: real
vocabularies (Llama 3's 128,256, Qwen2's 151,936, Gemma 3's 262,144) divide by 8.
"""
from __future__ import annotations

from kiln.builder.ir import Graph, Node
from kiln.plugins import get_plugin
from kiln.plugins.sharding import ShardError, Split


def shard(graph: Graph, rank: int, world_size: int) -> Graph:
    g = graph.copy()
    if world_size == 1:
        return g
    _split_vocabulary(g, world_size)
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


def lm_head(g: Graph) -> Node | None:
    """The linear that computes the logits (the graph's first output), looking back through the
    one-input ops after it (Gemma 3's soft cap); None when the logits come from no linear."""
    node = g.producer(g.outputs[0])
    while node is not None and node.op != "linear" and len(node.tensor_inputs()) == 1:
        node = g.producer(node.tensor_inputs()[0])
    return node if node is not None and node.op == "linear" else None


def vocab_parallel(g: Graph) -> bool:
    """Whether a rank's graph gathers the logits from the ranks' slices of the vocabulary."""
    head = lm_head(g)
    return head is not None and head.attrs.get("all_gather", 0) > 1


def _split_vocabulary(g: Graph, world_size: int) -> None:
    """Mark the LM head for a column-parallel cut and a gather of its output, when the
    vocabulary divides evenly over the ranks (see the module docstring)."""
    head = lm_head(g)
    if head is None or head.attrs["parallel"] != "none":
        return
    weight = head.inputs["weight"]
    if g.weights[weight].shape[0] % world_size:
        return
    if any(node is not head for node in g.users(weight)):  # a tied embedding reads it whole
        head.inputs["weight"] = g.add_weight(f"{weight}.lm_head", g.weights[weight])
    head.attrs.update(parallel="column", all_gather=world_size)
