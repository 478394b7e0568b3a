"""The FP8 KV cache's GPU kernels: the KV write, paged attention (prefill, decode, split-KV),
attention_o_proj and norm_qkv_rope's KV-write epilogue against their PyTorch references under
Triton's interpreter, with per-head scales; each compiled for sm_89, sm_90 and sm_100 (the CUDA
decode kernels too, whose numerics tests/test_decode_fp8_gpu.py checks on a GPU), and the sm_80
build refused."""
import os

# Must precede the first `import triton` anywhere: @triton.jit reads it when it decorates.
os.environ.setdefault("TRITON_INTERPRET", "1")

import json  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from gpu_build import compiled_json  # noqa: E402
from kiln.builder.config import BuildConfig, BuildConfigError  # noqa: E402
from kiln.plugins import get_plugin  # noqa: E402
from kiln.plugins.aot import MAX_SHARED_BYTES  # noqa: E402
from kiln.plugins.attention import kernels as attention_kernels  # noqa: E402
from kiln.plugins.attention_o_proj import kernels as attention_o_proj_kernels  # noqa: E402
from kiln.plugins.fp8 import FP8, FP8_TARGETS, to_e4m3  # noqa: E402
from kiln.plugins.norm_qkv_rope import kernels as norm_qkv_rope_kernels  # noqa: E402
from kiln.runtime.step import SequenceChunk, pack_step  # noqa: E402

from test_kernels_attention import (DECODE_FIRST_STEP, DECODE_STEP, LLAMA3_8B, MIXED_STEP, SMALL_TILES, attention_attrs,  # noqa: E402
                                    close, make_step)

INTERPRETED = all(isinstance(k, InterpretedFunction) for k in (
    attention_kernels.attention_kernel, norm_qkv_rope_kernels.norm_qkv_rope_kernel))
pytestmark = [pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
              pytest.mark.skipif(not INTERPRETED, reason="kernels built before TRITON_INTERPRET was set: "
                                 "test_kernels_attention.py's fresh-process check covers the same setup")]


def scales_for(layers: int, kv_heads: int, seed: int) -> torch.Tensor:
    """Per-head scales [layers, 2, kv heads] that put the random k and v (std 1) well inside
    e4m3's range, subnormals included."""
    gen = torch.Generator().manual_seed(seed)
    return 0.004 + 0.02 * torch.rand(layers, 2, kv_heads, generator=gen)


def fp8_step(spec: list, heads: int, dtype: torch.dtype, seed: int):
    data = make_step(spec, heads, dtype, seed)
    scales = scales_for(2, data["cache"].shape[-2], seed)
    data["cache"] = to_e4m3(data["cache"], scales[:, :, None, None, :, None])
    return data, scales


def inputs(data: dict, cache: torch.Tensor, scales: torch.Tensor) -> list:
    s = data["step"]
    return [data["q"], data["k"], data["v"], cache, s.slot_mapping, s.block_tables, s.query_lens, s.context_lens,
            scales]


def bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    assert a.dtype == b.dtype == FP8
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", [MIXED_STEP, DECODE_FIRST_STEP, DECODE_STEP], ids=["mixed", "decode first", "decode"])
def test_fp8_attention_writes_the_reference_bytes_and_reads_them_back_scaled(dtype, spec):
    data, scales = fp8_step(spec, 4, dtype, seed=5)
    attrs = attention_attrs(4, 0)
    ref_cache, cache = data["cache"].clone(), data["cache"].clone()
    ref = get_plugin("attention").call_reference(inputs(data, ref_cache, scales), attrs)
    out = torch.empty_like(ref)
    attention_kernels.run(inputs(data, cache, scales), attrs, out)
    # The kernel rounds to e4m3 itself, as plugins/fp8.py does: the same bytes, subnormals too.
    assert bytes_equal(cache, ref_cache)
    assert close(out, ref)
    s = data["step"]
    for splits in (1, 3):
        out = torch.empty_like(ref)
        attention_kernels.paged_attention(data["q"], cache, s.block_tables, s.query_lens, s.context_lens, out, attrs,
                                          splits, SMALL_TILES, kv_scales=scales)
        assert close(out, ref), f"num_splits={splits}"
    # The scales matter: read as 1.0, the same bytes give another result.
    out = torch.empty_like(ref)
    attention_kernels.paged_attention(data["q"], cache, s.block_tables, s.query_lens, s.context_lens, out, attrs,
                                      1, SMALL_TILES, kv_scales=torch.ones_like(scales))
    assert not close(out, ref)


