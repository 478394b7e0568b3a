"""Can the decode step's idle bandwidth during attention pull o_proj's weight into the L2?
(a developer's probe)

    PYTHONPATH=. python3 scripts/probe_l2_prefetch.py compile cubins.pkl   # anywhere: AOT
    PYTHONPATH=. python3 scripts/probe_l2_prefetch.py run cubins.pkl OUT   # on the GPU

At batch 1, decode attention runs on a few dozen programs and reads little, then o_proj streams
34 MB at well under the copy rate (its ramp and tail). Here a stand-in for attention (`busy`:
BUSY programs that each wait BUSY_NS) is launched with extra programs that fetch o_proj's weight
(MODE 1: `prefetch.global.L2` per 128-byte line; MODE 2: plain loads summed into a sink), then
the engine's o_proj kernel (linear_residual's decode bucket, cubins through the driver) runs on
that weight. Every call takes the next of six weight copies (200 MB, 4x the L2), in a CUDA graph.
Measured on an H200 on 2026-12-01 (BENCHMARKS.md): the prefetches change nothing, and with the
weight really in the L2 (the loads) o_proj still takes 8.7 us against 11.6 from memory, so there
is little to win this way; Kiln does not prefetch.
"""
from __future__ import annotations

import itertools
import pickle
import sys

import triton
import triton.language as tl

from kiln.plugins.aot import AotKernel, compile_cubin, pointer_params
from scripts.gpu_timing import graph_us

N = K = 4096
BUSY_PROGRAMS, BUSY_NS = 32, 5000
BLOCK = tl.constexpr(1024)      # lines a program touches per iteration


@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def busy_fetch_kernel(w_ptr, sink_ptr, NBYTES: tl.constexpr, BUSY: tl.constexpr, WAIT_NS: tl.constexpr,
                      MODE: tl.constexpr, STRIDE: tl.constexpr):
    """Programs below BUSY wait WAIT_NS; the rest fetch NBYTES at w_ptr, shared evenly: MODE 1
    one `prefetch.global.L2` every STRIDE bytes, MODE 2 every byte loaded (16 bytes a thread)."""
    pid = tl.program_id(0)
    if pid < BUSY:
        start = _now()
        now = start
        while now - start < WAIT_NS:
            now = _now()
        return
    if MODE == 0:
        return
    fetchers = tl.num_programs(0) - BUSY
    units: tl.constexpr = NBYTES // STRIDE
    per = tl.cdiv(units, fetchers)
    lo = (pid - BUSY) * per
    total = tl.zeros((BLOCK,), tl.int32)
    for i in range(0, per, BLOCK):
        unit = lo + i + tl.arange(0, BLOCK)
        ok = (unit < units) & (i + tl.arange(0, BLOCK) < per)
        if MODE == 1:
            ptrs = w_ptr + tl.where(ok, unit, 0).to(tl.int64) * STRIDE
            total += tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                                               dtype=tl.int32, is_pure=False, pack=1)
        else:   # STRIDE 4: w_ptr read as int32
            total += tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + unit.to(tl.int64), mask=ok, other=0,
                             cache_modifier=".cg")
    tl.store(sink_ptr + pid, tl.sum(total))


def kernels() -> dict:
    from kiln.plugins.linear_residual.kernels import aot_kernels

    out = {"o_proj": [k for k in aot_kernels("bfloat16", {"K": K, "N": N}) if k.meta.get("bucket") == "decode"
                      and (k.targets is None or "sm_90" in k.targets)]}
    signature = {"w_ptr": "*i8", "sink_ptr": "*i32", "NBYTES": "constexpr", "BUSY": "constexpr",
                 "WAIT_NS": "constexpr", "MODE": "constexpr"}
    signature["STRIDE"] = "constexpr"
    for mode, stride in ((0, 4), (1, 128), (1, 32), (2, 4)):
        for warps in (4, 8):
            out[f"fetch{mode}s{stride}w{warps}"] = [AotKernel(
                busy_fetch_kernel, signature, {"NBYTES": N * K * 2, "BUSY": BUSY_PROGRAMS, "WAIT_NS": BUSY_NS,
                                               "MODE": mode, "STRIDE": stride}, num_warps=warps, num_stages=1,
                aligned=pointer_params(signature), meta={})]
    return out


