"""Plugin `take_rows`: [T, H] and row indices [L] -> [L, H] (last token of each sequence)."""
from kiln.plugins.registry import PluginSpec, register
from kiln.plugins.take_rows.reference import take_rows

SPEC = register(PluginSpec(
    name="take_rows", version=1, package=__name__,
    inputs=("x", "indices"), attrs={},
    shape=lambda s, a: (s["indices"][0], s["x"][1]),
    dtype="x", reference=take_rows,
    # What kernels.aot_kernels needs: the row width.
    compile_shapes=lambda s, a, block_size: {"hidden": s["x"][1]},
))
