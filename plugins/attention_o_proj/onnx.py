"""`attention_o_proj` in ONNX: `attention`'s dense prefill form, the output projection (summed
over the ranks when row-parallel) and the residual add."""
from kiln.plugins.attention.onnx import attention, kv_inputs, windowed
from kiln.plugins.linear.onnx import linear
from kiln.plugins.onnx_function import CACHE_K, OnnxFunction, variant


def function(inputs: dict, attrs: dict) -> OnnxFunction:
    k, v = kv_inputs(inputs)
    bias, reduce = inputs["b_o"] is not None, bool(attrs["all_reduce"])
    body = (attention("attn_", "q", k, v, "query_lens", windowed(attrs), "attn")
            + linear("o_", "attn", "w_o", "b_o" if bias else None, reduce, "o")
            + ["y = Add(residual, o)"])
    return OnnxFunction("attention_o_proj",
                        variant(("cache", k == CACHE_K), ("window", windowed(attrs)), ("bias", bias),
                                ("all_reduce", reduce)),
                        ("q", k, v, "query_lens", "w_o") + (("b_o",) if bias else ()) + ("residual",), ("y",),
                        ("layer", "num_heads", "num_kv_heads", "head_dim", "scale", "window", "all_reduce"),
                        tuple(body))
