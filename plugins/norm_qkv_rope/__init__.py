"""Fused plugin `norm_qkv_rope`: RMSNorm + q/k/v projection + (q/k norm) + RoPE + KV write
(in e4m3, value / scale, when `kv_scales` is given: see plugins/attention/reference.py).

[T, H] -> q [T, heads*head_dim]; k and v are written into the paged KV cache. Under tensor
parallelism each rank keeps whole q heads and the kv heads they use. `w_qkv_scale` (float32
[rows of w_qkv]) makes the projection W8A8 (`plugins.fp8`): w_qkv is float8_e4m3fn and the
normalized rows are quantized per token (or with the static per-tensor `w_qkv_input_scale`,
float32 [1], from calibration); the weight scale splits with w_qkv's rows.
"""
import torch

from kiln.plugins.attention import KV_SCALES, kv_scales_split
from kiln.plugins.norm_qkv_rope.reference import norm_qkv_rope
from kiln.plugins.registry import PluginSpec, register
from kiln.plugins.sharding import Shard, Split, heads, rows


def compile_shapes(shapes: dict, attrs: dict, block_size: int) -> dict:
    """What `kernels.aot_kernels` needs: K, the head layout, the KV cache's block size and which
    optional inputs it reads (kv_scales: the cache is e4m3)."""
    return {"K": shapes["w_qkv"][1], "num_heads": attrs["num_heads"], "num_kv_heads": attrs["num_kv_heads"],
            "head_dim": attrs["head_dim"], "block_size": block_size, "bias": shapes["b_qkv"] is not None,
            "qk_norm": shapes["q_norm"] is not None, "norm_weight": shapes["norm_weight"] is not None,
            "fp8_kv": shapes.get("kv_scales") is not None, "fp8": shapes.get("w_qkv_scale") is not None,
            "fp8_static": shapes.get("w_qkv_input_scale") is not None}


def shard(shapes: dict, attrs: dict, rank: int, world: int, source: str) -> Shard:
    """This rank's q heads and kv heads, cut from each of the q, k and v blocks of w_qkv and b_qkv."""
    hd = attrs["head_dim"]
    q0, qn = heads(attrs["num_heads"], rank, world, "attention heads", replicate=False)
    k0, kn = heads(attrs["num_kv_heads"], rank, world, "kv heads")
    q_rows, kv_rows = attrs["num_heads"] * hd, attrs["num_kv_heads"] * hd

    def take(w: torch.Tensor) -> torch.Tensor:
        q, k, v = w[:q_rows], w[q_rows:q_rows + kv_rows], w[q_rows + kv_rows:]
        return torch.cat([rows(q, q0 * hd, qn * hd), rows(k, k0 * hd, kn * hd), rows(v, k0 * hd, kn * hd)])
    split = Split(f"qkv {rank}/{world}", take)
    return Shard(attrs={"num_heads": qn, "num_kv_heads": kn},
                 weights={"w_qkv": split, "b_qkv": split, "w_qkv_scale": split, "kv_scales": kv_scales_split(k0, kn)})


SPEC = register(PluginSpec(
    name="norm_qkv_rope", version=2, package=__name__,
    inputs=("x", "norm_weight?", "w_qkv", "b_qkv?", "q_norm?", "k_norm?", "positions",
            "rope_cache", "kv_cache", "slot_mapping", KV_SCALES, "w_qkv_scale?",
            "w_qkv_input_scale?"),
    attrs={"eps": float, "layer": int, "num_heads": int, "num_kv_heads": int, "head_dim": int},
    shape=lambda s, a: (s["x"][0], a["num_heads"] * a["head_dim"]),
    dtype="x", reference=norm_qkv_rope, mutates=("kv_cache",), fused=True,
    compile_shapes=compile_shapes, shard=shard,
))
