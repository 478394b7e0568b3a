"""`linear_residual` in ONNX: `linear`'s projection, then the residual added."""
from kiln.plugins.linear.onnx import linear
from kiln.plugins.onnx_function import OnnxFunction, variant


def function(inputs: dict, attrs: dict) -> OnnxFunction:
    bias, reduce = inputs["bias"] is not None, bool(attrs["all_reduce"])
    body = linear("proj_", "x", "weight", "bias" if bias else None, reduce, "proj") + ["y = Add(residual, proj)"]
    return OnnxFunction("linear_residual", variant(("bias", bias), ("all_reduce", reduce)),
                        ("x", "weight") + (("bias",) if bias else ()) + ("residual",), ("y",),
                        ("parallel", "heads", "all_reduce"), tuple(body))
