"""Time the GEMM kernels a Llama-3-8B engine runs, bf16 beside FP8 (W8A8), the way the engine runs
them (a developer's tool, for issue 14's H200 run).

    PYTHONPATH=. python3 scripts/bench_fp8_gemm.py compile gemms.pkl [TARGET]  # anywhere: AOT, no GPU (sm_90)
    PYTHONPATH=. python3 scripts/bench_fp8_gemm.py run gemms.pkl RESULTS.txt   # on the GPU

Where `tune_gemm.py` and `tune_prefill_gemm.py` sweep tilings of one kernel, this times each
projection's whole GEMM op at every bucket, through the plugin's own driver launcher (`launch.py`)
with the cubins its `aot_kernels` gives (the FP8 quantize pre-pass and the norm row-scale
pre-pass included), as the CUDA executor does. Projections: qkv (norm_qkv_rope, 4096 -> 6144),
o_proj (the GEMM of attention_o_proj: linear_residual, 4096 -> 4096), gate/up (norm_swiglu,
4096 -> 2 x 14336) and down (linear_residual, 14336 -> 4096), at T = 1, 8, 64, 256 and 4096.

Variants: "bf16 engine" and "fp8 engine" (the engine's kernels for each dtype), each again as ", Triton"
(its CUDA C++ kernels left out, as in an engine built without nvcc: the Triton tiles of every bucket),
cuBLAS bf16 (torch.mm) and cuBLAS FP8 (torch._scaled_mm with per-row scales, where
this torch has it; x quantized by torch outside the timing). Each is checked against the op in
float32 with the weights it was given (FP8: the dequantized e4m3 weights, so the error shown is
the activations' quantization, about 2-3%) and against the plugin's own reference on the same
inputs (W8A8 for FP8: only the order of the sums differs, so about a bf16 rounding), then timed in a CUDA graph of 20 launches (median
of 5 replays) cycling through weight copies of 200 MB, 4x the H200's L2. A GPU check first
compares the quantize pre-pass with `plugins.fp8.quantize_rows` bit for bit (the hardware cast).

Printed, and written to RESULTS.txt: per projection and T, each variant's time, weight bytes per
us as TB/s and as a share of the device copy rate measured in the same run, TFLOP/s, and its
speed-up over the bf16 engine kernels; then each T's four projections summed (one layer's GEMMs).
"""
from __future__ import annotations

import importlib
import itertools
import os
import pickle
import sys

from kiln.plugins.aot import compile_cubin
from kiln.plugins.nvcc import NvccKernel
from scripts.gpu_timing import graph_us

L2_ROTATION = 200_000_000
# KILN_BENCH_ROWS=1,64,448 times other row counts (the compile and run calls must agree).
ROWS = tuple(int(r) for r in os.environ.get("KILN_BENCH_ROWS", "1,8,64,256,4096").split(","))
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
EPS = 1e-5
# projection: (plugin, compile shapes, weight rows, K)
PROJECTIONS = {
    "qkv": ("norm_qkv_rope", {"K": 4096, "num_heads": HEADS, "num_kv_heads": KV_HEADS, "head_dim": HEAD_DIM}, 6144,
            4096),
    "o_proj": ("linear_residual", {"K": 4096, "N": 4096}, 4096, 4096),
    "gate_up": ("norm_swiglu", {"K": 4096, "I": 14336, "block": 64}, 28672, 4096),
    "down": ("linear_residual", {"K": 14336, "N": 4096}, 4096, 14336),
}
ATTRS = {"linear_residual": {"parallel": "none", "heads": 0, "all_reduce": False},
         "norm_swiglu": {"eps": EPS, "block": 64, "activation": "silu"},
         "norm_qkv_rope": {"eps": EPS, "layer": 0, "num_heads": HEADS, "num_kv_heads": KV_HEADS, "head_dim": HEAD_DIM}}


VARIANTS = ("bf16 engine", "fp8 engine", "bf16 engine, Triton", "fp8 engine, Triton")


