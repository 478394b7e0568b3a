"""The CUDA GEMVs (`plugins/linear/gemv.cu`, `gemv_fp8.cu`) on the GPU: built by nvcc for this GPU and
launched by each plugin's driver launcher at one and two rows, they match the plugin's reference (GPU
only: `pytest -m gpu`; norm_qkv_rope and norm_swiglu have one at one row only, and FP8 weights one at
one row). Shapes with K tails (K not a multiple of a lane iteration's elements), folded and unfolded norm
weights, biases, the KV-cache write (bf16 and e4m3), both activations and interleaved and plain gate/up weights are
each covered, with bf16 and with e4m3 weights (whose reference runs in bf16, so that x is rounded where
the kernels round it before they quantize it), per-token and static activation scales; the engine tests
cover the Llama shapes at decode. The one-row FP8 handoff (norm_swiglu's GEMV staging its output for the
static down projection's, `linear.gemv.one_row_handoff`) runs its two GEMVs one after the other as a step
does."""
from __future__ import annotations

import pytest
import torch

from gpu_kernels import load_plugin_kernels
from kiln.plugins import get_plugin
from kiln.plugins.fp8 import FP8_TARGETS, quantize_rows, to_e4m3
from kiln.plugins.linear.fp8 import HANDOFF
from kiln.plugins.linear.launch import pick_bucket
from kiln.runtime.cuda_driver import programmatic_launch

pytestmark = pytest.mark.gpu

EPS = 1e-5
LINEAR_ATTRS = {"parallel": "none", "heads": 0, "all_reduce": False}
HEADS, KV_HEADS, LAYER, MAX_POS = 4, 2, 1, 64
# name -> (plugin, compile shapes, attrs)
CASES = {
    "down+residual": ("linear_residual", {"K": 1032, "N": 512}, LINEAR_ATTRS),
    "o_proj+bias+residual": ("linear_residual", {"K": 264, "N": 256, "bias": True}, LINEAR_ATTRS),
    "lm_head": ("linear", {"K": 4096, "N": 2048}, LINEAR_ATTRS),
    "qkv d64 bias": ("norm_qkv_rope", {"K": 264, "num_heads": HEADS, "num_kv_heads": KV_HEADS, "head_dim": 64,
                                       "bias": True},
                     {"eps": EPS, "layer": LAYER, "num_heads": HEADS, "num_kv_heads": KV_HEADS, "head_dim": 64}),
    "qkv d128 norm weight": ("norm_qkv_rope", {"K": 512, "num_heads": HEADS, "num_kv_heads": KV_HEADS,
                                               "head_dim": 128, "norm_weight": True},
                             {"eps": EPS, "layer": LAYER, "num_heads": HEADS, "num_kv_heads": KV_HEADS,
                              "head_dim": 128}),
    "swiglu block 64": ("norm_swiglu", {"K": 1032, "I": 256, "block": 64},
                        {"eps": EPS, "block": 64, "activation": "silu"}),
    "geglu plain norm weight": ("norm_swiglu", {"K": 512, "I": 128, "block": 0, "norm_weight": True,
                                                "activation": "gelu_tanh"},
                                {"eps": EPS, "block": 0, "activation": "gelu_tanh"}),
}
QKV_ATTRS = {"eps": EPS, "layer": LAYER, "num_heads": HEADS, "num_kv_heads": KV_HEADS, "head_dim": 64}
CASES.update({
    "fp8 down+residual": ("linear_residual", {"K": 1040, "N": 512, "fp8": True}, LINEAR_ATTRS),
    "fp8 o_proj+bias+residual": ("linear_residual", {"K": 256, "N": 256, "bias": True, "fp8": True}, LINEAR_ATTRS),
    "fp8 qkv d64 bias": ("norm_qkv_rope", {"K": 528, "num_heads": HEADS, "num_kv_heads": KV_HEADS, "head_dim": 64,
                                           "bias": True, "fp8": True}, QKV_ATTRS),
    "fp8 qkv norm weight": ("norm_qkv_rope", {"K": 2064, "num_heads": HEADS, "num_kv_heads": KV_HEADS,
                                              "head_dim": 64, "norm_weight": True, "fp8": True}, QKV_ATTRS),
    "fp8 qkv e4m3 cache": ("norm_qkv_rope", {"K": 528, "num_heads": HEADS, "num_kv_heads": KV_HEADS, "head_dim": 64,
                                             "fp8": True, "fp8_kv": True, "block_size": 4}, QKV_ATTRS),
    "fp8 swiglu block 64": ("norm_swiglu", {"K": 2064, "I": 256, "block": 64, "fp8": True},
                            {"eps": EPS, "block": 64, "activation": "silu"}),
    "fp8 geglu plain norm weight": ("norm_swiglu", {"K": 512, "I": 128, "block": 0, "norm_weight": True,
                                                    "activation": "gelu_tanh", "fp8": True},
                                    {"eps": EPS, "block": 0, "activation": "gelu_tanh"}),
    # A static activation scale (fp8_static): the entries that divide by it.
    "fp8 static down+residual": ("linear_residual", {"K": 1040, "N": 512, "fp8": True, "fp8_static": True},
                                 LINEAR_ATTRS),
    "fp8 static qkv norm weight": ("norm_qkv_rope", {"K": 2064, "num_heads": HEADS, "num_kv_heads": KV_HEADS,
                                                     "head_dim": 64, "norm_weight": True, "fp8": True,
                                                     "fp8_static": True}, QKV_ATTRS),
    "fp8 static swiglu block 64": ("norm_swiglu", {"K": 2064, "I": 256, "block": 64, "fp8": True, "fp8_static": True},
                                   {"eps": EPS, "block": 64, "activation": "silu"}),
})
# A static scale under which the largest GEMM inputs (about 4 in magnitude) come near e4m3's 448 or
# saturate.
STATIC_SCALE = 0.009
ONE_ROW = ("norm_qkv_rope", "norm_swiglu")
# Where each plugin takes its weight and, with FP8 weights, their scales.
WEIGHT_AT = {"linear": 1, "linear_residual": 1, "norm_qkv_rope": 2, "norm_swiglu": 2}
SCALE_AT = {"linear": 3, "linear_residual": 4, "norm_qkv_rope": 11, "norm_swiglu": 3}


