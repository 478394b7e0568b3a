"""Plugin `add`: a + b, same shapes."""
from kiln.plugins.add.reference import add
from kiln.plugins.registry import PluginSpec, register

SPEC = register(PluginSpec(
    name="add", version=1, package=__name__,
    inputs=("a", "b"), attrs={},
    shape=lambda s, a: s["a"],
    dtype="a", reference=add,
))
