"""The `transformers` configs of the random checkpoints' families (`random_checkpoint.py`):
each family's config class and the settings that make it that family, at a given size.

``transformers`` is imported lazily, as in `random_checkpoint.py`.
"""
from __future__ import annotations

from typing import Any

FAMILIES: tuple[str, ...] = (
    "llama2", "llama3", "llama3.2", "llama-linear-rope", "mistral", "qwen2", "qwen3", "gemma3",
)


def family_config(family: str, size: dict[str, Any], tie: bool | None) -> Any:
    """The transformers config of a `family` checkpoint with `size`'s config keys; `tie`, when
    not None, overrides the family's choice of tied embeddings."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    head_dim = size["hidden_size"] // size["num_attention_heads"]
    llama3_rope = {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        # Far below max_position_embeddings so that, even at head_dim 16, some
        # frequencies are kept, some interpolated and some divided by `factor`.
        "original_max_position_embeddings": max(1, size["max_position_embeddings"] // 4),
    }
    specs: dict[str, tuple[type, dict[str, Any]]] = {
        "llama2": (LlamaConfig, dict(rope_theta=10000.0, rms_norm_eps=1e-5)),
        "llama3": (LlamaConfig, dict(rope_theta=500000.0, rope_scaling=llama3_rope, rms_norm_eps=1e-5)),
        "llama3.2": (LlamaConfig, dict(rope_theta=500000.0, rope_scaling=llama3_rope,
                                       rms_norm_eps=1e-5, tie_word_embeddings=True)),
        "llama-linear-rope": (LlamaConfig, dict(rope_theta=10000.0, rms_norm_eps=1e-5,
                                                rope_scaling={"rope_type": "linear", "factor": 2.0})),
        "mistral": (MistralConfig, dict(rope_theta=1e6, sliding_window=None, head_dim=head_dim,
                                        rms_norm_eps=1e-5)),
        "qwen2": (Qwen2Config, dict(rope_theta=1e6, use_sliding_window=False, rms_norm_eps=1e-6,
                                    max_window_layers=size["num_hidden_layers"])),
        "qwen3": (Qwen3Config, dict(rope_theta=1e6, head_dim=head_dim, attention_bias=False,
                                    use_sliding_window=False, rms_norm_eps=1e-6,
                                    max_window_layers=size["num_hidden_layers"])),
    }
    if family == "gemma3":
        return _gemma3_config(size, head_dim, tie)
    if family not in specs:
        raise ValueError(f"unknown family {family!r}; expected one of {', '.join(FAMILIES)}")
    config_cls, extra = specs[family]
    extra.setdefault("tie_word_embeddings", False)
    if tie is not None:
        extra["tie_word_embeddings"] = tie
    return config_cls(**size, **extra, hidden_act="silu", attn_implementation="eager")


# Gemma 3's variants, sized so that each shows in a small random model's logits: every other
# layer windowed (real models window five in six) with a window shorter than a test's prompt
# plus its generated tokens, a local RoPE base unlike the global one, linear RoPE scaling on
# the global layers (as the 4B and larger models have), an attention scale that is not
# head_dim's, and a soft cap near random logits' size.
GEMMA3_SLIDING_WINDOW, GEMMA3_SOFTCAP = 8, 5.0


def _gemma3_config(size: dict[str, Any], head_dim: int, tie: bool | None) -> Any:
    from transformers import Gemma3TextConfig

    layers = size["num_hidden_layers"]
    return Gemma3TextConfig(
        **size, head_dim=head_dim, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
        query_pre_attn_scalar=head_dim * 3 // 2, sliding_window=GEMMA3_SLIDING_WINDOW,
        layer_types=["full_attention" if i % 2 else "sliding_attention" for i in range(layers)],
        rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 4.0},
        final_logit_softcapping=GEMMA3_SOFTCAP, attn_logit_softcapping=None,
        tie_word_embeddings=True if tie is None else tie, attn_implementation="eager")
