"""Fusion passes: each finds one pattern of primitive ops and replaces it with a fused plugin.

A pattern matches only when every intermediate tensor is used by the pattern alone, so the
rewrite never changes what other nodes see. Whatever does not match stays as primitive ops.
Fusions only concatenate weights; folding norms and kernel layouts are `fold.py`'s job.
"""
from __future__ import annotations

import torch

from kiln.builder.ir import Graph, Node
from kiln.builder.passes.quantize import input_scale_name


def _weight_prefix(names: list[str]) -> str:
    """Common module path of several weights: 'l.0.attn.q_proj.weight', ... -> 'l.0.attn'."""
    parts = [n.split(".") for n in names]
    common = []
    for seg in zip(*parts):
        if len(set(seg)) != 1:
            break
        common.append(seg[0])
    return ".".join(common)


def _concat(graph: Graph, names: list[str | None], rows: list[int], name: str) -> str | None:
    """Concatenate weights or biases along dim 0; missing biases count as zeros."""
    if all(n is None for n in names):
        return None
    ref = next(graph.weights[n] for n in names if n is not None)
    parts = [graph.weights[n] if n else torch.zeros(r, *ref.shape[1:], dtype=ref.dtype) for n, r in zip(names, rows)]
    return graph.add_weight(name, torch.cat(parts, dim=0))


def _scales(graph: Graph, lins: list[Node], rows: list[int], name: str) -> tuple[bool, str | None, str | None]:
    """(whether the projections can share one weight, their concatenated FP8 weight scales, the
    static scale of their shared input): all float8 with scales, or none; all with a static input
    scale, or none. The shared input's scale is the largest, so no projection's input saturates
    sooner than it did."""
    scales = [lin.inputs.get("weight_scale") for lin in lins]
    inputs = [lin.inputs.get("weight_input_scale") for lin in lins]
    if all(s is None for s in scales):
        return True, None, None
    if any(s is None for s in scales) or len({s is None for s in inputs}) > 1:
        return False, None, None
    input_scale = None
    if inputs[0] is not None:
        input_scale = graph.add_weight(input_scale_name(name.removesuffix("_scale")),
                                       torch.stack([graph.weights[s] for s in inputs]).amax(dim=0))
    return True, _concat(graph, scales, rows, name), input_scale


def _plain(node: Node | None, op: str) -> bool:
    """A primitive node of this op whose projection (if any) is not yet all-reduced."""
    return node is not None and node.op == op and not node.attrs.get("all_reduce", False)


def fuse_norm_qkv_rope(graph: Graph) -> Graph:
    """rms_norm -> linear q, k, v -> (head_rms_norm q, k) -> rope q, k -> attention
    becomes norm_qkv_rope (writing k, v into the cache) -> attention(q only)."""
    g = graph.copy()
    for attn in [n for n in g.nodes if n.op == "attention" and n.inputs["k"] and n.inputs["v"]]:
        rq, rk = g.producer(attn.inputs["q"]), g.producer(attn.inputs["k"])
        lv = g.producer(attn.inputs["v"])
        if not (_plain(rq, "rope") and _plain(rk, "rope") and _plain(lv, "linear")):
            continue
        if (rq.inputs["positions"], rq.inputs["rope_cache"]) != (rk.inputs["positions"], rk.inputs["rope_cache"]):
            continue
        nq, nk = g.producer(rq.inputs["x"]), g.producer(rk.inputs["x"])
        qk_norm = nq is not None and nq.op == "head_rms_norm"
        if qk_norm != (nk is not None and nk.op == "head_rms_norm"):
            continue
        lq = g.producer(nq.inputs["x"]) if qk_norm else nq
        lk = g.producer(nk.inputs["x"]) if qk_norm else nk
        if not (_plain(lq, "linear") and _plain(lk, "linear")):
            continue
        x = lq.inputs["x"]
        norm = g.producer(x)
        if not _plain(norm, "rms_norm") or {lk.inputs["x"], lv.inputs["x"]} != {x}:
            continue
        if any(lin.attrs["parallel"] != "column" for lin in (lq, lk, lv)):
            continue
        if {id(u) for u in g.users(x)} != {id(lq), id(lk), id(lv)} or x in g.outputs:
            continue
        chain = [lq, lk, lv, rq, rk] + ([nq, nk] if qk_norm else [])
        if any(g.only_user(n.output) is None for n in chain if n not in (rq, rk, lv)):
            continue
        if g.only_user(rk.output) is not attn or g.only_user(lv.output) is not attn or g.only_user(rq.output) is not attn:
            continue
        if qk_norm and not (nq.attrs["eps"] == nk.attrs["eps"] == norm.attrs["eps"]):
            continue
        a = attn.attrs
        rows = [a["num_heads"] * a["head_dim"], a["num_kv_heads"] * a["head_dim"], a["num_kv_heads"] * a["head_dim"]]
        lins = [lq, lk, lv]
        prefix = _weight_prefix([lin.inputs["weight"] for lin in lins])
        same, w_qkv_scale, w_qkv_input_scale = _scales(g, lins, rows, f"{prefix}.qkv_proj.weight_scale")
        if not same:
            continue
        w_qkv = _concat(g, [lin.inputs["weight"] for lin in lins], rows, f"{prefix}.qkv_proj.weight")
        b_qkv = _concat(g, [lin.inputs["bias"] for lin in lins], rows, f"{prefix}.qkv_proj.bias")
        fused = Node("norm_qkv_rope", {
            "x": norm.inputs["x"], "norm_weight": norm.inputs["weight"], "w_qkv": w_qkv, "b_qkv": b_qkv,
            "q_norm": nq.inputs["weight"] if qk_norm else None, "k_norm": nk.inputs["weight"] if qk_norm else None,
            "positions": rq.inputs["positions"], "rope_cache": rq.inputs["rope_cache"],
            "kv_cache": attn.inputs["kv_cache"], "slot_mapping": attn.inputs["slot_mapping"],
            "w_qkv_scale": w_qkv_scale, "w_qkv_input_scale": w_qkv_input_scale,
        }, {"eps": norm.attrs["eps"], "layer": a["layer"], "num_heads": a["num_heads"],
            "num_kv_heads": a["num_kv_heads"], "head_dim": a["head_dim"]}, rq.output, lq.source.rsplit(".", 1)[0])
        attn.inputs["k"] = attn.inputs["v"] = None
        g.replace([norm, *chain], fused)
    return g


