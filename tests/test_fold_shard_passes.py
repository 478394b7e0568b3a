"""Weight folding and tensor-parallel sharding on hand-built graphs."""
from __future__ import annotations

import math

import pytest
import torch

from kiln.builder.ir import Graph
from kiln.builder.passes import (ShardError, fold_weights, shard, vocab_parallel)
from kiln.builder.passes.quantize import quantize_fp8
from kiln.builder.passes.shard import lm_head
from kiln.plugins.step_inputs import KV_CACHE
from pass_graphs import *  # noqa: F401,F403

# 5. fold_weights
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("inter,block", [(INTER, 8), (128, 64), (96, 32)])
def test_fold_weights(inter, block):
    g = make_llama(inter=inter, qk_norm=True)
    fused = fuse_all(g)
    snap = snapshot(fused)
    f = fold_weights(fused)
    assert_unchanged(fused, snap)

    (qkv,) = nodes_of(f, "norm_qkv_rope")
    (swi,) = nodes_of(f, "norm_swiglu")
    (qkv0,) = nodes_of(fused, "norm_qkv_rope")
    (swi0,) = nodes_of(fused, "norm_swiglu")
    assert qkv.inputs["norm_weight"] is None and swi.inputs["norm_weight"] is None
    assert qkv.inputs["q_norm"] == qkv0.inputs["q_norm"]  # per-head norms are not folded
    ln1 = g.weights["layers.0.input_layernorm.weight"]
    ln2 = g.weights["layers.0.post_attention_layernorm.weight"]
    torch.testing.assert_close(f.weights[qkv.inputs["w_qkv"]], fused.weights[qkv0.inputs["w_qkv"]] * ln1[None, :])

    assert swi.attrs["block"] == block == math.gcd(inter, 64)
    gate = g.weights["layers.0.mlp.gate_proj.weight"] * ln2[None, :]
    up = g.weights["layers.0.mlp.up_proj.weight"] * ln2[None, :]
    w_gu = f.weights[swi.inputs["w_gu"]]
    assert w_gu.shape == (2 * inter, H)
    for j in range(inter // block):  # [g0 u0 g1 u1 ...] in blocks of `block` rows
        torch.testing.assert_close(w_gu[2 * j * block:(2 * j + 1) * block], gate[j * block:(j + 1) * block])
        torch.testing.assert_close(w_gu[(2 * j + 1) * block:(2 * j + 2) * block], up[j * block:(j + 1) * block])

    # pruned: no unused originals, and every weight is read by some node
    used = {t for n in f.nodes for t in n.tensor_inputs()}
    assert set(f.weights) <= used
    for gone in ("layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight",
                 qkv0.inputs["w_qkv"], swi0.inputs["w_gu"], f"{swi0.inputs['w_gu']}.folded"):
        assert gone not in f.weights and gone not in f.tensors
    assert "norm.weight" in f.weights  # the final plain rms_norm keeps its weight
    assert set(f.weights) == set(f.tensors) & set(f.weights)
    assert all(f.tensors[k].kind == "weight" and f.tensors[k].shape == tuple(w.shape) for k, w in f.weights.items())

    envs_ref, cache_ref = run_steps(g)
    envs, cache = run_steps(f)
    for e_ref, e in zip(envs_ref, envs):
        torch.testing.assert_close(e[swi.output], e_ref[swi.output], **TOL)
        torch.testing.assert_close(e[g.outputs[0]], e_ref[g.outputs[0]], **TOL)
    torch.testing.assert_close(cache, cache_ref, **TOL)

    # idempotent: a folded graph has nothing left to fold
    again = fold_weights(f)
    assert again.nodes == f.nodes and again.weights.keys() == f.weights.keys()


# --------------------------------------------------------------------------------------------
# 6. shard
# --------------------------------------------------------------------------------------------

def _qkv_rows(g: Graph, q_heads: list[int], kv_heads: list[int], what: str = "weight") -> torch.Tensor:
    p = "layers.0.self_attn"
    q, k, v = (g.weights[f"{p}.{n}_proj.{what}"] for n in "qkv")
    return torch.cat([q[h * HD:(h + 1) * HD] for h in q_heads] + [k[h * HD:(h + 1) * HD] for h in kv_heads]
                     + [v[h * HD:(h + 1) * HD] for h in kv_heads])


def test_shard_world_2_fused_graph():
    g = make_llama(bias=True)
    fused = fuse_all(g)
    snap = snapshot(fused)
    ranks = [shard(fused, r, 2) for r in range(2)]
    assert_unchanged(fused, snap)
    for r, s in enumerate(ranks):
        assert s.meta["rank"] == r and s.meta["world_size"] == 2
        assert s.count_ops() == fused.count_ops()
        (qkv,) = nodes_of(s, "norm_qkv_rope")
        assert qkv.attrs["num_heads"] == 2 and qkv.attrs["num_kv_heads"] == 1
        assert s.weights[qkv.inputs["w_qkv"]].shape == ((2 + 2 * 1) * HD, H)
        assert torch.equal(s.weights[qkv.inputs["w_qkv"]], _qkv_rows(g, [2 * r, 2 * r + 1], [r]))
        assert torch.equal(s.weights[qkv.inputs["b_qkv"]], _qkv_rows(g, [2 * r, 2 * r + 1], [r], "bias"))
        assert s.tensors[qkv.output].shape == ("T", 2 * HD)

        (ao,) = nodes_of(s, "attention_o_proj")
        assert ao.attrs["all_reduce"] is True and ao.attrs["num_heads"] == 2 and ao.attrs["num_kv_heads"] == 1
        w_o = g.weights["layers.0.self_attn.o_proj.weight"]
        assert torch.equal(s.weights[ao.inputs["w_o"]], w_o[:, r * 2 * HD:(r + 1) * 2 * HD])
        assert s.tensors[ao.output].shape == ("T", H)

        (swi,) = nodes_of(s, "norm_swiglu")
        half = INTER // 2
        gate, up = g.weights["layers.0.mlp.gate_proj.weight"], g.weights["layers.0.mlp.up_proj.weight"]
        assert torch.equal(s.weights[swi.inputs["w_gu"]],
                           torch.cat([gate[r * half:(r + 1) * half], up[r * half:(r + 1) * half]]))
        assert s.tensors[swi.output].shape == ("T", half)

        down = s.producer("layers.0.add.2")
        assert down.op == "linear_residual" and down.attrs["all_reduce"] is True
        w_d = g.weights["layers.0.mlp.down_proj.weight"]
        assert torch.equal(s.weights[down.inputs["weight"]], w_d[:, r * half:(r + 1) * half])

        # replicated: embedding, norms, rope table
        for name in ("embed_tokens.weight", "norm.weight", "rope_cache", "layers.0.input_layernorm.weight"):
            assert torch.equal(s.weights[name], fused.weights[name])
        # vocabulary parallel: the LM head's rows of this rank, its output gathered whole
        head = s.producer(s.outputs[0])
        assert head.attrs == {"parallel": "column", "heads": 0, "all_reduce": False, "all_gather": 2}
        assert torch.equal(s.weights["lm_head.weight"], g.weights["lm_head.weight"][r * VOCAB // 2:(r + 1) * VOCAB // 2])
        assert s.tensors[s.outputs[0]].shape == ("L", VOCAB)
        assert s.tensors[KV_CACHE].shape == (1, 2, "N", "block_size", 1, HD)
        assert_valid_order(s)


def test_shard_world_4_replicates_kv_heads():
    g = make_llama()
    fused = fuse_all(g)
    for r in range(4):
        s = shard(fused, r, 4)
        (qkv,) = nodes_of(s, "norm_qkv_rope")
        assert qkv.attrs["num_heads"] == 1 and qkv.attrs["num_kv_heads"] == 1
        # rank 0, 1 -> kv head 0; ranks 2, 3 -> kv head 1; q head r on rank r
        assert torch.equal(s.weights[qkv.inputs["w_qkv"]], _qkv_rows(g, [r], [r // 2]))
        assert s.tensors[KV_CACHE].shape[4] == 1
        (ao,) = nodes_of(s, "attention_o_proj")
        assert torch.equal(s.weights[ao.inputs["w_o"]], g.weights["layers.0.self_attn.o_proj.weight"][:, r * HD:(r + 1) * HD])
        (swi,) = nodes_of(s, "norm_swiglu")
        assert s.weights[swi.inputs["w_gu"]].shape == (2 * INTER // 4, H)


def test_shard_unfused_graph_splits_primitive_linears():
    g = make_llama(qk_norm=True)
    for r in range(4):
        s = shard(g, r, 4)
        w = lambda name: s.weights[f"layers.0.{name}.weight"]  # noqa: E731
        full = lambda name: g.weights[f"layers.0.{name}.weight"]  # noqa: E731
        assert torch.equal(w("self_attn.q_proj"), full("self_attn.q_proj")[r * HD:(r + 1) * HD])
        kv = r // 2
        assert torch.equal(w("self_attn.k_proj"), full("self_attn.k_proj")[kv * HD:(kv + 1) * HD])
        assert torch.equal(w("self_attn.v_proj"), full("self_attn.v_proj")[kv * HD:(kv + 1) * HD])
        assert torch.equal(w("self_attn.q_norm"), full("self_attn.q_norm"))  # per head: replicated
        assert torch.equal(w("self_attn.o_proj"), full("self_attn.o_proj")[:, r * HD:(r + 1) * HD])
        assert s.producer("layers.0.self_attn.o_proj.linear").attrs["all_reduce"] is True
        attn = s.producer("layers.0.self_attn.attention")
        assert (attn.attrs["num_heads"], attn.attrs["num_kv_heads"]) == (1, 1)
        assert s.tensors["layers.0.self_attn.rope"].shape == ("T", HD)
        assert s.tensors[KV_CACHE].shape[4] == 1


def test_shard_row_parallel_partials_sum_to_unsharded():
    g = fuse_all(make_llama())
    x = torch.randn(5, NH * HD, generator=torch.Generator().manual_seed(1))
    h = torch.randn(5, INTER, generator=torch.Generator().manual_seed(2))
    (ao,) = nodes_of(g, "attention_o_proj")
    down = g.producer("layers.0.add.2")
    for world in (2, 4):
        ranks = [shard(g, r, world) for r in range(world)]
        for node, inp, cols in ((ao, x, NH * HD), (down, h, INTER)):
            key = "w_o" if node is ao else "weight"
            full = torch.nn.functional.linear(inp, g.weights[node.inputs[key]])
            per = cols // world
            parts = [torch.nn.functional.linear(inp[:, r * per:(r + 1) * per], s.weights[node.inputs[key]])
                     for r, s in enumerate(ranks)]
            torch.testing.assert_close(sum(parts), full, **TOL)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("head", [dict(), dict(tied=True, softcap=5.0), dict(vocab=34)],
                         ids=["untied", "tied-softcap", "uneven-vocab"])
def test_shard_end_to_end_matches_unsharded(world, fused, head):
    """Each rank runs its graph (folded after sharding, as the build does); with the all-reduce
    and the LM head's all-gather simulated, the logits and each rank's slice of the KV cache
    match the single-rank run."""
    g = make_llama(bias=True, qk_norm=True, **head)
    base = fuse_all(g) if fused else g
    ranks = [fold_weights(shard(base, r, world)) if fused else shard(base, r, world) for r in range(world)]
    envs_ref, cache_ref = run_steps(g)
    caches = [new_cache(s) for s in ranks]
    for step, e_ref in zip([prefill_step(), decode_step()], envs_ref):
        envs = run_tensor_parallel(ranks, step, caches)
        for e in envs:
            torch.testing.assert_close(e[g.outputs[0]], e_ref[g.outputs[0]], **TOL)
    per = max(NKV // world, 1)
    for r, c in enumerate(caches):
        first = (r * NKV) // world if NKV >= world else r // (world // NKV)
        torch.testing.assert_close(c, cache_ref[:, :, :, :, first:first + per], **TOL)


def test_shard_world_1_is_a_copy():
    g = fuse_all(make_llama())
    s = shard(g, 0, 1)
    assert s is not g and s.nodes == g.nodes and s.weights.keys() == g.weights.keys()
    assert "all_gather" not in s.producer(s.outputs[0]).attrs and not vocab_parallel(s)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("tied,softcap", [(False, None), (True, None), (True, 5.0)])
def test_shard_lm_head_keeps_a_slice_of_the_vocabulary(world, tied, softcap):
    """Each rank's head holds its [vocab / world, hidden] rows, found behind the soft cap; a
    tied embedding keeps reading the whole weight, the head its own cut copy."""
    g = fuse_all(make_llama(tied=tied, softcap=softcap))
    full = g.weights["embed_tokens.weight" if tied else "lm_head.weight"]
    per = VOCAB // world
    for r in range(world):
        s = shard(g, r, world)
        head = lm_head(s)
        assert head is s.producer("lm_head.linear") and vocab_parallel(s)
        assert head.attrs["all_gather"] == world and head.attrs["parallel"] == "column"
        assert s.weights[head.inputs["weight"]].shape == (per, H)
        assert torch.equal(s.weights[head.inputs["weight"]], full[r * per:(r + 1) * per])
        assert s.tensors["lm_head.linear"].shape == s.tensors[s.outputs[0]].shape == ("L", VOCAB)
        (embed,) = nodes_of(s, "embedding")
        assert torch.equal(s.weights[embed.inputs["weight"]], g.weights["embed_tokens.weight"])
        assert (head.inputs["weight"] == "embed_tokens.weight.lm_head") == tied


def test_shard_lm_head_of_an_uneven_vocabulary_stays_whole():
    g = fuse_all(make_llama(vocab=33))
    for r in range(2):
        s = shard(g, r, 2)
        assert not vocab_parallel(s) and lm_head(s).attrs["parallel"] == "none"
        assert torch.equal(s.weights["lm_head.weight"], g.weights["lm_head.weight"])
        assert s.tensors[s.outputs[0]].shape == ("L", 33)


def test_shard_fp8_lm_head_cuts_its_scales_with_its_rows():
    g = quantize_fp8(fuse_all(make_llama(tied=True)), lm_head=True)
    head = lm_head(g)
    weight, scale = (g.weights[head.inputs[k]] for k in ("weight", "weight_scale"))
    assert weight.dtype == torch.float8_e4m3fn and scale.shape == (VOCAB,)
    for r in range(2):
        s = shard(g, r, 2)
        cut = lm_head(s)
        rows = slice(r * VOCAB // 2, (r + 1) * VOCAB // 2)
        assert torch.equal(s.weights[cut.inputs["weight"]].view(torch.uint8), weight[rows].view(torch.uint8))
        assert torch.equal(s.weights[cut.inputs["weight_scale"]], scale[rows])
        (embed,) = nodes_of(s, "embedding")
        assert torch.equal(s.weights[embed.inputs["weight"]], g.weights["embed_tokens.weight"])


def test_shard_error_heads_not_divisible():
    g = fuse_all(make_llama(num_heads=3, num_kv_heads=1))
    with pytest.raises(ShardError, match="--tp-size"):
        shard(g, 0, 2)
    with pytest.raises(ShardError, match="--tp-size 2"):
        shard(make_llama(num_heads=3, num_kv_heads=1), 1, 2)  # unfused: the q_proj linear


@pytest.mark.parametrize("fused", [False, True])
def test_shard_error_intermediate_not_divisible(fused):
    g = make_llama(inter=26)
    g = fuse_all(g) if fused else g
    shard(g, 0, 2)  # 26 splits over 2
    with pytest.raises(ShardError, match="--tp-size 4"):
        shard(g, 0, 4)


@pytest.mark.parametrize("fused", [False, True])
def test_shard_error_fewer_q_heads_than_ranks(fused):
    g = make_llama(num_heads=2, num_kv_heads=1)
    g = fuse_all(g) if fused else g
    with pytest.raises(ShardError, match="--tp-size 4"):
        shard(g, 2, 4)


# --------------------------------------------------------------------------------------------
