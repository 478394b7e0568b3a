"""Fused plugin `norm_swiglu`: RMSNorm + gate/up projection + gated activation, [T, H] -> [T, I].
`activation` picks the gate's: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma). Under tensor parallelism each rank keeps an equal slice of the intermediate features, of both
the gate and the up half of w_gu. `w_gu_scale` (float32 [2I], in w_gu's row order) makes the
projection W8A8 (`plugins.fp8`); it splits and interleaves with w_gu's rows. `w_gu_input_scale`
(float32 [1]) is a static per-tensor activation scale from calibration. `out_scale` (float32 [1]) is
the static activation scale of the FP8 GEMM that reads the output (the down projection's, with its
attr fp8_handoff): the GPU kernels then also write the output quantized for it (`linear.fp8`'s
handoff). The output itself does not change."""
import torch

from kiln.plugins.norm_swiglu.reference import norm_swiglu
from kiln.plugins.registry import PluginSpec, register
from kiln.plugins.sharding import Shard, Split, rows, split_even


def compile_shapes(shapes: dict, attrs: dict, block_size: int) -> dict:
    """What `kernels.aot_kernels` needs: K, I, the gate/up interleave block, the norm weight and
    the activation."""
    return {"K": shapes["w_gu"][1], "I": shapes["w_gu"][0] // 2, "block": attrs["block"],
            "norm_weight": shapes["norm_weight"] is not None, "activation": attrs["activation"],
            "fp8": shapes.get("w_gu_scale") is not None, "fp8_static": shapes.get("w_gu_input_scale") is not None,
            "out_scale": shapes.get("out_scale") is not None}


def shard(shapes: dict, attrs: dict, rank: int, world: int, source: str) -> Shard:
    inter = shapes["w_gu"][0] // 2
    start, count = split_even(inter, rank, world, "MLP intermediate size")

    def take(w: torch.Tensor) -> torch.Tensor:
        return torch.cat([rows(w, start, count), rows(w, inter + start, count)])
    split = Split(f"gate_up {start}+{count}", take)
    return Shard(weights={"w_gu": split, "w_gu_scale": split})


SPEC = register(PluginSpec(
    name="norm_swiglu", version=3, package=__name__,
    inputs=("x", "norm_weight?", "w_gu", "w_gu_scale?", "w_gu_input_scale?", "out_scale?"), attrs={"eps": float, "block": int, "activation": str},
    shape=lambda s, a: (s["x"][0], s["w_gu"][0] // 2),
    dtype="x", reference=norm_swiglu, fused=True,
    compile_shapes=compile_shapes, shard=shard,
))
