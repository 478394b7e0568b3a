"""Are the CUDA C++ decode GEMVs (`plugins/linear/gemv.cu`) and the CuTe decode GEMM
(`plugins/linear/cute_gemm.py`) faster than the engine's Triton decode GEMMs? (a developer's probe;
BENCHMARKS.md, sessions 21 and 22, has the GEMVs' figures)

    PYTHONPATH=. python3 scripts/probe_cuda_gemv.py compile probe.pkl   # anywhere: nvcc and Triton AOT
    PYTHONPATH=. python3 scripts/probe_cuda_gemv.py run probe.pkl       # on the GPU
    PYTHONPATH=. python3 scripts/probe_cuda_gemv.py engine probe.pkl    # on the GPU: the engine's kernels only
    PYTHONPATH=. python3 scripts/probe_cuda_gemv.py fp8 probe.pkl       # on the GPU: the e4m3 CuTe GEMM only

`compile` builds, with `plugins.nvcc`, `gemv.cu`'s plain GEMV at rows T and weight rows per warp R
(VARIANTS) and the CuTe decode GEMM (TMA and wgmma with the weights as the 64-row operand, K split in
parts; bf16 and e4m3, CUTE_VARIANTS; left out without `nvidia-cutlass`'s headers), then the engine's
decode-bucket `linear_kernel` for Llama-3-8B's four projection shapes, each plugin's whole kernel
list at those shapes (ENGINE_CASES) and the GEMVs the engine does not build but might
(`extra_kernels`), into one pickle. `run` checks every plain kernel against torch, then times (CUDA
graphs, weights of 32 distinct layers, 14 GB, so nothing comes from the L2) each alone (20 launches
over 20 layers' weights) and whole chains of 32 layers x (qkv, o, gate/up, down) as a decode step
orders them, Triton's against the fastest GEMV and CuTe kernel of each shape (a kernel whose result
is off is printed WRONG and left out of them; kernels built for programmatic dependent launch are
launched so, as the engine launches them); then the e4m3 CuTe kernel over the same weights
quantized (`cute_fp8`); then, as `engine` does alone, each plugin's kernels through its launcher at
one and two rows: the engine's buckets against the Triton ones alone (the GEMVs left out) and, where
`extra_kernels` has one, that GEMV ahead of the Triton buckets, weights cycled through 200 MB. The
device copy rate is measured in the same run.
"""
from __future__ import annotations

import importlib
import itertools
import pickle
import sys

from scripts.sweep import kernel_entry, load

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
RESIDUAL = {"qkv": False, "o_proj": True, "gate_up": False, "down": True}
LAYERS = 32
# (T, R) of the plain GEMV: rows of x, weight rows per warp.
VARIANTS = [(1, 1), (1, 2), (1, 4), (2, 2), (2, 4), (4, 2), (8, 2), (8, 4)]
# Rows of x every family is timed at (each where it serves them).
ROWS = (1, 2, 4, 8, 16)
# The CuTe decode GEMM: (rows of x it serves, stages, element), each timed at every split of K in CUTE_PARTS;
# the e4m3 ones apart (`cute_fp8`), over the same weights quantized per row.
CUTE_VARIANTS = [(8, 8, "bf16"), (8, 12, "bf16"), (16, 8, "bf16"), (8, 8, "fp8e4nv"), (8, 12, "fp8e4nv"),
                 (16, 8, "fp8e4nv"), (32, 8, "fp8e4nv"), (64, 8, "fp8e4nv"), (64, 12, "fp8e4nv")]