@pytest.fixture(scope="module")
def loaded():
    cache = {}

    def get(name: str):
        if name not in cache:
            plugin, shapes, attrs = CASES[name]
            cache[name] = load_plugin_kernels(plugin, shapes, attrs, 2)
        return cache[name]
    return get


def inputs_for(name: str, rows: int, g: torch.Generator) -> list[torch.Tensor | None]:
    """CPU float32 inputs (rounded to bf16 by the caller) in the plugin's order."""
    plugin, shapes, _ = CASES[name]
    k = shapes["K"]
    randn = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    norm = 1 + 0.2 * randn(k) if shapes.get("norm_weight") else None
    if plugin in ("linear", "linear_residual"):
        n = shapes["N"]
        inputs = [randn(rows, k), randn(n, k) / 32, randn(n) if shapes.get("bias") else None]
        return inputs + [randn(rows, n)] if plugin == "linear_residual" else inputs
    if plugin == "norm_swiglu":
        return [randn(rows, k), norm, randn(2 * shapes["I"], k) / 16]
    d = shapes["head_dim"]
    n = (HEADS + 2 * KV_HEADS) * d
    angles = torch.arange(MAX_POS)[:, None] * 10000.0 ** (-torch.arange(0, d, 2) / d)
    return [randn(rows, k), norm, randn(n, k) / 16, randn(n) if shapes.get("bias") else None, None, None,
            torch.randint(0, MAX_POS, (rows,), generator=g, dtype=torch.int32),
            torch.cat([angles.cos(), angles.sin()], dim=1), randn(2, 2, 6, 4, KV_HEADS, d),
            torch.randperm(24, generator=g)[:rows].to(torch.int32)]


def on_gpu(t: torch.Tensor | None) -> torch.Tensor | None:
    """bf16 on the GPU, except the tensors the kernels take as they are (int32 positions and
    slots, the float32 RoPE table)."""
    if t is None:
        return None
    keep = t.dtype == torch.int32 or t.dim() == 2 and t.shape[0] == MAX_POS and t.dtype == torch.float32
    return t.to("cuda") if keep else t.to("cuda", torch.bfloat16)


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool(torch.isfinite(got).all()) and float((got - want).abs().max() / want.abs().max()) < 2e-2


