"""Fusion passes on hand-built graphs: each fuses what it should, leaves the rest alone and
keeps the numerics."""
from __future__ import annotations


import pytest
import torch

from kiln.builder.ir import Graph, TensorInfo
from kiln.builder.passes import (fuse_attention_o_proj, fuse_linear_residual,
                                 fuse_norm_qkv_rope, fuse_norm_swiglu)
from pass_graphs import *  # noqa: F401,F403

# --------------------------------------------------------------------------------------------
# 1. fuse_norm_qkv_rope
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["llama", "qwen3_qk_norm", "qwen2_bias"])
def test_fuse_norm_qkv_rope_fuses_and_matches(variant):
    g = make_llama(qk_norm=variant == "qwen3_qk_norm", bias=variant == "qwen2_bias")
    snap = snapshot(g)
    f = fuse_norm_qkv_rope(g)
    assert_unchanged(g, snap)  # passes return new graphs

    counts = f.count_ops()
    assert counts["norm_qkv_rope"] == 1
    assert counts["rms_norm"] == 2  # the MLP norm and the final norm stay
    assert counts["linear"] == g.count_ops()["linear"] - 3
    assert "rope" not in counts and "head_rms_norm" not in counts
    assert_valid_order(f)

    (fused,) = nodes_of(f, "norm_qkv_rope")
    (attn,) = nodes_of(f, "attention")
    assert attn.inputs["k"] is None and attn.inputs["v"] is None
    assert attn.inputs["q"] == fused.output
    assert f.nodes.index(fused) < f.nodes.index(attn)
    assert fused.attrs == {"eps": EPS, "layer": 0, "num_heads": NH, "num_kv_heads": NKV, "head_dim": HD}
    assert fused.inputs["norm_weight"] == "layers.0.input_layernorm.weight"
    assert fused.inputs["positions"] == "positions" and fused.inputs["rope_cache"] == "rope_cache"
    w = g.weights
    p = "layers.0.self_attn"
    assert torch.equal(f.weights[fused.inputs["w_qkv"]],
                       torch.cat([w[f"{p}.q_proj.weight"], w[f"{p}.k_proj.weight"], w[f"{p}.v_proj.weight"]]))
    assert f.tensors[fused.inputs["w_qkv"]].shape == ((NH + 2 * NKV) * HD, H)
    if variant == "qwen2_bias":
        assert torch.equal(f.weights[fused.inputs["b_qkv"]],
                           torch.cat([w[f"{p}.q_proj.bias"], w[f"{p}.k_proj.bias"], w[f"{p}.v_proj.bias"]]))
    else:
        assert fused.inputs["b_qkv"] is None
    if variant == "qwen3_qk_norm":
        assert fused.inputs["q_norm"] == f"{p}.q_norm.weight" and fused.inputs["k_norm"] == f"{p}.k_norm.weight"
    else:
        assert fused.inputs["q_norm"] is None and fused.inputs["k_norm"] is None
    # the separate projections are gone from the fused graph's weights
    assert f"{p}.q_proj.weight" not in f.weights and f"{p}.q_proj.weight" not in f.tensors

    envs_ref, cache_ref = run_steps(g)
    envs, cache = run_steps(f)
    for e_ref, e in zip(envs_ref, envs):
        torch.testing.assert_close(e[attn.output], e_ref[attn.output], **TOL)
        torch.testing.assert_close(e[g.outputs[0]], e_ref[g.outputs[0]], **TOL)
    assert cache.abs().sum() > 0
    torch.testing.assert_close(cache, cache_ref, **TOL)


def test_fuse_norm_qkv_rope_two_layers_and_partial_bias():
    """Every layer fuses; a bias on q alone is concatenated with zeros for k and v."""
    g = make_llama(layers=2)
    b = g.nodes[[n.output for n in g.nodes].index("layers.1.self_attn.q_proj.linear")]
    b.inputs["bias"] = g.add_weight("layers.1.self_attn.q_proj.bias", torch.randn(NH * HD))
    f = fuse_norm_qkv_rope(g)
    fused = nodes_of(f, "norm_qkv_rope")
    assert [n.attrs["layer"] for n in fused] == [0, 1]
    assert fused[0].inputs["b_qkv"] is None
    b_qkv = f.weights[fused[1].inputs["b_qkv"]]
    assert torch.equal(b_qkv[: NH * HD], g.weights["layers.1.self_attn.q_proj.bias"])
    assert torch.equal(b_qkv[NH * HD:], torch.zeros(2 * NKV * HD))
    assert_valid_order(f)
    (ref, *_), cache_ref = run_steps(g)
    (out, *_), cache = run_steps(f)
    torch.testing.assert_close(out[g.outputs[0]], ref[g.outputs[0]], **TOL)
    torch.testing.assert_close(cache, cache_ref, **TOL)


