"""Rewrite a checkpoint folder's decoder projections as a pre-quantized FP8 checkpoint, in the
compressed-tensors or ModelOpt format that `models.fp8_checkpoint` loads, so tests of those
formats need no downloads (`make-checkpoint --fp8-format`).

Weights are quantized with `plugins.fp8`: per channel (one scale per output feature, exactly as
`build-engine --quantization fp8` quantizes them) or per tensor (one scale for the whole matrix).
The LM head and the embedding stay as they are, as published FP8 checkpoints leave them.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kiln.models.fp8_checkpoint import COMPRESSED_TENSORS, MODELOPT, MODELOPT_CONFIG
from kiln.plugins.fp8 import E4M3_MAX, MIN_SCALE, quantize_rows, to_e4m3

FP8_FORMATS = (COMPRESSED_TENSORS, MODELOPT)
FP8_STRATEGIES = ("channel", "tensor")
_PROJECTION = re.compile(r"\.layers\.\d+\..*_proj\.weight$")


def _quantize(w: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, its scale: [N] per channel, [] per tensor)."""
    if strategy == "channel":
        return quantize_rows(w)
    scale = (w.float().abs().amax() / E4M3_MAX).clamp(min=MIN_SCALE)
    return to_e4m3(w, scale), scale


def _config(fmt: str, strategy: str) -> dict:
    if fmt == COMPRESSED_TENSORS:
        return {"quant_method": COMPRESSED_TENSORS, "format": "float-quantized", "quantization_status": "compressed",
                "ignore": ["lm_head"], "kv_cache_scheme": None,
                "config_groups": {"group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy,
                                "dynamic": False},
                    "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                                          "dynamic": True}}}}
    return {"quant_method": MODELOPT, "quant_algo": "FP8" if strategy == "tensor" else "FP8_PER_CHANNEL_PER_TOKEN",
            "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}


def quantize_checkpoint(folder: str | Path, fmt: str, strategy: str = "channel") -> None:
    """Quantize the decoder projections of the checkpoint in `folder` in place (the caller
    writes into a staging folder: see `random_checkpoint.write_random_checkpoint`)."""
    if fmt not in FP8_FORMATS:
        raise ValueError(f"unknown FP8 checkpoint format {fmt!r}; choose one of {', '.join(FP8_FORMATS)}")
    if strategy not in FP8_STRATEGIES:
        raise ValueError(f"unknown FP8 scale strategy {strategy!r}; choose one of {', '.join(FP8_STRATEGIES)}")
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"] if index.is_file() else None
    for path in sorted(folder.glob("*.safetensors")):
        tensors = load_file(str(path))
        out: dict[str, torch.Tensor] = {}
        for name, w in tensors.items():
            if not _PROJECTION.search(name):
                out[name] = w
                continue
            wq, scale = _quantize(w, strategy)
            # compressed-tensors stores a channel scale as [N, 1] and a tensor scale as [1]; ModelOpt
            # a tensor scale as a 0-d tensor.
            if fmt == COMPRESSED_TENSORS:
                scale = scale[:, None] if strategy == "channel" else scale.reshape(1)
            scale_name = name.removesuffix("weight") + "weight_scale"
            out[name], out[scale_name] = wq, scale.contiguous()
            if weight_map is not None:
                weight_map[scale_name] = path.name
        save_file(out, str(path), metadata={"format": "pt"})
    if weight_map is not None:
        index.write_text(json.dumps({**json.loads(index.read_text()), "weight_map": weight_map}, indent=2) + "\n")
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = _config(fmt, strategy)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    if fmt == MODELOPT:
        (folder / MODELOPT_CONFIG).write_text(json.dumps(
            {"producer": {"name": "modelopt"}, "quantization": {k: v for k, v in _config(fmt, strategy).items()
                                                               if k != "quant_method"}}, indent=2) + "\n")
