"""The FP8 KV-cache scales a quantized checkpoint carries, read apart from its weights.

Tools that quantize the KV cache store, per layer, the scale s of k and of v (the cache holds
value / s in e4m3) as small float32 tensors beside the weights:
- compressed-tensors (llm-compressor; `quantization_config.kv_cache_scheme`):
  `model.layers.{i}.self_attn.k_scale` and `.v_scale`, and in older exports
  `model.layers.{i}.self_attn.k_proj.output_scale` and `v_proj.output_scale`;
- NVIDIA ModelOpt: `model.layers.{i}.self_attn.k_proj.k_scale` and `v_proj.v_scale`;
- an older single `model.layers.{i}.self_attn.kv_scale`, used for both.
Each holds one value (per tensor) or one per kv head. The weight loader skips these names
(`is_kv_scale`); `models.checkpoint.read_kv_scales` gathers them for `--kv-cache-dtype fp8`.
"""
from __future__ import annotations

import re
import torch

from kiln.models.config import CheckpointError
from kiln.models.fp8_checkpoint import check_scale_values

# (pattern, which): which 0 is k, 1 is v, None both.
_NAMES = (
    (re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:k_scale|k_proj\.output_scale|k_proj\.k_scale)$"), 0),
    (re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:v_scale|v_proj\.output_scale|v_proj\.v_scale)$"), 1),
    (re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.kv_scale$"), None),
)


def _match(name: str) -> tuple[int, int | None] | None:
    for pattern, which in _NAMES:
        m = pattern.search(name)
        if m:
            return int(m.group(1)), which
    return None


def is_kv_scale(name: str) -> bool:
    """Whether a checkpoint tensor is a KV-cache scale (not a model weight)."""
    return _match(name) is not None


def kv_scales_from(tensors: dict[str, torch.Tensor], num_layers: int, num_kv_heads: int,
                   source: str) -> torch.Tensor | None:
    """[layers, 2, kv heads] float32 from the scale tensors among `tensors` (name -> tensor);
    None when there are none. A checkpoint that has some but not every layer's k and v scale
    is refused: a missing scale would silently fall back to 1.0 for that layer."""
    scales = torch.full((num_layers, 2, num_kv_heads), float("nan"))
    found = False
    for name, tensor in tensors.items():
        hit = _match(name)
        if hit is None:
            continue
        layer, which = hit
        if layer >= num_layers:
            raise CheckpointError(f"{source}: KV-cache scale {name!r} is for layer {layer}; the model has "
                                  f"{num_layers} layers")
        values = tensor.detach().float().reshape(-1)
        if values.numel() not in (1, num_kv_heads):
            raise CheckpointError(f"{source}: KV-cache scale {name!r} has {values.numel()} values; expected 1 "
                                  f"(per tensor) or {num_kv_heads} (one per kv head)")
        # The cache write divides by it: zero or NaN would fill the layer's cache with NaN.
        check_scale_values(values, f"{source}: KV-cache scale {name!r}", "a scale is a finite number above 0",
                           lambda s: s > 0, "build without them (--kv-cache-dtype fp8 then takes 1.0), or "
                           "calibrate the checkpoint again")
        for w in (0, 1) if which is None else (which,):
            scales[layer, w] = values.expand(num_kv_heads)
        found = True
    if not found:
        return None
    missing = [(layer, "kv"[w]) for layer in range(num_layers) for w in (0, 1) if torch.isnan(scales[layer, w]).any()]
    if missing:
        layer, kind = missing[0]
        raise CheckpointError(f"{source}: the checkpoint has KV-cache scales but none for layer {layer}'s {kind} "
                              f"({len(missing)} missing in all): re-export it with every layer's k and v scales")
    return scales