def compile_all(path: str) -> None:
    blob = {name: [([s for s in k.signature.values() if s != "constexpr"], k.meta, compile_cubin(k, "sm_90"))
                   for k in ks] for name, ks in kernels().items()}
    with open(path, "wb") as f:
        pickle.dump(blob, f)


def run_all(path: str, results: str) -> None:
    import torch

    from kiln.plugins.linear_residual import launch as o_launch
    from kiln.runtime.cuda_driver import load_kernel
    from kiln.runtime.cuda_executor import kernel_scratch

    with open(path, "rb") as f:
        blob = pickle.load(f)
    loaded = {}
    for name, entries in blob.items():
        loaded[name] = ([load_kernel(c.binary, c.name, sig, c.num_warps, c.shared_bytes, c.global_scratch)
                         for sig, _, c in entries], [meta for _, meta, _ in entries])
    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    weights = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5 for _ in range(6)]
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(1, N, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(1, N, device="cuda", dtype=torch.bfloat16)
    sink = torch.zeros(4096, dtype=torch.int32, device="cuda")
    fns, metas = loaded["o_proj"]
    limits = {"T": 16, "S": 16, "B": 64, "block_size": 16, "element_bytes": 2}
    sizes: dict[str, int] = {}
    for meta in metas:
        for name, nbytes in kernel_scratch(meta, limits).items():
            sizes[name] = max(sizes.get(name, 0), nbytes)
    scratch = {name: torch.zeros(n, dtype=torch.uint8, device="cuda") for name, n in sizes.items()}
    attrs = {"parallel": "none", "heads": 0, "all_reduce": False}

    def o_proj(w):
        o_launch.launch(fns, metas, [x, w, None, residual], attrs, out, {"T": 1}, stream(), scratch)

    def fetch(name, fetchers, w):
        fn = loaded[name][0][0]
        fn.launch((BUSY_PROGRAMS + fetchers, 1, 1), [w.data_ptr(), sink.data_ptr()], stream())

    o_proj(weights[0])
    torch.cuda.synchronize()
    ref = (x.float() @ weights[0].float().T + residual.float())
    lines = [f"{torch.cuda.get_device_name()}: o_proj check, max error {(out.float() - ref).abs().max().item():.3e}"]
    cases = {"o_proj alone": lambda w: o_proj(w)}
    for warps in (4, 8):
        idle = f"fetch0s4w{warps}"
        cases[f"busy alone (w{warps})"] = lambda w, n=idle: fetch(n, 0, w)
        cases[f"busy, then o_proj (w{warps})"] = lambda w, n=idle: (fetch(n, 0, w), o_proj(w))
        for name, label in ((f"fetch1s128w{warps}", "prefetch.L2/128B"), (f"fetch1s32w{warps}", "prefetch.L2/32B"),
                            (f"fetch2s4w{warps}", "loads")):
            for fetchers in (64, 100, 200):
                tag = f"{label} w{warps} x{fetchers}"
                cases[f"busy+{tag} alone"] = lambda w, n=name, f=fetchers: fetch(n, f, w)
                cases[f"busy+{tag}, then o_proj"] = lambda w, n=name, f=fetchers: (fetch(n, f, w), o_proj(w))
    for label, fn in cases.items():
        turn = itertools.count()
        us = graph_us(lambda: fn(weights[next(turn) % len(weights)]))
        lines.append(f"{us:8.2f} us  {label}")
        print(lines[-1], flush=True)
    with open(results, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    {"compile": compile_all, "run": run_all}[sys.argv[1]](*sys.argv[2:])