@pytest.mark.parametrize("block_size,window", [(32, 0), (32, 7), (4, 5)])
def test_fp8_attention_reads_v_blocks_longer_than_a_tile_and_windows_off_a_block_start(block_size, window):
    """v's transposed blocks are read in runs of a block, or of a key tile where blocks are longer
    than tiles (32 against 16); a window's first key falls inside a block."""
    gen = torch.Generator().manual_seed(11)
    spec = [(0, 7), (30, 5), (44, 1), (19, 1)]   # (tokens cached before the step, new tokens)
    need = [-(-(start + n) // block_size) for start, n in spec]
    order = torch.randperm(sum(need), generator=gen).tolist()
    chunks, first = [], 0
    for (start, n), count in zip(spec, need):
        chunks.append(SequenceChunk(list(range(n)), start, order[first:first + count]))
        first += count
    step = pack_step(chunks, block_size, max(need) + 1)
    t, kv_heads, d = step.num_tokens, 2, 16
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    scales = scales_for(2, kv_heads, 11)
    cache = to_e4m3(rand(2, 2, sum(need), block_size, kv_heads, d), scales[:, :, None, None, :, None])
    data = {"step": step, "q": rand(t, 4 * d), "k": rand(t, kv_heads * d), "v": rand(t, kv_heads * d)}
    attrs = {**attention_attrs(4, window), "head_dim": d}
    ref_cache = cache.clone()
    ref = get_plugin("attention").call_reference(inputs(data, ref_cache, scales), attrs)
    for tiles in (None, SMALL_TILES):
        out, got = torch.empty_like(ref), cache.clone()
        attention_kernels.write_kv(got, 1, data["k"], data["v"], step.slot_mapping, scales)
        attention_kernels.paged_attention(data["q"], got, step.block_tables, step.query_lens, step.context_lens, out,
                                          attrs, 1, tiles, kv_scales=scales)
        assert bytes_equal(got, ref_cache)
        assert close(out, ref), tiles


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_attention_o_proj_matches_reference(dtype):
    data, scales = fp8_step(MIXED_STEP, 4, dtype, seed=6)
    attrs = {**attention_attrs(4, 0), "all_reduce": False}
    gen = torch.Generator().manual_seed(7)
    o_proj = [(torch.randn(48, 64, generator=gen) / 8).to(dtype), None,
              torch.randn(data["q"].shape[0], 48, generator=gen).to(dtype)]
    ref_cache, cache = data["cache"].clone(), data["cache"].clone()
    args = lambda c: inputs(data, c, scales)[:8] + o_proj + [scales]  # noqa: E731 (kv_scales comes last)
    ref = get_plugin("attention_o_proj").call_reference(args(ref_cache), attrs)
    out = torch.empty_like(ref)
    attention_o_proj_kernels.run(args(cache), attrs, out)
    assert bytes_equal(cache, ref_cache)
    assert close(out, ref)


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("t", [3, 70])  # the decode and prefill buckets
def test_fp8_norm_qkv_rope_writes_the_reference_bytes(qk_norm, t):
    torch.manual_seed(8)
    k, d, heads, kv_heads, layer = 64, 16, 4, 2, 1
    rows = (heads + 2 * kv_heads) * d
    w_qkv = torch.randn(rows, k) * k ** -0.5
    angles = torch.arange(128)[:, None] * 10000.0 ** (-torch.arange(0, d, 2) / d)
    scales = scales_for(2, kv_heads, 9)
    kv_cache = to_e4m3(torch.randn(2, 2, 20, 4, kv_heads, d), 1.0)
    slots = torch.randperm(80)[:t].to(torch.int32)
    norm = (1 + 0.2 * torch.randn(d)) if qk_norm else None
    args = lambda cache: [torch.randn(t, k, generator=torch.Generator().manual_seed(1)), None, w_qkv, None, norm,  # noqa: E731
                          norm, torch.randint(0, 128, (t,), dtype=torch.int32,
                                              generator=torch.Generator().manual_seed(2)),
                          torch.cat([angles.cos(), angles.sin()], dim=1), cache, slots, scales]
    attrs = {"eps": 1e-6, "layer": layer, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": d}
    ref_cache, cache = kv_cache.clone(), kv_cache.clone()
    ref = get_plugin("norm_qkv_rope").call_reference(args(ref_cache), attrs)
    out = torch.empty_like(ref)
    norm_qkv_rope_kernels.run(args(cache), attrs, out)
    assert close(out, ref)
    # float32 sums in another order can land a value on the other side of an e4m3 rounding
    # boundary: then one step of e4m3 apart, and rarely.
    got, want = cache.float(), ref_cache.float()
    differ = got != want
    assert differ.float().mean() < 0.01
    step = want.abs().clamp(min=2 ** -6) / 8  # one e4m3 spacing at each value (3 mantissa bits)
    assert ((got - want).abs() <= step * 1.01)[differ].all()
    assert torch.equal(cache[0].view(torch.uint8), kv_cache[0].view(torch.uint8))  # other layers untouched


COMPILE_SCRIPT = """
import json, sys
from kiln.plugins.aot import compile_cubin, kernel_name
from kiln.plugins.attention import kernels as attention
from kiln.plugins.norm_qkv_rope import kernels as norm_qkv_rope
shapes = json.loads(sys.argv[1])
qkv = {"K": shapes["hidden"], "num_heads": shapes["heads"], "num_kv_heads": shapes["kv_heads"],
       "head_dim": shapes["head_dim"], "fp8_kv": True, "block_size": shapes["block_size"]}
result = []
for name, kernels in (("attention", attention.aot_kernels("bfloat16", {**shapes, "fp8_kv": True})),
                      ("norm_qkv_rope", norm_qkv_rope.aot_kernels("bfloat16", qkv))):
    for kernel in kernels:
        for target in kernel.targets or ("sm_89", "sm_90", "sm_100"):
            if target == "sm_80":
                continue
            try:
                cubin = compile_cubin(kernel, target)
                result.append([name, kernel_name(kernel), target, len(cubin.binary), cubin.shared_bytes])
            except Exception as exc:
                result.append([name, kernel_name(kernel), target, repr(exc)[:400], 0])
sys.stdout.write(json.dumps(result))
"""


def test_fp8_kv_kernels_compile_for_the_fp8_targets():
    """Compiled in a child without TRITON_INTERPRET (compilation needs the GPU @triton.jit
    kernels), for Llama-3-8B's shapes."""
    results = compiled_json(COMPILE_SCRIPT, json.dumps(LLAMA3_8B), timeout=900)
    failed = [r for r in results if not isinstance(r[3], int) or r[3] == 0]
    assert not failed, failed
    assert not [r for r in results if r[4] > MAX_SHARED_BYTES[r[2]]]
    for target in FP8_TARGETS:
        built = {r[1] for r in results if r[2] == target}
        assert built >= {"_write_kv_kernel", "attention_kernel", "norm_qkv_rope_kernel"}
        # The CUDA decode kernels (plugins/attention/decode_fp8.cu), plain and split, by nvcc.
        assert len([name for name in built if name.startswith("kiln_decode_fp8")]) == 2, built


def test_fp8_kv_cache_refuses_sm_80_at_build_time():
    with pytest.raises(BuildConfigError, match="--kv-cache-dtype fp8 cannot run on --target sm_80.*sm_89, sm_90, sm_100"):
        BuildConfig(targets=("sm_80", "sm_90"), kv_cache_dtype="fp8")
    BuildConfig(targets=("sm_80",))  # the model-dtype cache still builds there
    BuildConfig(targets=("cpu", "sm_89", "sm_90", "sm_100"), kv_cache_dtype="fp8")
    with pytest.raises(BuildConfigError, match="--kv-cache-dtype int8: choose one of auto, fp8"):
        BuildConfig(kv_cache_dtype="int8")
