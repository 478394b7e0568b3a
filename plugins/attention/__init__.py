"""Plugin `attention`: causal paged attention of q [T, heads*head_dim] over the KV cache.
Under tensor parallelism each rank attends with its own q heads and the kv heads they use.
`kv_scales` [layers, 2, kv_heads] (float32) is given when the cache is e4m3 (see reference)."""
from kiln.plugins.attention.reference import attention
from kiln.plugins.registry import PluginSpec, register
from kiln.plugins.sharding import Shard, Split, heads

ATTRS = {"layer": int, "num_heads": int, "num_kv_heads": int, "head_dim": int,
         "scale": float, "window": int}
CACHE_INPUTS = ("kv_cache", "slot_mapping", "block_tables", "query_lens", "context_lens")
# Last among an op's inputs, and after its attrs in the reference, so models that pass the
# attrs by position never see it (only the builder's kv_cache pass adds it).
KV_SCALES = "kv_scales?"


def compile_shapes(shapes: dict, attrs: dict, block_size: int) -> dict:
    """What `kernels.aot_kernels` needs: the head layout, the KV cache's block size and whether
    the cache is e4m3 (it has scales)."""
    return {"heads": attrs["num_heads"], "kv_heads": attrs["num_kv_heads"], "head_dim": attrs["head_dim"],
            "block_size": block_size, "fp8_kv": shapes.get("kv_scales") is not None}


def shard(shapes: dict, attrs: dict, rank: int, world: int, source: str) -> Shard:
    """This rank's head counts (q follows the column-parallel projection before it)."""
    _, qn = heads(attrs["num_heads"], rank, world, "attention heads", replicate=False)
    k0, kn = heads(attrs["num_kv_heads"], rank, world, "kv heads")
    return Shard(attrs={"num_heads": qn, "num_kv_heads": kn}, weights={"kv_scales": kv_scales_split(k0, kn)})


def kv_scales_split(first: int, count: int) -> Split:
    """This rank's kv heads of the [layers, 2, kv_heads] scales, like its part of the cache."""
    return Split(f"kv heads {first}+{count}", lambda w: w[:, :, first:first + count].contiguous())


SPEC = register(PluginSpec(
    name="attention", version=3, package=__name__,
    inputs=("q", "k?", "v?") + CACHE_INPUTS + (KV_SCALES,), attrs=ATTRS,
    shape=lambda s, a: s["q"],
    dtype="q", reference=attention, mutates=("kv_cache",),
    compile_shapes=compile_shapes, shard=shard,
))
