"""Plugin `add`: a + b, same shapes."""
from kiln.plugins.add.reference import add
from kiln.plugins.registry import PluginSpec, register

SPEC = register(PluginSpec(
    name="add", version=1, package=__name__,
    inputs=("a", "b"), attrs={},
    shape=lambda s, a: s["a"],
    dtype="a", reference=add,
    # What kernels.aot_kernels needs: the row width.
    compile_shapes=lambda s, a, block_size: {"width": s["a"][1]},
))
