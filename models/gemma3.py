"""Kiln's definition of Gemma 3's text model (`Gemma3ForCausalLM`).

Against the Llama family it adds: embeddings scaled by sqrt(hidden_size) in the table's dtype;
RMSNorm weights applied as (1 + w), which the loader stores (`from_checkpoint`, in float32 like
every norm weight: exact), so the norms are the plain `rms_norm` and the fusion passes fold them
as Llama's; a norm after attention and
after the MLP (each before its residual add, which therefore stays a primitive `add`); per-head
q/k norm; GeGLU; the attention scale query_pre_attn_scalar^-1/2; sliding-window layers with
their own RoPE table (`local_rope_theta`) between global ones (`rope_theta` and
`rope_scaling`); and soft-capped logits. The window is a mask over a full-length KV cache: the
cache keeps every token of a sequence, and a windowed layer's attention only looks at the last
`sliding_window` of them.

Module names mirror Hugging Face's, so checkpoint tensors load by name; a multimodal Gemma 3
checkpoint's text tensors are renamed to them and its vision tensors skipped (`checkpoint_name`).
"""
from __future__ import annotations

import torch
from torch import nn

from kiln.models.config import ModelConfig
from kiln.models.layers import Embedding, Linear, RMSNorm
from kiln.models.llama import MLP, Attention
from kiln.models.rope import rope_table
from kiln.plugins import op

# Where a multimodal checkpoint (Gemma3ForConditionalGeneration) keeps the text model's tensors,
# by transformers version, and the prefixes of the parts Kiln does not build.
_TEXT_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.",
                  "language_model.lm_head.": "lm_head."}
_OTHER_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = Attention(cfg, layer, dtype)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(cfg, dtype)
        self.post_feedforward_layernorm = RMSNorm(h, eps)

    def forward(self, h, positions, rope_cache, kv_cache, slot_mapping, block_tables, query_lens, context_lens):
        a = self.self_attn(self.input_layernorm(h), positions, rope_cache, kv_cache, slot_mapping,
                           block_tables, query_lens, context_lens)
        h = op("add")(h, self.post_attention_layernorm(a))
        m = self.mlp(self.pre_feedforward_layernorm(h))
        return op("add")(h, self.post_feedforward_layernorm(m))


class DecoderStack(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, scale=cfg.hidden_size ** 0.5)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Gemma3ForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, max_positions: int | None = None):
        super().__init__()
        self.config = cfg
        self.model = DecoderStack(cfg, dtype)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, "none", 0, dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        positions = max_positions or cfg.max_position_embeddings
        self.register_buffer("rope_cache", rope_table(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, positions),
                             persistent=False)
        self.register_buffer("local_rope_cache", rope_table(cfg.head_dim, cfg.local_rope_theta, None, positions),
                             persistent=False)

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """The module path a checkpoint tensor loads into; None for a multimodal checkpoint's
        vision tensors, which the text model does not use."""
        if name.startswith(_OTHER_PREFIXES):
            return None
        for prefix, ours in _TEXT_PREFIXES.items():
            if name.startswith(prefix):
                return ours + name[len(prefix):]
        return name

    @staticmethod
    def from_checkpoint(name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Gemma's RMSNorm scales by (1 + w): stored as that, in float32 as transformers forms it
        (norm weights are float32 in every engine dtype, so the sum is exact)."""
        return 1.0 + tensor.float() if name.endswith("norm.weight") else tensor

    def forward(self, input_ids, positions, slot_mapping, block_tables, query_lens, context_lens,
                logits_indices, kv_cache):
        h = self.model.embed_tokens(input_ids)
        for layer, windowed in zip(self.model.layers, self.config.sliding_layers):
            rope = self.local_rope_cache if windowed else self.rope_cache
            h = layer(h, positions, rope, kv_cache, slot_mapping, block_tables, query_lens, context_lens)
        h = op("take_rows")(h, logits_indices)
        logits = self.lm_head(self.model.norm(h))
        cap = self.config.final_logit_softcapping
        return op("softcap")(logits, cap) if cap is not None else logits
