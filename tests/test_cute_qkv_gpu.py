"""The CuTe qkv GEMM (`plugins.linear.cute_gemm.qkv`: norm_qkv_rope's projection, row scale, bias, RoPE,
q out and k and v into the paged cache) on an H200 (GPU only: `pytest -m gpu`): built by nvcc, loaded
through `runtime.cuda_driver` and launched on TMA descriptors as a launcher would, it matches the
plugin's reference, q and the cache alike, for Llama-3-8B's heads at both tile heights, with and without
bias, for heads of 64 columns, for positions and cache slots in no order in the second layer of a
cache, with more tiles than blocks (the persistent loop), for row counts that leave a tile part empty,
and it writes nothing past T rows or outside the tokens' slots; and norm_qkv_rope's launcher takes it for
129 to 256 rows, its row-scale pre-pass included, and matches the reference."""
from __future__ import annotations

import pytest
import torch

from kiln.plugins import get_plugin
from kiln.plugins.aot import compile_cubin
from kiln.plugins.linear import cute_gemm
from kiln.plugins.linear.launch import launch_cute_qkv

pytestmark = pytest.mark.gpu

EPS = 1e-5
# (rows, heads, kv_heads, head_dim, K, block_m, pairs, bias, blocks: the grid's cap, as a GPU's SM count)
CASES = [(200, 32, 8, 128, 4096, 128, 48, False, 132), (256, 32, 8, 128, 4096, 64, 96, True, 132),
         (130, 4, 2, 64, 512, 128, 32, True, 5), (129, 8, 2, 128, 1024, 64, 64, False, 132),
         (256, 32, 8, 128, 4096, 128, 64, False, 132)]


@pytest.mark.parametrize("rows, heads, kv_heads, d, k, block_m, pairs, bias, blocks", CASES)
def test_cute_qkv_matches_the_plugin_reference(rows, heads, kv_heads, d, k, block_m, pairs, bias, blocks):
    from kiln.runtime.cuda_driver import load_kernel

    kernel = cute_gemm.qkv(block_m, pairs, d, 6, 8)
    cubin = compile_cubin(kernel, "sm_90")
    fn = load_kernel(cubin.binary, cubin.name, list(kernel.signature.values()), cubin.num_warps, cubin.shared_bytes,
                     cubin.global_scratch)
    gen = torch.Generator().manual_seed(rows + heads + d)
    n, layers, block_size = (heads + 2 * kv_heads) * d, 2, 16
    # x in a longer buffer whose rows past T hold NaN: the descriptor covers whole tiles, as the engine's do.
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16).cuda()
    x = torch.cat([x, torch.full((block_m, k), float("nan"), dtype=torch.bfloat16, device="cuda")])[:rows]
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(torch.bfloat16).cuda()
    b = torch.randn(n, generator=gen).to(torch.bfloat16).cuda() if bias else None
    positions = torch.randperm(4 * rows, generator=gen)[:rows].to(torch.int32).cuda()
    angles = torch.arange(4 * rows)[:, None].float() * 10000.0 ** (-torch.arange(0, d, 2) / d)
    rope = torch.cat([angles.cos(), angles.sin()], dim=1).cuda()
    blocks_in_cache = -(-2 * rows // block_size)
    slots = torch.randperm(blocks_in_cache * block_size, generator=gen)[:rows].to(torch.int32).cuda()
    cache = torch.full((layers, 2, blocks_in_cache, block_size, kv_heads, d), float("nan"), dtype=torch.bfloat16,
                       device="cuda")
    ref_cache = cache.clone()
    ref = get_plugin("norm_qkv_rope").call_reference(
        [x, None, w, b, None, None, positions, rope, ref_cache, slots],
        {"eps": EPS, "layer": 1, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": d})
    # Three rows past T that the kernel must leave alone: q out is a view of a longer buffer.
    buffer = torch.full((rows + 3, heads * d), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = buffer[:rows]
    scales = torch.rsqrt(x.float().pow(2).mean(dim=1) + EPS)
    launch_cute_qkv(fn, cute_gemm.qkv_grid(rows, heads, kv_heads, d, k, block_m, pairs, blocks), block_m, pairs, x,
                    w, scales.data_ptr(), b, positions, rope, cache, slots, out, 1, heads, kv_heads,
                    torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < 1e-2, f"q: relative error {err:.2e}"
    assert torch.isnan(buffer[rows:]).all(), "rows past T were written"
    written = ~torch.isnan(ref_cache)
    assert torch.equal(written, ~torch.isnan(cache)), "the cache was written outside the tokens' slots"
    err = ((cache[written].float() - ref_cache[written].float()).norm() / ref_cache[written].float().norm()).item()
    assert err < 1e-2, f"k and v: relative error {err:.2e}"


@pytest.mark.parametrize("rows, bias", [(129, False), (256, True)])
def test_norm_qkv_rope_launcher_takes_it_and_matches_the_reference(rows, bias):
    from gpu_kernels import load_plugin_kernels
    from kiln.plugins.linear.launch import pick_bucket

    heads, kv_heads, d, k = 32, 8, 128, 4096
    shapes = {"K": k, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": d, "block_size": 16, "bias": bias}
    attrs = {"eps": EPS, "layer": 0, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": d}
    launcher, fns, metas, scratch = load_plugin_kernels("norm_qkv_rope", shapes, attrs, rows)
    assert metas[pick_bucket(metas, rows)].get("cute"), "an sm_90 build with nvcc should take the CuTe qkv here"
    gen = torch.Generator().manual_seed(rows)
    n = (heads + 2 * kv_heads) * d
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16).cuda()
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(torch.bfloat16).cuda()
    b = torch.randn(n, generator=gen).to(torch.bfloat16).cuda() if bias else None
    positions = torch.arange(rows, dtype=torch.int32, device="cuda")
    angles = torch.arange(rows)[:, None].float() * 500000.0 ** (-torch.arange(0, d, 2) / d)
    rope = torch.cat([angles.cos(), angles.sin()], dim=1).cuda()
    slots = torch.arange(rows, dtype=torch.int32, device="cuda")
    cache = torch.zeros(1, 2, -(-rows // 16), 16, kv_heads, d, dtype=torch.bfloat16, device="cuda")
    inputs = [x, None, w, b, None, None, positions, rope, cache, slots]
    ref_cache = cache.clone()
    ref = get_plugin("norm_qkv_rope").call_reference(inputs[:8] + [ref_cache, slots], attrs)
    out = torch.empty(rows, heads * d, dtype=torch.bfloat16, device="cuda")
    launcher.launch(fns, metas, inputs, attrs, out, {"T": rows}, torch.cuda.current_stream().cuda_stream, scratch)
    torch.cuda.synchronize()
    for got, want in ((out, ref), (cache, ref_cache)):
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert err < 1e-2, f"relative error {err:.2e}"
