"""The KV cache in e4m3 (`--kv-cache-dtype fp8`): the cache becomes float8_e4m3fn and every op
that writes or reads it gets the scales.

The scales are one float32 weight, `kv_scales` [layers, 2 (k, v), kv heads], which every such
op takes as its `kv_scales` input: what goes into the cache is value / scale rounded to e4m3
(`plugins.fp8.to_e4m3`), what comes out is value * scale. Per-tensor scales are the same for
every head of a layer. Runs after fusion (the fused ops are the ones that read the cache) and
before sharding, which cuts the weight to each rank's kv heads like the cache.
"""
from __future__ import annotations

import torch

from kiln.builder.ir import Graph
from kiln.engines.manifest import KV_FP8
from kiln.plugins import get_plugin
from kiln.plugins.step_inputs import KV_CACHE

KV_SCALES = "kv_scales"


class KVScalesError(ValueError):
    """Scales that do not fit the model's KV cache; the message says which and why."""


def per_head_scales(scales: torch.Tensor | None, num_layers: int, num_kv_heads: int) -> torch.Tensor:
    """[layers, 2, kv heads] float32 from None (1.0 everywhere: no calibration), per-tensor
    scales [layers, 2] or per-head ones [layers, 2, kv heads]; each must be finite and positive."""
    if scales is None:
        return torch.ones(num_layers, 2, num_kv_heads)
    scales = scales.float()
    if scales.dim() == 2:
        scales = scales[:, :, None].expand(-1, -1, num_kv_heads)
    if tuple(scales.shape) != (num_layers, 2, num_kv_heads):
        raise KVScalesError(f"KV cache scales of shape {list(scales.shape)} do not fit a model of {num_layers} "
                            f"layers and {num_kv_heads} kv heads: expected [{num_layers}, 2] (per tensor) or "
                            f"[{num_layers}, 2, {num_kv_heads}] (per head)")
    if not bool(torch.isfinite(scales).all() and (scales > 0).all()):
        raise KVScalesError("KV cache scales must be finite and positive; the checkpoint's include "
                            f"{scales[~(torch.isfinite(scales) & (scales > 0))][0].item()}")
    return scales.contiguous()


def granularity(scales: torch.Tensor) -> str:
    """"tensor" when every head of each layer's k (and v) shares its scale, else "head"."""
    return "tensor" if bool((scales == scales[:, :, :1]).all()) else "head"


def quantize_kv_cache(graph: Graph, scales: torch.Tensor | None = None) -> Graph:
    """The graph with an e4m3 KV cache; `scales` as `per_head_scales` takes them."""
    g = graph.copy()
    kv = g.tensors[KV_CACHE]
    kv.dtype = KV_FP8
    g.add_weight(KV_SCALES, per_head_scales(scales, kv.shape[0], kv.shape[4]))
    for node in g.nodes:
        if KV_CACHE in node.inputs:
            spec = get_plugin(node.op)
            if KV_SCALES not in spec.input_names:
                raise KVScalesError(f"op {node.op!r} in module {node.source!r} uses the KV cache but takes no "
                                    f"{KV_SCALES}: it cannot run with --kv-cache-dtype fp8")
            # Plan inputs are in the plugin's order: the launchers take them by position.
            given = {**node.inputs, KV_SCALES: KV_SCALES}
            node.inputs = {name: given.get(name) for name in spec.input_names}
    return g
