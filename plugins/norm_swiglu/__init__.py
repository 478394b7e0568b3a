"""Fused plugin `norm_swiglu`: RMSNorm + gate/up projection + SwiGLU, [T, H] -> [T, I]."""
from kiln.plugins.norm_swiglu.reference import norm_swiglu
from kiln.plugins.registry import PluginSpec, register

SPEC = register(PluginSpec(
    name="norm_swiglu", version=1,
    inputs=("x", "norm_weight?", "w_gu"), attrs={"eps": float, "block": int},
    shape=lambda s, a: (s["x"][0], s["w_gu"][0] // 2),
    dtype="x", reference=norm_swiglu, fused=True,
))
