"""Load a checkpoint into Kiln's model definition: a Hugging Face folder (config.json + one or
several safetensors files) or a GGUF file (read as the folder it would be, by `models.gguf`)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open

from kiln.dtypes import MODEL_DTYPES, torch_dtype
from kiln.models.config import CheckpointError, ModelConfig, parse_config, read_folder_config
from kiln.models.fp8_checkpoint import (INPUT_SCALE, WEIGHT_SCALE, is_float8, per_channel_scale,
                                        static_input_scale)
from kiln.models.gemma3 import Gemma3ForCausalLM
from kiln.models.gguf import read_gguf
from kiln.models.kv_scales import is_kv_scale, kv_scales_from
from kiln.models.layers import Linear
from kiln.models.llama import LlamaForCausalLM

# family -> model definition; every other family is the Llama one's
_MODELS = {"gemma3": Gemma3ForCausalLM}

# Tensors some exporters save that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# The files of a Hugging Face folder that an engine carries: the config and the tokenizer's.
ENGINE_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "generation_config.json", "tokenizer.model")


def is_gguf_path(checkpoint: Path) -> bool:
    """Whether --checkpoint names a GGUF file rather than a Hugging Face folder."""
    return checkpoint.is_file() and checkpoint.suffix == ".gguf"


def read_config(checkpoint: str | Path) -> ModelConfig:
    """The model configuration of a Hugging Face folder or of a GGUF file."""
    checkpoint = Path(checkpoint)
    if is_gguf_path(checkpoint):
        return parse_config(read_gguf(checkpoint).config, str(checkpoint))
    return read_folder_config(checkpoint)


def engine_files(checkpoint: str | Path) -> dict[str, bytes]:
    """Name -> contents of the checkpoint's config and tokenizer files, for the engine folder."""
    checkpoint = Path(checkpoint)
    if is_gguf_path(checkpoint):
        files = read_gguf(checkpoint).folder_files()
        return {name: data for name, data in files.items() if name in ENGINE_FILES}
    return {name: (checkpoint / name).read_bytes() for name in ENGINE_FILES if (checkpoint / name).is_file()}


def read_chat_template(checkpoint: str | Path) -> str | None:
    """The checkpoint's chat template, as transformers finds it: `chat_template.jinja`, else the
    `chat_template` of `tokenizer_config.json` (a string, or a list of named templates of which
    "default" is the one used); a GGUF's `tokenizer.chat_template`; None when it has none."""
    checkpoint_dir = Path(checkpoint)
    if is_gguf_path(checkpoint_dir):
        return read_gguf(checkpoint_dir).chat_template
    jinja = checkpoint_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    config = checkpoint_dir / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config} is not valid JSON: {e}") from None
    if isinstance(template, list):
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    return template if isinstance(template, str) else None


def safetensors_files(checkpoint_dir: Path) -> list[Path]:
    index = checkpoint_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from None
        files = [checkpoint_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} lists shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(checkpoint_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{checkpoint_dir} has no *.safetensors files: Kiln reads safetensors checkpoints "
            "(re-save a .bin checkpoint with save_pretrained(..., safe_serialization=True))")
    return files


