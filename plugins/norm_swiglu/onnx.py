"""`norm_swiglu` in ONNX: RMSNormalization (scale 1 once the norm is folded), one Gemm against
the gate/up weight, the gate and up columns taken apart (halves, or blocks of `@block`
interleaved), silu(gate) * up, or gelu_tanh(gate) * up for activation "gelu_tanh"."""
from kiln.plugins.gelu_mul.onnx import gelu_mul
from kiln.plugins.onnx_function import OnnxFunction, ints, shape, variant
from kiln.plugins.rms_norm.onnx import rms_norm
from kiln.plugins.silu_mul.onnx import silu_mul

GATED = {"silu": silu_mul, "gelu_tanh": gelu_mul}


def split_gate_up(p: str, y: str, interleaved: bool, gate: str, up: str) -> list[str]:
    if not interleaved:
        return [f"{gate}, {up} = Split <axis: int = 1, num_outputs: int = 2> ({y})"]
    return shape(f"{p}pairs_shape", [0, -1, 2, "@block"]) + [
        f"{p}pairs = Reshape({y}, {p}pairs_shape)",
        f"{p}gate, {p}up = Split <axis: int = 2, num_outputs: int = 2> ({p}pairs)",
        ints(f"{p}flat", [0, -1]),
        f"{gate} = Reshape({p}gate, {p}flat)",
        f"{up} = Reshape({p}up, {p}flat)",
    ]


def function(inputs: dict, attrs: dict) -> OnnxFunction:
    norm, interleaved = inputs["norm_weight"] is not None, attrs["block"] > 0
    gelu = attrs["activation"] == "gelu_tanh"
    body = (rms_norm("norm_", "x", "norm_weight" if norm else None, "normed")
            + ["gate_up = Gemm <transB: int = 1> (normed, w_gu)"]
            + split_gate_up("split_", "gate_up", interleaved, "gate", "up")
            + GATED[attrs["activation"]]("act_", "gate", "up", "y"))
    return OnnxFunction("norm_swiglu", variant(("norm_weight", norm), ("interleaved", interleaved), ("gelu_tanh", gelu)),
                        ("x",) + (("norm_weight",) if norm else ()) + ("w_gu",), ("y",), ("eps", "block", "activation"),
                        tuple(body))
