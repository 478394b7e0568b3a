"""Plugin `rms_norm`: RMSNorm over the hidden dim, [T, H] -> [T, H]."""
from kiln.plugins.registry import PluginSpec, register
from kiln.plugins.rms_norm.reference import rms_norm

SPEC = register(PluginSpec(
    name="rms_norm", version=1, package=__name__,
    inputs=("x", "weight?"), attrs={"eps": float},
    shape=lambda s, a: s["x"],
    dtype="x", reference=rms_norm,
    # What kernels.aot_kernels needs: the row width.
    compile_shapes=lambda s, a, block_size: {"hidden": s["x"][1]},
))
