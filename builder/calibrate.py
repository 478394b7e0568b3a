"""Static activation scales for FP8 engines and scales for an e4m3 KV cache (`build-engine
--calibration-prompts FILE`).

The model's fused plan, before quantization, runs on the CPU through the plugins' PyTorch
references over the user's prompts (one prefill each, in the build dtype), and the input of every
projection is watched (`plugins.linear.reference.observing_gemm_inputs`). The largest magnitude
each op's GEMM multiplied becomes its static per-tensor activation scale (amax / 448, the rule of
`plugins.fp8`), which `passes.quantize` gives the op as its `<weight>_input_scale` input where a
static scale pays (not to the ops that RMSNorm their input: `passes.quantize.PER_TOKEN_OPS`); at run
time a larger value saturates at +-448. The KV cache the prompts wrote gives each layer's k and v
a scale per KV head by the same rule (`Calibration.kv_scales`). Without them an e4m3 cache has
scale 1.0, where values under 2^-6 lose precision: SmolLM2-135M's perplexity rose 1.13% with its
cache in e4m3 at 1.0 and 0.36% at calibrated scales, +-0.34% (tests/test_fp8_kv_accuracy.py).
"""
from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from kiln.builder.gptq import gptq_e4m3
from kiln.builder.ir import Graph
from kiln.builder.passes.quantize import GEMM_WEIGHTS, scale_input
from kiln.dtypes import torch_dtype
from kiln.plugins import get_plugin
from kiln.plugins.fp8 import E4M3_MAX, MIN_SCALE
from kiln.plugins.linear.reference import observing_gemm_inputs
from kiln.plugins.step_inputs import KV_CACHE


class CalibrationError(ValueError):
    """The calibration prompts cannot be used; the message says why and what to do."""


def read_prompts(path: str | Path) -> list[str]:
    """One prompt per line of a UTF-8 text file; blank lines are skipped."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise CalibrationError(f"--calibration-prompts {path}: cannot read it as UTF-8 text ({e})") from None
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise CalibrationError(f"--calibration-prompts {path} holds no prompts: write one prompt per line")
    return prompts


def _step(ids: list[int], block_size: int) -> dict[str, torch.Tensor]:
    """The step inputs of one sequence's whole prompt as a prefill, in blocks 0, 1, ..."""
    n = len(ids)
    blocks = math.ceil(n / block_size)

    def i32(values) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.int32)
    return {"input_ids": i32(ids), "positions": i32(range(n)), "slot_mapping": i32(range(n)),
            "block_tables": i32(range(blocks))[None], "query_lens": i32([n]), "context_lens": i32([n]),
            "logits_indices": i32([n - 1])}


@dataclass(frozen=True)
class Calibration:
    """What the prompts measured: the largest magnitude each op's projection input reached (node output ->
    amax), and the largest the KV cache was written with, per layer, k or v, and KV head; with `gptq`, the
    weights it names rounded to e4m3 over their inputs (weight name -> (e4m3 weight, scale per row))."""

    activations: dict[str, float]
    kv: torch.Tensor   # [layers, 2, kv heads] float32
    rounded: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def kv_scales(self) -> torch.Tensor:
        """An e4m3 cache's scales: each head's largest magnitude maps to 448 (at least MIN_SCALE: a head
        the prompts left at zero)."""
        return (self.kv / E4M3_MAX).clamp(min=MIN_SCALE)


def calibrate(graph: Graph, prompts: list[list[int]], block_size: int, progress: bool = False,
              gptq: Collection[str] = ()) -> Calibration:
    """Run `graph` (its KV cache not yet quantized) over `prompts` and measure what `Calibration` holds,
    rounding the weights named in `gptq` by GPTQ (`builder.gptq`) over the inputs their projections get.
    The ops run one at a time over every prompt, so that a weight's inputs are all seen (and their
    [K, K] statistic freed) before the next op runs; a prompt's tensors are dropped after their last use.
    With `gptq`, an op whose weight was just rounded runs again in W8A8 with it, and what comes after is
    measured on that: SmolLM2-135M's FP8 perplexity rose 1.45% over bf16 so, 1.86% with every weight
    rounded over the unquantized model's inputs (tests/fp8_accuracy_check.py)."""
    layers, two, _, _, kv_heads, head_dim = graph.tensors[KV_CACHE].shape
    kv_dtype = torch_dtype(graph.tensors[KV_CACHE].dtype)
    envs = [{**_step(ids, block_size),
             KV_CACHE: torch.zeros(layers, two, math.ceil(len(ids) / block_size), block_size, kv_heads, head_dim,
                                   dtype=kv_dtype)} for ids in prompts]
    last_use = {name: i for i, node in enumerate(graph.nodes) for name in node.inputs.values() if name}
    keep = {KV_CACHE, *graph.outputs}
    gemm_users = {}   # weight to round -> the index of the last op that multiplies by it
    for i, node in enumerate(graph.nodes):
        weight = node.inputs.get(GEMM_WEIGHTS.get(node.op, ""))
        if weight in gptq:
            gemm_users[weight] = i
    amax: dict[str, float] = {}
    hessians: dict[str, torch.Tensor] = {}
    rounded: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for i, node in enumerate(tqdm(graph.nodes, desc="calibrate", unit="op", disable=not progress)):
        spec = get_plugin(node.op)
        weight = node.inputs.get(GEMM_WEIGHTS.get(node.op, ""))
        seen: list[float] = []

        def observe(x: torch.Tensor) -> None:
            seen.append(x.detach().abs().amax().float().item())
            if weight in gemm_users:
                x = x.detach().float().reshape(-1, x.shape[-1])
                hessians[weight] = hessians.get(weight, 0) + x.t() @ x

        def run(env: dict[str, torch.Tensor], given: dict[str, torch.Tensor]) -> torch.Tensor:
            args = [given[name] if name in given else graph.weights.get(t, env.get(t)) if t else None
                    for name, t in ((name, node.inputs.get(name)) for name in spec.input_names)]
            return spec.call_reference(args, node.attrs)

        with observing_gemm_inputs(observe):
            outputs = [run(env, {}) for env in envs]
        if seen:
            amax[node.output] = max(seen)
        if gemm_users.get(weight) == i:
            rounded[weight] = gptq_e4m3(graph.weights[weight], hessians.pop(weight))
            # GPTQ in sequence: the ops after this one see its output as the FP8 engine computes it (the weight
            # rounded, the input quantized per token), and round their weights for that.
            given = dict(zip((GEMM_WEIGHTS[node.op], scale_input(node.op)), rounded[weight]))
            outputs = [run(env, given) for env in envs]
        for env, out in zip(envs, outputs):
            env[node.output] = out
            for name in node.inputs.values():
                if name and last_use[name] == i and name not in keep:
                    env.pop(name, None)
    # Slots past a prompt stay zero, which no maximum notices.
    kv_amax = torch.zeros(layers, two, kv_heads)
    for env in envs:
        kv_amax = torch.maximum(kv_amax, env[KV_CACHE].float().abs().amax(dim=(2, 3, 5)))
    return Calibration(amax, kv_amax, rounded)