def with_e4m3_weight(plugin: str, gpu: list, static: bool) -> list:
    """The inputs with the weight quantized per row (`plugins.fp8`) and its scales where the plugin takes them,
    and after them the static activation scale where the case has one."""
    gpu = list(gpu) + [None] * (SCALE_AT[plugin] + 1 - len(gpu))
    gpu[WEIGHT_AT[plugin]], gpu[SCALE_AT[plugin]] = quantize_rows(gpu[WEIGHT_AT[plugin]])
    return gpu + [torch.tensor([STATIC_SCALE], device="cuda")] if static else gpu


def untransposed_v(cache: torch.Tensor) -> torch.Tensor:
    """An e4m3 cache [layers, 2, blocks, block size, kv heads, head_dim] with v's blocks as k's are laid out."""
    out = cache.clone()
    blocks, size, kv_heads, dim = cache.shape[2:]
    out[:, 1] = cache[:, 1].reshape(-1, blocks, kv_heads, dim, size).permute(0, 1, 4, 2, 3)
    return out


@pytest.mark.parametrize("name,rows", [(name, rows) for name, (plugin, shapes, _) in CASES.items()
                                       for rows in ((1,) if plugin in ONE_ROW or shapes.get("fp8") else (1, 2))])
def test_gemv_matches_the_reference(loaded, name, rows):
    plugin, shapes, attrs = CASES[name]
    if shapes.get("fp8") and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip(f"FP8 GEMVs are built for {', '.join(FP8_TARGETS)} only")
    launcher, fns, metas, scratch = loaded(name)
    assert metas[pick_bucket(metas, rows)]["bucket"] == f"gemv{rows}"
    assert metas[pick_bucket(metas, rows)].get("static", False) == shapes.get("fp8_static", False)
    gpu = [on_gpu(t) for t in inputs_for(name, rows, torch.Generator().manual_seed(rows * 7 + len(name)))]
    if shapes.get("fp8"):
        gpu = with_e4m3_weight(plugin, gpu, shapes.get("fp8_static", False))
    if shapes.get("fp8_kv"):
        # Scales per layer, k/v and head, so that the values span e4m3's range; the old cache as e4m3.
        gpu[10] = 0.01 + 0.02 * torch.rand(2, 2, KV_HEADS, generator=torch.Generator().manual_seed(1)).cuda()
        gpu[8] = gpu[8].float().clamp(-448, 448).to(torch.float8_e4m3fn)
    if shapes.get("fp8"):
        ref_inputs = [None if t is None else t.cpu() for t in gpu]
    else:
        ref_inputs = [t.cpu().float() if t is not None and t.is_floating_point() else
                      None if t is None else t.cpu() for t in gpu]
    # The reference writes k and v into its own copy of the cache.
    want = get_plugin(plugin).call_reference(ref_inputs, attrs)
    out = torch.full(tuple(want.shape), float("nan"), dtype=torch.bfloat16, device="cuda")
    before = gpu[8].clone() if plugin == "norm_qkv_rope" else None
    launcher.launch(fns, metas, gpu, attrs, out, {"T": rows}, torch.cuda.current_stream().cuda_stream, scratch)
    torch.cuda.synchronize()
    assert close(out.float().cpu(), want.float())
    if plugin == "norm_qkv_rope":
        cache, ref_cache, slots = gpu[8].float().cpu(), ref_inputs[8].float(), gpu[9].long().cpu()
        if shapes.get("fp8_kv"):
            # v's blocks of an e4m3 cache are [kv heads, head_dim, block size]: compared as k's layout.
            cache, ref_cache = (untransposed_v(c) for c in (cache, ref_cache))
        written = torch.zeros(2, 2, 24, dtype=torch.bool)
        written[LAYER, :, slots] = True
        written = written.view(2, 2, 6, 4)
        if shapes.get("fp8_kv"):
            # Within one e4m3 step of the reference's, and of the bf16 error its RoPE makes in the rotated
            # pair (the reference rotates k rounded to bf16; the kernel rotates it in float32, and a value
            # much smaller than its pair's length comes out of the rotation with that length's error).
            got, ref = cache[written], ref_cache[written]
            half = ref.shape[-1] // 2
            pair = (ref[..., :half] ** 2 + ref[..., half:] ** 2).sqrt().repeat(1, 1, 2)
            off = (got - ref).abs() - (0.125 * ref.abs() + 2.0 ** -9 + 0.02 * pair)
            worst = int(off.argmax())
            assert float(off.max()) <= 0, f"cache value {float(got[worst])} against {float(ref[worst])} at {worst}"
            assert close(got, ref)
        else:
            assert close(cache[written], ref_cache[written])
        was = before.float().cpu()
        was = untransposed_v(was) if shapes.get("fp8_kv") else was
        assert torch.equal(cache[~written], was[~written])


