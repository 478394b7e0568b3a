"""Memory planning and the fx tracer."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from kiln.builder.ir import Graph, TensorInfo
from kiln.builder.passes import (fold_weights, plan_memory, shard)
from kiln.builder.passes.memory import ALIGN, MemoryPlan
from kiln.dtypes import element_bytes
from kiln.builder.trace import TraceError, trace
from kiln.plugins import op
from kiln.plugins.step_inputs import KV_CACHE
from pass_graphs import *  # noqa: F401,F403

# 7. plan_memory
# --------------------------------------------------------------------------------------------

BOUNDS = {"T": 8, "S": 2, "L": 2, "B": BLOCKS_PER_SEQ}


def _lifetimes(g: Graph) -> dict[str, tuple[int, int]]:
    """[first write, last read] in plan order, computed independently of the pass."""
    life = {n: [-1, -1] for n in g.inputs if g.tensors[n].kind == "input"}
    for i, node in enumerate(g.nodes):
        life[node.output] = [i, i]
    for i, node in enumerate(g.nodes):
        for t in node.tensor_inputs():
            if t in life:
                life[t][1] = max(life[t][1], i)
    for o in g.outputs:
        life[o][1] = len(g.nodes)
    return {k: tuple(v) for k, v in life.items()}


def _check_plan(g: Graph, plan: MemoryPlan, bounds: dict) -> None:
    life = _lifetimes(g)
    tensors = plan.slots
    assert set(tensors) == set(life)  # every step input and activation, no weights or state
    for name, t in tensors.items():
        assert t.offset % ALIGN == 0 and t.nbytes % ALIGN == 0
        info = g.tensors[name]
        need = math.prod(bounds[d] if isinstance(d, str) else d for d in info.shape) * element_bytes(info.dtype)
        assert t.nbytes >= need
        assert t.offset + t.nbytes <= plan.arena_bytes
    names = list(tensors)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            (fa, la), (fb, lb) = life[a], life[b]
            if la < fb or lb < fa:
                continue  # lifetimes disjoint: may share bytes
            ta, tb = tensors[a], tensors[b]
            disjoint = ta.offset + ta.nbytes <= tb.offset or tb.offset + tb.nbytes <= ta.offset
            assert disjoint, f"{a} {life[a]} and {b} {life[b]} overlap in memory"
    for node in g.nodes:  # explicit: an op's output never aliases its inputs
        out = tensors[node.output]
        for t in node.tensor_inputs():
            if t in tensors:
                ti = tensors[t]
                assert out.offset + out.nbytes <= ti.offset or ti.offset + ti.nbytes <= out.offset


@pytest.mark.parametrize("pipeline", ["unfused", "fused_folded", "sharded"])
def test_plan_memory_no_overlapping_lifetimes_share_bytes(pipeline):
    g = make_llama(layers=2)
    if pipeline == "fused_folded":
        g = fold_weights(fuse_all(g))
    elif pipeline == "sharded":
        g = fold_weights(shard(fuse_all(g), 1, 2))
    snap = snapshot(g)
    plan = plan_memory(g, BOUNDS)
    assert_unchanged(g, snap)
    _check_plan(g, plan, BOUNDS)
    assert KV_CACHE not in plan.slots and "lm_head.weight" not in plan.slots
    total = sum(t.nbytes for t in plan.slots.values())
    assert plan.arena_bytes < total


def test_plan_memory_puts_the_step_inputs_first_smallest_first():
    """The step inputs fill the arena's start, in order of their size at the bounds, so the block tables
    (sequences x blocks) end the region that the CUDA executor uploads only as far as a step fills it."""
    g = make_llama(layers=2)
    bounds = {"T": 64, "S": 8, "L": 8, "B": 40}
    plan = plan_memory(g, bounds)
    inputs = [n for n in g.inputs if g.tensors[n].kind == "input"]
    by_offset = sorted(inputs, key=lambda n: plan.slots[n].offset)
    sizes = [plan.slots[n].nbytes for n in by_offset]
    assert sizes == sorted(sizes) and by_offset[-1] == "block_tables"
    assert plan.slots[by_offset[0]].offset == 0
    assert all(plan.slots[a].offset + plan.slots[a].nbytes == plan.slots[b].offset
               for a, b in zip(by_offset, by_offset[1:]))


def _chain(n: int) -> Graph:
    b = GraphBuilder()
    x = b.node("embedding", "embed", input_ids="input_ids", weight=b.weight("embed.weight", VOCAB, H), scale=1.0)
    for i in range(n):
        x = b.node("rms_norm", f"norm{i}", x=x, weight=None, eps=EPS)
    b.g.outputs.append(x)
    return b.g


def test_plan_memory_chain_reuses_bytes_and_respects_bounds():
    g = _chain(6)
    plan = plan_memory(g, BOUNDS)
    _check_plan(g, plan, BOUNDS)
    t = plan.slots
    assert g.tensors["norm0"].shape == ("T", H)
    assert t["norm0"].nbytes >= 8 * 16 * 4 == 512
    assert t["input_ids"].nbytes >= 8 * 4
    total = sum(v.nbytes for v in t.values())
    assert plan.arena_bytes < total
    # a chain needs only two live [T, H] buffers at a time (plus the step inputs)
    inputs = sum(v.nbytes for k, v in t.items() if k in g.inputs)
    assert plan.arena_bytes <= inputs + 2 * 512 + 512
    # bigger bounds, bigger buffers
    big = plan_memory(g, {**BOUNDS, "T": 64})
    assert big.slots["norm0"].nbytes >= 64 * 16 * 4
    _check_plan(g, big, {**BOUNDS, "T": 64})


def test_plan_memory_graph_outputs_live_to_the_end():
    b = GraphBuilder()
    x = b.node("embedding", "embed", input_ids="input_ids", weight=b.weight("embed.weight", VOCAB, H), scale=1.0)
    early = b.node("rms_norm", "early", x=x, weight=None, eps=EPS)
    y = early
    for i in range(4):
        y = b.node("rms_norm", f"n{i}", x=y, weight=None, eps=EPS)
    b.g.outputs += [early, y]
    plan = plan_memory(b.g, BOUNDS)
    _check_plan(b.g, plan, BOUNDS)
    e = plan.slots["early"]
    for i in range(4):
        o = plan.slots[f"n{i}"]
        assert o.offset + o.nbytes <= e.offset or e.offset + e.nbytes <= o.offset


# --------------------------------------------------------------------------------------------
# 8. trace
# --------------------------------------------------------------------------------------------

class _Act(nn.Module):
    def forward(self, x):
        return torch.sigmoid(x) * x


class _TinyMLP(nn.Module):
    def __init__(self, act: nn.Module | None = None):
        super().__init__()
        self.gate = nn.Parameter(torch.randn(INTER, H) * 0.3, requires_grad=False)
        self.up = nn.Parameter(torch.randn(INTER, H) * 0.3, requires_grad=False)
        self.down = nn.Parameter(torch.randn(H, INTER) * 0.3, requires_grad=False)
        self.act = act

    def forward(self, x):
        g = op("linear")(x, self.gate, None, "column", 0, False)
        if self.act is not None:
            g = self.act(g)
        u = op("linear")(x, self.up, None, "column", 0, False)
        return op("linear")(op("silu_mul")(g, u), self.down, None, "row", 0, False)


class _TinyModel(nn.Module):
    def __init__(self, act: nn.Module | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Parameter(torch.randn(VOCAB, H), requires_grad=False)
        self.norm = nn.Parameter(torch.ones(H) + 0.1 * torch.randn(H), requires_grad=False)
        self.wq = nn.Parameter(torch.randn(NH * HD, H) * 0.3, requires_grad=False)
        self.wk = nn.Parameter(torch.randn(NKV * HD, H) * 0.3, requires_grad=False)
        self.wv = nn.Parameter(torch.randn(NKV * HD, H) * 0.3, requires_grad=False)
        self.wo = nn.Parameter(torch.randn(H, NH * HD) * 0.3, requires_grad=False)
        self.norm2 = nn.Parameter(torch.ones(H) + 0.1 * torch.randn(H), requires_grad=False)
        self.mlp = _TinyMLP(act)
        self.register_buffer("rope_cache", rope_cache(), persistent=False)

    def forward(self, input_ids, positions, slot_mapping, block_tables, query_lens, context_lens,
                logits_indices, kv_cache):
        h = op("embedding")(input_ids, self.embed)
        x = op("rms_norm")(h, self.norm, EPS)
        q = op("rope")(op("linear")(x, self.wq, None, "column", NH, False), positions, self.rope_cache, HD)
        k = op("rope")(op("linear")(x, self.wk, None, "column", NKV, False), positions, self.rope_cache, HD)
        v = op("linear")(x, self.wv, None, "column", NKV, False)
        a = op("attention")(q, k, v, kv_cache, slot_mapping, block_tables, query_lens, context_lens,
                            0, NH, NKV, HD, HD ** -0.5, 0)
        h = op("add")(h, op("linear")(a, self.wo, None, "row", 0, False))
        h = op("add")(h, self.mlp(op("rms_norm")(h, self.norm2, EPS)))
        return op("take_rows")(h, logits_indices)


def test_trace_records_plugin_ops():
    model = _TinyModel()
    g = trace(model)
    assert [n.op for n in g.nodes] == ["embedding", "rms_norm", "linear", "rope", "linear", "rope", "linear",
                                       "attention", "linear", "add", "rms_norm", "linear", "linear", "silu_mul",
                                       "linear", "add", "take_rows"]
    assert g.inputs == ["input_ids", "positions", "slot_mapping", "block_tables", "query_lens", "context_lens",
                        "logits_indices", KV_CACHE]
    assert g.outputs == [g.nodes[-1].output]
    assert set(g.weights) == {"embed", "norm", "norm2", "wq", "wk", "wv", "wo", "mlp.gate", "mlp.up", "mlp.down",
                              "rope_cache"}
    assert all(g.tensors[w].kind == "weight" for w in g.weights)
    assert g.tensors["input_ids"] == TensorInfo(("T",), "int32", "input")
    assert g.tensors[KV_CACHE] == TensorInfo((1, 2, "N", "block_size", NKV, HD), "float32", "state")
    lin_q = g.nodes[2]
    assert lin_q.inputs == {"x": g.nodes[1].output, "weight": "wq", "bias": None, "weight_scale": None,
                           "weight_input_scale": None}
    assert lin_q.attrs == {"parallel": "column", "heads": NH, "all_reduce": False}
    attn = g.nodes[7]
    assert attn.inputs["q"] == g.nodes[3].output and attn.inputs["k"] == g.nodes[5].output
    assert attn.inputs["v"] == g.nodes[6].output and attn.inputs["kv_cache"] == KV_CACHE
    assert attn.attrs == {"layer": 0, "num_heads": NH, "num_kv_heads": NKV, "head_dim": HD,
                          "scale": HD ** -0.5, "window": 0}
    assert g.nodes[8].attrs["parallel"] == "row" and g.nodes[8].inputs["x"] == attn.output
    mlp_nodes = g.nodes[11:15]
    assert all(n.source == "mlp" for n in mlp_nodes) and g.nodes[0].source == "<top level>"
    assert [n.output for n in mlp_nodes] == ["mlp.linear", "mlp.linear.2", "mlp.silu_mul", "mlp.linear.3"]
    assert len({n.output for n in g.nodes}) == len(g.nodes)  # output names are unique
    assert g.tensors[g.outputs[0]].shape == ("L", H)

    # the traced graph computes what the eager module computes
    step = prefill_step()
    env = run_graph(g, step, new_cache(g))
    cache = new_cache(g)
    expected = model(**step.as_dict(), kv_cache=cache)
    torch.testing.assert_close(env[g.outputs[0]], expected, **TOL)
    # and it is a graph the fusions recognise
    assert fuse_all(g).count_ops() == {"embedding": 1, "norm_qkv_rope": 1, "attention_o_proj": 1,
                                       "norm_swiglu": 1, "linear_residual": 1, "take_rows": 1}


def test_trace_rejects_non_plugin_op_naming_it_and_the_module():
    with pytest.raises(TraceError) as err:
        trace(_TinyModel(act=_Act()))
    assert "sigmoid" in str(err.value)
    assert "mlp.act" in str(err.value)


def test_trace_rejects_unknown_forward_argument():
    class M(nn.Module):
        def forward(self, input_ids, hidden):
            return op("add")(hidden, hidden)

    with pytest.raises(TraceError, match="hidden"):
        trace(M())
