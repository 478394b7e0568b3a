"""`embedding` in ONNX: Gather of the token table's rows, times @scale when it is not 1 (cast to
the table's type first: the reference scales in the table's dtype)."""
from kiln.plugins.onnx_function import OnnxFunction, variant


def function(inputs: dict, attrs: dict) -> OnnxFunction:
    scaled = attrs["scale"] != 1.0
    gather = "Gather <axis: int = 0> (weight, input_ids)"
    body = (f"rows = {gather}", "scale_f = Constant <value_float: float = @scale> ()",
            "scale = CastLike(scale_f, rows)", "y = Mul(rows, scale)") if scaled else (f"y = {gather}",)
    return OnnxFunction("embedding", variant(("scaled", scaled)), ("input_ids", "weight"), ("y",), ("scale",), body)
