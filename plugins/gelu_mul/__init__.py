"""Plugin `gelu_mul`: gelu_tanh(gate) * up (GeGLU, Gemma's MLP), [T, I] x [T, I] -> [T, I].

Like `silu_mul` it has no kernel of its own: on GPUs it runs inside `norm_swiglu` (activation
"gelu_tanh"), which the fusion pass makes of it."""
from kiln.plugins.gelu_mul.reference import gelu_mul
from kiln.plugins.registry import PluginSpec, register

SPEC = register(PluginSpec(
    name="gelu_mul", version=1, package=__name__,
    inputs=("gate", "up"), attrs={},
    shape=lambda s, a: s["gate"],
    dtype="gate", reference=gelu_mul,
))
