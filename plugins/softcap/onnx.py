"""`softcap` in ONNX: Tanh of x / @cap, times @cap (in x's type)."""
from kiln.plugins.onnx_function import OnnxFunction


def function(inputs: dict, attrs: dict) -> OnnxFunction:
    return OnnxFunction("softcap", "", ("x",), ("y",), ("cap",), (
        "cap_f = Constant <value_float: float = @cap> ()",
        "cap = CastLike(cap_f, x)",
        "scaled = Div(x, cap)",
        "squashed = Tanh(scaled)",
        "y = Mul(squashed, cap)",
    ))