NORMED_X = "layers.0.input_layernorm.rms_norm"


def _extra_user_of_normed_x(g: Graph) -> Graph:
    # h2 = add(h, normed x) feeds the MLP instead of add(h, o): x now has a fourth user
    add = g.producer("layers.0.add")
    add.inputs["b"] = NORMED_X
    g.prune()
    return g


def _normed_x_is_output(g: Graph) -> Graph:
    g.outputs.append(NORMED_X)
    return g


def _row_parallel_q(g: Graph) -> Graph:
    g.producer("layers.0.self_attn.q_proj.linear").attrs["parallel"] = "row"
    return g


def _different_positions(g: Graph) -> Graph:
    g.tensors["positions2"] = TensorInfo(("T",), "int32", "input")
    g.inputs.append("positions2")
    g.producer("layers.0.self_attn.rope.2").inputs["positions"] = "positions2"
    return g


def _different_rope_cache(g: Graph) -> Graph:
    g.add_weight("rope_cache2", rope_cache() * 2)
    g.producer("layers.0.self_attn.rope.2").inputs["rope_cache"] = "rope_cache2"
    return g


def _k_rope_extra_user(g: Graph) -> Graph:
    g.outputs.append("layers.0.self_attn.rope.2")
    return g


def _q_linear_extra_user(g: Graph) -> Graph:
    g.outputs.append("layers.0.self_attn.q_proj.linear")
    return g


def _k_from_other_norm(g: Graph) -> Graph:
    """k projects the un-normed hidden state, so q/k/v do not share one rms_norm."""
    g.producer("layers.0.self_attn.k_proj.linear").inputs["x"] = "embed_tokens.embedding"
    return g


def _already_all_reduced_v(g: Graph) -> Graph:
    g.producer("layers.0.self_attn.v_proj.linear").attrs["all_reduce"] = True
    return g


@pytest.mark.parametrize("mutate", [_extra_user_of_normed_x, _normed_x_is_output, _row_parallel_q,
                                    _different_positions, _different_rope_cache, _k_rope_extra_user,
                                    _q_linear_extra_user, _k_from_other_norm, _already_all_reduced_v])
def test_fuse_norm_qkv_rope_negative(mutate):
    g = mutate(make_llama())
    snap = snapshot(g)
    f = fuse_norm_qkv_rope(g)
    assert_unchanged(g, snap)
    assert f.count_ops() == g.count_ops()
    assert "norm_qkv_rope" not in f.count_ops()
    attn = nodes_of(f, "attention")[0]
    assert attn.inputs["k"] and attn.inputs["v"]


def test_fuse_norm_qkv_rope_qk_norm_on_one_side_only():
    g = make_llama(qk_norm=True)
    # k skips its head norm: the pattern is asymmetric and must stay unfused
    g.producer("layers.0.self_attn.rope.2").inputs["x"] = "layers.0.self_attn.k_proj.linear"
    g.prune()
    f = fuse_norm_qkv_rope(g)
    assert f.count_ops() == g.count_ops()


# --------------------------------------------------------------------------------------------
# 2. fuse_attention_o_proj
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("o_bias", [False, True])
def test_fuse_attention_o_proj_fuses_and_matches(o_bias):
    g = make_llama()
    if o_bias:
        g.producer("layers.0.self_attn.o_proj.linear").inputs["bias"] = g.add_weight(
            "layers.0.self_attn.o_proj.bias", torch.randn(H))
    snap = snapshot(g)
    f = fuse_attention_o_proj(g)
    assert_unchanged(g, snap)
    assert "attention" not in f.count_ops()
    assert f.count_ops()["attention_o_proj"] == 1
    assert f.count_ops()["add"] == 1 and f.count_ops()["linear"] == g.count_ops()["linear"] - 1
    assert_valid_order(f)
    (node,) = nodes_of(f, "attention_o_proj")
    assert node.output == "layers.0.add"
    assert node.inputs["residual"] == "embed_tokens.embedding"
    assert node.inputs["w_o"] == "layers.0.self_attn.o_proj.weight"
    assert node.inputs["b_o"] == ("layers.0.self_attn.o_proj.bias" if o_bias else None)
    assert node.attrs["all_reduce"] is False and node.attrs["num_heads"] == NH
    envs_ref, cache_ref = run_steps(g)
    envs, cache = run_steps(f)
    for e_ref, e in zip(envs_ref, envs):
        torch.testing.assert_close(e["layers.0.add"], e_ref["layers.0.add"], **TOL)
        torch.testing.assert_close(e[g.outputs[0]], e_ref[g.outputs[0]], **TOL)
    torch.testing.assert_close(cache, cache_ref, **TOL)


