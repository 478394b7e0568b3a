"""The CUDA GEMVs (`plugins/linear/gemv.cu`, `gemv_fp8.cu`) on the GPU: built by nvcc for this GPU and
launched by each plugin's driver launcher at one and two rows, they match the plugin's reference (GPU
only: `pytest -m gpu`; norm_qkv_rope and norm_swiglu have one at one row only, and FP8 weights one at
one row). Shapes with K tails (K not a multiple of a lane iteration's elements), folded and unfolded norm
weights, biases, the KV-cache write (bf16 and e4m3), both activations and interleaved and plain gate/up weights are
each covered, with bf16 and with e4m3 weights (whose reference runs in bf16, so that x is rounded where
the kernels round it before they quantize it), per-token and static activation scales; the engine tests
cover the Llama shapes at decode."""
from __future__ import annotations

import pytest
import torch

from gpu_kernels import load_plugin_kernels
from kiln.plugins import get_plugin
from kiln.plugins.fp8 import FP8_TARGETS, quantize_rows
from kiln.plugins.linear.launch import pick_bucket

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
