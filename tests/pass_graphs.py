"""Hand-built graphs and a tiny interpreter for the builder pass tests.

Graphs are small (hidden 16, 4 heads, 2 kv heads, head_dim 4, intermediate 24) and built by
hand, never via a full model. The interpreter runs a graph through the plugins' PyTorch
references on real step inputs (`runtime.step.pack_step`) and a KV cache.
"""
from __future__ import annotations

import copy

import torch

import kiln.plugins.linear.reference as linear_reference
from kiln.builder.ir import Graph, Node, TensorInfo
from kiln.builder.passes import (fuse_attention_o_proj, fuse_linear_residual,
                                 fuse_norm_qkv_rope, fuse_norm_swiglu)
from kiln.plugins import STEP_INPUTS, get_plugin
from kiln.plugins.step_inputs import KV_CACHE
from kiln.runtime.step import SequenceChunk, pack_step


H, NH, NKV, HD, INTER, VOCAB = 16, 4, 2, 4, 24, 32
EPS = 1e-6
BLOCK_SIZE, NUM_BLOCKS, BLOCKS_PER_SEQ, MAX_POS = 4, 8, 3, 16
TOL = dict(rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# Hand-built graphs
# --------------------------------------------------------------------------------------------

class GraphBuilder:
    """Appends nodes to a Graph one at a time, inferring each output's shape as it goes."""

    def __init__(self, seed: int = 0, num_layers: int = 1, num_kv_heads: int = NKV, head_dim: int = HD):
        self.g = Graph([], {}, {}, [], [])
        self.gen = torch.Generator().manual_seed(seed)
        for spec in STEP_INPUTS:
            self.g.tensors[spec.name] = TensorInfo(spec.shape, spec.dtype, "input")
            self.g.inputs.append(spec.name)
        self.g.tensors[KV_CACHE] = TensorInfo((num_layers, 2, "N", "block_size", num_kv_heads, head_dim),
                                              "float32", "state")
        self.g.inputs.append(KV_CACHE)

    def weight(self, name: str, *shape: int, scale: float = 0.3, offset: float = 0.0) -> str:
        return self.g.add_weight(name, torch.randn(*shape, generator=self.gen) * scale + offset)

    def node(self, op_name: str, out: str, source: str = "", **kwargs) -> str:
        spec = get_plugin(op_name)
        unknown = set(kwargs) - set(spec.input_names) - set(spec.attrs)
        assert not unknown, f"{op_name}: unknown arguments {unknown}"
        inputs = {n: kwargs.get(n) for n in spec.input_names}
        attrs = {n: kwargs[n] for n in spec.attrs}
        node = Node(op_name, inputs, attrs, out, source or out.rsplit(".", 1)[0])
        self.g.nodes.append(node)
        self.g.infer_node(node)
        return out


def rope_cache() -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, HD, 2).float() / HD))
    freqs = torch.arange(MAX_POS).float()[:, None] * inv[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=1)


def linear(b: GraphBuilder, x: str, w: str, out: str, parallel: str, heads: int = 0, bias: str | None = None) -> str:
    return b.node("linear", out, x=x, weight=w, bias=bias, parallel=parallel, heads=heads, all_reduce=False)


def attention_block(b: GraphBuilder, h: str, layer: int, *, bias: bool = False, qk_norm: bool = False,
                    num_heads: int = NH, num_kv_heads: int = NKV) -> str:
    """rms_norm -> q/k/v linears -> (head_rms_norm q, k) -> rope q, k -> attention; returns the
    attention output."""
    p = f"layers.{layer}"
    qn, kvn = num_heads * HD, num_kv_heads * HD
    ln = b.weight(f"{p}.input_layernorm.weight", H, scale=0.2, offset=1.0)
    x = b.node("rms_norm", f"{p}.input_layernorm.rms_norm", x=h, weight=ln, eps=EPS)
    q = linear(b, x, b.weight(f"{p}.self_attn.q_proj.weight", qn, H), f"{p}.self_attn.q_proj.linear", "column",
               num_heads, b.weight(f"{p}.self_attn.q_proj.bias", qn) if bias else None)
    k = linear(b, x, b.weight(f"{p}.self_attn.k_proj.weight", kvn, H), f"{p}.self_attn.k_proj.linear", "column",
               num_kv_heads, b.weight(f"{p}.self_attn.k_proj.bias", kvn) if bias else None)
    v = linear(b, x, b.weight(f"{p}.self_attn.v_proj.weight", kvn, H), f"{p}.self_attn.v_proj.linear", "column",
               num_kv_heads, b.weight(f"{p}.self_attn.v_proj.bias", kvn) if bias else None)
    if qk_norm:
        q = b.node("head_rms_norm", f"{p}.self_attn.q_norm.head_rms_norm", x=q,
                   weight=b.weight(f"{p}.self_attn.q_norm.weight", HD, scale=0.2, offset=1.0), eps=EPS, head_dim=HD)
        k = b.node("head_rms_norm", f"{p}.self_attn.k_norm.head_rms_norm", x=k,
                   weight=b.weight(f"{p}.self_attn.k_norm.weight", HD, scale=0.2, offset=1.0), eps=EPS, head_dim=HD)
    q = b.node("rope", f"{p}.self_attn.rope", x=q, positions="positions", rope_cache="rope_cache", head_dim=HD)
    k = b.node("rope", f"{p}.self_attn.rope.2", x=k, positions="positions", rope_cache="rope_cache", head_dim=HD)
    return b.node("attention", f"{p}.self_attn.attention", q=q, k=k, v=v, kv_cache=KV_CACHE,
                  slot_mapping="slot_mapping", block_tables="block_tables", query_lens="query_lens",
                  context_lens="context_lens", layer=layer, num_heads=num_heads, num_kv_heads=num_kv_heads,
                  head_dim=HD, scale=HD ** -0.5, window=0)


