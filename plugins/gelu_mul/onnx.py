"""`gelu_mul` in ONNX: Gelu (tanh approximation) of the gate times the up projection."""
from kiln.plugins.onnx_function import OnnxFunction


def gelu_mul(p: str, gate: str, up: str, out: str) -> list[str]:
    return [f'{p}gelu = Gelu <approximate: string = "tanh"> ({gate})', f"{out} = Mul({p}gelu, {up})"]


def function(inputs: dict, attrs: dict) -> OnnxFunction:
    return OnnxFunction("gelu_mul", "", ("gate", "up"), ("y",), (), tuple(gelu_mul("", "gate", "up", "y")))
