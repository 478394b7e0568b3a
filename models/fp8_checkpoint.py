"""Pre-quantized FP8 checkpoints, loaded as they are: the `quantization_config` of a Hugging Face
folder in the compressed-tensors format (`quant_method: "compressed-tensors"`, as Neural Magic /
llm-compressor publish Llama and Qwen FP8 models) or NVIDIA ModelOpt's (`quant_method: "modelopt"`,
or a `hf_quant_config.json` beside config.json), read and checked; and the scale tensors of their
float8 weights turned into Kiln's one form, a float32 scale per output feature.

Both formats store a quantized projection as `<module>.weight` (float8_e4m3fn [N, K]) and
`<module>.weight_scale` (a config with only a KV-cache scheme is no weight quantization: its
scales are `models.kv_scales`' business): per channel ([N] or [N, 1]) or per tensor ([] or [1], broadcast here to
every channel, which is the same numbers). A static per-tensor `<module>.input_scale` becomes the
op's `<weight>_input_scale`; without one, activations are quantized per token at run time
(`plugins.fp8`). Anything else (int8, AWQ, GPTQ,
NVFP4, block-wise or group-wise scales, per-channel input scales) is refused with a message saying so.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from kiln.models.errors import CheckpointError
from kiln.plugins.fp8 import FP8

COMPRESSED_TENSORS = "compressed-tensors"
MODELOPT = "modelopt"
# ModelOpt's quant_algo values that are e4m3 weights with per-tensor or per-channel scales.
MODELOPT_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN")
COMPRESSED_TENSORS_STRATEGIES = ("channel", "tensor")
MODELOPT_CONFIG = "hf_quant_config.json"
# Checkpoint tensors that describe a float8 weight rather than hold model weights.
WEIGHT_SCALE, INPUT_SCALE = "weight_scale", "input_scale"


def quantization_of(raw: dict, source: str) -> str:
    """The Kiln quantization ("none" or "fp8") a config.json's `quantization_config` describes;
    CheckpointError for one Kiln cannot load."""
    qc = raw.get("quantization_config")
    if qc is None:
        return "none"
    where = f"{source}: quantization_config"
    if not isinstance(qc, dict):
        raise CheckpointError(f"{where} must be an object")
    method = qc.get("quant_method")
    if method == COMPRESSED_TENSORS:
        if not qc.get("config_groups"):
            return "none"  # only a KV-cache scheme (models/kv_scales.py reads its scales)
        _check_compressed_tensors(qc, where)
    elif method == MODELOPT:
        if not qc.get("quant_algo"):
            return "none"  # only a KV-cache algorithm
        _check_modelopt(qc, where)
    else:
        raise CheckpointError(f"{where}.quant_method {method!r} is not supported: Kiln loads FP8 checkpoints in the "
                              f"{COMPRESSED_TENSORS} and {MODELOPT} formats; build from the unquantized checkpoint "
                              "(add --quantization fp8 for an FP8 engine)")
    return "fp8"


def with_modelopt_file(raw: dict, folder: Path) -> dict:
    """config.json's keys, with ModelOpt's `hf_quant_config.json` as its quantization_config when
    config.json has none (ModelOpt writes its settings there)."""
    path = folder / MODELOPT_CONFIG
    if "quantization_config" in raw or not path.is_file():
        return raw
    try:
        quant = json.loads(path.read_text()).get("quantization")
    except (json.JSONDecodeError, AttributeError) as e:
        raise CheckpointError(f"{path} is not a ModelOpt quantization file: {e}") from None
    if not isinstance(quant, dict):
        raise CheckpointError(f"{path} has no 'quantization' object: is it ModelOpt's hf_quant_config.json?")
    return {**raw, "quantization_config": {"quant_method": MODELOPT, **quant}}


def _check_compressed_tensors(qc: dict, where: str) -> None:
    fmt = qc.get("format")
    if fmt not in ("float-quantized", "naive-quantized", None):
        raise CheckpointError(f"{where}.format {fmt!r} is not supported: Kiln loads float-quantized (FP8) "
                              "compressed-tensors checkpoints")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict):
        raise CheckpointError(f"{where}.config_groups must be an object")
    for name, group in groups.items():
        w = (group or {}).get("weights") or {}
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise CheckpointError(f"{where}.config_groups.{name}.weights is {w.get('num_bits')}-bit "
                                  f"{w.get('type')}: Kiln loads only 8-bit float (e4m3) weights")
        if w.get("strategy") not in COMPRESSED_TENSORS_STRATEGIES:
            raise CheckpointError(f"{where}.config_groups.{name}.weights.strategy {w.get('strategy')!r} is not "
                                  f"supported: Kiln loads {' or '.join(COMPRESSED_TENSORS_STRATEGIES)} scales "
                                  "(not block- or group-wise ones)")
        a = (group or {}).get("input_activations")
        if a and (a.get("type") != "float" or a.get("num_bits") != 8):
            raise CheckpointError(f"{where}.config_groups.{name}.input_activations are {a.get('num_bits')}-bit "
                                  f"{a.get('type')}: Kiln runs FP8 weights with 8-bit float activations")


def _check_modelopt(qc: dict, where: str) -> None:
    algo = qc.get("quant_algo")
    if algo not in MODELOPT_ALGOS:
        raise CheckpointError(f"{where}.quant_algo {algo!r} is not supported: Kiln loads ModelOpt's "
                              f"{' and '.join(MODELOPT_ALGOS)}")


def per_channel_scale(scale: torch.Tensor, out_features: int, name: str) -> torch.Tensor:
    """A checkpoint's weight scale as float32 [out_features]: a per-tensor scale is broadcast."""
    check_scale_values(scale, name, "weight scales are finite and not negative", lambda s: s >= 0, REBUILD)
    if scale.numel() == 1:
        return scale.float().reshape(1).expand(out_features).contiguous()
    if scale.numel() == out_features and scale.dim() in (1, 2) and scale.shape[0] == out_features:
        return scale.float().reshape(out_features).contiguous()
    raise CheckpointError(f"{name} has shape {tuple(scale.shape)}: Kiln loads per-tensor or per-channel "
                          f"([{out_features}]) FP8 weight scales, not block- or group-wise ones")


