"""Fused plugin `linear_residual`: projection with the residual add in its epilogue, giving [T, N]."""
from kiln.plugins.linear_residual.reference import linear_residual
from kiln.plugins.registry import PluginSpec, register

SPEC = register(PluginSpec(
    name="linear_residual", version=1,
    inputs=("x", "weight", "bias?", "residual"),
    attrs={"parallel": str, "heads": int, "all_reduce": bool},
    shape=lambda s, a: s["residual"],
    dtype="residual", reference=linear_residual, fused=True,
))