def test_fuse_attention_o_proj_after_norm_qkv_rope_and_residual_first():
    """Works on an attention whose k/v were fused away, and with add(o, residual) order."""
    g = make_llama()
    add = g.producer("layers.0.add")
    add.inputs["a"], add.inputs["b"] = add.inputs["b"], add.inputs["a"]
    f = fuse_attention_o_proj(fuse_norm_qkv_rope(g))
    (node,) = nodes_of(f, "attention_o_proj")
    assert node.inputs["k"] is None and node.inputs["residual"] == "embed_tokens.embedding"
    (ref, *_), _ = run_steps(g)
    (out, *_), _ = run_steps(f)
    torch.testing.assert_close(out[g.outputs[0]], ref[g.outputs[0]], **TOL)


def _o_second_user(g: Graph) -> Graph:
    g.outputs.append("layers.0.self_attn.o_proj.linear")
    return g


def _o_second_user_node(g: Graph) -> Graph:
    # the MLP's norm reads o as well: o has two node users
    g.producer("layers.0.post_attention_layernorm.rms_norm").inputs["x"] = "layers.0.self_attn.o_proj.linear"
    return g


def _o_column_parallel(g: Graph) -> Graph:
    g.producer("layers.0.self_attn.o_proj.linear").attrs["parallel"] = "column"
    return g


def _attention_second_user(g: Graph) -> Graph:
    g.outputs.append("layers.0.self_attn.attention")
    return g


@pytest.mark.parametrize("mutate", [_o_second_user, _o_second_user_node, _o_column_parallel, _attention_second_user])
def test_fuse_attention_o_proj_negative(mutate):
    g = mutate(make_llama())
    f = fuse_attention_o_proj(g)
    assert f.count_ops() == g.count_ops()


# --------------------------------------------------------------------------------------------
# 3. fuse_norm_swiglu
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("gated,activation", [("silu_mul", "silu"), ("gelu_mul", "gelu_tanh")])
def test_fuse_norm_swiglu_fuses_and_matches(gated, activation):
    g = make_llama(gated=gated)
    snap = snapshot(g)
    f = fuse_norm_swiglu(g)
    assert_unchanged(g, snap)
    assert f.count_ops()["norm_swiglu"] == 1 and gated not in f.count_ops()
    assert f.count_ops()["rms_norm"] == g.count_ops()["rms_norm"] - 1
    assert f.count_ops()["linear"] == g.count_ops()["linear"] - 2
    assert_valid_order(f)
    (node,) = nodes_of(f, "norm_swiglu")
    assert node.output == f"layers.0.mlp.{gated}"
    assert node.attrs == {"eps": EPS, "block": 0, "activation": activation}
    assert node.inputs["x"] == "layers.0.add"
    assert node.inputs["norm_weight"] == "layers.0.post_attention_layernorm.weight"
    assert node.inputs["w_gu"] == "layers.0.mlp.gate_up_proj.weight"
    assert torch.equal(f.weights[node.inputs["w_gu"]],
                       torch.cat([g.weights["layers.0.mlp.gate_proj.weight"], g.weights["layers.0.mlp.up_proj.weight"]]))
    assert f.tensors[node.output].shape == ("T", INTER)
    envs_ref, _ = run_steps(g)
    envs, _ = run_steps(f)
    for e_ref, e in zip(envs_ref, envs):
        torch.testing.assert_close(e[node.output], e_ref[node.output], **TOL)
        torch.testing.assert_close(e[g.outputs[0]], e_ref[g.outputs[0]], **TOL)


