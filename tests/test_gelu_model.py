"""A model whose MLP is not SwiGLU builds without that fusion and still matches its eager
output; the attention fusions still apply."""
from __future__ import annotations

import torch
from torch import nn

from kiln.builder.build import build_from_model
from kiln.builder.config import BuildConfig
from kiln.models.config import parse_config
from kiln.models.layers import Linear
from kiln.models.llama import LlamaForCausalLM
from kiln.plugins import op
from kiln.runtime.engine import load_engine
from kiln.runtime.executor import CpuExecutor
from kiln.runtime.step import SequenceChunk, pack_step


class GeluMLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.up_proj = Linear(hidden, inter, True, "column")
        self.down_proj = Linear(inter, hidden, True, "row")

    def forward(self, x):
        return self.down_proj(op("gelu")(self.up_proj(x)))


def gelu_model() -> LlamaForCausalLM:
    cfg = parse_config({"architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 32,
                        "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-5})
    model = LlamaForCausalLM(cfg)
    for layer in model.model.layers:
        layer.mlp = GeluMLP(cfg.hidden_size, cfg.intermediate_size)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name
                    else 0.1 * torch.randn(p.shape, generator=g))
    return model


def test_gelu_mlp_builds_unfused_and_matches_eager(tmp_path):
    model = gelu_model()
    cfg = BuildConfig(max_batch_size=16, max_seq_len=32, max_num_tokens=32, kv_block_size=4)
    summary = build_from_model(model, tmp_path / "gelu", cfg, {"architecture": "test-gelu"})
    assert "norm_swiglu" not in summary.fusions_per_layer
    assert summary.fusions_per_layer["norm_qkv_rope"] == 1 and summary.fusions_per_layer["attention_o_proj"] == 1
    engine = load_engine(tmp_path / "gelu")
    ops = [o.spec.name for o in engine.plan]
    assert ops.count("gelu") == 2 and "silu_mul" not in ops

    ex = CpuExecutor(engine, num_kv_blocks=16)
    eager_cache = torch.zeros_like(ex.kv_cache)
    bs, nb = 4, engine.manifest.blocks_per_sequence
    steps = [[SequenceChunk([3, 9, 27, 81, 5, 7], 0, [2, 0], all_logits=True)]]
    steps += [[SequenceChunk([10 + i], 6 + i, [2, 0, 5])] for i in range(4)]
    for chunks in steps:
        step = pack_step(chunks, bs, nb)
        with torch.no_grad():
            eager = model(**step.as_dict(), kv_cache=eager_cache)
        got = ex.run(step)
        assert torch.allclose(got, eager, rtol=1e-5, atol=1e-5)
