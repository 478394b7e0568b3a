"""`rope` in ONNX: RotaryEmbedding (rotate-half) of each head, with cos and sin from the two
halves of the op's table and the tokens' positions."""
from kiln.plugins.onnx_function import OnnxFunction, ints, shape


def rope(p: str, x: str, positions: str, rope_cache: str, out: str) -> list[str]:
    """out = x [T, heads*@head_dim] rotated by position; RotaryEmbedding wants
    [batch, heads, T, head_dim], so the tokens become one batch row."""
    return shape(f"{p}heads", [0, -1, "@head_dim"]) + [
        ints(f"{p}ax0", [0]),
        f"{p}cos, {p}sin = Split <axis: int = 1, num_outputs: int = 2> ({rope_cache})",
        f"{p}cos_x = CastLike({p}cos, {x})",
        f"{p}sin_x = CastLike({p}sin, {x})",
        f"{p}pos = Cast <to: int = 7> ({positions})",
        f"{p}pos_b = Unsqueeze({p}pos, {p}ax0)",
        f"{p}split = Reshape({x}, {p}heads)",
        f"{p}batch = Unsqueeze({p}split, {p}ax0)",
        f"{p}bhtd = Transpose <perm: ints = [0, 2, 1, 3]> ({p}batch)",
        f"{p}rotated = RotaryEmbedding <interleaved: int = 0> ({p}bhtd, {p}cos_x, {p}sin_x, {p}pos_b)",
        f"{p}bthd = Transpose <perm: ints = [0, 2, 1, 3]> ({p}rotated)",
        f"{p}thd = Squeeze({p}bthd, {p}ax0)",
        ints(f"{p}flat", [0, -1]),
        f"{out} = Reshape({p}thd, {p}flat)",
    ]


def function(inputs: dict, attrs: dict) -> OnnxFunction:
    return OnnxFunction("rope", "", ("x", "positions", "rope_cache"), ("y",), ("head_dim",),
                        tuple(rope("", "x", "positions", "rope_cache", "y")))
