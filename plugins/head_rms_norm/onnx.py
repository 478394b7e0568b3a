"""`head_rms_norm` in ONNX: [T, heads*head_dim] viewed as [T, heads, head_dim], RMSNormalization
of each head, viewed back."""
from kiln.plugins.onnx_function import OnnxFunction, ints, shape


def head_rms_norm(p: str, x: str, weight: str, out: str) -> list[str]:
    """out = RMSNorm of each `@head_dim` slice of x, times weight (cast to x's type: the output
    takes the scale's, and norm weights are float32 in every engine), with the op's `@eps`."""
    return shape(f"{p}heads", [0, -1, "@head_dim"]) + [
        f"{p}split = Reshape({x}, {p}heads)",
        f"{p}scale = CastLike({weight}, {x})",
        f"{p}normed = RMSNormalization <axis: int = -1, epsilon: float = @eps, stash_type: int = 1> "
        f"({p}split, {p}scale)",
        ints(f"{p}flat", [0, -1]),
        f"{out} = Reshape({p}normed, {p}flat)",
    ]


def function(inputs: dict, attrs: dict) -> OnnxFunction:
    return OnnxFunction("head_rms_norm", "", ("x", "weight"), ("y",), ("eps", "head_dim"),
                        tuple(head_rms_norm("", "x", "weight", "y")))