# Rows of x the e4m3 CuTe decode GEMM is timed at (`cute_fp8`): 17-64 rows are an FP8 engine's "small" bucket.
FP8_ROWS = (1, 2, 4, 8, 16, 32, 64)
CUTE_PARTS = (1, 2, 4, 8)
# The engine's plugins at Llama-3-8B's shapes: (compile shapes, attrs). norm_swiglu has no GEMV
# bucket since session 21 (its pair kernel lost): both of its columns then time the Triton kernel.
ENGINE_CASES = {
    "norm_qkv_rope": ({"K": 4096, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128},
                      {"eps": 1e-5, "layer": 0, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128}),
    "linear_residual": ({"K": 4096, "N": 4096}, {}),
    "norm_swiglu": ({"K": 4096, "I": 14336, "block": 64}, {"eps": 1e-5, "block": 64, "activation": "silu"}),
    "linear": ({"K": 14336, "N": 4096}, {}),
}


def gemv_kernel(t: int, r: int):
    from kiln.plugins.linear import gemv
    from kiln.plugins.nvcc import NvccKernel

    name = f"probe_gemv_t{t}_r{r}"
    return NvccKernel(gemv.SOURCE, name, f"KILN_GEMV_LINEAR({name}, {t}, {r})", gemv.LINEAR_SIGNATURE, gemv.WARPS)


def cute_kernels() -> dict[tuple[int, int, str], tuple]:
    """The CuTe decode GEMM's variants, compiled (none without CUTLASS's headers)."""
    from kiln.plugins.linear import cute_gemm

    try:
        return {v: kernel_entry(cute_gemm.decode(*v)) for v in CUTE_VARIANTS}
    except RuntimeError as e:
        print(f"no CuTe decode GEMM: {e}")
        return {}


