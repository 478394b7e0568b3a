"""FP8 weight quantization (`--quantization fp8`): each GEMM weight of the decoder layers (and the
LM head's, with `--quantize-lm-head`) becomes float8_e4m3fn [N, K] with one float32 scale per
output feature (`plugins.fp8.quantize_rows`), given to its op as the `<weight>_scale` input. The
plugins then run the GEMM as W8A8: their input quantized per token, products summed in float32.

Runs on the fused graph of the whole model, before sharding and folding. A per-output-feature
scale is unchanged by what comes after: concatenating, interleaving or splitting rows moves
whole rows with their scales, and a row-parallel split keeps each row's full-row scale on every
rank. Folding a norm weight into an FP8 weight would need a second rounding, so the fold pass
leaves the norm weight of an FP8 projection to the norm. A weight that is already float8 (a
pre-quantized checkpoint, `models.fp8_checkpoint`) keeps its own scale, so both ways to an FP8
engine give the same bytes. A weight that calibration rounded by GPTQ (`--gptq`, `builder/gptq.py`) is
taken as it was rounded. With a calibration run's figures (`builder/calibrate.py`, `--activation-scales
static`) the FP8 ops
whose input another kernel writes (o_proj, the down projection, any plain projection) also get a
static activation scale, `<weight>_input_scale` (float32 [1]): that kernel then writes their input in
e4m3 as it stores it (`hand_off_fp8`), one launch fewer each. The ops that RMSNorm their input
(PER_TOKEN_OPS) keep per-token scales: their norm reads the whole row anyway, so the row's own scale
costs no launch (static scales there gave Gemma 3 270M on the CPU a perplexity 1.024x the bf16
engine's, against 1.013x on o_proj and down alone, over one 110-token paragraph, session 42: a gap within
what chance moved that measurement by, `tests/fp8_accuracy_check.py`).
A checkpoint's own input scales are kept wherever it gives them.
"""
from __future__ import annotations

import torch

from kiln.builder.ir import Graph, Node, in_spec_order, layer_of
from kiln.plugins.fp8 import E4M3_MAX, FP8, MIN_SCALE, quantize_rows

# The FP8 ops that quantize their input as they RMSNorm it: per-token scales there, even when calibrated.
PER_TOKEN_OPS = ("norm_qkv_rope", "norm_swiglu")
# op -> its GEMM weight input; the scale input is that name + "_scale"
GEMM_WEIGHTS = {"linear": "weight", "linear_residual": "weight", "norm_qkv_rope": "w_qkv",
                "attention_o_proj": "w_o", "norm_swiglu": "w_gu"}


def scale_input(op: str) -> str | None:
    """The name of an op's FP8 weight-scale input; None for an op without a GEMM weight."""
    weight = GEMM_WEIGHTS.get(op)
    return f"{weight}_scale" if weight else None


def input_scale_name(weight: str) -> str:
    """The static activation scale's tensor name beside its weight's, as checkpoints name it:
    "...o_proj.weight" -> "...o_proj.input_scale"."""
    return f"{weight.removesuffix('.weight')}.input_scale" if weight.endswith(".weight") else f"{weight}.input_scale"


def is_fp8(graph: Graph) -> bool:
    """Whether any op of the graph runs its GEMM in FP8."""
    return any(node.inputs.get(scale_input(node.op) or "") for node in graph.nodes)


def has_static_scales(graph: Graph) -> bool:
    """Whether any FP8 op of the graph has a static activation scale (`<weight>_input_scale`)."""
    return any(node.inputs.get(f"{key}_input_scale") for node in graph.nodes
               if (key := GEMM_WEIGHTS.get(node.op)) is not None)


def weights_to_quantize(graph: Graph, lm_head: bool = False) -> set[str]:
    """The GEMM weights `quantize_fp8` rounds to e4m3: the decoder layers' (and the LM head's when
    `lm_head`) that are not FP8 already."""
    names = set()
    for node in graph.nodes:
        key = GEMM_WEIGHTS.get(node.op)
        if key is None or node.inputs.get(f"{key}_scale") is not None:
            continue
        if lm_head or layer_of(node.source) is not None:
            names.add(node.inputs[key])
    return names


def quantize_fp8(graph: Graph, lm_head: bool = False, input_amax: dict[str, float] | None = None,
                 rounded: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None) -> Graph:
    """Quantize the decoder layers' GEMM weights (and the LM head's when `lm_head`): each to its nearest
    e4m3 values, or as `rounded` gives it (weight name -> (e4m3 weight, scale per row), from GPTQ). With
    `input_amax` (node output -> the largest magnitude its GEMM input reached, from
    `builder.calibrate`), every FP8 op without an activation scale gets a static one, but for
    PER_TOKEN_OPS (see the module docstring)."""
    g = graph.copy()
    targets = weights_to_quantize(g, lm_head)
    done: dict[str, tuple[str, str]] = {}  # weight -> (quantized weight, its scale)
    for node in g.nodes:
        key = GEMM_WEIGHTS.get(node.op)
        if key is None:
            continue
        if node.inputs[key] in targets:
            _quantize_weight(g, node, key, done, rounded or {})
        if node.inputs.get(f"{key}_scale") is None:
            continue
        if (input_amax and node.output in input_amax and node.op not in PER_TOKEN_OPS
                and node.inputs.get(f"{key}_input_scale") is None):
            scale = torch.tensor([max(input_amax[node.output] / E4M3_MAX, MIN_SCALE)], dtype=torch.float32)
            node.inputs[f"{key}_input_scale"] = g.add_weight(input_scale_name(node.inputs[key]), scale)
        node.inputs = in_spec_order(node.op, node.inputs)
    g.prune()
    return g


def hand_off_fp8(graph: Graph) -> Graph:
    """Where a static-scale FP8 down projection (linear_residual) reads an FP8 norm_swiglu's output and
    nothing else does, norm_swiglu gets its scale (`out_scale`) and writes the output in e4m3 for it
    too, and the projection (attr fp8_handoff) reads that instead of quantizing x in a pre-pass of its
    own (`plugins.linear.fp8`'s handoff): one launch fewer a layer at decode batch sizes."""
    g = graph.copy()
    for node in g.nodes:
        static = node.inputs.get("weight_input_scale")
        if node.op != "linear_residual" or static is None:
            continue
        producer = g.producer(node.inputs["x"])
        if producer is None or producer.op != "norm_swiglu" or producer.inputs.get("w_gu_scale") is None:
            continue
        if g.only_user(node.inputs["x"]) is not node:
            continue
        producer.inputs = in_spec_order(producer.op, {**producer.inputs, "out_scale": static})
        node.attrs["fp8_handoff"] = True
    return g


def _quantize_weight(g: Graph, node: Node, key: str, done: dict[str, tuple[str, str]],
                     rounded: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Give `node` the e4m3 form of its weight input `key` and the scales, made once per weight (taken from
    `rounded` where it has the weight)."""
    name = node.inputs[key]
    if g.weights[name].dtype == FP8:
        raise ValueError(f"{node.source}: weight {name} is float8 without a scale: the checkpoint lost its "
                         "weight_scale")
    if name not in done:
        wq, scale = rounded[name] if name in rounded else quantize_rows(g.weights[name])
        # A weight that another op reads as it is (a tied embedding) keeps its name for it.
        shared = any(n.op not in GEMM_WEIGHTS for n in g.users(name))
        qname = f"{name}.fp8" if shared else name
        done[name] = (g.add_weight(qname, wq), g.add_weight(f"{qname}_scale", scale))
    node.inputs[key], node.inputs[f"{key}_scale"] = done[name]
