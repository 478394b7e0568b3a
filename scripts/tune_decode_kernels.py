"""Sweep tile configurations of the decode-path kernels on the GPU (a developer's tool).

    PYTHONPATH=. python3 scripts/tune_decode_kernels.py

Times `linear_kernel` (the GEMM core every fused projection shares) for Llama-3-8B's widest
and narrowest projections at T = 1 and 64, and paged decode attention at several batch sizes,
each configuration in a CUDA graph of 20 launches (median of 5 replays). Prints the bandwidth
each reaches; the best configurations go into plugins/linear/kernels.py TILES and
plugins/attention/kernels.py DECODE by hand.
"""
from __future__ import annotations

import itertools
import statistics

import torch
import triton

from kiln.plugins.attention import kernels as attention
from kiln.plugins.linear.kernels import linear_kernel

REPEAT = 20


def graph_us(fn) -> float:
    """Microseconds per call of `fn`, from a CUDA graph of REPEAT calls."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEAT):
            fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / REPEAT)
    return statistics.median(times)


def sweep_linear() -> None:
    for (n, k), t in itertools.product([(28672, 4096), (4096, 14336)], [1, 64]):
        x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        out = torch.empty(t, n, device="cuda", dtype=torch.bfloat16)
        space = ([16], [16, 32, 64], [128, 256]) if t <= 16 else ([64], [32, 64, 128], [64, 128])
        results = []
        for bm, bn, bk, warps, stages in itertools.product(*space, [4], [3, 4, 6]):
            grid = (triton.cdiv(t, bm), triton.cdiv(n, bn))

            def call():
                linear_kernel[grid](x, w, None, None, out, t, N=n, K=k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                    UPCAST_DOT=False, num_warps=warps, num_stages=stages)
            try:
                us = graph_us(call)
            except Exception as e:  # a config that does not compile or fit is skipped
                print(f"  skip bm{bm} bn{bn} bk{bk} w{warps} s{stages}: {type(e).__name__}")
                continue
            results.append((us, bm, bn, bk, warps, stages))
        results.sort()
        print(f"linear N={n} K={k} T={t}: weights {n * k * 2 / 1e6:.0f} MB")
        for us, bm, bn, bk, warps, stages in results[:6]:
            print(f"  {us:7.1f} us  {n * k * 2 / us / 1e6:6.2f} TB/s  bm{bm} bn{bn} bk{bk} w{warps} s{stages}")


def sweep_attention() -> None:
    heads, kv_heads, head_dim, block_size, max_keys = 32, 8, 128, 16, 4352
    attrs = {"num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim, "layer": 0,
             "scale": head_dim ** -0.5, "window": 0}
    for batch, context in [(1, 128), (1, 2048), (64, 128), (64, 1024), (256, 128)]:
        blocks_per_seq = max_keys // block_size
        cache = torch.randn(1, 2, batch * blocks_per_seq, block_size, kv_heads, head_dim, device="cuda",
                            dtype=torch.bfloat16)
        tables = torch.arange(batch * blocks_per_seq, device="cuda", dtype=torch.int32).view(batch, -1)
        q = torch.randn(batch, heads * head_dim, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        lens = torch.ones(batch, device="cuda", dtype=torch.int32)
        ctx = torch.full((batch,), context, device="cuda", dtype=torch.int32)
        kv_bytes = batch * context * kv_heads * head_dim * 2 * 2
        splits = attention.choose_num_splits(batch, batch, kv_heads, max_keys)
        results = []
        for bm, bn, warps, stages in itertools.product([16], [32, 64, 128], [2, 4], [2, 3]):
            cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
            try:
                us = graph_us(lambda: attention.paged_attention(q, cache, tables, lens, ctx, out, attrs, splits, cfg))
            except Exception as e:
                print(f"  skip {cfg}: {type(e).__name__}")
                continue
            results.append((us, cfg))
        results.sort(key=lambda r: r[0])
        current = next((us for us, cfg in results if cfg == {**attention.DECODE}), None)
        print(f"attention batch {batch} context {context} splits {splits}: KV {kv_bytes / 1e6:.1f} MB, "
              f"current config {current} us")
        for us, cfg in results[:5]:
            print(f"  {us:7.1f} us  {kv_bytes / us / 1e6:6.2f} TB/s  {cfg}")


if __name__ == "__main__":
    sweep_attention()
    sweep_linear()
