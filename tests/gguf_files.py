"""Writing small GGUF files for tests with `gguf.GGUFWriter`: any metadata and raw tensors, and a
random Hugging Face checkpoint written the way llama.cpp's converter writes one (its tensor names,
llama's q/k rows permuted per head, its tokenizer as gpt2 metadata)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

HF_TO_GGUF_LAYER = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
HF_TO_GGUF_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                  "lm_head.weight": "output.weight"}


def write_gguf(path: Path, arch: str, metadata: dict[str, Any], tensors: dict[str, tuple[np.ndarray, str | None]]) -> Path:
    """A GGUF of `arch` with `metadata` (key -> int, float, str, bool or list) and `tensors`
    (name -> (array, None) for a float array in its own dtype, or (uint8 raw blocks, type name))."""
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

    w = GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif value and isinstance(value[0], str):
            w.add_array(key, value)
        elif value and isinstance(value[0], float):
            w.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=GGUFValueType.FLOAT32)
        else:
            w.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32)
    for name, (array, qtype) in tensors.items():
        w.add_tensor(name, array, raw_dtype=None if qtype is None else GGMLQuantizationType[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def permute_like_llama_cpp(t: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's q/k row order: within each head, row i of the first half and row i
    of the second half become rows 2i and 2i+1."""
    half = t.shape[0] // heads // 2
    return t.reshape(heads, 2, half, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def gguf_name(hf_name: str) -> str:
    if hf_name in HF_TO_GGUF_TOP:
        return HF_TO_GGUF_TOP[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{HF_TO_GGUF_LAYER[module]}.{kind}"


def tokenizer_metadata(hf_dir: Path) -> dict[str, Any]:
    """A byte-level BPE tokenizer.json (Kiln's random checkpoints') as gpt2 GGUF metadata."""
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {a["content"] for a in tok["added_tokens"] if a["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    return {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": [3 if t in special else 1 for t in tokens],
        "tokenizer.ggml.bos_token_id": vocab[config["bos_token"]],
        "tokenizer.ggml.eos_token_id": vocab[config["eos_token"]],
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.chat_template": "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}",
    }


def gguf_from_hf(hf_dir: Path, path: Path, arch: str = "llama") -> Path:
    """Kiln's random checkpoint `hf_dir` (a Llama or Qwen2) as llama.cpp would convert it, in F32."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    tensors = {}
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        if arch == "llama" and ".q_proj." in name:
            t = permute_like_llama_cpp(t, heads)
        elif arch == "llama" and ".k_proj." in name:
            t = permute_like_llama_cpp(t, kv_heads)
        tensors[gguf_name(name)] = (t.float().numpy(), None)
    metadata = {
        f"{arch}.context_length": cfg["max_position_embeddings"], f"{arch}.embedding_length": cfg["hidden_size"],
        f"{arch}.block_count": cfg["num_hidden_layers"], f"{arch}.feed_forward_length": cfg["intermediate_size"],
        f"{arch}.attention.head_count": heads, f"{arch}.attention.head_count_kv": kv_heads,
        f"{arch}.rope.freq_base": float(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]),
        f"{arch}.attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"]),
        f"{arch}.vocab_size": cfg["vocab_size"], "general.file_type": 0,
        **tokenizer_metadata(hf_dir),
    }
    return write_gguf(path, arch, metadata, tensors)