def static_input_scale(scale: torch.Tensor, name: str) -> torch.Tensor:
    """A checkpoint's static activation scale as float32 [1]."""
    if scale.numel() != 1:
        raise CheckpointError(f"{name} has shape {tuple(scale.shape)}: Kiln loads a static input scale per "
                              "tensor only (or none: activations are then quantized per token)")
    # Activations are divided by it: zero would make every product infinite or NaN.
    check_scale_values(scale, name, "a static input scale is a finite number above 0", lambda s: s > 0, REBUILD)
    return scale.float().reshape(1)


# What to do about a damaged FP8 weight or input scale.
REBUILD = "build from its bf16 original with --quantization fp8 instead"


def check_scale_values(scale: torch.Tensor, name: str, rule: str, valid, advice: str) -> None:
    """Refuse a checkpoint's scale tensor with a value that breaks `rule` (`valid` says which values keep
    it), naming the first such value and what to do (`advice`): a damaged checkpoint, which would
    otherwise give NaN logits with no error."""
    wide = scale.float()
    bad = ~(torch.isfinite(wide) & valid(wide))
    if bad.any():
        value = wide[bad].reshape(-1)[0].item()
        raise CheckpointError(f"{name} holds {value}: {rule}. The checkpoint's scales are damaged; {advice}")


def is_float8(tensor: torch.Tensor) -> bool:
    if tensor.dtype.is_floating_point and tensor.element_size() == 1 and tensor.dtype != FP8:
        raise CheckpointError(f"float8 weights of dtype {tensor.dtype} are not supported: Kiln loads e4m3 "
                              "(float8_e4m3fn)")
    return tensor.dtype == FP8
