"""Is a CUDA C++ decode GEMV, with programmatic dependent launch, faster than the engine's Triton
decode GEMMs? (a developer's probe)

    PYTHONPATH=. python3 scripts/probe_cuda_gemv.py compile probe.pkl   # anywhere: nvcc and Triton AOT
    PYTHONPATH=. python3 scripts/probe_cuda_gemv.py run probe.pkl       # on the GPU
    PYTHONPATH=. python3 scripts/probe_cuda_gemv.py engine probe.pkl    # on the GPU: the engine's kernels only

At batch 1 the narrow projections of a decode step (qkv, o_proj, down) stream their weights at
2.8-3.8 TB/s where gate/up reaches 4.1: BENCHMARKS.md puts the rest in per-kernel overheads that
Triton's tiles could not remove (split-K's reduction, the pipeline's ramp, the launch). The CUDA
kernel (`probe_cuda_gemv.cu`) streams weights into registers with no split-K, and with PDL loads
its first weight pieces before waiting for the kernel ahead of it.

`compile` builds the .cu file with nvcc for sm_90a and the engine's decode-bucket `linear_kernel`
for Llama-3-8B's four projection shapes with Triton's AOT path, into one pickle. `run` checks
every kernel against torch, then times (CUDA graphs, weights of 32 distinct layers, 14 GB, so
nothing comes from the L2): each kernel alone (20 launches over 20 layers' weights), then whole
chains of 32 layers x (qkv, o, gate/up, down) as a decode step orders them: Triton's kernels,
the fastest CUDA kernel of each shape, and those with PDL. The device copy rate is measured in
the same run.
"""
from __future__ import annotations

import importlib
import itertools
import pickle
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
RESIDUAL = {"qkv": False, "o_proj": True, "gate_up": False, "down": True}
LAYERS = 32
SOURCE = Path(__file__).with_suffix(".cu")
CUDA_SIGNATURE = ["*bf16", "*bf16", "*bf16", "*bf16", "i32", "i32"]


# The engine's plugins at Llama-3-8B's shapes: (compile shapes, attrs). norm_swiglu has no GEMV
# bucket since session 21 (its pair kernel lost): both of its columns then time the Triton kernel.
ENGINE_CASES = {
    "norm_qkv_rope": ({"K": 4096, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128},
                      {"eps": 1e-5, "layer": 0, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128}),
    "linear_residual": ({"K": 4096, "N": 4096}, {}),
    "norm_swiglu": ({"K": 4096, "I": 14336, "block": 64}, {"eps": 1e-5, "block": 64, "activation": "silu"}),
    "linear": ({"K": 14336, "N": 4096}, {}),
}


def variants() -> list[tuple[int, int, int]]:
    """(T, R, U) of every kernel the .cu file instantiates."""
    return [tuple(map(int, m)) for m in re.findall(r"^GEMV\((\d+), (\d+), (\d+)\)", SOURCE.read_text(), re.M)]


def compile_all(path: str) -> None:
    import triton

    from kiln.plugins.aot import compile_cubin
    from kiln.plugins.linear.kernels import linear_aot_kernels

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "gemv.cubin"
        subprocess.run(["nvcc", "-cubin", "-arch=sm_90a", "-O3", "-o", str(out), str(SOURCE)], check=True)
        cuda_cubin = out.read_bytes()
    triton_kernels = {}
    for name, (n, k) in SHAPES.items():
        kernel = next(kr for kr in linear_aot_kernels("bfloat16", n, k, bias=False, residual=RESIDUAL[name])
                      if kr.meta.get("bucket") == "decode" and (kr.targets is None or "sm_90" in kr.targets))
        cubin = compile_cubin(kernel, "sm_90")
        params = [t for t in kernel.signature.values() if t != "constexpr"]
        triton_kernels[name] = (cubin, params, kernel.meta)
    engine = {}
    for plugin, (shapes, _) in ENGINE_CASES.items():
        aot = [kr for kr in importlib.import_module(f"kiln.plugins.{plugin}.kernels").aot_kernels("bfloat16", shapes)
               if kr.targets is None or "sm_90" in kr.targets]
        engine[plugin] = [(compile_cubin(kr, "sm_90"), [t for t in kr.signature.values() if t != "constexpr"],
                           kr.meta) for kr in aot]
    with open(path, "wb") as f:
        pickle.dump({"cuda": cuda_cubin, "variants": variants(), "triton": triton_kernels, "engine": engine,
                     "triton_version": triton.__version__}, f)
    print(f"{len(variants()) * 2} CUDA kernels, {len(triton_kernels)} Triton kernels -> {path}")


