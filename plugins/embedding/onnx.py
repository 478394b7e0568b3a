"""`embedding` in ONNX: Gather of the token table's rows."""
from kiln.plugins.onnx_function import OnnxFunction


def function(inputs: dict, attrs: dict) -> OnnxFunction:
    return OnnxFunction("embedding", "", ("input_ids", "weight"), ("y",), (),
                        ("y = Gather <axis: int = 0> (weight, input_ids)",))
