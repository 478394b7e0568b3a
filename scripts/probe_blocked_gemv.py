"""Does a tensor-core decode GEMM over 8x8-blocked weights stream them at the CUDA-core GEMV's rate?
(a developer's probe for issue 12's batch 8 and issue 14's FP8 decode; `probe_blocked_gemv.cu` says why)

    PYTHONPATH=. python3 scripts/probe_blocked_gemv.py compile blocked.pkl   # anywhere: nvcc and Triton AOT
    PYTHONPATH=. python3 scripts/probe_blocked_gemv.py run blocked.pkl       # on the GPU

`compile` builds the blocked GEMM's VARIANTS (bf16 and e4m3, each beside its row-major control; 8 or
16 rows of x; row groups a warp; pieces in flight) and, as baselines, the engine's Triton decode bucket of
each of Llama-3-8B's four projections, the CUDA-core GEMV (`plugins/linear/gemv.cu`) and the FP8 GEMV at
one row. `run`, at ROWS rows of x, blocks LAYERS distinct weights of each shape (14 GB in bf16,
7 GB in e4m3: nothing comes from the L2), checks every kernel against torch (a kernel whose result is
off is printed WRONG and left out of the chains), times each alone at every split of K (20 launches
over 20 layers) and then, at each row count, 32-layer chains of (qkv, o, gate/up, down) as a step
orders them, each family's best kernel per shape, against the copy rate measured in the same run.
The questions: at 8 rows, is the blocked GEMM's chain near the GEMV's 3.40 ms at one row (BENCHMARKS.md
session 33: Triton 3.718, CuTe 3.697; issue 12's batch 8 needs about 3.4)? Is the row-major control
as fast (then the engine needs no new layout)? Does the e4m3 one beat the FP8 GEMV at one row (whose
conversions to f16 an MMA of e4m3 does not need; x here is quantized ahead, as a pre-pass would)?
"""
from __future__ import annotations

import pickle
import sys
from pathlib import Path

from scripts.probe_cuda_gemv import LAYERS, RESIDUAL, SHAPES, gemv_kernel, layer_weights
from scripts.sweep import kernel_entry, load

SOURCE = Path(__file__).with_name("probe_blocked_gemv.cu")
WARPS = 8
SIGNATURE = {"x": "*u8", "w": "*u8", "w_scale": "*fp32", "x_scale": "*fp32", "residual": "*bf16", "out": "*bf16",
             "T": "i32", "N": "i32", "row_bytes": "i32", "parts": "i32"}
# (e4m3, blocked weights, halves of 8 rows of x, row groups a warp, pieces of each a lane an iteration), each
# beside its row-major control
VARIANTS = [(fp8, is_blocked, th, r, u) for fp8 in (False, True) for is_blocked in (True, False)
            for th in (1, 2) for r, u in ((1, 4), (1, 8), (2, 4))]
PARTS = (1, 2, 4, 8)
ROWS = (1, 8, 16)   # batch 1 (the GEMV, FP8), 8 (issue 12), 16
GEMV_VARIANTS = [(1, 2)]   # the engine's (T, weight rows a warp) at one row


