"""Model configuration read from a Hugging Face `config.json`, for the architectures Kiln supports."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kiln.models.errors import CheckpointError
from kiln.models.fp8_checkpoint import quantization_of, with_modelopt_file


# architecture -> family name shown to users
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
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
    # Gemma 3's variants; the defaults are the Llama family's.
    hidden_activation: str = "silu"                 # gated MLP activation: "silu" or "gelu_tanh"
    query_pre_attn_scalar: float | None = None      # attention scale is its -1/2 power (else head_dim's)
    sliding_layers: tuple[bool, ...] | None = None  # per layer: windowed; None: every layer uses sliding_window
    local_rope_theta: float | None = None           # RoPE base of the windowed layers (else rope_theta)
    final_logit_softcapping: float | None = None    # logits = cap * tanh(logits / cap)
    quantization: str = "none"                      # "fp8": a pre-quantized checkpoint (models/fp8_checkpoint.py)

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    def layer_window(self, layer: int) -> int:
        """The sliding window of one layer's attention, 0 for none."""
        windowed = self.sliding_layers[layer] if self.sliding_layers is not None else True
        return (self.sliding_window or 0) if windowed else 0

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
    if arch in GEMMA3_ARCHITECTURES or raw.get("model_type") in ("gemma3", "gemma3_text"):
        return parse_gemma3(raw, source)
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
            quantization=quantization_of(raw, source),
        )
    except KeyError as e:
        raise CheckpointError(f"{source}: missing required key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{source}: bad value: {e}") from None


# Gemma 3: the text model, or the multimodal one whose `text_config` Kiln builds on its own.
GEMMA3_ARCHITECTURES = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
# transformers' Gemma3TextConfig defaults: published configs (the multimodal ones' text_config
# above all) leave out every key that has its default.
_GEMMA3_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "eos_token_id": 1, "bos_token_id": 2,
    "tie_word_embeddings": True, "attention_bias": False, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "sliding_window_pattern": 6, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
}
_GEMMA3_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def _gemma3_text(raw: dict, source: str) -> dict:
    """The text model's keys: the config itself, or a multimodal config's `text_config` (its
    token ids and dtype may sit at the top level), with Gemma3TextConfig's defaults beneath."""
    if raw.get("model_type") == "gemma3" or (raw.get("architectures") or [None])[0] == "Gemma3ForConditionalGeneration":
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise CheckpointError(f"{source}: a multimodal Gemma 3 config needs a text_config object to build "
                                  "its text model from")
        inherited = {k: raw[k] for k in ("bos_token_id", "eos_token_id", "dtype", "torch_dtype") if k in raw}
        raw = {**inherited, **text}
    return {**_GEMMA3_DEFAULTS, **raw}


def _gemma3_rope(raw: dict, source: str) -> tuple[float, dict | None, float]:
    """(global theta, global scaling, local theta): transformers 5 writes `rope_parameters`
    keyed by layer type; older configs `rope_theta`, `rope_scaling` and `rope_local_base_freq`."""
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = params.get("full_attention") or {}
        local = dict(params.get("sliding_attention") or {})
    else:
        full = {"rope_theta": raw["rope_theta"], **(raw.get("rope_scaling") or {})}
        local = {"rope_theta": raw["rope_local_base_freq"]}
    theta, scaling = _rope({"rope_parameters": full})
    local_theta, local_scaling = _rope({"rope_parameters": {"rope_theta": 10_000.0, **local}})
    if local_scaling is not None:
        raise CheckpointError(f"{source}: rope scaling on the sliding-window layers ({local_scaling}) is not "
                              "supported; Kiln scales only the global layers' RoPE")
    return theta, scaling, local_theta


def _gemma3_layers(raw: dict, layers: int, source: str) -> tuple[bool, ...]:
    """Which layers are windowed: `layer_types`, else every `sliding_window_pattern`-th layer is global."""
    types = raw.get("layer_types")
    if types is None:
        pattern = int(raw["sliding_window_pattern"])
        return tuple(bool((i + 1) % pattern) for i in range(layers))
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown or len(types) != layers:
        raise CheckpointError(f"{source}: layer_types must name sliding_attention or full_attention for each of "
                              f"the {layers} layers; got {types}")
    return tuple(t == "sliding_attention" for t in types)


def parse_gemma3(raw: dict, source: str) -> ModelConfig:
    """A Gemma 3 config (`gemma3_text`, or a multimodal `gemma3` one's text part) as ModelConfig."""
    try:
        text = _gemma3_text(raw, source)
        if text.get("attn_logit_softcapping") is not None:
            raise CheckpointError(
                f"{source}: attn_logit_softcapping {text['attn_logit_softcapping']} is set, but transformers' Gemma 3 "
                "never applies it, so there is no reference to build against; remove it (set it to null)")
        if text.get("use_bidirectional_attention"):
            raise CheckpointError(f"{source}: use_bidirectional_attention (an embedding model) is not supported; "
                                  "Kiln builds causal decoders")
        activation = _GEMMA3_ACTIVATIONS.get(text["hidden_activation"])
        if activation is None:
            raise CheckpointError(f"{source}: hidden_activation {text['hidden_activation']!r} is not supported; "
                                  f"Kiln's Gemma 3 runs {', '.join(_GEMMA3_ACTIVATIONS)}")
        layers = int(text["num_hidden_layers"])
        theta, scaling, local_theta = _gemma3_rope(text, source)
        eos = text.get("eos_token_id")
        cap = text.get("final_logit_softcapping")
        window = text.get("sliding_window")
        return ModelConfig(
            architecture="Gemma3ForCausalLM",
            vocab_size=int(text["vocab_size"]),
            hidden_size=int(text["hidden_size"]),
            intermediate_size=int(text["intermediate_size"]),
            num_layers=layers,
            num_heads=int(text["num_attention_heads"]),
            num_kv_heads=int(text["num_key_value_heads"]),
            head_dim=int(text["head_dim"]),
            rms_norm_eps=float(text["rms_norm_eps"]),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(text["max_position_embeddings"]),
            tie_word_embeddings=bool(text["tie_word_embeddings"]),
            qkv_bias=bool(text["attention_bias"]),
            o_bias=bool(text["attention_bias"]),
            mlp_bias=False,
            qk_norm=True,
            sliding_window=int(window) if window else None,
            bos_token_id=text.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else ([] if eos is None else [eos])),
            dtype=_checkpoint_dtype(text),
            hidden_activation=activation,
            query_pre_attn_scalar=float(text["query_pre_attn_scalar"]),
            sliding_layers=_gemma3_layers(text, layers, source),
            local_rope_theta=local_theta,
            final_logit_softcapping=float(cap) if cap is not None else None,
            quantization=quantization_of(raw, source),
        )
    except KeyError as e:
        raise CheckpointError(f"{source}: missing required key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{source}: bad value: {e}") from None


def read_folder_config(checkpoint_dir: str | Path) -> ModelConfig:
    """The model configuration of a Hugging Face folder, from its config.json."""
    checkpoint_dir = Path(checkpoint_dir)
    path = checkpoint_dir / "config.json"
    if not checkpoint_dir.is_dir():
        raise CheckpointError(f"checkpoint {checkpoint_dir} does not exist or is neither a folder nor a .gguf file")
    if not path.is_file():
        raise CheckpointError(f"{checkpoint_dir} has no config.json: point --checkpoint at a Hugging Face model "
                              "folder or a .gguf file")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    return parse_config(with_modelopt_file(raw, checkpoint_dir), str(path))