def extra_kernels() -> dict[str, object]:
    """Per plugin, a GEMV the engine does not build, timed ahead of the Triton buckets: o_proj's
    at one row with one weight row a warp (the engine takes two), the SwiGLU GEMV at two rows."""
    from kiln.plugins.linear import gemv
    from kiln.plugins.nvcc import NvccKernel

    swiglu = NvccKernel(gemv.SOURCE, "probe_swiglu_t2", "KILN_GEMV_SWIGLU(probe_swiglu_t2, 2, false, false)",
                        gemv.SWIGLU_SIGNATURE, gemv.WARPS, gemv._meta(2, 14336 // gemv.WARPS, block=64))
    linear = NvccKernel(gemv.SOURCE, "probe_linear_t1_r1", "KILN_GEMV_LINEAR(probe_linear_t1_r1, 1, 1)",
                        gemv.LINEAR_SIGNATURE, gemv.WARPS, gemv._meta(1, 4096 // gemv.WARPS))
    return {"norm_swiglu": swiglu, "linear_residual": linear}


def compile_all(path: str) -> None:
    import triton

    from kiln.plugins.linear.kernels import linear_aot_kernels

    cuda = {(t, r): kernel_entry(gemv_kernel(t, r)) for t, r in VARIANTS}
    cute = cute_kernels()
    triton_kernels = {name: kernel_entry(next(
        kr for kr in linear_aot_kernels("bfloat16", n, k, bias=False, residual=RESIDUAL[name])
        if kr.meta.get("bucket") == "decode" and (kr.targets is None or "sm_90" in kr.targets)))
        for name, (n, k) in SHAPES.items()}
    engine = {plugin: [kernel_entry(kr) for kr in importlib.import_module(f"kiln.plugins.{plugin}.kernels")
                       .aot_kernels("bfloat16", shapes) if kr.targets is None or "sm_90" in kr.targets]
              for plugin, (shapes, _) in ENGINE_CASES.items()}
    with open(path, "wb") as f:
        pickle.dump({"cuda": cuda, "cute": cute, "triton": triton_kernels, "engine": engine,
                     "extra": {plugin: kernel_entry(k) for plugin, k in extra_kernels().items()},
                     "triton_version": triton.__version__}, f)
    print(f"{len(cuda)} CUDA GEMVs, {len(cute)} CuTe decode GEMMs, "
          f"{len(triton_kernels)} Triton decode kernels, "
          f"{sum(map(len, engine.values()))} engine kernels -> {path}")


def run_all(path: str, mode: str = "all") -> None:
    """mode "all": every kernel; "engine": the engine's kernels through their launchers alone; "fp8": the e4m3
    CuTe decode GEMM alone."""
    import torch

    with open(path, "rb") as f:
        built = pickle.load(f)
    from scripts.gpu_timing import copy_rate

    copy = copy_rate()
    print(f"device copy {copy:.2f} TB/s (bytes read + written); torch {torch.__version__}, "
          f"triton (compile) {built['triton_version']}")
    if mode == "fp8":
        cute_fp8(built, layer_weights(), copy)
        return
    if mode == "all":
        plain_kernels(built, copy)
    engine_kernels(built["engine"], built["extra"])


def layer_weights() -> dict:
    """LAYERS distinct bf16 weights of each shape (14 GB: nothing comes from the L2)."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    return {name: [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
                   for _ in range(LAYERS)] for name, (n, k) in SHAPES.items()}


def plain_kernels(built: dict, copy: float) -> None:
    """Each plain GEMV and Triton decode kernel alone, then the chains (see the module docstring)."""
    import torch

    from kiln.plugins.driver_launch import grid as eval_grid
    from kiln.plugins.linear.cute_gemm import WEIGHT_ROWS, decode_grid, k_tile
    from kiln.runtime.cuda_driver import encode_tensor_map
    from scripts.gpu_timing import replay_ms

    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    weights = layer_weights()
    gen = torch.Generator(device="cuda").manual_seed(1)
    ts = ROWS
    xs = {(name, t): torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=gen)
          for (name, (n, k)), t in itertools.product(SHAPES.items(), ts)}
    residuals = {(name, t): torch.randn(t, n, device="cuda", dtype=torch.bfloat16, generator=gen)
                 for (name, (n, k)), t in itertools.product(SHAPES.items(), ts) if RESIDUAL[name]}
    outs = {(name, t): torch.empty(t, n, device="cuda", dtype=torch.bfloat16)
            for (name, (n, k)), t in itertools.product(SHAPES.items(), ts)}
    part = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    count = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")

    def rel_err(name: str, t: int, layer: int) -> float:
        ref = xs[name, t].float() @ weights[name][layer].float().T
        ref = ref + residuals[name, t].float() if RESIDUAL[name] else ref
        return ((outs[name, t].float() - ref).norm() / ref.norm()).item()

    cuda = {key: load(entry)[0] for key, entry in built["cuda"].items()}
    cute = {key[:2]: load(entry)[0] for key, entry in built.get("cute", {}).items() if key[2] == "bf16"}
    w_maps, x_maps = {}, {}
    if cute:
        w_maps = {(name, layer): encode_tensor_map(w.data_ptr(), "bf16", tuple(w.shape), (WEIGHT_ROWS, k_tile()))
                  for name, ws in weights.items() for layer, w in enumerate(ws)}
        x_maps = {(name, t, rows): encode_tensor_map(xs[name, t].data_ptr(), "bf16", (t, SHAPES[name][1]),
                                                     (rows, k_tile()))
                  for (name, t), rows in itertools.product(xs, {rows for rows, _ in cute})}
    triton_fns = {name: load(entry) for name, entry in built["triton"].items()}

    def cuda_launch(t: int, r: int):
        def launch(name: str, layer: int) -> None:
            n, k = SHAPES[name]
            res = residuals[name, t].data_ptr() if RESIDUAL[name] else 0
            cuda[t, r].launch((n // (8 * r), 1, 1), [xs[name, t].data_ptr(), weights[name][layer].data_ptr(), 0, res,
                                                     outs[name, t].data_ptr(), n, k], stream())
        return launch

    def cute_launch(t: int, v: tuple[int, int, int]):
        rows, _, parts = v

        def launch(name: str, layer: int) -> None:
            n, k = SHAPES[name]
            res = residuals[name, t].data_ptr() if RESIDUAL[name] else 0
            cute[v[:2]].launch(decode_grid(t, n, k, rows, parts), [w_maps[name, layer], x_maps[name, t, rows], 0, 0,
                                                                    res, outs[name, t].data_ptr(), part.data_ptr(),
                                                                    count.data_ptr(), t, n, k], stream())
        return launch

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

    # (label, rows, launch, (kind, variant) or None for Triton's)
    alone: dict[tuple[str, int], list[tuple[float, str, tuple | None, float]]] = {}
    families = [("triton decode bucket", t, triton_launch(t), None) for t in ts]
    families += [(f"cuda gemv r{r}", t, cuda_launch(t, r), ("cuda gemv", r)) for t, r in VARIANTS]
    # Each CuTe variant at the rows it serves that no smaller variant serves.
    families += [(f"cute decode t{rows} s{stages} p{parts}", t, cute_launch(t, (rows, stages, parts)),
                  ("cute decode", (rows, stages, parts)))
                 for rows, stages in cute for parts in CUTE_PARTS for t in ts
                 if t <= rows and not any(t <= r < rows for r, _ in cute)]
    for label, t, launch, r in families:
        for name, (n, k) in SHAPES.items():
            outs[name, t].zero_()
            launch(name, LAYERS - 1)
            torch.cuda.synchronize()
            err = rel_err(name, t, LAYERS - 1)
            us = replay_ms(lambda: [launch(name, layer) for layer in range(20)]) * 1e3 / 20
            alone.setdefault((name, t), []).append((us, label, r, err))
    for (name, t), rows in sorted(alone.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        n, k = SHAPES[name]
        print(f"{name} {n}x{k} T={t}: weights {n * k * 2 / 1e6:.0f} MB, "
              f"{n * k * 2 / copy / 1e6:.1f} us at the copy rate")
        for us, label, _, err in sorted(rows, key=lambda row: row[0]):
            flag = "" if err < 1e-2 else "  WRONG"
            print(f"  {us:7.2f} us  {n * k * 2 / us / 1e6:5.2f} TB/s  rel err {err:.1e}  {label}{flag}")

    total = sum(w.nbytes for ws in weights.values() for w in ws)
    print(f"chains: {LAYERS} layers x {list(SHAPES)}, {total / 1e9:.2f} GB, limit {total / copy / 1e9:.3f} ms "
          "at the copy rate")
    make = {"cuda gemv": cuda_launch, "cute decode": cute_launch}
    for t in ts:
        chains = {"triton": {name: triton_launch(t) for name in SHAPES}}
        for kind in make:
            rows = {name: [row for row in alone[name, t] if row[2] and row[2][0] == kind and row[3] < 1e-2]
                    for name in SHAPES}
            if all(rows.values()):
                best = {name: min(rows[name], key=lambda row: row[0])[2][1] for name in SHAPES}
                chains[kind] = {name: make[kind](t, best[name]) for name in SHAPES}
                print(f"T={t} {kind}: " + ", ".join(f"{n} {b}" for n, b in best.items()))
        for label, fns in chains.items():
            ms = replay_ms(lambda: [fns[name](name, layer) for layer in range(LAYERS) for name in SHAPES])
            print(f"  {label:12s} {ms:.3f} ms  {total / ms / 1e9:.2f} TB/s ({total / ms / 1e9 / copy:.1%} of copy)")
    cute_fp8(built, weights, copy)


def cute_fp8(built: dict, weights: dict, copy: float) -> None:
    """The e4m3 CuTe decode GEMM over `weights` quantized per row, x quantized per row: at each T of FP8_ROWS
    each variant serving T that no variant for fewer rows serves, alone at every split of K, then the
    32-layer chain of the best of each shape, against the device's copy rate (the e4m3 bytes: half of
    bf16's)."""
    import torch

    from kiln.plugins.fp8 import dequantize_rows, quantize_rows
    from kiln.plugins.linear.cute_gemm import WEIGHT_ROWS, decode_grid, k_tile
    from kiln.runtime.cuda_driver import encode_tensor_map
    from scripts.gpu_timing import replay_ms

    variants = {key[:2]: load(entry)[0] for key, entry in built.get("cute", {}).items() if key[2] == "fp8e4nv"}
    if not variants:
        return
    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    gen = torch.Generator(device="cuda").manual_seed(2)
    quantized = {name: [quantize_rows(w) for w in ws] for name, ws in weights.items()}
    box = (WEIGHT_ROWS, k_tile("fp8e4nv"))
    w_maps = {(name, layer): encode_tensor_map(q.data_ptr(), "fp8e4nv", tuple(q.shape), box)
              for name, qs in quantized.items() for layer, (q, _) in enumerate(qs)}
    part = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    count = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")
    total = sum(q.nbytes for qs in quantized.values() for q, _ in qs)
    print(f"e4m3 CuTe decode: {LAYERS} layers x {list(SHAPES)}, {total / 1e9:.2f} GB, "
          f"limit {total / copy / 1e9:.3f} ms")
    for t in FP8_ROWS:
        serving = [v for v in variants if t <= v[0] and not any(t <= r < v[0] for r, _ in variants)]
        xs = {name: quantize_rows(torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=gen))
              for name, (n, k) in SHAPES.items()}
        residuals = {name: torch.randn(t, n, device="cuda", dtype=torch.bfloat16, generator=gen)
                     for name, (n, k) in SHAPES.items() if RESIDUAL[name]}
        outs = {name: torch.empty(t, n, device="cuda", dtype=torch.bfloat16) for name, (n, k) in SHAPES.items()}
        x_maps = {(name, rows): encode_tensor_map(xs[name][0].data_ptr(), "fp8e4nv", (t, SHAPES[name][1]),
                                                  (rows, k_tile("fp8e4nv")))
                  for name, (rows, _) in itertools.product(SHAPES, serving)}

        def launcher(v: tuple[int, int], parts: int):
            def launch(name: str, layer: int) -> None:
                n, k = SHAPES[name]
                q, scale = quantized[name][layer]
                res = residuals[name].data_ptr() if RESIDUAL[name] else 0
                variants[v].launch(decode_grid(t, n, k, v[0], parts, "fp8e4nv"),
                                   [w_maps[name, layer], x_maps[name, v[0]], scale.data_ptr(), xs[name][1].data_ptr(),
                                    res, outs[name].data_ptr(), part.data_ptr(), count.data_ptr(), t, n, k], stream())
            return launch

        best = {}
        for name, (n, k) in SHAPES.items():
            q, scale = quantized[name][LAYERS - 1]
            ref = dequantize_rows(*xs[name]) @ dequantize_rows(q, scale).T
            ref = ref + residuals[name].float() if RESIDUAL[name] else ref
            rows = []
            for v, parts in itertools.product(serving, CUTE_PARTS):
                launch = launcher(v, parts)
                outs[name].zero_()
                launch(name, LAYERS - 1)
                torch.cuda.synchronize()
                err = ((outs[name].float() - ref).norm() / ref.norm()).item()
                us = replay_ms(lambda: [launch(name, layer) for layer in range(20)]) * 1e3 / 20
                rows.append((us, f"cute decode fp8 t{v[0]} s{v[1]} p{parts}", launch, err))
            rows.sort(key=lambda row: row[0])
            good = [row for row in rows if row[3] < 1e-2]
            if good:
                best[name] = good[0][2]
            print(f"{name} {n}x{k} e4m3 T={t}: weights {n * k / 1e6:.0f} MB, "
                  f"{n * k / copy / 1e6:.1f} us at the copy rate")
            for us, label, _, err in rows[:4] + [row for row in rows[4:] if row[3] >= 1e-2]:
                flag = "" if err < 1e-2 else "  WRONG"
                print(f"  {us:7.2f} us  {n * k / us / 1e6:5.2f} TB/s  rel err {err:.1e}  {label}{flag}")
        if len(best) == len(SHAPES):
            ms = replay_ms(lambda: [best[name](name, layer) for layer in range(LAYERS) for name in SHAPES])
            rate = total / ms / 1e9
            print(f"  T={t} e4m3 chain {ms:.3f} ms  {rate:.2f} TB/s ({rate / copy:.1%} of copy)")


def engine_kernels(built: dict, extra: dict) -> None:
    """The engine's own kernels of each plugin at rows 1 and 2, launched by its launcher: the
    CUDA GEMV bucket against the Triton decode bucket (the GEMV kernels left out) and EXTRA's GEMV
    ahead of the Triton buckets, over weight copies cycled beyond the L2. ("linear" stands for
    down's shape without the residual.)"""
    import torch

    from scripts.gpu_timing import replay_ms

    print("engine kernels through their launchers (us, 20 launches over weight copies):")
    gen = torch.Generator(device="cuda").manual_seed(1)
    for plugin, (shapes, attrs) in ENGINE_CASES.items():
        launcher = importlib.import_module(f"kiln.plugins.{plugin}.launch")
        loaded = [load(entry) for entry in built[plugin]]
        triton_only = [(fn, m) for fn, m in loaded if not m.get("gemv")]
        sets = {"engine": loaded, "triton": triton_only}
        if plugin in extra:
            sets["extra"] = [load(extra[plugin])] + triton_only
        k = shapes["K"]
        if plugin == "norm_qkv_rope":
            n, out_cols = (32 + 16) * 128, 32 * 128
        elif plugin == "norm_swiglu":
            n, out_cols = 2 * shapes["I"], shapes["I"]
        else:
            n = out_cols = shapes["N"]
        copies = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
                  for _ in range(max(2, -(-200_000_000 // (n * k * 2))))]
        for rows in (1, 2):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            out = torch.empty(rows, out_cols, device="cuda", dtype=torch.bfloat16)
            if plugin == "norm_qkv_rope":
                more = [torch.arange(rows, dtype=torch.int32, device="cuda"), torch.randn(4096, 128, device="cuda"),
                        torch.zeros(1, 2, 8, 16, 8, 128, device="cuda", dtype=torch.bfloat16),
                        torch.arange(rows, dtype=torch.int32, device="cuda")]
            else:
                more = [torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)] if plugin == "linear_residual" else []
            scratch = {"row_scale": torch.zeros(4096, device="cuda"),
                       "gemm_split_part": torch.zeros(64 << 20, dtype=torch.uint8, device="cuda"),
                       "gemm_split_count": torch.zeros(1 << 16, dtype=torch.int32, device="cuda")}

            def inputs(w):
                if plugin == "norm_qkv_rope":
                    return [x, None, w, None, None, None, *more]
                return [x, None, w] if plugin == "norm_swiglu" else [x, w, None, *more]
            line, results = [], []
            for label, chosen in sets.items():
                if label == "extra" and chosen[0][1]["max_rows"] != rows:
                    continue   # a GEMV built for more rows than the step has would read past x
                fns, metas = zip(*chosen)
                turn = itertools.count()

                def call():
                    launcher.launch(list(fns), list(metas), inputs(copies[next(turn) % len(copies)]), attrs, out,
                                    {"T": rows}, torch.cuda.current_stream().cuda_stream, scratch)
                call()
                torch.cuda.synchronize()
                results.append(out.float().clone())
                us = replay_ms(lambda: [call() for _ in range(20)]) * 1e3 / 20
                line.append(f"{label} {us:6.2f}")
            # Every set on the same weights (its first call: copy 0) gives the same output.
            agree = all(((r - results[1]).norm() / results[1].norm()).item() < 2e-2 for r in results)
            print(f"  {plugin:16s} T={rows}: " + "  ".join(line) + f"  ({n * k * 2 / 1e6:.0f} MB)"
                  + ("" if agree else "  OUTPUTS DIFFER"))


if __name__ == "__main__":
    {"compile": compile_all, "run": run_all, "engine": lambda p: run_all(p, "engine"),
     "fp8": lambda p: run_all(p, "fp8")}[sys.argv[1]](sys.argv[2])
