"""Adding an op takes its folder and its registration, nothing else in Kiln.

`relu2_scale` (tests/toy_plugins/relu2_scale: spec, shard rule, PyTorch reference) lives
outside Kiln and is registered by importing its folder. A model that uses it builds with
build-engine's Python API for the CPU and runs in the CPU engine, matching the same model
computed in plain PyTorch; its own shard rule splits it for tensor parallelism; and a GPU
build names it as an op without kernels. Registering a clashing or inconsistent spec is refused
with a message that says what to fix.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import toy_plugins.relu2_scale  # noqa: F401  (registers the op)
from kiln.builder.build import build_from_model
from kiln.builder.config import BuildConfig
from kiln.builder.kernels import KernelError
from kiln.builder.passes import FUSIONS, shard
from kiln.builder.trace import trace
from kiln.models.config import parse_config
from kiln.models.layers import Linear
from kiln.models.llama import LlamaForCausalLM
from kiln.plugins import all_plugins, op
from kiln.plugins.registry import register
from kiln.runtime.engine import load_engine
from kiln.runtime.executor import CpuExecutor
from kiln.runtime.step import SequenceChunk, pack_step
from pass_graphs import TOL, decode_step, new_cache, prefill_step, run_steps, run_tensor_parallel

BUILD = dict(max_batch_size=16, max_seq_len=32, max_num_tokens=32, kv_block_size=4)


def kiln_relu2_scale(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return op("relu2_scale")(x, scale, "column")


def plain_relu2_scale(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.relu(x) ** 2 * scale


class Relu2MLP(nn.Module):
    """up (column parallel) -> relu(.)^2 * scale -> down (row parallel); `act` computes the middle."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.up_proj = Linear(hidden, inter, False, "column")
        self.scale = nn.Parameter(torch.empty(inter), requires_grad=False)
        self.down_proj = Linear(inter, hidden, False, "row")
        self.act = kiln_relu2_scale

    def forward(self, x):
        return self.down_proj(self.act(self.up_proj(x), self.scale))


def relu2_model() -> LlamaForCausalLM:
    cfg = parse_config({"architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 32,
                        "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-5})
    model = LlamaForCausalLM(cfg)
    for layer in model.model.layers:
        layer.mlp = Relu2MLP(cfg.hidden_size, cfg.intermediate_size)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name or "scale" in name
                    else 0.1 * torch.randn(p.shape, generator=g))
    return model


def test_new_op_builds_and_runs_in_the_cpu_engine(tmp_path):
    model = relu2_model()
    build_from_model(model, tmp_path / "relu2", BuildConfig(**BUILD), {"architecture": "test-relu2"})
    engine = load_engine(tmp_path / "relu2")
    assert [o.spec.name for o in engine.plan].count("relu2_scale") == 2

    for layer in model.model.layers:
        layer.mlp.act = plain_relu2_scale  # the expected values: the op in plain PyTorch
    ex = CpuExecutor(engine, num_kv_blocks=16)
    eager_cache = torch.zeros_like(ex.kv_cache)
    steps = [[SequenceChunk([3, 9, 27, 81, 5, 7], 0, [2, 0], all_logits=True)]]
    steps += [[SequenceChunk([10 + i], 6 + i, [2, 0, 5])] for i in range(4)]
    for chunks in steps:
        step = pack_step(chunks, BUILD["kv_block_size"], engine.manifest.blocks_per_sequence)
        with torch.no_grad():
            expected = model(**step.as_dict(), kv_cache=eager_cache)
        torch.testing.assert_close(ex.run(step), expected, rtol=1e-5, atol=1e-5)
    ex.close()


@pytest.mark.parametrize("world", [2, 4])
def test_new_op_shards_by_its_own_rule(world):
    """Each rank keeps its slice of the scale, matching its slice of up_proj's features; with
    the all-reduce simulated, the ranks' logits are the single-rank run's."""
    graph = trace(relu2_model())
    for fusion in FUSIONS:
        graph = fusion(graph)
    ranks = [shard(graph, r, world) for r in range(world)]
    full = graph.weights["model.layers.0.mlp.scale"]
    per = full.shape[0] // world
    for r, g in enumerate(ranks):
        torch.testing.assert_close(g.weights["model.layers.0.mlp.scale"], full[r * per:(r + 1) * per])
    envs_ref, _ = run_steps(graph)
    caches = [new_cache(g) for g in ranks]
    for step, env_ref in zip([prefill_step(), decode_step()], envs_ref):
        for env in run_tensor_parallel(ranks, step, caches):
            torch.testing.assert_close(env[graph.outputs[0]], env_ref[graph.outputs[0]], **TOL)


def test_gpu_build_names_the_new_op_without_kernels(tmp_path):
    cfg = BuildConfig(**BUILD, targets=("cpu", "sm_90"))
    with pytest.raises(KernelError, match="op 'relu2_scale' in module 'model.layers.0.mlp' has no GPU kernel"):
        build_from_model(relu2_model(), tmp_path / "relu2-gpu", cfg, {"architecture": "test-relu2"})


def test_registering_names_what_is_wrong():
    spec = toy_plugins.relu2_scale.SPEC
    with pytest.raises(ValueError, match="'relu2_scale' registered twice .*give the new op another name"):
        register(spec)
    with pytest.raises(ValueError, match=r"added_once names \['residual'\], which are not among its inputs"):
        register(dataclasses.replace(spec, name="relu2_scale_once", added_once=("residual",)))
    assert "relu2_scale_once" not in all_plugins()