def mlp_block(b: GraphBuilder, h: str, layer: int, inter: int = INTER, gated: str = "silu_mul") -> str:
    """rms_norm -> gate/up linears -> silu_mul (or gelu_mul) -> down linear; returns the down output."""
    p = f"layers.{layer}"
    ln = b.weight(f"{p}.post_attention_layernorm.weight", H, scale=0.2, offset=1.0)
    x = b.node("rms_norm", f"{p}.post_attention_layernorm.rms_norm", x=h, weight=ln, eps=EPS)
    gate = linear(b, x, b.weight(f"{p}.mlp.gate_proj.weight", inter, H), f"{p}.mlp.gate_proj.linear", "column")
    up = linear(b, x, b.weight(f"{p}.mlp.up_proj.weight", inter, H), f"{p}.mlp.up_proj.linear", "column")
    m = b.node(gated, f"{p}.mlp.{gated}", gate=gate, up=up)
    return linear(b, m, b.weight(f"{p}.mlp.down_proj.weight", H, inter), f"{p}.mlp.down_proj.linear", "row")


def make_llama(*, layers: int = 1, bias: bool = False, qk_norm: bool = False, inter: int = INTER,
               num_heads: int = NH, num_kv_heads: int = NKV, seed: int = 0, gated: str = "silu_mul",
               vocab: int = VOCAB, tied: bool = False, softcap: float | None = None) -> Graph:
    """embedding -> decoder layers (attention + SwiGLU MLP with residual adds) -> take_rows ->
    final norm -> lm_head (reading the embedding's weight when `tied`) -> soft cap (when
    `softcap`), the shape of what the tracer produces for a Llama-family model (or Gemma 3)."""
    b = GraphBuilder(seed, num_layers=layers, num_kv_heads=num_kv_heads)
    b.g.add_weight("rope_cache", rope_cache())
    embed = b.weight("embed_tokens.weight", vocab, H, scale=1.0)
    h = b.node("embedding", "embed_tokens.embedding", input_ids="input_ids", weight=embed, scale=1.0)
    for layer in range(layers):
        a = attention_block(b, h, layer, bias=bias, qk_norm=qk_norm, num_heads=num_heads, num_kv_heads=num_kv_heads)
        o = linear(b, a, b.weight(f"layers.{layer}.self_attn.o_proj.weight", H, num_heads * HD),
                   f"layers.{layer}.self_attn.o_proj.linear", "row")
        h = b.node("add", f"layers.{layer}.add", a=h, b=o)
        d = mlp_block(b, h, layer, inter, gated)
        h = b.node("add", f"layers.{layer}.add.2", a=h, b=d)
    h = b.node("take_rows", "take_rows", x=h, indices="logits_indices")
    h = b.node("rms_norm", "norm.rms_norm", x=h, weight=b.weight("norm.weight", H, scale=0.2, offset=1.0), eps=EPS)
    logits = linear(b, h, embed if tied else b.weight("lm_head.weight", vocab, H), "lm_head.linear", "none")
    if softcap is not None:
        logits = b.node("softcap", "softcap", x=logits, cap=softcap)
    b.g.outputs.append(logits)
    return b.g


def fuse_all(g: Graph) -> Graph:
    for fusion in (fuse_norm_qkv_rope, fuse_attention_o_proj, fuse_norm_swiglu, fuse_linear_residual):
        g = fusion(g)
    return g


# --------------------------------------------------------------------------------------------
# Interpreter
# --------------------------------------------------------------------------------------------

def prefill_step():
    """Two sequences: 5 tokens over blocks [3, 1] and 3 tokens in block [6]."""
    return pack_step([SequenceChunk([1, 2, 3, 4, 5], 0, [3, 1], all_logits=True),
                      SequenceChunk([6, 7, 8], 0, [6])], BLOCK_SIZE, BLOCKS_PER_SEQ)


