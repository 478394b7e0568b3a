"""Static activation scales for FP8 engines (`build-engine --calibration-prompts FILE`).

The model's fused plan, before quantization, runs on the CPU through the plugins' PyTorch
references over the user's prompts (one prefill each, in the build dtype), and the input of every
projection is watched (`plugins.linear.reference.observing_gemm_inputs`). The largest magnitude
each op's GEMM multiplied becomes its static per-tensor activation scale (amax / 448, the rule of
`plugins.fp8`), which `passes.quantize` gives the op as its `<weight>_input_scale` input; at run
time a larger value saturates at +-448.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
from tqdm import tqdm

from kiln.builder.ir import Graph
from kiln.dtypes import torch_dtype
from kiln.plugins import get_plugin
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


def calibrate(graph: Graph, prompts: list[list[int]], block_size: int, progress: bool = False) -> dict[str, float]:
    """{node output: the largest magnitude its projection's input reached} over `prompts`."""
    layers, two, _, _, kv_heads, head_dim = graph.tensors[KV_CACHE].shape
    kv_dtype = torch_dtype(graph.tensors[KV_CACHE].dtype)
    amax: dict[str, float] = {}
    for ids in tqdm(prompts, desc="calibrate", unit="prompt", disable=not progress):
        kv = torch.zeros(layers, two, math.ceil(len(ids) / block_size), block_size, kv_heads, head_dim, dtype=kv_dtype)
        env = {**graph.weights, **_step(ids, block_size), KV_CACHE: kv}
        for node in graph.nodes:
            spec = get_plugin(node.op)
            args = [env[t] if t else None for t in (node.inputs.get(name) for name in spec.input_names)]
            seen: list[float] = []
            with observing_gemm_inputs(lambda x: seen.append(x.detach().abs().amax().float().item())):
                env[node.output] = spec.call_reference(args, node.attrs)
            if seen:
                amax[node.output] = max(amax.get(node.output, 0.0), *seen)
    return amax