def fuse_attention_o_proj(graph: Graph) -> Graph:
    """attention -> linear(o, row-parallel) -> add(residual) becomes attention_o_proj."""
    g = graph.copy()
    for attn in [n for n in g.nodes if n.op == "attention"]:
        lo = g.only_user(attn.output)
        if not _plain(lo, "linear") or lo.inputs["x"] != attn.output or lo.attrs["parallel"] != "row":
            continue
        add = g.only_user(lo.output)
        if add is None or add.op != "add":
            continue
        residual = add.inputs["b"] if add.inputs["a"] == lo.output else add.inputs["a"]
        if residual == lo.output:
            continue
        fused = Node("attention_o_proj", {**attn.inputs, "w_o": lo.inputs["weight"], "b_o": lo.inputs["bias"],
                                          "residual": residual, "w_o_scale": lo.inputs.get("weight_scale"),
                                          "w_o_input_scale": lo.inputs.get("weight_input_scale")},
                     {**attn.attrs, "all_reduce": False}, add.output, attn.source)
        g.replace([attn, lo, add], fused)
    return g


# gated primitive -> norm_swiglu's activation attr
GATED_ACTIVATIONS = {"silu_mul": "silu", "gelu_mul": "gelu_tanh"}


def fuse_norm_swiglu(graph: Graph) -> Graph:
    """rms_norm -> linear(gate), linear(up) -> silu_mul (or gelu_mul) becomes norm_swiglu."""
    g = graph.copy()
    for mul in [n for n in g.nodes if n.op in GATED_ACTIVATIONS]:
        lg, lu = g.producer(mul.inputs["gate"]), g.producer(mul.inputs["up"])
        if not (_plain(lg, "linear") and _plain(lu, "linear")) or lg is lu:
            continue
        if lg.inputs["bias"] or lu.inputs["bias"] or lg.attrs["parallel"] != "column" or lu.attrs["parallel"] != "column":
            continue
        x = lg.inputs["x"]
        norm = g.producer(x)
        if lu.inputs["x"] != x or not _plain(norm, "rms_norm"):
            continue
        if {id(u) for u in g.users(x)} != {id(lg), id(lu)} or x in g.outputs:
            continue
        if g.only_user(lg.output) is not mul or g.only_user(lu.output) is not mul:
            continue
        inter = g.tensors[lg.output].shape[1]
        names = [lg.inputs["weight"], lu.inputs["weight"]]
        same, w_gu_scale, w_gu_input_scale = _scales(g, [lg, lu], [inter, inter],
                                                     f"{_weight_prefix(names)}.gate_up_proj.weight_scale")
        if not same:
            continue
        w_gu = _concat(g, names, [inter, inter], f"{_weight_prefix(names)}.gate_up_proj.weight")
        fused = Node("norm_swiglu", {"x": norm.inputs["x"], "norm_weight": norm.inputs["weight"], "w_gu": w_gu,
                                     "w_gu_scale": w_gu_scale, "w_gu_input_scale": w_gu_input_scale},
                     {"eps": norm.attrs["eps"], "block": 0, "activation": GATED_ACTIVATIONS[mul.op]},
                     mul.output, mul.source)
        g.replace([norm, lg, lu, mul], fused)
    return g


def fuse_linear_residual(graph: Graph) -> Graph:
    """linear -> add(residual) becomes linear_residual (the down projection, and any other
    projection whose only user is a residual add)."""
    g = graph.copy()
    for lin in [n for n in g.nodes if n.op == "linear"]:
        add = g.only_user(lin.output)
        if add is None or add.op != "add" or add.inputs["a"] == add.inputs["b"]:
            continue
        residual = add.inputs["b"] if add.inputs["a"] == lin.output else add.inputs["a"]
        fused = Node("linear_residual", {**lin.inputs, "residual": residual}, dict(lin.attrs), add.output, lin.source)
        g.replace([lin, add], fused)
    return g


FUSIONS = (fuse_norm_qkv_rope, fuse_attention_o_proj, fuse_norm_swiglu, fuse_linear_residual)
