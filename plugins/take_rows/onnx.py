"""`take_rows` in ONNX: Gather of the wanted rows."""
from kiln.plugins.onnx_function import OnnxFunction


def function(inputs: dict, attrs: dict) -> OnnxFunction:
    return OnnxFunction("take_rows", "", ("x", "indices"), ("y",), (), ("y = Gather <axis: int = 0> (x, indices)",))
