"""Plugin `linear`: [T, K] x [N, K]^T -> [T, N].

Attributes say how it shards: `parallel` is "column" (split output features), "row" (split
input features, then all-reduce) or "none" (replicate); `heads` > 0 says the output features
are that many heads, so a column split keeps heads whole. A row-parallel op's bias is added
once, after the sum.

`all_gather` (the number of ranks) marks the LM head of a tensor-parallel engine: the shard pass
sets it, with "column", on the linear that computes the logits (`builder.passes.shard`), so each
rank computes its slice of the vocabulary and every rank ends with the whole output, gathered
after the GEMM (`reference.all_gather_columns`, which the CUDA executor calls too). Models do not
pass it and single-rank graphs do not carry it, so it is not among the spec's `attrs`; absent
means 0, no gather.

`weight_scale` (float32 [N]) makes it W8A8: the weight is float8_e4m3fn and x is quantized per
token (`plugins.fp8`). It splits with the output features and is whole on every rank of a
row-parallel split, where each rank's rows keep their full-row scale. `weight_input_scale`
(float32 [1], only with `weight_scale`) is a static per-tensor scale for x from a calibration run,
used instead of the per-token one; whole on every rank.
"""
from kiln.plugins.linear.reference import linear
from kiln.plugins.registry import PluginSpec, register
from kiln.plugins.sharding import Shard, heads, input_split, output_split, split_even


def compile_shapes(shapes: dict, attrs: dict, block_size: int) -> dict:
    """What `kernels.aot_kernels` needs: the GEMM's K and N, whether it adds a bias, whether it
    is W8A8 (fp8) and whether its activation scale is static (fp8_static)."""
    return {"K": shapes["weight"][1], "N": shapes["weight"][0], "bias": shapes["bias"] is not None,
            "fp8": shapes.get("weight_scale") is not None, "fp8_static": shapes.get("weight_input_scale") is not None}


def shard(shapes: dict, attrs: dict, rank: int, world: int, source: str) -> Shard:
    """Column parallel: a slice of the output features (whole heads when `heads` is set), and
    of the bias. Row parallel: a slice of the input features, then an all-reduce."""
    out_features, in_features = shapes["weight"]
    if attrs["parallel"] == "column":
        if attrs["heads"]:
            first, count = heads(attrs["heads"], rank, world, f"heads of {source}")
            head_dim = out_features // attrs["heads"]
            start, count = first * head_dim, count * head_dim
        else:
            start, count = split_even(out_features, rank, world, f"output features of {source}")
        split = output_split(start, count)
        return Shard(weights={"weight": split, "bias": split, "weight_scale": split})
    if attrs["parallel"] == "row":
        start, count = split_even(in_features, rank, world, f"input features of {source}")
        return Shard(attrs={"all_reduce": True}, weights={"weight": input_split(start, count)})
    return Shard()


SPEC = register(PluginSpec(
    name="linear", version=1, package=__name__,
    inputs=("x", "weight", "bias?", "weight_scale?", "weight_input_scale?"), attrs={"parallel": str, "heads": int, "all_reduce": bool},
    shape=lambda s, a: (s["x"][0], s["weight"][0] * max(a.get("all_gather", 0), 1)),
    dtype="x", reference=linear,
    compile_shapes=compile_shapes, shard=shard, added_once=("bias",),
))
