"""Fused plugin `attention_o_proj`: attention -> o_proj -> + residual, giving [T, H]."""
from kiln.plugins.attention import ATTRS, CACHE_INPUTS
from kiln.plugins.attention_o_proj.reference import attention_o_proj
from kiln.plugins.registry import PluginSpec, register

SPEC = register(PluginSpec(
    name="attention_o_proj", version=1,
    inputs=("q", "k?", "v?") + CACHE_INPUTS + ("w_o", "b_o?", "residual"),
    attrs={**ATTRS, "all_reduce": bool},
    shape=lambda s, a: s["residual"],
    dtype="residual", reference=attention_o_proj, mutates=("kv_cache",), fused=True,
))