def iter_tensors(checkpoint_dir: Path, wanted=lambda name: True) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a folder's safetensors files whose names `wanted` accepts."""
    for path in safetensors_files(checkpoint_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    if wanted(name):
                        yield name, f.get_tensor(name)
        except (OSError, RuntimeError, SafetensorError) as e:
            raise CheckpointError(f"cannot read {path}: {e} (re-copy or re-download the checkpoint)") from None


def read_kv_scales(checkpoint: str | Path, cfg: ModelConfig) -> torch.Tensor | None:
    """The FP8 KV-cache scales a checkpoint carries, [layers, 2, kv heads] float32
    (`models.kv_scales`); None when it has none (a GGUF file never does)."""
    checkpoint = Path(checkpoint)
    if is_gguf_path(checkpoint):
        return None
    return kv_scales_from(dict(iter_tensors(checkpoint, is_kv_scale)), cfg.num_layers, cfg.num_kv_heads,
                          str(checkpoint))


def load(checkpoint: str | Path, dtype: str = "float32", max_positions: int | None = None
         ) -> tuple[LlamaForCausalLM | Gemma3ForCausalLM, ModelConfig]:
    """Build Kiln's model for a checkpoint (folder or .gguf) and fill it with its weights in `dtype`."""
    checkpoint = Path(checkpoint)
    cfg = read_config(checkpoint)
    tensors = read_gguf(checkpoint).tensors() if is_gguf_path(checkpoint) else iter_tensors(checkpoint)
    if dtype not in MODEL_DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not supported; choose one of {', '.join(MODEL_DTYPES)}")
    with torch.device("meta"):
        model = _MODELS.get(cfg.family, LlamaForCausalLM)(cfg, torch_dtype(dtype), max_positions)
    expected = dict(model.named_parameters())
    state: dict[str, torch.Tensor] = {}
    fp8: dict[str, tuple[str, torch.Tensor]] = {}      # float8 weight -> (stored name, tensor)
    scales: dict[str, torch.Tensor] = {}               # module -> its weight_scale
    input_scales: dict[str, torch.Tensor] = {}         # module -> its static input_scale
    for stored, tensor in tensors:
        name = model.checkpoint_name(stored)
        if (name is None or name.endswith(_IGNORED_SUFFIXES) or is_kv_scale(stored)
                or (cfg.tie_word_embeddings and name == "lm_head.weight")):
            continue
        module, _, leaf = name.rpartition(".")
        if cfg.quantization == "fp8" and leaf in (WEIGHT_SCALE, INPUT_SCALE):
            (scales if leaf == WEIGHT_SCALE else input_scales)[module] = tensor
            continue
        if name not in expected:
            raise CheckpointError(f"{checkpoint}: unexpected tensor {stored!r} for a {cfg.architecture} "
                                  "with this config.json (is config.json from another model?)")
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(f"{checkpoint}: tensor {stored!r} has shape {tuple(tensor.shape)}, "
                                  f"config.json implies {tuple(expected[name].shape)}")
        if is_float8(tensor):
            if cfg.quantization != "fp8":
                raise CheckpointError(f"{checkpoint}: tensor {stored!r} is float8 but config.json has no "
                                      "quantization_config saying how it is scaled")
            fp8[name] = (stored, tensor)
            continue
        # Rounded to the model's dtype first, as transformers loads it; a norm weight is then
        # held in float32 (see models.layers.RMSNorm), where Gemma's 1 + w is exact.
        state[name] = model.from_checkpoint(name, tensor.to(torch_dtype(dtype))).to(expected[name].dtype)
    _load_fp8(model, fp8, scales, input_scales, checkpoint)
    missing = sorted(set(expected) - set(state) - set(fp8))
    if missing:
        raise CheckpointError(f"{checkpoint}: missing tensors {', '.join(missing[:5])}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval(), cfg


def _load_fp8(model: torch.nn.Module, weights: dict[str, tuple[str, torch.Tensor]], scales: dict[str, torch.Tensor],
              input_scales: dict[str, torch.Tensor], checkpoint: Path) -> None:
    """Give each projection with a float8 weight that weight, as stored, its scale per output
    feature and its static input scale when it has one (`models.fp8_checkpoint`)."""
    for name, (stored, weight) in weights.items():
        path = name.rpartition(".")[0]
        module = model.get_submodule(path)
        if not isinstance(module, Linear) or not name.endswith(".weight"):
            raise CheckpointError(f"{checkpoint}: tensor {stored!r} is float8, but only projection weights "
                                  "(Linear layers) can be: keep it in the model dtype")
        if path not in scales:
            raise CheckpointError(f"{checkpoint}: float8 tensor {stored!r} has no {WEIGHT_SCALE} beside it")
        input_scale = input_scales.pop(path, None)
        module.set_fp8(weight, per_channel_scale(scales.pop(path), weight.shape[0], f"{stored}_scale"),
                       None if input_scale is None else static_input_scale(input_scale, f"{path}.{INPUT_SCALE}"))
    for leaf, orphans in ((WEIGHT_SCALE, scales), (INPUT_SCALE, input_scales)):
        if orphans:
            raise CheckpointError(f"{checkpoint}: {sorted(orphans)[0]}.{leaf} scales a weight that is not float8")