def variants(plugin: str, shapes: dict) -> dict[str, list]:
    """Each engine variant's kernels for a projection, in aot_kernels order (VARIANTS): as an engine holds
    them, and without the CUDA C++ ones (the GEMVs, the CuTe GEMMs), as one built without nvcc does."""
    kernels = importlib.import_module(f"kiln.plugins.{plugin}.kernels")
    engine = {"bf16 engine": kernels.aot_kernels("bfloat16", shapes),
              "fp8 engine": kernels.aot_kernels("bfloat16", {**shapes, "fp8": True})}
    return {**engine, **{f"{name}, Triton": [k for k in ks if not isinstance(k, NvccKernel)]
                         for name, ks in engine.items()}}


def compile_all(path: str, target: str = "sm_90") -> None:
    entries = {}
    for name, (plugin, shapes, _, _) in PROJECTIONS.items():
        for variant, kernels in variants(plugin, shapes).items():
            mine = [k for k in kernels if k.targets is None or target in k.targets]
            entries[(name, variant)] = [([s for s in k.signature.values() if s != "constexpr"], k.meta,
                                         compile_cubin(k, target)) for k in mine]
            print(f"{name} {variant}: {len(mine)} kernels", flush=True)
    with open(path, "wb") as f:
        pickle.dump({"target": target, "entries": entries}, f)


