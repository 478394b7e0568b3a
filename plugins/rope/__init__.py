"""Plugin `rope`: rotary embedding of q or k, [T, heads*head_dim] -> same shape."""
from kiln.plugins.registry import PluginSpec, register
from kiln.plugins.rope.reference import rope

SPEC = register(PluginSpec(
    name="rope", version=1, package=__name__,
    inputs=("x", "positions", "rope_cache"), attrs={"head_dim": int},
    shape=lambda s, a: s["x"],
    dtype="x", reference=rope,
))
