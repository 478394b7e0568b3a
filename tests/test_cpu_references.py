"""What the CPU references compute, checked against plain PyTorch: `project`'s GEMM in a 16-bit dtype is a
float32 GEMM rounded once (plugins/wide.py says why), over weights widened once; and the paged attention
reference, which takes a step's sequences with the same number of new tokens together, gives each query row
what attention over its own sequence's keys gives."""
from __future__ import annotations

import pytest
import torch

from kiln.plugins.attention.reference import paged_attention, write_kv
from kiln.plugins.fp8 import FP8, quantize_rows
from kiln.plugins.linear.reference import project
from kiln.plugins.wide import widened


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_projection_is_a_float32_gemm_rounded_once(dtype):
    torch.manual_seed(0)
    x, w, b = torch.randn(37, 384, dtype=dtype), torch.randn(96, 384, dtype=dtype), torch.randn(96, dtype=dtype)
    want = (x.float() @ w.float().t() + b.float()).to(dtype)
    assert torch.equal(project(x, w, None, b), want)
    assert torch.equal(project(x, w, None), (x.float() @ w.float().t()).to(dtype))


def test_a_cpu_weight_is_widened_once_and_again_after_a_write():
    for w in (quantize_rows(torch.randn(8, 16))[0], torch.randn(8, 16, dtype=torch.bfloat16)):
        first = widened(w)
        assert widened(w) is first and torch.equal(first, w.float())
        w[0, 0] = torch.tensor(1.0).to(w.dtype)
        assert widened(w) is not first and torch.equal(widened(w), w.float())


HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 2, 16, 4


def _step(query_lens: list[int], context_lens: list[int], window: int, kv_dtype: torch.dtype, seed: int = 0):
    """A step's q and a cache holding each sequence's keys in shuffled blocks; every slot no sequence holds is
    NaN and every table entry past a sequence's own blocks is out of range, so that a read of either shows."""
    torch.manual_seed(seed)
    blocks_needed = [-(-c // BLOCK) for c in context_lens]
    num_blocks = sum(blocks_needed) + 3
    order = torch.randperm(num_blocks)
    tables = torch.full((len(context_lens), max(blocks_needed) + 2), 10 ** 6, dtype=torch.int32)
    cache = torch.full((2, 2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM), float("nan")).to(kv_dtype)
    scales = torch.rand(2, 2, KV_HEADS) + 0.5 if kv_dtype == FP8 else None
    keys, used = [], 0
    for s, (ctx, need) in enumerate(zip(context_lens, blocks_needed)):
        tables[s, :need] = order[used:used + need].to(torch.int32)
        used += need
        k, v = torch.randn(ctx, KV_HEADS, HEAD_DIM), torch.randn(ctx, KV_HEADS, HEAD_DIM)
        slots = tables[s, torch.arange(ctx) // BLOCK].long() * BLOCK + torch.arange(ctx) % BLOCK
        write_kv(cache, 1, k, v, slots, scales)
        keys.append((k, v))
    q = torch.randn(sum(query_lens), HEADS * HEAD_DIM)
    return q, cache, tables, keys, scales


def _one_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """Causal attention of q's n rows, the last n positions of k and v, with grouped heads, by SDPA."""
    n, ctx = len(q), len(k)
    q_pos, k_pos = torch.arange(ctx - n, ctx)[:, None], torch.arange(ctx)[None, :]
    allowed = (k_pos <= q_pos) & ((q_pos - k_pos < window) if window > 0 else True)
    heads = q.view(n, HEADS, HEAD_DIM).transpose(0, 1)
    k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1) for t in (k, v))
    o = torch.nn.functional.scaled_dot_product_attention(heads, k, v, attn_mask=allowed, scale=HEAD_DIM ** -0.5)
    return o.transpose(0, 1).reshape(n, -1)


@pytest.mark.parametrize("kv_dtype", [torch.float32, FP8])
@pytest.mark.parametrize("window", [0, 6])
def test_paged_attention_gives_each_row_its_own_sequences_attention(window, kv_dtype):
    # Three decode rows, two chunks of 5 new tokens and one of 3, at contexts inside, at and past block ends.
    query_lens, context_lens = [1, 5, 1, 3, 5, 1], [9, 12, 1, 3, 5, 16]
    q, cache, tables, keys, scales = _step(query_lens, context_lens, window, kv_dtype)
    got = paged_attention(q, cache, tables, torch.tensor(query_lens, dtype=torch.int32),
                          torch.tensor(context_lens, dtype=torch.int32), 1, HEADS, KV_HEADS, HEAD_DIM,
                          HEAD_DIM ** -0.5, window, scales)
    start = 0
    for s, n in enumerate(query_lens):
        k, v = keys[s]
        if scales is not None:  # what the cache holds: the e4m3 rounding of value / scale, times the scale
            k, v = ((t / scales[1, i][:, None]).to(FP8).float() * scales[1, i][:, None] for i, t in enumerate((k, v)))
        want = _one_sequence(q[start:start + n], k, v, window)
        torch.testing.assert_close(got[start:start + n], want, rtol=1e-5, atol=1e-5, msg=f"sequence {s}")
        start += n
