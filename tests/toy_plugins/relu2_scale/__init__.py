"""Toy plugin `relu2_scale` (tests only): relu(x)^2 times a per-feature scale, [T, I] -> [T, I].

It lives outside Kiln, to show that an op is its folder and its registration: importing this
package registers it, and the builder and runtime learn everything else from its spec. The
`parallel` attribute says whether x's features are split over the ranks (a column-parallel
projection before it), so the scale must be split alike. It has no GPU kernels.
"""
from kiln.plugins.registry import PluginSpec, register
from kiln.plugins.sharding import Shard, output_split, split_even
from toy_plugins.relu2_scale.reference import relu2_scale


def shard(shapes: dict, attrs: dict, rank: int, world: int, source: str) -> Shard:
    if attrs["parallel"] != "column":
        return Shard()
    start, count = split_even(shapes["scale"][0], rank, world, f"features of {source}")
    return Shard(weights={"scale": output_split(start, count)})


SPEC = register(PluginSpec(
    name="relu2_scale", version=1, package=__name__,
    inputs=("x", "scale"), attrs={"parallel": str},
    shape=lambda s, a: s["x"],
    dtype="x", reference=relu2_scale, shard=shard,
))
