"""The CuTe prefill attention (`plugins.attention.prefill_sm90`) on an H200 (GPU only: `pytest -m gpu`):
built by nvcc, loaded through `runtime.cuda_driver` and launched on its TMA descriptors, it matches the
attention plugin's reference for Llama-3-8B's heads (GQA 4) and for plain multi-head attention, for prompts
of one block's tokens to several tiles of keys, with a cached prefix before a chunk, behind a mixed step's
decode rows (which it leaves alone), with cache blocks in no order, in a cache's second layer, with a block
a tile or persistent (7 blocks walking every tile, so that each reuses its query buffers and stages many
times; one per SM), and it writes no row of another sequence's or past T; and the attention plugin's
launcher takes it for a chunk of a prompt and matches the reference."""
from __future__ import annotations

import functools

import pytest
import torch

from kiln.plugins.aot import compile_cubin
from kiln.plugins.attention import prefill_sm90
from kiln.plugins.attention.reference import paged_attention

pytestmark = pytest.mark.gpu

# (heads, kv_heads, decode rows in front, [(query tokens, cached tokens before them)] of the prompts)
CASES = [(32, 8, 0, [(2048, 0)]), (32, 8, 2, [(300, 0), (129, 40)]), (8, 8, 0, [(16, 0), (1000, 500)]),
         (16, 2, 3, [(1, 0), (255, 257), (128, 0)])]


@functools.cache
def loaded(block_n: int, stages: int, schedule: str):
    """The kernel at a tiling, built and loaded once for every case."""
    from kiln.runtime.cuda_driver import load_kernel

    kernel = prefill_sm90.kernel(block_n, stages, schedule)
    cubin = compile_cubin(kernel, "sm_90")
    return load_kernel(cubin.binary, cubin.name, list(kernel.signature.values()), cubin.num_warps, cubin.shared_bytes,
                       cubin.global_scratch)


@pytest.mark.parametrize("block_n, stages, schedule", [(128, 2, "plain"), (128, 2, "pingpong"), (64, 3, "pingpong"),
                                                       (128, 2, "overlap"), (64, 3, "overlap")])
@pytest.mark.parametrize("heads, kv_heads, decodes, prompts", CASES)
@pytest.mark.parametrize("sms", [None, 7, "device"])
def test_cute_prefill_matches_the_reference(heads, kv_heads, decodes, prompts, block_n, stages, schedule, sms):
    fn = loaded(block_n, stages, schedule)
    if sms == "device":
        sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator().manual_seed(heads + decodes + len(prompts))
    d, size = prefill_sm90.HEAD_DIM, prefill_sm90.BLOCK_SIZE
    query_lens = [1] * decodes + [n for n, _ in prompts]
    context_lens = [int(torch.randint(1, 600, (1,), generator=gen)) for _ in range(decodes)]
    context_lens += [n + cached for n, cached in prompts]
    blocks_of = [-(-c // size) for c in context_lens]
    order = torch.randperm(sum(blocks_of) + 4, generator=gen)
    width = max(blocks_of)
    tables = torch.zeros(len(query_lens), width, dtype=torch.int32)
    used = 0
    for s, count in enumerate(blocks_of):
        tables[s, :count] = order[used:used + count]
        used += count
    # Finite values in every slot, the unused ones too, as a cache's are (zeroed, then written with keys).
    cache = torch.randn(2, 2, sum(blocks_of) + 4, size, kv_heads, d, generator=gen).to(torch.bfloat16).cuda()
    tokens = sum(query_lens)
    q = torch.randn(tokens, heads * d, generator=gen).to(torch.bfloat16).cuda()
    tables, qlens, clens = tables.cuda(), torch.tensor(query_lens, dtype=torch.int32).cuda(), \
        torch.tensor(context_lens, dtype=torch.int32).cuda()
    scale = d ** -0.5
    ref = paged_attention(q.cpu(), cache.cpu(), tables.cpu(), qlens.cpu(), clens.cpu(), 1, heads, kv_heads, d, scale,
                          0).cuda()
    buffer = torch.full((tokens + 3, heads * d), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = buffer[:tokens]
    prefill_sm90.launch(fn, q, cache[1, 0], cache[1, 1], out, tables, qlens, clens, decodes, heads, scale,
                        torch.cuda.current_stream().cuda_stream, sms)
    torch.cuda.synchronize()
    assert torch.isnan(out[:decodes]).all(), "the decode rows were written"
    assert torch.isnan(buffer[tokens:]).all(), "rows past T were written"
    got, want = out[decodes:].float(), ref[decodes:].float()
    err = ((got - want).norm() / want.norm()).item()
    assert err < 1e-2, f"relative error {err:.2e}"


def test_attention_launcher_takes_it_and_matches_the_reference():
    from gpu_kernels import load_plugin_kernels

    heads, kv_heads, d, size = 32, 8, 128, 16
    shapes = {"heads": heads, "kv_heads": kv_heads, "head_dim": d, "block_size": size}
    attrs = {"layer": 0, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": d, "scale": d ** -0.5, "window": 0}
    query_lens, context_lens = [300], [340]   # a chunk after 40 cached tokens
    tokens = sum(query_lens)
    launcher, fns, metas, scratch = load_plugin_kernels("attention", shapes, attrs, tokens)
    assert any(m.get("role") == "prefill_cute" for m in metas), "an sm_90 build with nvcc should hold the CuTe prefill"
    gen = torch.Generator().manual_seed(7)
    tables = torch.randperm(22, generator=gen).view(1, 22).to(torch.int32)
    cache = torch.randn(1, 2, 22, size, kv_heads, d, generator=gen).to(torch.bfloat16)
    q = torch.randn(tokens, heads * d, generator=gen).to(torch.bfloat16)
    qlens, clens = torch.tensor(query_lens, dtype=torch.int32), torch.tensor(context_lens, dtype=torch.int32)
    ref = paged_attention(q, cache, tables, qlens, clens, 0, heads, kv_heads, d, attrs["scale"], 0)
    out = torch.empty(tokens, heads * d, dtype=torch.bfloat16, device="cuda")
    inputs = [q.cuda(), None, None, cache.cuda(), torch.zeros(tokens, dtype=torch.int32).cuda(), tables.cuda(),
              qlens.cuda(), clens.cuda()]
    launcher.launch(fns, metas, inputs, attrs, out, {"T": tokens, "S": 1},
                    torch.cuda.current_stream().cuda_stream, scratch)
    torch.cuda.synchronize()
    err = ((out.float().cpu() - ref.float()).norm() / ref.float().norm()).item()
    assert err < 1e-2, f"relative error {err:.2e}"
