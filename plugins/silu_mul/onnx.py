"""`silu_mul` in ONNX: Swish (x * sigmoid(x)) of the gate times the up projection."""
from kiln.plugins.onnx_function import OnnxFunction


def silu_mul(p: str, gate: str, up: str, out: str) -> list[str]:
    return [f"{p}silu = Swish({gate})", f"{out} = Mul({p}silu, {up})"]


def function(inputs: dict, attrs: dict) -> OnnxFunction:
    return OnnxFunction("silu_mul", "", ("gate", "up"), ("y",), (), tuple(silu_mul("", "gate", "up", "y")))
