"""Weight folding and layout: the last rewrite of weights before they are written.

- A fused op's RMSNorm weight g is multiplied into its projection (W diag(g)), so the kernel
  only needs the row scale rsqrt(mean(x^2) + eps).
  Not into an FP8 weight (one with a scale): that would round it twice, so its norm keeps the
  weight (`passes.quantize`).
- norm_swiglu's [W_gate; W_up] is interleaved in blocks of rows, so one output tile of the
  GEMM holds matching gate and up columns and the epilogue can form silu(g) * u; an FP8
  weight's per-row scales move with their rows.
Runs after sharding, on each rank's weights.
"""
from __future__ import annotations

import math

import torch

from kiln.builder.ir import Graph

GATE_UP_BLOCK = 64


def _fold_norm(graph: Graph, weight: str, norm: str) -> str:
    w, g = graph.weights[weight], graph.weights[norm]
    folded = (w.float() * g.float()[None, :]).to(w.dtype)
    return graph.add_weight(f"{weight}.folded", folded)


def interleave(w: torch.Tensor, block: int) -> torch.Tensor:
    """[W_gate; W_up] as [g0 u0 g1 u1 ...] in blocks of `block` rows, the layout norm_swiglu reads."""
    two_i, k = w.shape
    gate, up = w[: two_i // 2], w[two_i // 2:]
    return torch.stack([gate.reshape(-1, block, k), up.reshape(-1, block, k)], dim=1).reshape(two_i, k)


def fold_weights(graph: Graph) -> Graph:
    g = graph.copy()
    for node in g.nodes:
        if node.op == "norm_qkv_rope" and node.inputs["norm_weight"] and not node.inputs.get("w_qkv_scale"):
            node.inputs["w_qkv"] = _fold_norm(g, node.inputs["w_qkv"], node.inputs["norm_weight"])
            node.inputs["norm_weight"] = None
        elif node.op == "norm_swiglu":
            scale = node.inputs.get("w_gu_scale")
            if node.inputs["norm_weight"] and not scale:
                node.inputs["w_gu"] = _fold_norm(g, node.inputs["w_gu"], node.inputs["norm_weight"])
                node.inputs["norm_weight"] = None
            if node.attrs["block"] == 0:
                inter = g.weights[node.inputs["w_gu"]].shape[0] // 2
                block = math.gcd(inter, GATE_UP_BLOCK)
                name = f"{node.inputs['w_gu']}.interleaved"
                node.inputs["w_gu"] = g.add_weight(name, interleave(g.weights[node.inputs["w_gu"]], block))
                if scale:
                    node.inputs["w_gu_scale"] = g.add_weight(
                        f"{scale}.interleaved", interleave(g.weights[scale][:, None], block)[:, 0])
                node.attrs["block"] = block
    g.prune()
    return g
