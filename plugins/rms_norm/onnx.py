"""`rms_norm` in ONNX: RMSNormalization over the last dim (float32 inside, as the reference);
a folded norm (no weight) scales by 1."""
from kiln.plugins.onnx_function import OnnxFunction, variant


def rms_norm(p: str, x: str, weight: str | None, out: str) -> list[str]:
    """out = RMSNorm(x) (* weight), with the op's `@eps`. The scale is cast to x's type (the
    output takes the scale's, and norm weights are float32 in every engine)."""
    lines = [f"{p}scale = CastLike({weight}, {x})"] if weight else [
        f"{p}one = Constant <value_float: float = 1.0> ()", f"{p}scale = CastLike({p}one, {x})"]
    scale = f"{p}scale"
    return lines + [f"{out} = RMSNormalization <axis: int = -1, epsilon: float = @eps, stash_type: int = 1> "
                    f"({x}, {scale})"]


def function(inputs: dict, attrs: dict) -> OnnxFunction:
    weight = inputs["weight"] is not None
    return OnnxFunction("rms_norm", variant(("weight", weight)), ("x",) + (("weight",) if weight else ()), ("y",),
                        ("eps",), tuple(rms_norm("", "x", "weight" if weight else None, "y")))
