"""Plugin `attention`: causal paged attention of q [T, heads*head_dim] over the KV cache.
Under tensor parallelism each rank attends with its own q heads and the kv heads they use."""
from kiln.plugins.attention.reference import attention
from kiln.plugins.registry import PluginSpec, register
from kiln.plugins.sharding import Shard, heads

ATTRS = {"layer": int, "num_heads": int, "num_kv_heads": int, "head_dim": int,
         "scale": float, "window": int}
CACHE_INPUTS = ("kv_cache", "slot_mapping", "block_tables", "query_lens", "context_lens")


def compile_shapes(shapes: dict, attrs: dict, block_size: int) -> dict:
    """What `kernels.aot_kernels` needs: the head layout and the KV cache's block size."""
    return {"heads": attrs["num_heads"], "kv_heads": attrs["num_kv_heads"], "head_dim": attrs["head_dim"],
            "block_size": block_size}


def shard(shapes: dict, attrs: dict, rank: int, world: int, source: str) -> Shard:
    """This rank's head counts (q follows the column-parallel projection before it)."""
    _, qn = heads(attrs["num_heads"], rank, world, "attention heads", replicate=False)
    _, kn = heads(attrs["num_kv_heads"], rank, world, "kv heads")
    return Shard(attrs={"num_heads": qn, "num_kv_heads": kn})


SPEC = register(PluginSpec(
    name="attention", version=1, package=__name__,
    inputs=("q", "k?", "v?") + CACHE_INPUTS, attrs=ATTRS,
    shape=lambda s, a: s["q"],
    dtype="q", reference=attention, mutates=("kv_cache",),
    compile_shapes=compile_shapes, shard=shard,
))
