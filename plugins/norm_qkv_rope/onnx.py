"""`norm_qkv_rope` in ONNX: RMSNormalization (scale 1 once the norm is folded), one Gemm against
[Wq; Wk; Wv] (plus bias), the q, k and v columns split apart, the optional per-head q/k norm,
RotaryEmbedding of q and k. q is the op's output; k and v, which the op writes into the paged
cache at run time, are its `cache_k` and `cache_v` outputs, which the layer's attention reads."""
from kiln.plugins.head_rms_norm.onnx import head_rms_norm
from kiln.plugins.onnx_function import CACHE_K, CACHE_V, OnnxFunction, variant
from kiln.plugins.rms_norm.onnx import rms_norm
from kiln.plugins.rope.onnx import rope


def split_qkv(p: str, qkv: str, q: str, k: str, v: str) -> list[str]:
    """q, k, v = the @num_heads, @num_kv_heads and @num_kv_heads heads of qkv's columns."""
    lines = []
    for name, ref in (("heads", "@num_heads"), ("kv_heads", "@num_kv_heads"), ("head_dim", "@head_dim")):
        lines.append(f"{p}{name} = Constant <value_int: int = {ref}> ()")
    return lines + [
        f"{p}ax0 = Constant <value_ints: ints = [0]> ()",
        f"{p}q_width = Mul({p}heads, {p}head_dim)",
        f"{p}kv_width = Mul({p}kv_heads, {p}head_dim)",
        f"{p}q_w = Unsqueeze({p}q_width, {p}ax0)",
        f"{p}kv_w = Unsqueeze({p}kv_width, {p}ax0)",
        f"{p}widths = Concat <axis: int = 0> ({p}q_w, {p}kv_w, {p}kv_w)",
        f"{q}, {k}, {v} = Split <axis: int = 1> ({qkv}, {p}widths)",
    ]


def function(inputs: dict, attrs: dict) -> OnnxFunction:
    norm, bias = inputs["norm_weight"] is not None, inputs["b_qkv"] is not None
    qk_norm = inputs["q_norm"] is not None and inputs["k_norm"] is not None
    body = (rms_norm("norm_", "x", "norm_weight" if norm else None, "normed")
            + [f"qkv = Gemm <transB: int = 1> (normed, w_qkv{', b_qkv' if bias else ''})"]
            + split_qkv("split_", "qkv", "q_raw", "k_raw", CACHE_V))
    q, k = "q_raw", "k_raw"
    if qk_norm:
        body += head_rms_norm("q_norm_", q, "q_norm", "q_normed") + head_rms_norm("k_norm_", k, "k_norm", "k_normed")
        q, k = "q_normed", "k_normed"
    body += rope("q_rope_", q, "positions", "rope_cache", "q") + rope("k_rope_", k, "positions", "rope_cache", CACHE_K)
    inputs_used = (("x",) + (("norm_weight",) if norm else ()) + ("w_qkv",) + (("b_qkv",) if bias else ())
                   + (("q_norm", "k_norm") if qk_norm else ()) + ("positions", "rope_cache"))
    return OnnxFunction("norm_qkv_rope", variant(("norm_weight", norm), ("bias", bias), ("qk_norm", qk_norm)),
                        inputs_used, ("q", CACHE_K, CACHE_V), ("eps", "layer", "num_heads", "num_kv_heads", "head_dim"),
                        tuple(body))
