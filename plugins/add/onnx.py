"""`add` in ONNX: Add."""
from kiln.plugins.onnx_function import OnnxFunction


def function(inputs: dict, attrs: dict) -> OnnxFunction:
    return OnnxFunction("add", "", ("a", "b"), ("y",), (), ("y = Add(a, b)",))
