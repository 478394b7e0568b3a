"""Plugin `softcap`: logit soft-capping, y = cap * tanh(x / cap), [R, N] -> [R, N] (Gemma's
`final_logit_softcapping`, applied to the logits)."""
from kiln.plugins.registry import PluginSpec, register
from kiln.plugins.softcap.reference import softcap

SPEC = register(PluginSpec(
    name="softcap", version=1, package=__name__,
    inputs=("x",), attrs={"cap": float},
    shape=lambda s, a: s["x"],
    dtype="x", reference=softcap,
    # What kernels.aot_kernels needs: the row width.
    compile_shapes=lambda s, a, block_size: {"width": s["x"][1]},
))
