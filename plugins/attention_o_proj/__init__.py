"""Fused plugin `attention_o_proj`: attention -> o_proj -> + residual, giving [T, H].
Under tensor parallelism each rank keeps its heads and their columns of w_o (row parallel),
sums its partial result over the ranks, and only rank 0 adds b_o and the residual. `w_o_scale`
(float32 [hidden]) makes the projection W8A8 (`plugins.fp8`); every rank keeps it whole, as it does `w_o_input_scale`
(float32 [1], a static activation scale from calibration)."""
from kiln.plugins import attention
from kiln.plugins.attention_o_proj.reference import attention_o_proj
from kiln.plugins.registry import PluginSpec, register
from kiln.plugins.sharding import Shard, input_split


def compile_shapes(shapes: dict, attrs: dict, block_size: int) -> dict:
    """attention's shapes, plus the o_proj GEMM's output width, whether it adds a bias, whether it is
    W8A8 and with a static scale, and whether the decode kernels hand o_proj its input in e4m3
    (`linear.fp8`'s handoff: a static scale, and a bf16 cache, whose decode is Triton's)."""
    out = {**attention.compile_shapes(shapes, attrs, block_size), "hidden": shapes["w_o"][0],
           "bias": shapes["b_o"] is not None, "fp8": shapes.get("w_o_scale") is not None,
           "fp8_static": shapes.get("w_o_input_scale") is not None}
    return {**out, "handoff": out["fp8"] and out["fp8_static"] and not out["fp8_kv"]}


def shard(shapes: dict, attrs: dict, rank: int, world: int, source: str) -> Shard:
    heads = attention.shard(shapes, attrs, rank, world, source)
    width = heads.attrs["num_heads"] * attrs["head_dim"]
    return Shard(attrs={**heads.attrs, "all_reduce": True},
                 weights={**heads.weights, "w_o": input_split(rank * width, width)})


SPEC = register(PluginSpec(
    name="attention_o_proj", version=3, package=__name__,
    inputs=("q", "k?", "v?") + attention.CACHE_INPUTS + ("w_o", "b_o?", "residual", attention.KV_SCALES, "w_o_scale?", "w_o_input_scale?"),
    attrs={**attention.ATTRS, "all_reduce": bool},
    shape=lambda s, a: s["residual"],
    dtype="residual", reference=attention_o_proj, mutates=("kv_cache",), fused=True,
    compile_shapes=compile_shapes, shard=shard, added_once=("b_o", "residual"),
))