def run_all(path: str, only_engine: bool = False) -> None:
    import torch

    from kiln.plugins.driver_launch import grid as eval_grid
    from kiln.runtime.cuda_driver import load_kernel
    from scripts.probe_dependent_launch import launcher

    with open(path, "rb") as f:
        built = pickle.load(f)
    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731

    def graph_ms(fn, reps: int = 10) -> float:
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        g.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    graph_ms(lambda: dst.copy_(src))   # a fresh process's first copies run below the clocks' speed
    copy = 2 * src.numel() / graph_ms(lambda: dst.copy_(src)) / 1e9
    del src, dst
    print(f"device copy {copy:.2f} TB/s (bytes read + written); torch {torch.__version__}, "
          f"triton (compile) {built['triton_version']}")
    if only_engine:
        engine_kernels(built["engine"], graph_ms)
        return

    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = {name: [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
                      for _ in range(LAYERS)] for name, (n, k) in SHAPES.items()}
    ts = sorted({v[0] for v in built["variants"]})
    xs = {(name, t): torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=gen)
          for (name, (n, k)), t in itertools.product(SHAPES.items(), ts)}
    residuals = {(name, t): torch.randn(t, n, device="cuda", dtype=torch.bfloat16, generator=gen)
                 for (name, (n, k)), t in itertools.product(SHAPES.items(), ts) if RESIDUAL[name]}
    outs = {(name, t): torch.empty(t, n, device="cuda", dtype=torch.bfloat16)
            for (name, (n, k)), t in itertools.product(SHAPES.items(), ts)}
    part = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    count = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")

    def reference(name: str, t: int, layer: int) -> torch.Tensor:
        ref = xs[name, t].float() @ weights[name][layer].float().T
        return ref + residuals[name, t].float() if RESIDUAL[name] else ref

    def rel_err(name: str, t: int, layer: int) -> float:
        ref = reference(name, t, layer)
        return ((outs[name, t].float() - ref).norm() / ref.norm()).item()

    # Every launch as fn(name, t, layer, pdl) for one kernel family.
    cuda_kernels = {}
    for t, r, u in built["variants"]:
        for pdl in (False, True):
            label = f"gemv_t{t}_r{r}_u{u}" + ("_pdl" if pdl else "")
            cuda_kernels[t, r, u, pdl] = launcher(load_kernel(built["cuda"], label, CUDA_SIGNATURE, 8, 0), pdl)

    def cuda_launch(t: int, r: int, u: int, pdl: bool):
        fn = cuda_kernels[t, r, u, pdl]

        def launch(name: str, layer: int) -> None:
            n, k = SHAPES[name]
            res = residuals[name, t].data_ptr() if RESIDUAL[name] else 0
            fn((n // (8 * r), 1, 1), [xs[name, t].data_ptr(), weights[name][layer].data_ptr(), res,
                                      outs[name, t].data_ptr(), n, k], stream())
        return launch

    triton_fns = {}
    for name, (cubin, params, meta) in built["triton"].items():
        triton_fns[name] = (load_kernel(cubin.binary, cubin.name, params, cubin.num_warps, cubin.shared_bytes,
                                        cubin.global_scratch), meta)

    def triton_launch(t: int):
        def launch(name: str, layer: int) -> None:
            kernel, meta = triton_fns[name]
            args = [xs[name, t].data_ptr(), weights[name][layer].data_ptr()]
            if RESIDUAL[name]:
                args.append(residuals[name, t].data_ptr())
            args.append(outs[name, t].data_ptr())
            if meta["split_k"] > 1:
                args += [part.data_ptr(), count.data_ptr()]
            kernel.launch(eval_grid(meta["grid"], {"T": t}), args + [t], stream())
        return launch

    # Correctness, then each kernel alone.
    alone: dict[tuple[str, int], list[tuple[float, str]]] = {}
    families = [(f"triton decode bucket", t, triton_launch(t), None) for t in ts]
    families += [(f"cuda r{r} u{u}{' pdl' * pdl}", t, cuda_launch(t, r, u, pdl), (r, u, pdl))
                 for (t, r, u, pdl) in cuda_kernels]
    for label, t, launch, key in families:
        for name, (n, k) in SHAPES.items():
            if key is not None and n % (8 * key[0]):
                continue
            outs[name, t].zero_()
            launch(name, LAYERS - 1)
            torch.cuda.synchronize()
            err = rel_err(name, t, LAYERS - 1)
            us = graph_ms(lambda: [launch(name, layer) for layer in range(20)]) * 1e3 / 20
            alone.setdefault((name, t), []).append((us, label, key, err))
    for (name, t), rows in sorted(alone.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        n, k = SHAPES[name]
        print(f"{name} {n}x{k} T={t}: weights {n * k * 2 / 1e6:.0f} MB, "
              f"{n * k * 2 / copy / 1e6:.1f} us at the copy rate")
        for us, label, _, err in sorted(rows, key=lambda row: row[0]):
            flag = "" if err < 1e-2 else "  WRONG"
            print(f"  {us:7.2f} us  {n * k * 2 / us / 1e6:5.2f} TB/s  rel err {err:.1e}  {label}{flag}")

    # Whole chains as a decode step orders them.
    total = sum(w.nbytes for ws in weights.values() for w in ws)
    print(f"chains: {LAYERS} layers x {list(SHAPES)}, {total / 1e9:.2f} GB, limit {total / copy / 1e9:.3f} ms "
          "at the copy rate")
    for t in ts:
        chains = {"triton": {name: triton_launch(t) for name in SHAPES}}
        best = {}
        for name in SHAPES:
            rows = [row for row in alone[name, t] if row[2] is not None and not row[2][2] and row[3] < 1e-2]
            best[name] = min(rows, key=lambda row: row[0])[2]
        for pdl in (False, True):
            chains[f"cuda{' + pdl' * pdl}"] = {name: cuda_launch(t, *best[name][:2], pdl) for name in SHAPES}
        print(f"T={t} (cuda kernels: " + ", ".join(f"{n} r{b[0]} u{b[1]}" for n, b in best.items()) + ")")
        for label, fns in chains.items():
            ms = graph_ms(lambda: [fns[name](name, layer) for layer in range(LAYERS) for name in SHAPES])
            print(f"  {label:12s} {ms:.3f} ms  {total / ms / 1e9:.2f} TB/s ({total / ms / 1e9 / copy:.1%} of copy)")
    del weights
    engine_kernels(built["engine"], graph_ms)


def engine_kernels(built: dict, graph_ms) -> None:
    """The engine's own kernels of each plugin at rows 1 and 2, launched by its launcher: the
    CUDA GEMV bucket against the Triton decode bucket (the GEMV kernels left out), over weight
    copies cycled beyond the L2. ("linear" stands for down's shape without the residual.)"""
    import torch

    from kiln.runtime.cuda_driver import load_kernel

    print("engine kernels through their launchers (us, 20 launches over weight copies):")
    gen = torch.Generator(device="cuda").manual_seed(1)
    for plugin, (shapes, attrs) in ENGINE_CASES.items():
        launcher = importlib.import_module(f"kiln.plugins.{plugin}.launch")
        loaded = [(load_kernel(c.binary, c.name, sig, c.num_warps, c.shared_bytes, c.global_scratch), meta)
                  for c, sig, meta in built[plugin]]
        k = shapes["K"]
        if plugin == "norm_qkv_rope":
            n, out_cols = (32 + 16) * 128, 32 * 128
        elif plugin == "norm_swiglu":
            n, out_cols = 2 * shapes["I"], shapes["I"]
        else:
            n, out_cols = shapes["N"], shapes["N"]
        copies = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
                  for _ in range(max(2, -(-200_000_000 // (n * k * 2))))]
        for rows in (1, 2):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            out = torch.empty(rows, out_cols, device="cuda", dtype=torch.bfloat16)
            extra = {"norm_qkv_rope": lambda: [torch.arange(rows, dtype=torch.int32, device="cuda"),
                                                torch.randn(4096, 128, device="cuda"),
                                                torch.zeros(1, 2, 8, 16, 8, 128, device="cuda", dtype=torch.bfloat16),
                                                torch.arange(rows, dtype=torch.int32, device="cuda")],
                     "linear_residual": lambda: [torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)]}
            more = extra.get(plugin, lambda: [])()
            scratch = {"row_scale": torch.zeros(4096, device="cuda"),
                       "gemm_split_part": torch.zeros(64 << 20, dtype=torch.uint8, device="cuda"),
                       "gemm_split_count": torch.zeros(1 << 16, dtype=torch.int32, device="cuda")}
            line = []
            for label, keep in (("cuda gemv", lambda m: True), ("triton", lambda m: not m.get("gemv"))):
                kernels = [(fn, m) for fn, m in loaded if keep(m)]
                fns, metas = [fn for fn, _ in kernels], [m for _, m in kernels]

                def inputs(w):
                    if plugin == "norm_qkv_rope":
                        return [x, None, w, None, None, None, *more]
                    if plugin == "norm_swiglu":
                        return [x, None, w]
                    return [x, w, None, *more]
                turn = itertools.count()

                def call():
                    launcher.launch(fns, metas, inputs(copies[next(turn) % len(copies)]), attrs, out, {"T": rows},
                                    torch.cuda.current_stream().cuda_stream, scratch)
                us = graph_ms(lambda: [call() for _ in range(20)]) * 1e3 / 20
                line.append(f"{label} {us:6.2f}")
            print(f"  {plugin:16s} T={rows}: " + "  ".join(line) + f"  ({n * k * 2 / 1e6:.0f} MB)")


if __name__ == "__main__":
    {"compile": compile_all, "run": run_all, "engine": lambda p: run_all(p, only_engine=True)}[sys.argv[1]](sys.argv[2])
