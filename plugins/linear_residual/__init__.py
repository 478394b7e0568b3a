"""Fused plugin `linear_residual`: projection with the residual add in its epilogue, giving [T, N].
It shards as `linear` does; a row-parallel one adds its bias and the residual once, after the sum.
`weight_scale?` (and `weight_input_scale?`) make it W8A8, as for `linear`. `fp8_handoff` (not among the
spec's attrs: a pass sets it, absent means False) says that x's producer also writes x's e4m3 rows
for this op's static-scale GEMM (`linear.fp8`'s handoff)."""
from kiln.plugins import linear
from kiln.plugins.linear_residual.reference import linear_residual
from kiln.plugins.registry import PluginSpec, register

SPEC = register(PluginSpec(
    name="linear_residual", version=1, package=__name__,
    inputs=("x", "weight", "bias?", "residual", "weight_scale?", "weight_input_scale?"),
    attrs={"parallel": str, "heads": int, "all_reduce": bool},
    shape=lambda s, a: s["residual"],
    dtype="residual", reference=linear_residual, fused=True,
    compile_shapes=linear.compile_shapes, shard=linear.shard, added_once=("bias", "residual"),
))
