"""Where do the FP8 GEMVs (`plugins/linear/gemv_fp8.cu`) lose time against their weight bytes? (a developer's probe)

    PYTHONPATH=. python3 scripts/probe_fp8_gemv.py compile probe.pkl   # anywhere: nvcc, no GPU needed
    PYTHONPATH=. python3 scripts/probe_fp8_gemv.py run probe.pkl       # on the GPU

At one row of x, on an H100 with warm clocks (BENCHMARKS.md session 45), the bf16 GEMVs of Llama-3-8B's
projections stream their weights at the copy rate while the FP8 ones lose 1-3 us a kernel, most of it to
staging x. (The static ones, o_proj's and down's in a calibrated engine, ran 0.8-2.6 us slower than the
per-token ones until session 45 found why: ptxas had moved the per-token ones' x loads ahead of the wait
for the kernel before.)

For each projection `compile` builds, for sm_90:
- the engine's FP8 GEMV (per-token scales), and four diagnostic variants of it made by editing the
  kernel's source here (their results are wrong by design): "no stage" (x loaded but not normalised,
  quantized or staged: no block reduction and no barrier), "no x" (not even loaded), "no math" (each
  weight piece XOR-folded into the sum instead of converted and multiplied) and "no x, no math" (the
  load pattern alone);
- the same GEMV built for a static activation scale, and for o_proj and down that one staging nothing
  ("fp8 static, no stage": what a one-row handoff of x in e4m3 would leave);
- other tilings of the per-token GEMV (`TILINGS`), and the engine's bf16 GEMV of the shape.

`run` checks the engine's kernels against the plugin's reference and times every kernel through its
plugin's launcher over 20 layers of weights (1-4.7 GB, so nothing comes from the L2) in a CUDA graph,
launched for programmatic dependent launch as the engine does, beside the device copy rate measured in
the same run. The gaps between the variants split a kernel's loss into its prologue (staging x), its
arithmetic and its load pattern.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import pickle
import sys
from concurrent.futures import ThreadPoolExecutor

HEADS, KV_HEADS, D, HIDDEN, INTER = 32, 8, 128, 4096, 14336
SHAPES = ("qkv", "o_proj", "gate_up", "down")

# The edits of `gemv_fp8.cu` that make the diagnostic variants: (text to find, replacement) pairs.
STAGE_SIGNATURE = ("  __device__ __forceinline__ float stage(const __nv_bfloat16* norm, const float* x_static, "
                   "uint4* xs, int K,\n                                         float eps) const {\n")
NO_STAGE = [(STAGE_SIGNATURE, STAGE_SIGNATURE + "    if (K > 0) return 1.0f;\n")]
NO_X = NO_STAGE + [("    wait_inputs();\n    const uint4* xv", "    wait_inputs();\n    if (K > 0) return;\n"
                                                              "    const uint4* xv")]
# A piece's conversion and products, as the K loop has them, and in their place a fold of the weight words.
MATH = """        __half2 sum = __float2half2_rn(0.0f);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          __half2 even, odd;
          e4m3_pairs(ww[i], even, odd);
          sum = __hfma2(even, as_half2(xw[2 * i]), sum);
          sum = __hfma2(odd, as_half2(xw[2 * i + 1]), sum);
        }
        const float2 wide = __half22float2(sum);
        acc[r] += wide.x + wide.y;
