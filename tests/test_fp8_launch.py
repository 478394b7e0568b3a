"""The FP8 GEMM plugins' driver launchers, given their AOT kernels for sm_89 and for sm_90,
launch what each bucket needs with arguments that compute the W8A8 reference: in every bucket the
quantize pre-pass into the executor's scratch buffers (sized from the kernels' metadata as the
CUDA executor sizes them), then the GEMM reading its e4m3 rows: on sm_90 in the prefill bucket
the persistent TMA GEMM. Each loaded kernel is a stand-in that runs the AOT kernel's function in
the interpreter (`interpreted_launch`)."""
import importlib
import os
from unittest import mock

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from interpreted_launch import Running, interpretable, interpreted_only, targeted  # noqa: E402
from kiln.plugins.aot import AotKernel  # noqa: E402
from kiln.plugins.fp8 import FP8, quantize_rows  # noqa: E402
from kiln.plugins.registry import get_plugin  # noqa: E402
from kiln.plugins.rms_norm.reference import rms_norm  # noqa: E402
from kiln.runtime.cuda_executor import op_scratch  # noqa: E402

PLUGINS = ("linear", "linear_residual", "norm_swiglu", "norm_qkv_rope", "attention_o_proj", "attention")
KERNELS = {name: importlib.import_module(f"kiln.plugins.{name}.kernels") for name in PLUGINS}
LAUNCHERS = {name: importlib.import_module(f"kiln.plugins.{name}.launch") for name in PLUGINS}

pytestmark = interpreted_only()
EPS = 1e-5
MAX_ROWS = 320          # the engine's T bound: the executor sizes per-row scratch for it
SMS = 3                 # fewer programs than tiles: each persistent TMA program walks several
LINEAR_ATTRS = {"parallel": "none", "heads": 0, "all_reduce": False}


def launch(plugin: str, shapes: dict, target: str, inputs: list, attrs: dict, out: torch.Tensor,
           views: list[torch.Tensor] = (), scratch: dict[str, torch.Tensor] | None = None) -> list[str]:
    """Run the plugin's launcher with its Triton kernels for `target` (the CUDA GEMVs, which serve one
    row, cannot run in the interpreter: test_gemv checks theirs); returns the kernels it launched.
    `scratch`: the executor's buffers, shared with earlier launches (those the kernels name and it
    lacks are added)."""
    launcher = LAUNCHERS[plugin]
    kernels = [interpretable(k) for k in targeted(KERNELS[plugin].aot_kernels("bfloat16", shapes), target)
               if isinstance(k, AotKernel)]
    limits = {"T": MAX_ROWS, "S": 8, "B": 64, "block_size": 16, "element_bytes": 2}
    scratch = {} if scratch is None else scratch
    for name, nbytes in op_scratch(launcher, attrs, [k.meta for k in kernels], limits).items():
        if name not in scratch or scratch[name].numel() < nbytes:
            scratch[name] = torch.zeros(nbytes, dtype=torch.uint8)
    log: list = []
    tensors = [t for t in [*inputs, out, *scratch.values(), *views] if t is not None]
    with mock.patch("kiln.plugins.driver_launch.sm_count", lambda: SMS):
        launcher.launch([Running(k, tensors, log) for k in kernels], [k.meta for k in kernels], inputs, attrs, out,
                        {"T": inputs[0].shape[0]}, 0, scratch)
    return [name for name, _ in log]


def close(out: torch.Tensor, expected: torch.Tensor) -> None:
    """bf16 results two roundings apart (see test_kernels_fp8.assert_matches)."""
    err = (out.float() - expected.float()).abs()
    assert (err <= 2 ** -7 * (expected.float().abs() + expected.float().abs().max())).all(), err.max()


