"""Plugin `linear`: [T, K] x [N, K]^T -> [T, N].

Attributes tell the sharding pass how to split it: `parallel` is "column" (split output
features), "row" (split input features, then all-reduce) or "none" (replicate); `heads` > 0
says the output features are that many heads, so a column split keeps heads whole.
"""
from kiln.plugins.linear.reference import linear
from kiln.plugins.registry import PluginSpec, register

SPEC = register(PluginSpec(
    name="linear", version=1,
    inputs=("x", "weight", "bias?"), attrs={"parallel": str, "heads": int, "all_reduce": bool},
    shape=lambda s, a: (s["x"][0], s["weight"][0]),
    dtype="x", reference=linear,
))
