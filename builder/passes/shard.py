"""Tensor-parallel sharding: the graph of one rank out of `world_size`.

Column-parallel projections (q/k/v, gate/up) keep a slice of their output features, whole
heads at a time; row-parallel ones (o, down) keep a slice of their input features and
all-reduce their result before the residual add. When there are fewer kv heads than ranks,
each kv head is replicated on the ranks whose q heads use it. Embedding, norms and LM head
are replicated.
"""
from __future__ import annotations

import torch

from kiln.builder.ir import Graph


class ShardError(ValueError):
    """The model's shape cannot be split over the requested number of ranks."""


def _heads(total: int, rank: int, world: int, what: str, replicate: bool = True) -> tuple[int, int]:
    """(first head, count) of this rank's heads. kv heads are replicated when too few;
    attention (q) heads never are (`replicate=False`)."""
    if total % world == 0:
        per = total // world
        return rank * per, per
    if replicate and total < world and world % total == 0:
        return rank // (world // total), 1
    raise ShardError(f"{total} {what} cannot be split over --tp-size {world}: "
                     f"use a tp size that divides {total} (or that {total} divides, for kv heads)")


def _rows(w: torch.Tensor, start: int, count: int) -> torch.Tensor:
    return w[start:start + count].contiguous()


def _split_even(n: int, rank: int, world: int, what: str) -> tuple[int, int]:
    if n % world:
        raise ShardError(f"{what} of size {n} cannot be split over --tp-size {world}: use a tp size that divides {n}")
    return rank * (n // world), n // world


def shard(graph: Graph, rank: int, world_size: int) -> Graph:
    g = graph.copy()
    if world_size == 1:
        return g
    done: dict[str, str] = {}

    def put(name: str | None, tensor_fn, how: str) -> None:
        if name is None:
            return
        if name in done:
            if done[name] != how:
                raise ShardError(f"weight {name} is used by ops that shard it differently ({done[name]} vs {how})")
            return
        done[name] = how
        g.add_weight(name, tensor_fn(g.weights[name]))

    for node in g.nodes:
        a, i = node.attrs, node.inputs
        if node.op in ("linear", "linear_residual") and a["parallel"] == "column":
            out = g.weights[i["weight"]].shape[0]
            if a["heads"]:
                first, count = _heads(a["heads"], rank, world_size, f"heads of {node.source}")
                hd = out // a["heads"]
                start, rows = first * hd, count * hd
            else:
                start, rows = _split_even(out, rank, world_size, f"output features of {node.source}")
            for name in (i["weight"], i["bias"]):
                put(name, lambda w: _rows(w, start, rows), f"column {start}+{rows}")
        elif node.op in ("linear", "linear_residual") and a["parallel"] == "row":
            start, cols = _split_even(g.weights[i["weight"]].shape[1], rank, world_size,
                                      f"input features of {node.source}")
            put(i["weight"], lambda w: w[:, start:start + cols].contiguous(), f"row {start}+{cols}")
            a["all_reduce"] = True
        elif node.op == "norm_qkv_rope":
            hd = a["head_dim"]
            q0, qn = _heads(a["num_heads"], rank, world_size, "attention heads", replicate=False)
            k0, kn = _heads(a["num_kv_heads"], rank, world_size, "kv heads")
            q_rows, kv_rows = a["num_heads"] * hd, a["num_kv_heads"] * hd

            def pick(w, q0=q0, qn=qn, k0=k0, kn=kn, q_rows=q_rows, kv_rows=kv_rows, hd=hd):
                q, k, v = w[:q_rows], w[q_rows:q_rows + kv_rows], w[q_rows + kv_rows:]
                return torch.cat([_rows(q, q0 * hd, qn * hd), _rows(k, k0 * hd, kn * hd), _rows(v, k0 * hd, kn * hd)])
            for name in (i["w_qkv"], i["b_qkv"]):
                put(name, pick, f"qkv {rank}/{world_size}")
            a["num_heads"], a["num_kv_heads"] = qn, kn
        elif node.op in ("attention", "attention_o_proj"):
            _, qn = _heads(a["num_heads"], rank, world_size, "attention heads", replicate=False)
            _, kn = _heads(a["num_kv_heads"], rank, world_size, "kv heads")
            if node.op == "attention_o_proj":
                start, cols = rank * qn * a["head_dim"], qn * a["head_dim"]
                put(i["w_o"], lambda w: w[:, start:start + cols].contiguous(), f"row {start}+{cols}")
                a["all_reduce"] = True
            a["num_heads"], a["num_kv_heads"] = qn, kn
        elif node.op == "norm_swiglu":
            inter = g.weights[i["w_gu"]].shape[0] // 2
            start, rows = _split_even(inter, rank, world_size, "MLP intermediate size")
            put(i["w_gu"], lambda w: torch.cat([_rows(w, start, rows), _rows(w, inter + start, rows)]),
                f"gate_up {start}+{rows}")
        elif node.op == "head_rms_norm" or node.op == "rope":
            pass  # per-head ops: the head count follows from their input's shape
    kv = g.tensors["kv_cache"]
    kv_heads = {n.attrs["num_kv_heads"] for n in g.nodes if "num_kv_heads" in n.attrs}
    if kv_heads:
        kv.shape = kv.shape[:4] + (kv_heads.pop(),) + kv.shape[5:]
    g.infer_shapes()
    g.meta["rank"], g.meta["world_size"] = rank, world_size
    return g