def fp8_weight(rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_rows(torch.randn(rows, k) * k ** -0.5)


STEPS = (3, 100, 300)    # decode, medium and xlarge (TMA) buckets


def expected(t: int, target: str, gemm: str, tma_gemm: str) -> list[str]:
    """The launches of a step of t rows: the pre-pass, then the pointer GEMM, or on sm_90 in the
    TMA buckets (from 257 rows) the persistent TMA GEMM."""
    return ["quantize_rows_kernel", tma_gemm if t > 256 and target == "sm_90" else gemm]


def static_scale(gemm_input: torch.Tensor) -> torch.Tensor:
    """A static activation scale under which the largest values of `gemm_input` saturate."""
    return torch.tensor([gemm_input.float().abs().max().item() / 448 / 1.5])


@pytest.mark.parametrize("target", ["sm_89", "sm_90"])
@pytest.mark.parametrize("t", STEPS)
@pytest.mark.parametrize("plugin", ["linear", "linear_residual"])
def test_fp8_linear_launches(plugin, t, target):
    torch.manual_seed(t)
    k, n = 256, 40
    wq, ws = fp8_weight(n, k)
    x, b = torch.randn(t, k).bfloat16(), torch.randn(n).bfloat16()
    r = torch.randn(t, n).bfloat16() if plugin == "linear_residual" else None
    inputs = [x, wq, b, ws] if r is None else [x, wq, b, r, ws]
    out = torch.full((t, n), float("nan"), dtype=torch.bfloat16)
    assert launch(plugin, {"K": k, "N": n, "bias": True, "fp8": True}, target, inputs, LINEAR_ATTRS, out) == \
        expected(t, target, "linear_kernel", "tma_linear_kernel")
    close(out, get_plugin(plugin).call_reference(inputs, LINEAR_ATTRS))


@pytest.mark.parametrize("target", ["sm_89", "sm_90"])
@pytest.mark.parametrize("t", (1, 300))
@pytest.mark.parametrize("plugin", ["linear", "linear_residual"])
def test_fp8_linear_launches_with_a_static_activation_scale(plugin, t, target):
    """The static scale (weight_input_scale, after weight_scale) reaches the pre-pass, whose rows
    every Triton bucket reads, one row included (the static FP8 GEMVs, which serve one row where
    the shapes allow, are test_gemv's and test_gemv_gpu's)."""
    torch.manual_seed(t)
    k, n = 256, 40
    wq, ws = fp8_weight(n, k)
    x, b = torch.randn(t, k).bfloat16(), torch.randn(n).bfloat16()
    r = torch.randn(t, n).bfloat16() if plugin == "linear_residual" else None
    inputs = [x, wq, b, ws, static_scale(x)] if r is None else [x, wq, b, r, ws, static_scale(x)]
    out = torch.full((t, n), float("nan"), dtype=torch.bfloat16)
    shapes = {"K": k, "N": n, "bias": True, "fp8": True, "fp8_static": True}
    assert launch(plugin, shapes, target, inputs, LINEAR_ATTRS, out) == \
        expected(t, target, "linear_kernel", "tma_linear_kernel")
    expected_out = get_plugin(plugin).call_reference(inputs, LINEAR_ATTRS)
    close(out, expected_out)
    dynamic = get_plugin(plugin).call_reference(inputs[:-1], LINEAR_ATTRS)
    assert not torch.equal(expected_out, dynamic)   # the static scale changed the numbers


@pytest.mark.parametrize("target", ["sm_89", "sm_90"])
def test_an_fp8_launch_without_the_static_scale_its_kernels_were_built_for_fails(target):
    k, n = 256, 40
    wq, ws = fp8_weight(n, k)
    x = torch.randn(3, k).bfloat16()
    out = torch.empty(3, n, dtype=torch.bfloat16)
    for shapes, inputs in (({"fp8_static": True}, [x, wq, None, ws]),
                           ({}, [x, wq, None, ws, static_scale(x)])):
        with pytest.raises(ValueError, match="static activation scale.*rebuild the engine"):
            launch("linear", {"K": k, "N": n, "fp8": True, **shapes}, target, inputs, LINEAR_ATTRS, out)


@pytest.mark.parametrize("target", ["sm_89", "sm_90"])
@pytest.mark.parametrize("t", STEPS)
@pytest.mark.parametrize("folded,static", [(True, False), (False, False), (False, True)])
def test_fp8_norm_swiglu_launches(folded, static, t, target):
    """With the norm weight unfolded the TMA kernel is not built: the pointer kernel serves. A static
    activation scale (w_gu_input_scale) reaches the pre-pass, which applies the norm first."""
    torch.manual_seed(t + folded)
    k, inter, block = 128, 24, 8
    wq, ws = fp8_weight(2 * inter, k)
    x = (3 * torch.randn(t, k)).bfloat16()
    g = None if folded else (1 + 0.3 * torch.randn(k)).bfloat16()
    inputs = [x, g, wq, ws] + ([static_scale(rms_norm(x, g, EPS))] if static else [])
    attrs = {"eps": EPS, "block": block, "activation": "silu"}
    out = torch.full((t, inter), float("nan"), dtype=torch.bfloat16)
    shapes = {"K": k, "I": inter, "block": block, "norm_weight": not folded, "fp8": True, "fp8_static": static}
    tma_gemm = "tma_norm_swiglu_kernel" if folded else "norm_swiglu_kernel"
    assert launch("norm_swiglu", shapes, target, inputs, attrs, out) == \
        expected(t, target, "norm_swiglu_kernel", tma_gemm)
    close(out, get_plugin("norm_swiglu").call_reference(inputs, attrs))


@pytest.mark.parametrize("target", ["sm_89", "sm_90"])
@pytest.mark.parametrize("t", (1, 2, 64, 100))
def test_fp8_handoff_from_norm_swiglu_to_the_down_projection(t, target):
    """norm_swiglu given the down projection's static scale (out_scale) also writes its output in e4m3
    into the handoff's scratch, where the down projection (attr fp8_handoff) reads it at 2-64 rows with
    no pre-pass of its own: the bytes are the static pre-pass's, so the result is bit for bit the one
    without the handoff. Past 64 rows (and at one, the GEMVs' row) the projection quantizes x itself."""
    from kiln.plugins.fp8 import to_e4m3
    from kiln.plugins.linear.fp8 import HANDOFF
    torch.manual_seed(t)
    k, inter, block, n = 128, 64, 8, 96
    w_gu, s_gu = fp8_weight(2 * inter, k)
    w_down, s_down = fp8_weight(n, inter)
    x = (3 * torch.randn(t, k)).bfloat16()
    attrs = {"eps": EPS, "block": block, "activation": "silu"}
    act_static = static_scale(get_plugin("norm_swiglu").call_reference([x, None, w_gu, s_gu], attrs))
    gu_inputs = [x, None, w_gu, s_gu, static_scale(rms_norm(x, None, EPS)), act_static]
    shapes = {"K": k, "I": inter, "block": block, "norm_weight": False, "fp8": True, "fp8_static": True,
              "out_scale": True}
    scratch: dict[str, torch.Tensor] = {}
    act = torch.full((t, inter), float("nan"), dtype=torch.bfloat16)
    assert launch("norm_swiglu", shapes, target, gu_inputs, attrs, act, scratch=scratch)[-1] == "norm_swiglu_kernel"
    close(act, get_plugin("norm_swiglu").call_reference(gu_inputs, attrs))
    handed = 2 <= t <= 64
    if handed:
        q = scratch[HANDOFF[0]][:t * inter].view(FP8).view(t, inter)
        assert torch.equal(q.view(torch.uint8), to_e4m3(act, act_static).view(torch.uint8))
        assert torch.equal(scratch[HANDOFF[1]][:4 * t].view(torch.float32), act_static.expand(t))
    down_inputs = [act, w_down, None, torch.randn(t, n).bfloat16(), s_down, act_static]
    down_shapes = {"K": inter, "N": n, "fp8": True, "fp8_static": True}
    outs = []
    for handoff in (True, False):
        out = torch.full((t, n), float("nan"), dtype=torch.bfloat16)
        launched = launch("linear_residual", down_shapes, target, down_inputs, {**LINEAR_ATTRS, "fp8_handoff": handoff},
                          out, scratch=scratch)
        assert launched == (["linear_kernel"] if handoff and handed else ["quantize_rows_kernel", "linear_kernel"])
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    close(outs[0], get_plugin("linear_residual").call_reference(down_inputs, LINEAR_ATTRS))


@pytest.mark.parametrize("target", ["sm_89", "sm_90"])
@pytest.mark.parametrize("t,blocks", [(1, 8), (3, 8), (3, 32), (8, 32)])
def test_fp8_handoff_from_decode_attention_to_o_proj(t, blocks, target):
    """attention_o_proj with a static scale and a bf16 cache (compile shape handoff): in a pure decode
    step of 2-64 rows the decode kernel, split over its keys or not (a table of 32 blocks or 8), also
    writes the attention output in e4m3 for o_proj (with split keys, the part that merges them), whose GEMM
    reads it with no pre-pass, giving bit for bit what the engine built without the handoff gives."""
    torch.manual_seed(t + blocks)
    heads, kv_heads, d, bs, hidden, layer = 4, 2, 32, 16, 72, 1
    kv_cache = torch.randn(2, 2, 40, bs, kv_heads, d).bfloat16()
    tables = torch.randint(0, 40, (t, blocks), dtype=torch.int32)
    wq, ws = fp8_weight(hidden, heads * d)
    context = torch.randint(1, 8 * bs, (t,), dtype=torch.int32)
    inputs = [torch.randn(t, heads * d).bfloat16(), None, None, kv_cache, torch.zeros(t, dtype=torch.int32), tables,
              torch.ones(t, dtype=torch.int32), context, wq, None, torch.randn(t, hidden).bfloat16(), None, ws]
    attrs = {"layer": layer, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": d, "scale": d ** -0.5,
             "window": 0, "all_reduce": False}
    attn = torch.empty_like(inputs[0])
    KERNELS["attention"].run(inputs[:8], attrs, attn)
    statics = [static_scale(attn)]
    outs, logs = [], []
    for handoff in (True, False):
        shapes = {"heads": heads, "kv_heads": kv_heads, "head_dim": d, "block_size": bs, "hidden": hidden, "fp8": True,
                  "fp8_static": True, "handoff": handoff}
        out = torch.full((t, hidden), float("nan"), dtype=torch.bfloat16)
        logs.append(launch("attention_o_proj", shapes, target, inputs + statics, attrs, out,
                           views=[kv_cache[layer, 0], kv_cache[layer, 1]]))
        outs.append(out)
    assert logs[0][0] == "attention_kernel" and "combine_splits_kernel" not in logs[0]
    assert "quantize_rows_kernel" in logs[1] and ("quantize_rows_kernel" in logs[0]) == (t == 1)
    assert torch.equal(outs[0], outs[1])
    close(outs[0], get_plugin("linear_residual").call_reference([attn, wq, None, inputs[10], ws, *statics],
                                                                LINEAR_ATTRS))


@pytest.mark.parametrize("target", ["sm_89", "sm_90"])
def test_norm_swiglu_kernels_built_without_the_handoff_refuse_an_out_scale(target):
    k, inter = 128, 64
    w_gu, s_gu = fp8_weight(2 * inter, k)
    x = torch.randn(3, k).bfloat16()
    scale = torch.tensor([0.01])
    shapes = {"K": k, "I": inter, "block": 8, "norm_weight": False, "fp8": True, "fp8_static": True}
    with pytest.raises(ValueError, match="does not hand its output on in e4m3.*rebuild the engine"):
        launch("norm_swiglu", shapes, target, [x, None, w_gu, s_gu, scale, scale],
               {"eps": EPS, "block": 8, "activation": "silu"}, torch.empty(3, inter, dtype=torch.bfloat16))


@pytest.mark.parametrize("target", ["sm_89", "sm_90"])
@pytest.mark.parametrize("t", STEPS)
@pytest.mark.parametrize("folded,bias,qk_norm,static", [(True, False, False, False), (True, True, True, False),
                                                        (False, True, True, False), (True, False, False, True)])
def test_fp8_norm_qkv_rope_launches(folded, bias, qk_norm, static, t, target):
    torch.manual_seed(t + bias)
    k, heads, kv_heads, d = 64, 4, 2, 32
    rows = (heads + 2 * kv_heads) * d
    wq, ws = fp8_weight(rows, k)
    angles = torch.arange(512)[:, None] * 10000.0 ** (-torch.arange(0, d, 2) / d)
    inputs = [torch.randn(t, k).bfloat16(), None if folded else (1 + 0.3 * torch.randn(k)).bfloat16(), wq,
              torch.randn(rows).bfloat16() if bias else None, 1 + 0.2 * torch.randn(d) if qk_norm else None,
              1 + 0.2 * torch.randn(d) if qk_norm else None, torch.randint(0, 512, (t,), dtype=torch.int32),
              torch.cat([angles.cos(), angles.sin()], dim=1), torch.randn(2, 2, 80, 4, kv_heads, d).bfloat16(),
              torch.randperm(320)[:t].to(torch.int32), None, ws]
    if static:
        inputs.append(static_scale(rms_norm(inputs[0], inputs[1], EPS)))
    attrs = {"eps": EPS, "layer": 1, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": d}
    shapes = {"K": k, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": d, "bias": bias,
              "qk_norm": qk_norm, "norm_weight": not folded, "fp8": True, "fp8_static": static}
    expected_cache = inputs[8].clone()
    expected_q = get_plugin("norm_qkv_rope").call_reference([*inputs[:8], expected_cache, *inputs[9:]], attrs)
    out = torch.full((t, heads * d), float("nan"), dtype=torch.bfloat16)
    tma_gemm = "tma_norm_qkv_rope_kernel" if folded else "norm_qkv_rope_kernel"
    assert launch("norm_qkv_rope", shapes, target, inputs, attrs, out) == \
        expected(t, target, "norm_qkv_rope_kernel", tma_gemm)
    close(out, expected_q)
    close(inputs[8], expected_cache)


@pytest.mark.parametrize("target", ["sm_89", "sm_90"])
@pytest.mark.parametrize("t", (3, 300))
def test_fp8_norm_qkv_rope_launches_with_an_fp8_kv_cache(t, target):
    """e4m3 weights and an e4m3 cache: kv_scales (before w_qkv_scale in the spec) reaches
    kv_scale_ptr of the pointer kernel and of sm_90's TMA kernel. The cache is compared
    dequantized: the reference's bf16 roundings before the cache's move a value by up to the
    bf16 bound of `close`, and then to a neighbouring e4m3 step."""
    torch.manual_seed(t)
    k, heads, kv_heads, d = 64, 4, 2, 32
    rows = (heads + 2 * kv_heads) * d
    wq, ws = fp8_weight(rows, k)
    angles = torch.arange(512)[:, None] * 10000.0 ** (-torch.arange(0, d, 2) / d)
    kv_scales = 0.004 + 0.02 * torch.rand(2, 2, kv_heads)
    inputs = [torch.randn(t, k).bfloat16(), None, wq, torch.randn(rows).bfloat16(), 1 + 0.2 * torch.randn(d),
              1 + 0.2 * torch.randn(d), torch.randint(0, 512, (t,), dtype=torch.int32),
              torch.cat([angles.cos(), angles.sin()], dim=1),
              torch.zeros(2, 2, 80, 4, kv_heads, d, dtype=FP8), torch.randperm(320)[:t].to(torch.int32), kv_scales,
              ws]
    attrs = {"eps": EPS, "layer": 1, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": d}
    shapes = {"K": k, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": d, "bias": True,
              "qk_norm": True, "fp8": True, "fp8_kv": True, "block_size": 4}
    expected_cache = inputs[8].clone()
    expected_q = get_plugin("norm_qkv_rope").call_reference([*inputs[:8], expected_cache, *inputs[9:]], attrs)
    out = torch.full((t, heads * d), float("nan"), dtype=torch.bfloat16)
    assert launch("norm_qkv_rope", shapes, target, inputs, attrs, out) == \
        expected(t, target, "norm_qkv_rope_kernel", "tma_norm_qkv_rope_kernel")
    close(out, expected_q)
    scale = kv_scales[:, :, None, None, :, None]
    got, want = inputs[8].float() * scale, expected_cache.float() * scale
    assert want[1].abs().max() > 0 and not got[0].any()   # written to layer 1 only
    bound = 2 ** -7 * (want.abs() + want.abs().max()) + want.abs() / 8
    assert ((got - want).abs() <= bound).all(), (got - want).abs().max()


@pytest.mark.parametrize("target", ["sm_89", "sm_90"])
@pytest.mark.parametrize("static", [False, True])
def test_fp8_attention_o_proj_launches_the_pre_pass_on_the_attention_output(static, target):
    """A prefill step: attention into the op's scratch buffer, the pre-pass quantizes that (with the
    static scale w_o_input_scale if given), and o_proj reads it."""
    torch.manual_seed(5)
    heads, kv_heads, d, bs, hidden, layer = 4, 2, 32, 16, 72, 1
    lens, cached = [70, 30], [0, 20]
    t = sum(lens)
    kv_cache = torch.randn(2, 2, 20, bs, kv_heads, d).bfloat16()
    tables = torch.randperm(20)[:16].view(2, 8).to(torch.int32)
    wq, ws = fp8_weight(hidden, heads * d)
    inputs = [torch.randn(t, heads * d).bfloat16(), None, None, kv_cache, torch.zeros(t, dtype=torch.int32), tables,
              torch.tensor(lens, dtype=torch.int32), torch.tensor([n + c for n, c in zip(lens, cached)],
                                                                   dtype=torch.int32),
              wq, None, torch.randn(t, hidden).bfloat16(), None, ws]
    attrs = {"layer": layer, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": d, "scale": d ** -0.5,
             "window": 0, "all_reduce": False}
    attn = torch.empty_like(inputs[0])   # o_proj's input: what the attention kernel gives
    KERNELS["attention"].run(inputs[:8], attrs, attn)
    statics = [static_scale(attn)] if static else []
    shapes = {"heads": heads, "kv_heads": kv_heads, "head_dim": d, "block_size": bs, "hidden": hidden, "fp8": True,
              "fp8_static": static}
    out = torch.full((t, hidden), float("nan"), dtype=torch.bfloat16)
    log = launch("attention_o_proj", shapes, target, inputs + statics, attrs, out,
                 views=[kv_cache[layer, 0], kv_cache[layer, 1]])
    assert log[-2:] == ["quantize_rows_kernel", "linear_kernel"]
    close(out, get_plugin("linear_residual").call_reference([attn, wq, None, inputs[10], ws, *statics],
                                                            LINEAR_ATTRS))
