"""Plugin `attention`: causal paged attention of q [T, heads*head_dim] over the KV cache."""
from kiln.plugins.attention.reference import attention
from kiln.plugins.registry import PluginSpec, register

ATTRS = {"layer": int, "num_heads": int, "num_kv_heads": int, "head_dim": int,
         "scale": float, "window": int}
CACHE_INPUTS = ("kv_cache", "slot_mapping", "block_tables", "query_lens", "context_lens")

SPEC = register(PluginSpec(
    name="attention", version=1,
    inputs=("q", "k?", "v?") + CACHE_INPUTS, attrs=ATTRS,
    shape=lambda s, a: s["q"],
    dtype="q", reference=attention, mutates=("kv_cache",),
))
