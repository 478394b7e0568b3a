"""What every plugin's `onnx.py` shares: the `OnnxFunction` it returns and the text helpers
its body is written with.

A plugin's `onnx.py` defines its op in standard ONNX ops, in the dense prefill form (one or
more prompts, each attending to itself under a causal mask; no paged KV cache):

    function(inputs, attrs) -> OnnxFunction

`inputs` are the plan node's inputs by name (None for an absent optional one) and `attrs` its
attributes; the function is the variant for the inputs present and any attribute that
changes the body's structure (its `overload`). Its body is ONNX's text syntax over formal
names: a Kiln input's own name binds to the node's tensor; `cache_k` and `cache_v` stand for
the layer's keys and values, which the paged cache holds at run time: an op that writes the
cache lists them among its outputs, and one that reads it among its inputs, and the exporter
connects the two. Attributes are the op's own, referenced as `@name`. The exporter keeps a
fused op as one node of the `kiln` domain calling this function and inlines a primitive op's
body into standard ops. `kiln.all_reduce` (the sum over tensor-parallel ranks) and
`kiln.all_gather` (the ranks' column slices side by side: the LM head's logits) are the `kiln`
ops with no function: ONNX has no collective.

The helpers below write lines that bodies repeat. The ops' own pieces (`rms_norm`, `rope`,
`linear`, `attention`, ... in their `onnx.py`) take a prefix for the names they define, so a
fused op's body combines them as its reference combines theirs; a body assigns each name once
and never a formal input's.
"""
from __future__ import annotations

from dataclasses import dataclass

DOMAIN = "kiln"
OPSET = 24  # the standard ops' version: RMSNormalization, RotaryEmbedding, Attention and Swish
DOMAIN_VERSION = 1
ALL_REDUCE = "all_reduce"
ALL_GATHER = "all_gather"
CACHE_K, CACHE_V = "cache_k", "cache_v"


@dataclass(frozen=True)
class OnnxFunction:
    """One variant of an op's ONNX definition. `inputs` and `outputs` are formal names (the
    first output is the op's own); `attrs` the op attributes the node carries."""

    name: str
    overload: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: tuple[str, ...]
    body: tuple[str, ...]

    def text(self) -> str:
        """The function in ONNX's text syntax (`onnx.parser.parse_function` reads it)."""
        head = (f'<domain: "{DOMAIN}", opset_import: ["" : {OPSET}, "{DOMAIN}" : {DOMAIN_VERSION}], '
                f'overload: "{self.overload}">')
        attrs = f" <{', '.join(self.attrs)}>" if self.attrs else ""
        lines = "\n".join(f"  {line}" for line in self.body)
        return (f"{head}\n{self.name}{attrs} ({', '.join(self.inputs)}) => ({', '.join(self.outputs)})\n"
                f"{{\n{lines}\n}}")


def variant(*features: tuple[str, bool]) -> str:
    """An overload name from the features a variant has: "bias+all_reduce", or "" for none."""
    return "+".join(name for name, present in features if present)


def ints(out: str, values: list[int]) -> str:
    """A constant 1-D int64 tensor."""
    return f"{out} = Constant <value_ints: ints = [{', '.join(str(v) for v in values)}]> ()"


def shape(out: str, dims: list[int | str]) -> list[str]:
    """A 1-D int64 shape whose entries are ints or `@attr` references to int attributes."""
    lines, parts = [], []
    for i, d in enumerate(dims):
        part = f"{out}_{i}"
        if isinstance(d, str):
            lines += [f"{part}_s = Constant <value_int: int = {d}> ()", ints(f"{part}_ax", [0]),
                      f"{part} = Unsqueeze({part}_s, {part}_ax)"]
        else:
            lines.append(ints(part, [d]))
        parts.append(part)
    return lines + [f"{out} = Concat <axis: int = 0> ({', '.join(parts)})"]


def all_reduce(x: str, out: str) -> str:
    """out = the sum of x over the tensor-parallel ranks."""
    return f"{out} = {DOMAIN}.{ALL_REDUCE}({x})"


def all_gather(x: str, out: str) -> str:
    """out = every tensor-parallel rank's x [rows, N], side by side: [rows, ranks * N]."""
    return f"{out} = {DOMAIN}.{ALL_GATHER}({x})"
