"""`linear` in ONNX: Gemm against the [N, K] weight (transB), plus the bias; a row-parallel
projection is summed over the ranks (`kiln.all_reduce`) before its bias is added once, and the
vocabulary-parallel LM head's slices are gathered from the ranks (`kiln.all_gather`)."""
from kiln.plugins.onnx_function import OnnxFunction, all_gather, all_reduce, variant


def linear(p: str, x: str, weight: str, bias: str | None, reduce: bool, out: str) -> list[str]:
    if not reduce:
        return [f"{out} = Gemm <transB: int = 1> ({x}, {weight}{', ' + bias if bias else ''})"]
    lines = [f"{p}partial = Gemm <transB: int = 1> ({x}, {weight})"]
    if bias is None:
        return lines + [all_reduce(f"{p}partial", out)]
    return lines + [all_reduce(f"{p}partial", f"{p}sum"), f"{out} = Add({p}sum, {bias})"]


def function(inputs: dict, attrs: dict) -> OnnxFunction:
    bias, reduce = inputs["bias"] is not None, bool(attrs["all_reduce"])
    gather = attrs.get("all_gather", 0) > 1
    body = linear("", "x", "weight", "bias" if bias else None, reduce, "slice" if gather else "y")
    return OnnxFunction("linear", variant(("bias", bias), ("all_reduce", reduce), ("all_gather", gather)),
                        ("x", "weight") + (("bias",) if bias else ()), ("y",),
                        ("parallel", "heads", "all_reduce") + (("all_gather",) if gather else ()),
                        tuple(body + ([all_gather("slice", "y")] if gather else [])))
