"""Kiln's definition of the Llama family: Llama 2, Llama 3.x, Mistral, Qwen2/2.5, Qwen3.

The members differ only in switches that `ModelConfig` carries: q/k/v bias (Qwen2), per-head
q/k RMSNorm (Qwen3), tied embeddings, the rope frequency scheme and a sliding window. Gemma 3
(`models/gemma3.py`) reuses the attention and MLP here with three more: a window per layer, the
attention scale and the MLP's gate activation. Module names mirror Hugging Face's, so
checkpoint tensors load by name.

`forward` takes the step inputs named in `plugins.step_inputs` plus the KV cache, and returns
the logits of the rows in `logits_indices`.
"""
from __future__ import annotations

import torch
from torch import nn

from kiln.models.config import ModelConfig
from kiln.models.layers import Embedding, HeadRMSNorm, Linear, RMSNorm
from kiln.models.rope import rope_table
from kiln.plugins import op


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype):
        super().__init__()
        h, hd, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.q_proj = Linear(h, nh * hd, cfg.qkv_bias, "column", nh, dtype)
        self.k_proj = Linear(h, nkv * hd, cfg.qkv_bias, "column", nkv, dtype)
        self.v_proj = Linear(h, nkv * hd, cfg.qkv_bias, "column", nkv, dtype)
        self.o_proj = Linear(nh * hd, h, cfg.o_bias, "row", 0, dtype)
        self.q_norm = HeadRMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = HeadRMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.layer, self.num_heads, self.num_kv_heads, self.head_dim = layer, nh, nkv, hd
        self.window = cfg.layer_window(layer)
        self.scale = (cfg.query_pre_attn_scalar or hd) ** -0.5

    def forward(self, x, positions, rope_cache, kv_cache, slot_mapping, block_tables, query_lens, context_lens):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = op("rope")(q, positions, rope_cache, self.head_dim)
        k = op("rope")(k, positions, rope_cache, self.head_dim)
        a = op("attention")(q, k, v, kv_cache, slot_mapping, block_tables, query_lens, context_lens,
                            self.layer, self.num_heads, self.num_kv_heads, self.head_dim,
                            self.scale, self.window)
        return self.o_proj(a)


# ModelConfig.hidden_activation -> the gated op
GATED_OPS = {"silu": "silu_mul", "gelu_tanh": "gelu_mul"}


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU, or GeGLU for Gemma."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(h, i, cfg.mlp_bias, "column", 0, dtype)
        self.up_proj = Linear(h, i, cfg.mlp_bias, "column", 0, dtype)
        self.down_proj = Linear(i, h, cfg.mlp_bias, "row", 0, dtype)
        self.gated = GATED_OPS[cfg.hidden_activation]

    def forward(self, x):
        return self.down_proj(op(self.gated)(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, dtype)

    def forward(self, h, positions, rope_cache, kv_cache, slot_mapping, block_tables, query_lens, context_lens):
        a = self.self_attn(self.input_layernorm(h), positions, rope_cache, kv_cache, slot_mapping,
                           block_tables, query_lens, context_lens)
        h = op("add")(h, a)
        return op("add")(h, self.mlp(self.post_attention_layernorm(h)))


class DecoderStack(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """The module path a checkpoint tensor loads into: its own name."""
        return name

    @staticmethod
    def from_checkpoint(name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor as this model stores it: unchanged."""
        return tensor

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, max_positions: int | None = None):
        super().__init__()
        self.config = cfg
        self.model = DecoderStack(cfg, dtype)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, "none", 0, dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # An explicit device keeps the table real when the model is built on the meta device.
        table = rope_table(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                           max_positions or cfg.max_position_embeddings)
        self.register_buffer("rope_cache", table, persistent=False)

    def forward(self, input_ids, positions, slot_mapping, block_tables, query_lens, context_lens,
                logits_indices, kv_cache):
        h = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            h = layer(h, positions, self.rope_cache, kv_cache, slot_mapping, block_tables, query_lens, context_lens)
        h = op("take_rows")(h, logits_indices)
        return self.lm_head(self.model.norm(h))
