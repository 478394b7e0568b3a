"""`gelu` in ONNX: Gelu with the tanh approximation."""
from kiln.plugins.onnx_function import OnnxFunction


def function(inputs: dict, attrs: dict) -> OnnxFunction:
    return OnnxFunction("gelu", "", ("x",), ("y",), (), ('y = Gelu <approximate: string = "tanh"> (x)',))
