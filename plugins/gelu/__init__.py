"""Plugin `gelu`: GELU activation for MLPs that are not gated, [T, I] -> [T, I]."""
from kiln.plugins.gelu.reference import gelu
from kiln.plugins.registry import PluginSpec, register

SPEC = register(PluginSpec(
    name="gelu", version=1, package=__name__,
    inputs=("x",), attrs={},
    shape=lambda s, a: s["x"],
    dtype="x", reference=gelu,
))
