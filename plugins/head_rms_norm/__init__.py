"""Plugin `head_rms_norm`: per-head RMSNorm, [T, heads*head_dim] -> same shape."""
from kiln.plugins.head_rms_norm.reference import head_rms_norm
from kiln.plugins.registry import PluginSpec, register

SPEC = register(PluginSpec(
    name="head_rms_norm", version=1, package=__name__,
    inputs=("x", "weight"), attrs={"eps": float, "head_dim": int},
    shape=lambda s, a: s["x"],
    dtype="x", reference=head_rms_norm,
))
