"""Plugin `silu_mul`: silu(gate) * up, [T, I] x [T, I] -> [T, I]."""
from kiln.plugins.registry import PluginSpec, register
from kiln.plugins.silu_mul.reference import silu_mul

SPEC = register(PluginSpec(
    name="silu_mul", version=1, package=__name__,
    inputs=("gate", "up"), attrs={},
    shape=lambda s, a: s["gate"],
    dtype="gate", reference=silu_mul,
))
