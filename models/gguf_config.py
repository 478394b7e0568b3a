"""What a GGUF file's architecture means in Hugging Face's terms: the `config.json` its model
would have, and each of its tensors under the Hugging Face name and layout.

llama.cpp's converters change two things on the way in, which are undone here: for the `llama`
architecture the rows of q and k are permuted per head (llama.cpp's RoPE pairs adjacent values,
Hugging Face's pairs the two halves of a head), and for `gemma3` every RMSNorm weight is stored
with the 1 that Gemma adds at run time already added.
"""
from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch

from kiln.models.config import CheckpointError
from kiln.models.gguf_file import GGUFFile

# GGUF architecture -> Hugging Face architecture.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}

# GGUF general.file_type -> the dtype the weights were written in; a quantized file reads as
# float32, the one dtype that holds its dequantized values exactly.
_FILE_TYPE_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}

_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 norms on both sides of attention and of the MLP.
_GEMMA3_LAYER = {
    **_LAYER,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Tensors a converter writes that the Hugging Face model recomputes from its config.
_DERIVED = ("rope_freqs.weight",)
# Gemma 3 alternates five sliding-window layers with one global layer; llama.cpp keeps the rule,
# not the list, and so does its GGUF.
_GEMMA3_SLIDING_PATTERN = 6
_GEMMA3_LOCAL_ROPE_BASE = 10000.0

_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def check_architecture(f: GGUFFile) -> str:
    arch = f.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise CheckpointError(f"{f.path}: GGUF architecture {arch!r} is not supported; Kiln reads GGUF files of "
                              f"the architectures {', '.join(GGUF_ARCHITECTURES)}")
    if "rope_freqs.weight" in f.tensor_names:
        raise CheckpointError(f"{f.path}: the file carries rope_freqs (Llama 3.1-style rope scaling as a table), "
                              "which Kiln cannot turn into a Hugging Face rope_scaling: build from the "
                              "Hugging Face checkpoint instead")
    return arch


def _decimal(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def _tied(f: GGUFFile) -> bool:
    return "output.weight" not in f.tensor_names


def hf_config(f: GGUFFile) -> dict[str, Any]:
    """The Hugging Face `config.json` of the file's model, from its metadata."""
    arch = check_architecture(f)

    def key(name: str, default: Any = None) -> Any:
        value = f.metadata(f"{arch}.{name}", default)
        if value is None:
            f.require(f"{arch}.{name}")
        return value

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    vocab = f.metadata(f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(f.require("tokenizer.ggml.tokens"))
    eos = [f.metadata(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    eos = list(dict.fromkeys(int(e) for e in eos if e is not None))
    config: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": _MODEL_TYPES[arch],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": int(key("attention.key_length", hidden // heads)),
        "rms_norm_eps": _decimal(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": _decimal(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length")),
        "tie_word_embeddings": _tied(f),
        "bos_token_id": f.metadata("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "torch_dtype": _FILE_TYPE_DTYPES.get(f.metadata("general.file_type"), "float32"),
    }
    scaling = f.metadata(f"{arch}.rope.scaling.type")
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": _decimal(key("rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise CheckpointError(f"{f.path}: rope scaling {scaling!r} is not supported; Kiln reads 'linear' from GGUF")
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in f.tensor_names
    if arch == "qwen2":
        config["use_sliding_window"] = False
    if arch == "gemma3":
        config.update(_gemma3_config(f, config))
    return config


def _gemma3_config(f: GGUFFile, config: dict[str, Any]) -> dict[str, Any]:
    layers = config["num_hidden_layers"]
    window = f.metadata("gemma3.attention.sliding_window")
    # llama.cpp scales Gemma 3 27B's queries by its hidden size per head, every other size by head_dim.
    scalar = config["hidden_size"] // config["num_attention_heads"] if layers == 62 else config["head_dim"]
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": scalar,
        "sliding_window": int(window) if window else None,
        "layer_types": ["full_attention" if (i + 1) % _GEMMA3_SLIDING_PATTERN == 0 else "sliding_attention"
                        for i in range(layers)],
        "rope_local_base_freq": _GEMMA3_LOCAL_ROPE_BASE,
        "final_logit_softcapping": f.metadata("gemma3.final_logit_softcapping"),
        "attn_logit_softcapping": f.metadata("gemma3.attn_logit_softcapping"),
        "attention_bias": False,
        "pad_token_id": f.metadata("tokenizer.ggml.padding_token_id"),
    }


def hf_tensor_name(arch: str, name: str) -> str | None:
    """The Hugging Face name of GGUF tensor `name`; None for one the model recomputes."""
    if name in _DERIVED:
        return None
    base, _, kind = name.rpartition(".")
    if base in _TOP_LEVEL and kind == "weight":
        return f"{_TOP_LEVEL[base]}.weight"
    m = _LAYER_NAME.match(name)
    table = _GEMMA3_LAYER if arch == "gemma3" else _LAYER
    if m and m.group(2) in table:
        return f"model.layers.{m.group(1)}.{table[m.group(2)]}.{m.group(3)}"
    raise CheckpointError(f"GGUF tensor {name!r} has no Hugging Face counterpart in a {arch} model "
                          "(is the file from a newer llama.cpp converter?)")


def _unpermute(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row order (pairs of adjacent rows) back to Hugging Face's
    (first half of the head, then second half)."""
    rest = t.shape[1:]
    return t.reshape(heads, t.shape[0] // heads // 2, 2, *rest).transpose(1, 2).reshape(t.shape)


def to_hf_tensor(arch: str, name: str, t: torch.Tensor, config: dict[str, Any]) -> torch.Tensor:
    """GGUF tensor `name` (already dequantized) in the Hugging Face model's layout."""
    if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
        heads = config["num_attention_heads"] if ".attn_q." in name else config["num_key_value_heads"]
        return _unpermute(t, heads)
    if arch == "gemma3" and name.endswith("norm.weight"):
        return t - 1.0
    return t