"""
NO_MATH = [(MATH, "        acc[r] += __uint_as_float((ww[0] ^ ww[1] ^ ww[2] ^ ww[3] ^ xw[r % VEC]) & 0x3f7fffffu);\n")]
DIAGNOSTICS = {"no stage": NO_STAGE, "no x": NO_X, "no math": NO_MATH, "no x, no math": NO_X + NO_MATH}
# The static entry of the projections without a norm (`STATIC_SHAPES`, the ones a calibrated engine builds
# static) staging nothing: what a producer writing x in e4m3 for it would leave. (Session 45's variants of
# where its scale comes from, at 7891c92, moved it by under 1 us once x was read after the wait.)
STATIC_DIAGNOSTICS = {"fp8 static, no stage": NO_STAGE}
STATIC_VALUE = 4.5 / 448   # the probe's static scale, near the per-token one of a unit-normal row
STATIC_SHAPES = ("o_proj", "down")
# Other tilings of the per-token GEMVs (`plugins.linear.gemv`'s constants, chosen on an H200 in sessions 23
# and 24 with the probe's clocks not yet warmed): more bytes in flight a lane (pieces an iteration), more
# rows or columns a warp.
TILINGS = {
    "qkv": [{"FP8_QKV_PIECES": u} for u in (1, 4)],
    "o_proj": [{"FP8_LINEAR_ROWS": r, "FP8_LINEAR_PIECES": u} for r, u in ((2, 8), (4, 4), (1, 8), (4, 2))],
    "gate_up": [{"FP8_SWIGLU_COLS": c, "FP8_SWIGLU_PIECES": u} for c, u in ((4, 2), (2, 2), (2, 4), (8, 1))],
    "down": [{"FP8_LINEAR_ROWS": r, "FP8_LINEAR_PIECES": u} for r, u in ((2, 8), (4, 4), (1, 8), (4, 2))],
}


def tiling_label(tiling: dict[str, int]) -> str:
    """How a tiling of `TILINGS` is named in the results: {"FP8_LINEAR_ROWS": 4, ...} -> "fp8 rows 4 ..."."""
    return "fp8 " + " ".join(f"{name.rsplit('_', 1)[1].lower()} {value}" for name, value in tiling.items())


def edited(text: str, edits: list[tuple[str, str]]) -> str:
    """`text` with every edit applied; each must match exactly once (the kernel's source changed if not)."""
    for find, replace in edits:
        if text.count(find) != 1:
            raise SystemExit(f"probe_fp8_gemv: gemv_fp8.cu no longer holds {find[:60]!r} once; update the probe")
        text = text.replace(find, replace)
    return text


def kernels() -> list[tuple[str, str, object]]:
    """(shape, label, NvccKernel) of every kernel timed."""
    from kiln.plugins.linear import gemv

    qkv_shapes = {"num_heads": HEADS, "num_kv_heads": KV_HEADS, "head_dim": D, "K": HIDDEN}
    swiglu_shapes = {"I": INTER, "K": HIDDEN, "block": 64}
    build = {
        "qkv": lambda dtype, **kw: gemv.qkv_kernels(dtype, {**qkv_shapes, **kw}),
        "o_proj": lambda dtype, **kw: gemv.linear_kernels(dtype, HIDDEN, HIDDEN, **kw)[:1],
        "gate_up": lambda dtype, **kw: gemv.swiglu_kernels(dtype, {**swiglu_shapes, **kw}),
        "down": lambda dtype, **kw: gemv.linear_kernels(dtype, HIDDEN, INTER, **kw)[:1],
    }
    fp8_flags = {"qkv": ("fp8", "fp8_static"), "gate_up": ("fp8", "fp8_static"),
                 "o_proj": ("fp8_weight", "fp8_static"), "down": ("fp8_weight", "fp8_static")}

    def variant(kernel, label: str, edits: list[tuple[str, str]]):
        entry = f"{kernel.entry}_{label.replace(',', '').replace(' ', '_')}"
        return dataclasses.replace(kernel, entry=entry, instance=edited(kernel.instance, edits).replace(kernel.entry, entry))

    out = []
    for shape in SHAPES:
        weight, static = fp8_flags[shape]
        engine = build[shape]("bfloat16", **{weight: True})[0]
        fixed = build[shape]("bfloat16", **{weight: True, static: True})[0]
        out.append((shape, "fp8 (engine)", engine))
        out.append((shape, "fp8 static", fixed))
        out += [(shape, label, variant(fixed, label, edits)) for label, edits in STATIC_DIAGNOSTICS.items()
                if shape in STATIC_SHAPES]
        out += [(shape, label, variant(engine, label, edits)) for label, edits in DIAGNOSTICS.items()]
        for tiling in TILINGS[shape]:
            saved = {name: getattr(gemv, name) for name in tiling}
            vars(gemv).update(tiling)
            try:
                out.append((shape, tiling_label(tiling), build[shape]("bfloat16", **{weight: True})[0]))
            finally:
                vars(gemv).update(saved)
        out.append((shape, "bf16 (engine)", build[shape]("bfloat16")[0]))
    return out


def compile_all(path: str) -> None:
    from kiln.plugins.nvcc import compile_cubin

    found = kernels()
    with ThreadPoolExecutor(os.cpu_count()) as pool:   # nvcc runs as a process
        cubins = list(pool.map(lambda k: compile_cubin(k[2], "sm_90"), found))
    with open(path, "wb") as f:
        pickle.dump([(shape, label, kernel, cubin) for (shape, label, kernel), cubin in zip(found, cubins)], f)
    print(f"{len(found)} kernels -> {path}")


def cases(shape: str, fp8: bool, static: bool, g) -> tuple[str, list[list], object, dict]:
    """(plugin, per layer its launcher's inputs, the output, attrs) on the GPU."""
    import torch

    from kiln.plugins.fp8 import quantize_rows
    from scripts.gpu_timing import REPEAT

    randn = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    bf = lambda t: t.to(torch.bfloat16)  # noqa: E731

    def weights(n: int, k: int, spread: float) -> list[list]:
        made = [randn(n, k) / spread for _ in range(REPEAT)]
        return [list(quantize_rows(w)) if fp8 else [bf(w)] for w in made]

    x_static = [torch.tensor([STATIC_VALUE], device="cuda")] if static else []
    if shape in ("o_proj", "down"):
        k = HIDDEN if shape == "o_proj" else INTER
        x, res = bf(randn(1, k)), bf(randn(1, HIDDEN))
        layers = [[x, w[0], None, res, *w[1:], *x_static] for w in weights(HIDDEN, k, 32)]
        return "linear_residual", layers, bf(randn(1, HIDDEN)), {"parallel": "none", "heads": 0, "all_reduce": False}
    x = bf(randn(1, HIDDEN))
    if shape == "gate_up":
        layers = [[x, None, *w, *x_static] for w in weights(2 * INTER, HIDDEN, 16)]
        return "norm_swiglu", layers, bf(randn(1, INTER)), {"eps": 1e-5, "block": 64, "activation": "silu"}
    angles = torch.arange(64)[:, None] * 10000.0 ** (-torch.arange(0, D, 2) / D)
    rope = torch.cat([angles.cos(), angles.sin()], dim=1).cuda()
    cache = bf(randn(1, 2, 4, 16, KV_HEADS, D))
    pos, slots = (torch.tensor([v], dtype=torch.int32, device="cuda") for v in (5, 9))
    layers = [[x, None, w[0], None, None, None, pos, rope, cache, slots, None, *w[1:], *x_static]
              for w in weights((HEADS + 2 * KV_HEADS) * D, HIDDEN, 16)]
    attrs = {"eps": 1e-5, "layer": 0, "num_heads": HEADS, "num_kv_heads": KV_HEADS, "head_dim": D}
    return "norm_qkv_rope", layers, bf(randn(1, HEADS * D)), attrs


def run(path: str) -> None:
    import importlib

    import torch

    from kiln.plugins import get_plugin
    from kiln.runtime.cuda_driver import load_kernel
    from scripts.gpu_timing import copy_rate, graph_us

    with open(path, "rb") as f:
        built = pickle.load(f)
    copy = copy_rate()
    print(f"copy rate {copy:.2f} TB/s ({torch.cuda.get_device_name()})")
    sizes = {"qkv": ((HEADS + 2 * KV_HEADS) * D, HIDDEN), "o_proj": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN),
             "down": (HIDDEN, INTER)}
    g = torch.Generator(device="cuda").manual_seed(0)
    for shape, group in itertools.groupby(built, key=lambda b: b[0]):
        made: dict[tuple[bool, bool], tuple] = {}   # one shape's weights at a time
        for _, label, kernel, cubin in group:
            fp8, static = label != "bf16 (engine)", label.startswith("fp8 static")
            if (fp8, static) not in made:
                made[fp8, static] = cases(shape, fp8, static, g)
            plugin, layers, out, attrs = made[fp8, static]
            launcher = importlib.import_module(f"kiln.plugins.{plugin}.launch")
            fn = load_kernel(cubin.binary, cubin.name, list(kernel.signature.values()), cubin.num_warps,
                             cubin.shared_bytes, cubin.global_scratch)
            fn.programmatic = True

            def launch(inputs: list) -> None:
                launcher.launch([fn], [kernel.meta], inputs, attrs, out, {"T": 1},
                                torch.cuda.current_stream().cuda_stream, {})

            launch(layers[0])
            torch.cuda.synchronize()
            check = ""
            if label not in DIAGNOSTICS and label not in STATIC_DIAGNOSTICS:   # the others are wrong by design
                want = get_plugin(plugin).call_reference(
                    [t.cpu() if isinstance(t, torch.Tensor) else t for t in layers[0]], attrs).float()
                err = float((out.float().cpu() - want).abs().max() / want.abs().max())
                check = f"  err {err:.1e}{'  WRONG' if err > 2e-2 else ''}"
            weight_bytes = sizes[shape][0] * sizes[shape][1] * (1 if fp8 else 2)
            cycle = itertools.cycle(layers)
            us = graph_us(lambda: launch(next(cycle)))
            print(f"{shape:8s} {label:20s} {us:7.2f} us  {weight_bytes / us / 1e6:5.2f} TB/s of weights "
                  f"(at the copy rate {weight_bytes / copy / 1e6:5.2f} us){check}", flush=True)


def main() -> None:
    if len(sys.argv) != 3 or sys.argv[1] not in ("compile", "run"):
        sys.exit(__doc__.split("\n\n")[1])
    (compile_all if sys.argv[1] == "compile" else run)(sys.argv[2])


if __name__ == "__main__":
    main()