def _gelu_mlp() -> Graph:
    b = GraphBuilder()
    x = b.node("embedding", "embed.embedding", input_ids="input_ids", weight=b.weight("embed.weight", VOCAB, H),
               scale=1.0)
    x = b.node("rms_norm", "mlp.norm.rms_norm", x=x, weight=b.weight("mlp.norm.weight", H), eps=EPS)
    u = linear(b, x, b.weight("mlp.fc1.weight", INTER, H), "mlp.fc1.linear", "column")
    u = b.node("gelu", "mlp.act.gelu", x=u)
    b.g.outputs.append(linear(b, u, b.weight("mlp.fc2.weight", H, INTER), "mlp.fc2.linear", "row"))
    return b.g


def test_fuse_norm_swiglu_leaves_gelu_mlp_alone():
    g = _gelu_mlp()
    snap = snapshot(g)
    f = fuse_norm_swiglu(g)
    assert_unchanged(g, snap)
    assert_unchanged(f, snap)


def _gate_bias(g: Graph) -> Graph:
    g.producer("layers.0.mlp.gate_proj.linear").inputs["bias"] = g.add_weight("gb", torch.randn(INTER))
    return g


def _gate_second_user(g: Graph) -> Graph:
    g.outputs.append("layers.0.mlp.gate_proj.linear")
    return g


def _mlp_normed_x_second_user(g: Graph) -> Graph:
    g.outputs.append("layers.0.post_attention_layernorm.rms_norm")
    return g


@pytest.mark.parametrize("mutate", [_gate_bias, _gate_second_user, _mlp_normed_x_second_user])
def test_fuse_norm_swiglu_negative(mutate):
    g = mutate(make_llama())
    assert fuse_norm_swiglu(g).count_ops() == g.count_ops()


# --------------------------------------------------------------------------------------------
# 4. fuse_linear_residual
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("residual_first", [True, False])
def test_fuse_linear_residual_both_operand_orders(residual_first):
    g = make_llama()
    add = g.producer("layers.0.add.2")
    if not residual_first:  # add(down, h) instead of add(h, down)
        add.inputs["a"], add.inputs["b"] = add.inputs["b"], add.inputs["a"]
    snap = snapshot(g)
    f = fuse_linear_residual(g)
    assert_unchanged(g, snap)
    counts = f.count_ops()
    # both the o projection and the down projection feed a residual add
    assert counts["linear_residual"] == 2 and "add" not in counts
    assert counts["linear"] == g.count_ops()["linear"] - 2
    assert_valid_order(f)
    down = f.producer("layers.0.add.2")
    assert down.op == "linear_residual"
    assert down.inputs == {"x": "layers.0.mlp.silu_mul", "weight": "layers.0.mlp.down_proj.weight", "bias": None,
                           "residual": "layers.0.add", "weight_scale": None,
                           "weight_input_scale": None}
    assert down.attrs == {"parallel": "row", "heads": 0, "all_reduce": False}
    envs_ref, _ = run_steps(g)
    envs, _ = run_steps(f)
    for e_ref, e in zip(envs_ref, envs):
        torch.testing.assert_close(e[g.outputs[0]], e_ref[g.outputs[0]], **TOL)


def test_fuse_linear_residual_negative():
    g = make_llama()
    g.outputs.append("layers.0.mlp.down_proj.linear")  # down has a second user
    add = g.producer("layers.0.add")
    add.inputs["a"] = add.inputs["b"]  # add(o, o): no residual operand
    g.prune()
    f = fuse_linear_residual(g)
    assert f.count_ops() == g.count_ops()


def test_full_fusion_pipeline_matches():
    g = make_llama(layers=2, qk_norm=True, bias=True)
    f = fuse_all(g)
    assert f.count_ops() == {"embedding": 1, "norm_qkv_rope": 2, "attention_o_proj": 2, "norm_swiglu": 2,
                             "linear_residual": 2, "take_rows": 1, "rms_norm": 1, "linear": 1}
    assert_valid_order(f)
    envs_ref, cache_ref = run_steps(g)
    envs, cache = run_steps(f)
    for e_ref, e in zip(envs_ref, envs):
        torch.testing.assert_close(e[g.outputs[0]], e_ref[g.outputs[0]], **TOL)
    torch.testing.assert_close(cache, cache_ref, **TOL)


# --------------------------------------------------------------------------------------------
