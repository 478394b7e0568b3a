"""Model configuration read from a Hugging Face `config.json`, for the architectures Kiln supports."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


class CheckpointError(ValueError):
    """A checkpoint folder Kiln cannot build from; the message says what is wrong and what to do."""


# architecture -> family name shown to users
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    dtype: str


    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _rope(raw: dict) -> tuple[float, dict | None]:
    """Rope settings from either the classic keys (`rope_theta`, `rope_scaling`) or the newer
    `rope_parameters` dict that transformers 5 writes."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    merged = {**scaling, **params}
    rope_type = merged.pop("rope_type", merged.pop("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"rope type {rope_type!r} is not supported; Kiln supports {', '.join(SUPPORTED_ROPE_TYPES)}")
    return theta, (None if rope_type == "default" else {"rope_type": rope_type, **merged})


def _checkpoint_dtype(raw: dict) -> str:
    """The dtype the checkpoint was saved in (`torch_dtype`, or `dtype` in transformers 5)."""
    dtype = str(raw.get("dtype") or raw.get("torch_dtype") or "float32").removeprefix("torch.")
    return dtype if dtype in ("float32", "float16", "bfloat16") else "float32"


def parse_config(raw: dict, source: str = "config.json") -> ModelConfig:
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{source}: architecture {arch or raw.get('model_type')!r} is not supported; "
            f"Kiln builds {', '.join(SUPPORTED_ARCHITECTURES)}")
    family = SUPPORTED_ARCHITECTURES[arch]
    try:
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        theta, scaling = _rope(raw)
        window = raw.get("sliding_window")
        if family in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
            window = None
        eos = raw.get("eos_token_id")
        attention_bias = bool(raw.get("attention_bias", False))
        return ModelConfig(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or attention_bias,
            o_bias=family in ("llama", "mistral", "qwen3") and attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            sliding_window=int(window) if window else None,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else ([] if eos is None else [eos])),
            dtype=_checkpoint_dtype(raw),
        )
    except KeyError as e:
        raise CheckpointError(f"{source}: missing required key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{source}: bad value: {e}") from None


def read_config(checkpoint_dir: str | Path) -> ModelConfig:
    path = Path(checkpoint_dir) / "config.json"
    if not Path(checkpoint_dir).is_dir():
        raise CheckpointError(f"checkpoint folder {checkpoint_dir} does not exist")
    if not path.is_file():
        raise CheckpointError(f"{checkpoint_dir} has no config.json: point --checkpoint at a Hugging Face model folder")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    return parse_config(raw, str(path))
