"""Fused plugin `norm_qkv_rope`: RMSNorm + q/k/v projection + (q/k norm) + RoPE + KV write.

[T, H] -> q [T, heads*head_dim]; k and v are written into the paged KV cache.
"""
from kiln.plugins.norm_qkv_rope.reference import norm_qkv_rope
from kiln.plugins.registry import PluginSpec, register

SPEC = register(PluginSpec(
    name="norm_qkv_rope", version=1,
    inputs=("x", "norm_weight?", "w_qkv", "b_qkv?", "q_norm?", "k_norm?", "positions",
            "rope_cache", "kv_cache", "slot_mapping"),
    attrs={"eps": float, "layer": int, "num_heads": int, "num_kv_heads": int, "head_dim": int},
    shape=lambda s, a: (s["x"][0], a["num_heads"] * a["head_dim"]),
    dtype="x", reference=norm_qkv_rope, mutates=("kv_cache",), fused=True,
))
