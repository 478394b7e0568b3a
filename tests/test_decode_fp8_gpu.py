"""The CUDA decode attention over an e4m3 cache (`plugins/attention/decode_fp8.cu`) on the GPU: built by
nvcc for this GPU and launched by attention's driver launcher, it matches the plugin's PyTorch
reference for decode steps of sequences whose contexts end inside, at and just past 16-key groups and
64-key chunks, one key to thousands, with and without a sliding window, split and not, for GQA groups
of 2, 4 and 8 query heads, head_dim 64 and 128 and 16- and 32-key cache blocks (GPU only:
`pytest -m gpu`); the engine tests cover it in whole decode steps."""
from __future__ import annotations

import pytest
import torch

from gpu_kernels import load_plugin_kernels
from kiln.plugins.attention import decode_fp8
from kiln.plugins.attention.kernels import choose_num_splits
from kiln.plugins.attention.launch import scratch_bytes
from kiln.plugins.attention.reference import paged_attention
from kiln.plugins.fp8 import to_e4m3

pytestmark = pytest.mark.gpu

CONTEXTS = [1, 15, 16, 17, 63, 64, 65, 130, 1000, 3001]
# name -> (heads, kv heads, head_dim, cache block, window, sequences)
CASES = {
    "llama3 few (split)": (32, 8, 128, 16, 0, CONTEXTS),
    "llama3 many (no split)": (32, 8, 128, 16, 0, CONTEXTS * 7),
    "group 8, window 100": (16, 2, 128, 16, 100, CONTEXTS),
    "group 2, d64, block 32": (4, 2, 64, 32, 0, CONTEXTS * 2),
    "group 8, d64, window 40, many": (32, 4, 64, 16, 40, CONTEXTS * 14),
}


@pytest.mark.parametrize("name", list(CASES))
def test_cuda_decode_matches_reference(name: str):
    heads, kv_heads, head_dim, block_size, window, contexts = CASES[name]
    shapes = {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "block_size": block_size, "fp8_kv": True}
    assert decode_fp8.serves("bfloat16", shapes)
    attrs = {"layer": 1, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim,
             "scale": head_dim ** -0.5, "window": window}
    launcher, fns, metas, _ = load_plugin_kernels("attention", shapes, attrs, 1)
    assert "decode_fp8" in [m.get("role") for m in metas]
    gen = torch.Generator().manual_seed(len(contexts) + heads)
    seqs, width = len(contexts), -(-max(contexts) // block_size) + 2
    blocks = sum(-(-n // block_size) for n in contexts) + 1
    # Each sequence's blocks scattered over the pool; table columns past the context hold a block
    # that does not exist, so a read past the context would fault.
    order = torch.randperm(blocks - 1, generator=gen) + 1
    tables = torch.full((seqs, width), 1 << 30, dtype=torch.int32)
    taken = 0
    for s, n in enumerate(contexts):
        used = -(-n // block_size)
        tables[s, :used] = order[taken:taken + used]
        taken += used
    scales = 0.004 + 0.02 * torch.rand(2, 2, kv_heads, generator=gen)
    values = torch.randn(2, 2, blocks, block_size, kv_heads, head_dim, generator=gen)
    cache = to_e4m3(values, scales[:, :, None, None, :, None])
    # v's blocks transposed, as the e4m3 cache holds them (moved as bytes: the CPU has few float8 kernels).
    raw = cache.view(torch.uint8)
    raw[:, 1] = raw[:, 1].permute(0, 1, 3, 4, 2).reshape(raw[:, 1].shape).clone()
    q = torch.randn(seqs, heads * head_dim, generator=gen).to(torch.bfloat16)
    lens = torch.tensor(contexts, dtype=torch.int32)
    ones = torch.ones(seqs, dtype=torch.int32)
    ref = paged_attention(q.float(), cache, tables.clamp(max=blocks - 1), ones, lens, 1, heads, kv_heads, head_dim,
                          attrs["scale"], window, kv_scales=scales).float()

    # NaN bytes (0x7f) in every slot past a context, which the kernel must keep out of its sums.
    gpu_cache = cache.cuda()
    poison = torch.zeros(blocks, block_size, dtype=torch.bool)
    for s, n in enumerate(contexts):
        last, used = tables[s, (n - 1) // block_size], n % block_size
        if used:
            poison[last, used:] = True
    nan = torch.tensor(0x7f, dtype=torch.uint8)
    for which in (0, 1):
        part = gpu_cache[1, which].view(torch.uint8)
        if which == 0:
            part[poison.cuda()] = nan.cuda()
        else:
            part.view(blocks, kv_heads, head_dim, block_size).permute(0, 3, 1, 2)[poison.cuda()] = nan.cuda()
    limits = {"T": seqs, "S": seqs, "B": width, "block_size": block_size, "element_bytes": 2}
    scratch = {k: torch.zeros(n, dtype=torch.uint8, device="cuda") for k, n in scratch_bytes(attrs, limits).items()}
    out = torch.zeros(seqs, heads * head_dim, dtype=torch.bfloat16, device="cuda")
    inputs = [q.cuda(), None, None, gpu_cache, torch.zeros(seqs, dtype=torch.int32, device="cuda"), tables.cuda(),
              ones.cuda(), lens.cuda(), scales.cuda()]
    launcher.launch(fns, metas, inputs, attrs, out, {}, torch.cuda.current_stream().cuda_stream, scratch)
    torch.cuda.synchronize()
    splits = choose_num_splits(seqs, seqs, kv_heads, width * block_size)
    got = out.float().cpu()
    assert torch.isfinite(got).all()
    err = ((got - ref).norm(dim=1) / ref.norm(dim=1)).max().item()
    assert err < 2e-2, f"{name} ({splits} splits): worst relative error of a sequence {err:.2e}"