# norm_swiglu of HANDOFF_HIDDEN to HANDOFF_INTER features and the down projection back, for the one-row handoff:
# both K loops end in a tail (1,040 and 4,672 values: 2 full iterations of 512 and 2,048, and part of a third),
# and the gate/up rows interleave in whole blocks of 64.
HANDOFF_HIDDEN, HANDOFF_INTER = 1040, 4672


def staged_row(act: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """act [1, I] as down's FP8 GEMV stages it (`gemv_fp8.cu`'s header, `XRow::stage`): its e4m3 values (the
    reference's `to_e4m3`) as f16, each unit of 8 values as the pairs (0, 2), (1, 3), (4, 6), (5, 7), the
    even units first, then the odd ones."""
    units = to_e4m3(act[0].cpu(), scale.cpu()).to(torch.float16).view(-1, 8)[:, [0, 2, 1, 3, 4, 6, 5, 7]]
    return torch.cat([units[0::2], units[1::2]]).flatten()


@pytest.mark.parametrize("norm_weight", [False, True])
def test_the_one_row_handoff_gives_what_the_gemvs_that_stage_x_give(norm_weight):
    """norm_swiglu's GEMV built to hand its output on stores the same output, and stages it for down exactly as
    down's own GEMV would (the reference's e4m3 values, in the staging layout); down's GEMV that reads it
    staged gives bit for bit what the one that stages x itself gives, and matches the reference. The two run
    back to back as in a step, launched for programmatic dependent launch where the GPU has it, over a staged
    row of NaNs, so a read of it ahead of the wait would show. The scale saturates the largest values."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip(f"FP8 GEMVs are built for {', '.join(FP8_TARGETS)} only")
    k, inter = HANDOFF_HIDDEN, HANDOFF_INTER
    attrs = {"eps": EPS, "block": 64, "activation": "silu"}
    gu_shapes = {"K": k, "I": inter, "block": 64, "norm_weight": norm_weight, "fp8": True}
    down_shapes = {"K": inter, "N": k, "fp8": True, "fp8_static": True}
    handing = load_plugin_kernels("norm_swiglu", {**gu_shapes, "out_scale": True}, attrs, 1)
    plain = load_plugin_kernels("norm_swiglu", gu_shapes, attrs, 1)
    prestaged = load_plugin_kernels("linear_residual", {**down_shapes, "fp8_handoff": True}, LINEAR_ATTRS, 1)
    staging = load_plugin_kernels("linear_residual", down_shapes, LINEAR_ATTRS, 1)
    for (_, _, metas, _), handoff in ((handing, True), (prestaged, True), (plain, False), (staging, False)):
        meta = metas[pick_bucket(metas, 1)]
        assert meta["bucket"] == "gemv1" and bool(meta.get("handoff") or meta.get("prestaged")) == handoff
    g = torch.Generator().manual_seed(5 + norm_weight)
    randn = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    x = (3 * randn(1, k)).to("cuda", torch.bfloat16)
    norm = (1 + 0.2 * randn(k)).to("cuda", torch.bfloat16) if norm_weight else None
    w_gu, s_gu = quantize_rows((randn(2 * inter, k) / 16).to("cuda", torch.bfloat16))
    w_down, s_down = quantize_rows((randn(k, inter) / 32).to("cuda", torch.bfloat16))
    residual = randn(1, k).to("cuda", torch.bfloat16)
    stream = torch.cuda.current_stream().cuda_stream

    def run(loaded, inputs: list, attrs: dict, width: int, scratch: dict | None = None) -> torch.Tensor:
        launcher, fns, metas, own = loaded
        for fn, meta in zip(fns, metas):
            fn.programmatic = programmatic_launch(meta)
        out = torch.full((1, width), float("nan"), dtype=torch.bfloat16, device="cuda")
        launcher.launch(fns, metas, inputs, attrs, out, {"T": 1}, stream, scratch or own)
        return out

    act_plain = run(plain, [x, norm, w_gu, s_gu], attrs, inter)
    scale = (act_plain.float().abs().max() / 448 / 1.5).reshape(1)
    own = run(staging, [act_plain, w_down, None, residual, s_down, scale], LINEAR_ATTRS, k)
    handing[3][HANDOFF[0]].fill_(0xFF)   # f16 NaNs
    torch.cuda.synchronize()
    act = run(handing, [x, norm, w_gu, s_gu, None, scale], attrs, inter)
    down_inputs = [act, w_down, None, residual, s_down, scale]
    out = run(prestaged, down_inputs, {**LINEAR_ATTRS, "fp8_handoff": True}, k,
              {**prestaged[3], HANDOFF[0]: handing[3][HANDOFF[0]]})
    torch.cuda.synchronize()
    assert torch.equal(act, act_plain)
    staged = handing[3][HANDOFF[0]][:2 * inter].view(torch.int16).cpu()
    assert torch.equal(staged, staged_row(act, scale).view(torch.int16))
    assert torch.equal(out, own)
    want = get_plugin("linear_residual").call_reference([t if t is None else t.cpu() for t in down_inputs],
                                                        LINEAR_ATTRS)
    assert close(out.float().cpu(), want.float())


def test_o_proj_reads_the_row_the_early_attention_staged():
    """attention_o_proj with the handoff at one row on sm_90 on: the EARLY decode attention stages its output
    in the handoff's scratch and o_proj's GEMV multiplies it from there, giving bit for bit what the same
    kernels without the handoff give (the GEMV staging the attention output itself). Launched for
    programmatic dependent launch as in a step, over a scratch of NaNs."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the EARLY decode attention is built for sm_90 on")
    shapes = {"heads": 32, "kv_heads": 8, "head_dim": 128, "block_size": 16, "hidden": 4096, "fp8": True,
              "fp8_static": True}
    attrs = {"layer": 0, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "scale": 128 ** -0.5, "window": 0,
             "all_reduce": False}
    g = torch.Generator().manual_seed(11)
    randn = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    cache = randn(1, 2, 4, 16, 8, 128).to("cuda", torch.bfloat16)
    step = [torch.tensor(t, dtype=torch.int32, device="cuda") for t in ([0], [[2]], [1], [13])]
    w, scale = quantize_rows((randn(4096, 4096) / 32).to("cuda", torch.bfloat16))
    q, residual = randn(1, 4096).to("cuda", torch.bfloat16), randn(1, 4096).to("cuda", torch.bfloat16)
    static = torch.tensor([0.004], device="cuda")   # the largest attention outputs saturate
    inputs = [q, None, None, cache, *step, w, None, residual, None, scale, static]
    stream = torch.cuda.current_stream().cuda_stream
    outs = []
    for handoff in (True, False):
        launcher, fns, metas, scratch = load_plugin_kernels("attention_o_proj", {**shapes, "handoff": handoff}, attrs, 1)
        assert any(m.get("prestaged") for m in metas) == handoff
        for fn, meta in zip(fns, metas):
            fn.programmatic = programmatic_launch(meta)
        for buffer in scratch.values():
            buffer.fill_(0xFF)
        scratch["attention_arrivals"].zero_()
        out = torch.full((1, 4096), float("nan"), dtype=torch.bfloat16, device="cuda")
        launcher.launch(fns, metas, inputs, attrs, out, {"T": 1}, stream, scratch)
        torch.cuda.synchronize()
        outs.append(out)
    assert not outs[0].isnan().any() and torch.equal(outs[0], outs[1])