def block_weights(w):
    """W [N, K] of a 1- or 2-byte type as the kernel reads it: blocks of 8 rows x 16 bytes, a row group's
    blocks in K order (W[n / 8][k / e][n % 8][k % e], e the values in 16 bytes)."""
    n, k = w.shape
    e = 16 // w.element_size()
    return w.view(n // 8, 8, k // e, e).transpose(1, 2).contiguous().view(n, k)


def family(fp8: bool, is_blocked: bool) -> str:
    return f"{'blocked' if is_blocked else 'row-major'} {'e4m3' if fp8 else 'bf16'}"


def kernel(fp8: bool, is_blocked: bool, th: int, r: int, u: int):
    """A variant, compiled appended to the engine's gemv.cu (whose load and launch helpers it uses)."""
    from kiln.plugins.linear import gemv
    from kiln.plugins.nvcc import NvccKernel

    name = f"probe_{family(fp8, is_blocked).replace(' ', '_').replace('-', '_')}_t{8 * th}_r{r}_u{u}"
    call = f"KILN_PROBE_BLOCKED({name}, {str(fp8).lower()}, {str(is_blocked).lower()}, {th}, {r}, {u})"
    return NvccKernel(gemv.SOURCE, name, f"{SOURCE.read_text()}\n{call}", SIGNATURE, WARPS, {"pdl": True})


def serves(n: int, r: int, parts: int) -> bool:
    """Whether N's row groups fill whole blocks of (WARPS / parts) slots of r row groups."""
    return (n // 8) % (r * WARPS // parts) == 0


def compile_all(path: str) -> None:
    import triton

    from kiln.plugins.linear import gemv
    from kiln.plugins.linear.kernels import linear_aot_kernels

    built = {
        "blocked": {v: kernel_entry(kernel(*v)) for v in VARIANTS},
        "gemv": {v: kernel_entry(gemv_kernel(*v)) for v in GEMV_VARIANTS},
        "fp8_gemv": {name: kernel_entry(gemv.linear_kernels("bfloat16", n, k, fp8_weight=True)[0])
                     for name, (n, k) in SHAPES.items()},
        "triton": {name: kernel_entry(next(
            kr for kr in linear_aot_kernels("bfloat16", n, k, bias=False, residual=RESIDUAL[name])
            if kr.meta.get("bucket") == "decode" and (kr.targets is None or "sm_90" in kr.targets)))
            for name, (n, k) in SHAPES.items()},
        "triton_version": triton.__version__,
    }
    with open(path, "wb") as f:
        pickle.dump(built, f)
    print(f"{len(built['blocked'])} blocked GEMMs, {len(built['gemv'])} GEMVs, FP8 GEMVs and Triton decode "
          f"kernels of {len(SHAPES)} shapes -> {path}")


def run_all(path: str) -> None:
    import torch

    from kiln.plugins.driver_launch import grid as eval_grid
    from kiln.plugins.fp8 import dequantize_rows, quantize_rows
    from kiln.plugins.linear.gemv import FP8_LINEAR_ROWS
    from scripts.gpu_timing import copy_rate, replay_ms

    with open(path, "rb") as f:
        built = pickle.load(f)
    copy = copy_rate()
    print(f"device copy {copy:.2f} TB/s; torch {torch.__version__}, triton (compile) {built['triton_version']}")
    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    weights = layer_weights()
    quantized = {name: [quantize_rows(w) for w in ws] for name, ws in weights.items()}
    packed = {("bf16", name): [block_weights(w) for w in ws] for name, ws in weights.items()}
    packed.update({("e4m3", name): [block_weights(q.view(torch.uint8)) for q, _ in qs] for name, qs in quantized.items()})
    kernels = {group: {key: load(entry)[0] for key, entry in built[group].items()}
               for group in ("blocked", "gemv", "fp8_gemv")}
    triton_fns = {name: load(entry) for name, entry in built["triton"].items()}
    part = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    count = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    ones = torch.ones(1 << 16, device="cuda")

    for t in ROWS:
        xs = {name: torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=gen) for name, (n, k) in
              SHAPES.items()}
        xq = {name: quantize_rows(x) for name, x in xs.items()}
        res = {name: torch.randn(t, n, device="cuda", dtype=torch.bfloat16, generator=gen) for name, (n, k) in
               SHAPES.items()}
        outs = {name: torch.empty(t, n, device="cuda", dtype=torch.bfloat16) for name, (n, k) in SHAPES.items()}

        def residual(name: str) -> int:
            return res[name].data_ptr() if RESIDUAL[name] else 0

        def blocked_launch(v: tuple, parts: int):
            fp8, is_blocked, _, r, _ = v

            def launch(name: str, layer: int) -> None:
                n, k = SHAPES[name]
                if is_blocked:
                    w = packed["e4m3" if fp8 else "bf16", name][layer]
                else:
                    w = quantized[name][layer][0] if fp8 else weights[name][layer]
                x, x_scale = (xq[name][0], xq[name][1].data_ptr()) if fp8 else (xs[name], ones.data_ptr())
                w_scale = quantized[name][layer][1].data_ptr() if fp8 else ones.data_ptr()
                kernels["blocked"][v].launch((n * parts // (64 * r), 1, 1),
                                             [x.data_ptr(), w.data_ptr(), w_scale, x_scale, residual(name),
                                              outs[name].data_ptr(), t, n, k * w.element_size(), parts], stream())
            return launch

        def gemv_launch(v: tuple):
            def launch(name: str, layer: int) -> None:
                n, k = SHAPES[name]
                kernels["gemv"][v].launch((n // (WARPS * v[1]), 1, 1),
                                          [xs[name].data_ptr(), weights[name][layer].data_ptr(), 0, residual(name),
                                           outs[name].data_ptr(), n, k], stream())
            return launch

        def fp8_gemv_launch(name: str, layer: int) -> None:
            n, k = SHAPES[name]
            q, scale = quantized[name][layer]
            kernels["fp8_gemv"][name].launch((n // (WARPS * FP8_LINEAR_ROWS), 1, 1),
                                             [xs[name].data_ptr(), q.data_ptr(), scale.data_ptr(), 0, residual(name),
                                              outs[name].data_ptr(), n, k], stream())

        def triton_launch(name: str, layer: int) -> None:
            fn, meta = triton_fns[name]
            args = [xs[name].data_ptr(), weights[name][layer].data_ptr()]
            args += [res[name].data_ptr()] if RESIDUAL[name] else []
            args.append(outs[name].data_ptr())
            args += [part.data_ptr(), count.data_ptr()] if meta["split_k"] > 1 else []
            fn.launch(eval_grid(meta["grid"], {"T": t}), args + [t], stream())

        def reference(name: str, fp8: bool):
            layer = LAYERS - 1
            if fp8:
                ref = dequantize_rows(*xq[name]) @ dequantize_rows(*quantized[name][layer]).T
            else:
                ref = xs[name].float() @ weights[name][layer].float().T
            return ref + res[name].float() if RESIDUAL[name] else ref

        # (family, label, launch, e4m3, whether it serves N) of every kernel serving T rows
        families = [("triton", "triton decode bucket", triton_launch, False, lambda n: True)]
        families += [("gemv", f"cuda gemv r{v[1]}", gemv_launch(v), False, lambda n: True)
                     for v in GEMV_VARIANTS if v[0] == t]
        families += [("fp8 gemv", "fp8 gemv", fp8_gemv_launch, True, lambda n: True)] if t == 1 else []
        families += [(family(fp8, is_blocked), f"{family(fp8, is_blocked)} t{8 * th} r{r} u{u} p{parts}",
                      blocked_launch((fp8, is_blocked, th, r, u), parts), fp8,
                      lambda n, r=r, parts=parts: serves(n, r, parts))
                     for fp8, is_blocked, th, r, u in VARIANTS for parts in PARTS if t <= 8 * th and (th == 1 or t > 8)]
        best: dict[tuple[str, str], tuple[float, object]] = {}
        print(f"T={t}")
        for name, (n, k) in SHAPES.items():
            rows = []
            for fam, label, launch, fp8, fits in families:
                if not fits(n):
                    continue
                outs[name].zero_()
                launch(name, LAYERS - 1)
                torch.cuda.synchronize()
                want = reference(name, fp8)
                err = ((outs[name].float() - want).norm() / want.norm()).item()
                us = replay_ms(lambda: [launch(name, layer) for layer in range(20)]) * 1e3 / 20
                nbytes = n * k * (1 if fp8 else 2)
                rows.append((us, label, err, nbytes))
                if err < 1e-2 and us < best.get((fam, name), (float("inf"),))[0]:
                    best[fam, name] = (us, launch)
            print(f"  {name} {n}x{k}: {n * k * 2 / copy / 1e6:.1f} us bf16 / {n * k / copy / 1e6:.1f} e4m3 at copy")
            for us, label, err, nbytes in sorted(rows):
                flag = "" if err < 1e-2 else "  WRONG"
                print(f"    {us:7.2f} us  {nbytes / us / 1e6:5.2f} TB/s  rel err {err:.1e}  {label}{flag}")
        for fam in dict.fromkeys(f for f, *_ in families):
            if not all((fam, name) in best for name in SHAPES):
                continue
            fns = {name: best[fam, name][1] for name in SHAPES}
            ms = replay_ms(lambda: [fns[name](name, layer) for layer in range(LAYERS) for name in SHAPES])
            nbytes = sum(n * k for n, k in SHAPES.values()) * LAYERS * (1 if "e4m3" in fam or "fp8" in fam
                                                                          else 2)
            rate = nbytes / ms / 1e9
            print(f"  chain T={t} {fam:12s} {ms:.3f} ms  {rate:.2f} TB/s ({rate / copy:.1%} of copy)")


if __name__ == "__main__":
    {"compile": compile_all, "run": run_all}[sys.argv[1]](sys.argv[2])
