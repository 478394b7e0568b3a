"""`attention` in ONNX, in the dense prefill form: each prompt of the step (`query_lens`, packed
one after another) attends to its own tokens under a causal mask (and the sliding window, if
any), through the standard Attention op with grouped kv heads and a float32 softmax. At run
time k and v go through the paged KV cache; here they are the prompt's own: the op's inputs,
or, once `norm_qkv_rope` has written them, that op's `cache_k` and `cache_v`."""
from kiln.plugins.onnx_function import CACHE_K, CACHE_V, OnnxFunction, ints, variant


def prompt_mask(p: str, query_lens: str, windowed: bool, out: str) -> list[str]:
    """out[i, j]: token j is in token i's prompt and not after it (and within `@window` of it)."""
    lines = [
        ints(f"{p}ax0", [0]),
        ints(f"{p}ax1", [1]),
        f"{p}zero = Constant <value_int: int = 0> ()",
        f"{p}one = Constant <value_int: int = 1> ()",
        f"{p}lens = Cast <to: int = 7> ({query_lens})",
        f"{p}ends = CumSum({p}lens, {p}zero)",
        f"{p}total = ReduceSum <keepdims: int = 0> ({p}lens)",
        f"{p}index = Range({p}zero, {p}total, {p}one)",
        f"{p}row = Unsqueeze({p}index, {p}ax1)",
        f"{p}col = Unsqueeze({p}index, {p}ax0)",
        # A token's prompt is the number of prompts that end at or before it.
        f"{p}ends_col = Unsqueeze({p}ends, {p}ax0)",
        f"{p}past = GreaterOrEqual({p}row, {p}ends_col)",
        f"{p}past_n = Cast <to: int = 7> ({p}past)",
        f"{p}prompt = ReduceSum <keepdims: int = 0> ({p}past_n, {p}ax1)",
        f"{p}prompt_row = Unsqueeze({p}prompt, {p}ax1)",
        f"{p}prompt_col = Unsqueeze({p}prompt, {p}ax0)",
        f"{p}same = Equal({p}prompt_row, {p}prompt_col)",
        f"{p}causal = LessOrEqual({p}col, {p}row)",
    ]
    if not windowed:
        return lines + [f"{out} = And({p}same, {p}causal)"]
    return lines + [
        f"{p}back = Sub({p}row, {p}col)",
        f"{p}window = Constant <value_int: int = @window> ()",
        f"{p}near = Less({p}back, {p}window)",
        f"{p}in_prompt = And({p}same, {p}causal)",
        f"{out} = And({p}in_prompt, {p}near)",
    ]


def attention(p: str, q: str, k: str, v: str, query_lens: str, windowed: bool, out: str) -> list[str]:
    """out = softmax(q k^T * @scale, masked) v over `@num_heads` q heads and `@num_kv_heads`
    kv heads; the tokens are one batch row."""
    return prompt_mask(f"{p}mask_", query_lens, windowed, f"{p}mask") + [
        ints(f"{p}ax0", [0]),
        f"{p}q_batch = Unsqueeze({q}, {p}ax0)",
        f"{p}k_batch = Unsqueeze({k}, {p}ax0)",
        f"{p}v_batch = Unsqueeze({v}, {p}ax0)",
        f"{p}attended = Attention <q_num_heads: int = @num_heads, kv_num_heads: int = @num_kv_heads, "
        f"scale: float = @scale, softmax_precision: int = 1> ({p}q_batch, {p}k_batch, {p}v_batch, {p}mask)",
        f"{out} = Squeeze({p}attended, {p}ax0)",
    ]


def kv_inputs(inputs: dict) -> tuple[str, str]:
    """Where k and v come from: the op's own inputs, or the layer's cache."""
    return ("k", "v") if inputs["k"] is not None and inputs["v"] is not None else (CACHE_K, CACHE_V)


def windowed(attrs: dict) -> bool:
    return attrs["window"] > 0


def function(inputs: dict, attrs: dict) -> OnnxFunction:
    k, v = kv_inputs(inputs)
    return OnnxFunction("attention", variant(("cache", k == CACHE_K), ("window", windowed(attrs))),
                        ("q", k, v, "query_lens"), ("y",),
                        ("layer", "num_heads", "num_kv_heads", "head_dim", "scale", "window"),
                        tuple(attention("", "q", k, v, "query_lens", windowed(attrs), "y")))