def _inputs(plugin: str, t: int, k: int, weight, scale, gen) -> tuple[list, object]:
    """The op's inputs (the weight and, for FP8, its scales in the places the launchers read
    them) and the output tensor."""
    import torch

    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    tail = [scale] if scale is not None else []
    if plugin == "linear_residual":
        n = weight.shape[0]
        residual = torch.randn(t, n, device="cuda", dtype=torch.bfloat16, generator=gen)
        return [x, weight, None, residual, *tail], torch.empty(t, n, device="cuda", dtype=torch.bfloat16)
    if plugin == "norm_swiglu":
        return [x, None, weight, *tail], torch.empty(t, weight.shape[0] // 2, device="cuda", dtype=torch.bfloat16)
    positions = torch.arange(t, dtype=torch.int32, device="cuda")
    angles = positions[:, None].float() * 500000.0 ** (-torch.arange(0, HEAD_DIM, 2, device="cuda") / HEAD_DIM)
    rope = torch.cat([angles.cos(), angles.sin()], dim=1).contiguous()
    kv = torch.zeros(1, 2, -(-t // 16), 16, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    inputs = [x, None, weight, None, None, None, positions, rope, kv, positions.clone(), None, *tail]  # no kv_scales
    return inputs, torch.empty(t, HEADS * HEAD_DIM, device="cuda", dtype=torch.bfloat16)


def _reference(plugin: str, inputs: list, weight) -> object:
    """The op in float32 with `weight` (bf16, or the dequantized e4m3 one) and x unquantized."""
    from kiln.plugins import get_plugin

    spec = get_plugin(plugin)
    # Up to the weight's scale inputs, which come last in every GEMM spec (after kv_scales).
    count = min((i for i, name in enumerate(spec.inputs) if name.endswith("_scale?")), default=len(spec.inputs))
    given = [t.float() if t is not None and t.is_floating_point() else t for t in inputs[:count]]
    given[2 if plugin != "linear_residual" else 1] = weight.float()
    if plugin == "norm_qkv_rope":
        given[8] = given[8].clone()
    return spec.call_reference(given, ATTRS[plugin])


def _own_reference(plugin: str, inputs: list) -> object:
    """The plugin's own reference on the same inputs (W8A8 for FP8: x quantized the same way), in
    the activation dtype: what the kernels should give up to the order of their sums."""
    from kiln.plugins import get_plugin

    given = list(inputs)
    if plugin == "norm_qkv_rope":
        given[8] = given[8].clone()
    return get_plugin(plugin).call_reference(given, ATTRS[plugin])


def _check_quantize(loaded: dict) -> str:
    """The FP8 pre-pass on the GPU (the hardware e4m3 cast) against plugins.fp8.quantize_rows on
    the CPU."""
    import torch

    from kiln.plugins.fp8 import quantize_rows
    from kiln.plugins.linear.launch import launch_quantize

    fns, metas = loaded[("o_proj", "fp8 engine")]
    x = torch.randn(300, 4096, device="cuda", dtype=torch.bfloat16) * 3
    scratch = {"fp8_x": torch.empty(300 * 4096, device="cuda", dtype=torch.uint8),
               "fp8_x_scale": torch.empty(300 * 4, device="cuda", dtype=torch.uint8)}
    launch_quantize(fns, metas, x, None, 0.0, torch.cuda.current_stream().cuda_stream, scratch)
    torch.cuda.synchronize()
    xq, scales = quantize_rows(x.cpu())
    got_q = scratch["fp8_x"].view(300, 4096).cpu()
    same_q = torch.equal(got_q, xq.view(torch.uint8))
    same_s = torch.equal(scratch["fp8_x_scale"].view(torch.float32).cpu(), scales)
    return f"quantize pre-pass vs plugins.fp8.quantize_rows: values {'identical' if same_q else 'DIFFER'}, " \
           f"scales {'identical' if same_s else 'DIFFER'}"


def run_all(path: str, results: str) -> None:
    import torch

    from kiln.plugins.driver_launch import sm_count
    from kiln.plugins.fp8 import dequantize_rows, quantize_rows
    from kiln.runtime.cuda_driver import load_kernel
    from kiln.runtime.cuda_executor import kernel_scratch

    with open(path, "rb") as f:
        blob = pickle.load(f)
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_tbs = 2 * src.numel() / graph_us(lambda: dst.copy_(src)) / 1e6
    src = dst = None
    say(f"{torch.cuda.get_device_name()} ({blob['target']} cubins), {sm_count()} SMs; device copy "
        f"{copy_tbs:.2f} TB/s (read + written)")
    limits = {"T": max(ROWS), "S": max(ROWS), "B": 256, "block_size": 16, "element_bytes": 2}
    global_scratch = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    loaded = {}
    for key, kernels in blob["entries"].items():
        fns = []
        for signature, meta, cubin in kernels:
            fn = load_kernel(cubin.binary, cubin.name, signature, cubin.num_warps, cubin.shared_bytes,
                             cubin.global_scratch)
            fn.scratch = (global_scratch.data_ptr(), global_scratch.numel() // max(cubin.global_scratch, 1))
            fns.append(fn)
        loaded[key] = (fns, [meta for _, meta, _ in kernels])
    say(_check_quantize(loaded))
    gen = torch.Generator(device="cuda").manual_seed(0)
    totals: dict[tuple[int, str], float] = {}
    for name, (plugin, shapes, rows, k) in PROJECTIONS.items():
        w = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k ** -0.5
        wq, ws = quantize_rows(w)
        copies = {"bf16": [w] + [w.clone() for _ in range(-(-L2_ROTATION // w.nbytes) - 1)],
                  "fp8": [wq] + [wq.clone() for _ in range(-(-L2_ROTATION // wq.nbytes) - 1)]}
        launcher = importlib.import_module(f"kiln.plugins.{plugin}.launch")
        for t in ROWS:
            rows_out = []
            for variant in VARIANTS:
                fns, metas = loaded[(name, variant)]
                fp8 = variant.startswith("fp8")
                weights = copies["fp8" if fp8 else "bf16"]
                inputs, out = _inputs(plugin, t, k, weights[0], ws if fp8 else None, gen)
                sizes = launcher.scratch_bytes(ATTRS[plugin], limits) if hasattr(launcher, "scratch_bytes") else {}
                for meta in metas:
                    for sname, nbytes in kernel_scratch(meta, limits).items():
                        sizes[sname] = max(sizes.get(sname, 0), nbytes)
                scratch = {sname: torch.zeros(n, dtype=torch.uint8, device="cuda") for sname, n in sizes.items()}
                slot = 2 if plugin != "linear_residual" else 1
                arg_sets = [inputs[:slot] + [wc] + inputs[slot + 1:] for wc in weights]
                turn = itertools.count()

                def call():
                    launcher.launch(fns, metas, arg_sets[next(turn) % len(arg_sets)], ATTRS[plugin], out, {"T": t},
                                    torch.cuda.current_stream().cuda_stream, scratch)
                launcher.launch(fns, metas, inputs, ATTRS[plugin], out, {"T": t},
                                torch.cuda.current_stream().cuda_stream, scratch)
                torch.cuda.synchronize()
                ref = _reference(plugin, inputs, dequantize_rows(wq, ws) if fp8 else w)
                err = ((out.float() - ref).norm() / ref.norm()).item()
                own = _own_reference(plugin, inputs).float()
                own_err = ((out.float() - own).norm() / own.norm()).item()
                rows_out.append((graph_us(call), variant, (err, own_err), weights[0].nbytes))
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            out = torch.empty(t, rows, device="cuda", dtype=torch.bfloat16)
            turn = itertools.count()
            us = graph_us(lambda: torch.mm(x, copies["bf16"][next(turn) % len(copies["bf16"])].T, out=out))
            rows_out.append((us, "cuBLAS bf16 torch.mm", None, w.nbytes))
            rows_out += _scaled_mm(x, copies["fp8"], ws)
            _report(say, name, t, rows, k, rows_out, copy_tbs, totals)
    say("one layer's four projections (sum over qkv, o_proj, gate_up, down):")
    for t in ROWS:
        bf16 = totals.get((t, "bf16 engine"))
        for variant in VARIANTS:
            if (t, variant) in totals:
                us = totals[(t, variant)]
                say(f"  T={t:5d} {variant:26s} {us:9.1f} us  {bf16 / us:5.2f}x bf16")
    with open(results, "w") as f:
        f.write("\n".join(lines) + "\n")


def _scaled_mm(x, weights: list, w_scale) -> list[tuple]:
    """cuBLAS FP8 (torch._scaled_mm, per-row scales) on the same weights; [] where unsupported."""
    import torch

    from kiln.plugins.fp8 import quantize_rows

    xq, xs = quantize_rows(x)
    turn = itertools.count()
    try:
        def call():
            torch._scaled_mm(xq, weights[next(turn) % len(weights)].T, scale_a=xs[:, None], scale_b=w_scale[None, :],
                             out_dtype=torch.bfloat16)
        return [(graph_us(call), "cuBLAS fp8 torch._scaled_mm (x quantized beforehand)", None,
                 weights[0].nbytes)]
    except (RuntimeError, TypeError) as e:
        print(f"  torch._scaled_mm unavailable: {str(e)[:120]}")
        return []


def _report(say, name: str, t: int, rows: int, k: int, results: list, copy_tbs: float, totals: dict) -> None:
    flops = 2 * t * rows * k
    bf16 = next(us for us, variant, _, _ in results if variant == "bf16 engine")
    say(f"{name} N={rows} K={k} T={t}:")
    for us, variant, err, nbytes in sorted(results, key=lambda r: r[0]):
        tbs = nbytes / us / 1e6
        check = "" if err is None else (f"  rel err {err[0]:.1e} vs exact, {err[1]:.1e} vs its reference"
                                        f"{'  WRONG' if not (err[0] < 0.06 and err[1] < 1e-2) else ''}")
        say(f"  {us:8.1f} us  {tbs:5.2f} TB/s of weights ({tbs / copy_tbs:4.0%} of copy)  {flops / us / 1e6:6.0f} "
            f"TFLOP/s  {bf16 / us:5.2f}x bf16 engine  {variant}{check}")
        if variant in VARIANTS:
            totals[(t, variant)] = totals.get((t, variant), 0.0) + us


if __name__ == "__main__":
    {"compile": compile_all, "run": run_all}[sys.argv[1]](*sys.argv[2:])
