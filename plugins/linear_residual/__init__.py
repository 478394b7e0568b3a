"""Fused plugin `linear_residual`: projection with the residual add in its epilogue, giving [T, N].
It shards as `linear` does; a row-parallel one adds its bias and the residual once, after the sum.
`weight_scale?` (and `weight_input_scale?`) make it W8A8, as for `linear`. `fp8_handoff` (not among the
spec's attrs: a pass sets it, absent means False) says that x's producer also writes x's e4m3 rows
for this op's static-scale GEMM (`linear.fp8`'s handoff); it is a compile shape too, as the one-row GEMV
reads x staged by the producer's GEMV instead of staging it (`linear.gemv.one_row_handoff`)."""
from kiln.plugins import linear
from kiln.plugins.linear_residual.reference import linear_residual
from kiln.plugins.registry import PluginSpec, register


def compile_shapes(shapes: dict, attrs: dict, block_size: int) -> dict:
    """`linear`'s, and "fp8_handoff" where the op has that attr."""
    out = linear.compile_shapes(shapes, attrs, block_size)
    return {**out, "fp8_handoff": True} if attrs.get("fp8_handoff") else out


SPEC = register(PluginSpec(
    name="linear_residual", version=1, package=__name__,
    inputs=("x", "weight", "bias?", "residual", "weight_scale?", "weight_input_scale?"),
    attrs={"parallel": str, "heads": int, "all_reduce": bool},
    shape=lambda s, a: s["residual"],
    dtype="residual", reference=linear_residual, fused=True,
    compile_shapes=compile_shapes, shard=linear.shard, added_once=("bias", "residual"),
))