def decode_step():
    return pack_step([SequenceChunk([9], 5, [3, 1]), SequenceChunk([10], 3, [6])], BLOCK_SIZE, BLOCKS_PER_SEQ)


def new_cache(g: Graph) -> torch.Tensor:
    layers, two, _, _, kvh, hd = g.tensors[KV_CACHE].shape
    return torch.zeros(layers, two, NUM_BLOCKS, BLOCK_SIZE, kvh, hd)


def _node_args(node: Node, env: dict) -> list:
    return [env[node.inputs[n]] if node.inputs.get(n) else None for n in get_plugin(node.op).input_names]


def _check_shape(g: Graph, name: str, value: torch.Tensor, step) -> None:
    dims = {"T": step.num_tokens, "S": step.query_lens.shape[0], "L": step.logits_indices.shape[0],
            "B": step.block_tables.shape[1]}
    info = g.tensors[name]
    assert tuple(value.shape) == tuple(dims.get(d, d) for d in info.shape), name
    assert str(value.dtype).removeprefix("torch.") == info.dtype, name


def run_graph(g: Graph, step, kv_cache: torch.Tensor) -> dict[str, torch.Tensor]:
    """Run every node's PyTorch reference in plan order; returns every tensor by name."""
    env = {**g.weights, **step.as_dict(), KV_CACHE: kv_cache}
    for node in g.nodes:
        env[node.output] = get_plugin(node.op).call_reference(_node_args(node, env), node.attrs)
        _check_shape(g, node.output, env[node.output], step)
    return env


def run_steps(g: Graph, steps=None) -> tuple[list[dict], torch.Tensor]:
    cache = new_cache(g)
    envs = [run_graph(g, s, cache) for s in (steps or [prefill_step(), decode_step()])]
    return envs, cache


# attr -> the reference's collective it switches on, and how the ranks' outputs combine.
COLLECTIVES = {"all_reduce": ("all_reduce_if", lambda parts: torch.stack(parts).sum(0)),
               "all_gather": ("all_gather_if", lambda parts: torch.cat(parts, dim=1))}


def run_tensor_parallel(graphs: list[Graph], step, caches: list[torch.Tensor]) -> list[dict]:
    """Run one graph per rank in lockstep; the collectives of `linear`'s reference are
    simulated: a row-parallel projection's all-reduce sums the ranks' partial products, the LM
    head's all-gather puts their slices side by side (each captured from the reference's
    `all_reduce_if` or `all_gather_if`)."""
    envs = [{**g.weights, **step.as_dict(), KV_CACHE: c} for g, c in zip(graphs, caches)]
    real = {name: getattr(linear_reference, name) for name, _ in COLLECTIVES.values()}
    try:
        for nodes in zip(*(g.nodes for g in graphs)):
            assert len({n.op for n in nodes}) == 1
            for attr, (name, combine) in COLLECTIVES.items():
                if nodes[0].attrs.get(attr):
                    parts: list[torch.Tensor] = []
                    setattr(linear_reference, name, lambda y, _: parts.append(y.clone()) or y)
                    for node, env in zip(nodes, envs):
                        get_plugin(node.op).call_reference(_node_args(node, env), node.attrs)
                    whole = combine(parts)
                    setattr(linear_reference, name, lambda y, _: whole.clone())
            for g, node, env in zip(graphs, nodes, envs):
                env[node.output] = get_plugin(node.op).call_reference(_node_args(node, env), node.attrs)
                _check_shape(g, node.output, env[node.output], step)
            for name, fn in real.items():
                setattr(linear_reference, name, fn)
    finally:
        for name, fn in real.items():
            setattr(linear_reference, name, fn)
    return envs


def snapshot(g: Graph) -> tuple:
    return (copy.deepcopy(g.nodes), copy.deepcopy(g.tensors), {k: v.clone() for k, v in g.weights.items()},
            list(g.inputs), list(g.outputs))


def assert_unchanged(g: Graph, snap: tuple) -> None:
    nodes, tensors, weights, inputs, outputs = snap
    assert g.nodes == nodes and g.tensors == tensors and g.inputs == inputs and g.outputs == outputs
    assert g.weights.keys() == weights.keys()
    assert all(torch.equal(g.weights[k], w) for k, w in weights.items())


def nodes_of(g: Graph, op_name: str) -> list[Node]:
    return [n for n in g.nodes if n.op == op_name]


def assert_valid_order(g: Graph) -> None:
    """Every node reads only graph inputs, weights and outputs of earlier nodes."""
    defined = set(g.inputs) | set(g.weights)
    for n in g.nodes:
        assert set(n.tensor_inputs()) <= defined, (n.op, set(n.tensor_inputs()) - defined)
        defined.add(n.output)
    assert set(g.outputs) <= defined

