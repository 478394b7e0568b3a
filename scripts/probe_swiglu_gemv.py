"""Why is the fused SwiGLU GEMV slower than the plain GEMV over the same weight bytes? (a developer's
probe; BENCHMARKS.md, session 22, has its figures)

    PYTHONPATH=. python3 scripts/probe_swiglu_gemv.py compile probe.pkl   # anywhere: nvcc
    PYTHONPATH=. python3 scripts/probe_swiglu_gemv.py run probe.pkl       # on the GPU

At one row, on Llama-3-8B's interleaved W_gu (28,672 x 4,096, gate and up rows in blocks of 64), the
engine's `kiln_gemv_swiglu_t1` against `gemv.cu`'s plain GEMV with two weight rows a warp (the same
grid, the same bytes) and against variants that each drop one difference: the norm weight's runtime
null check, the sum of x^2 for the row scale, the 64-row distance between a warp's gate and up rows
(`adjacent` reads rows 2j and 2j + 1 instead: wrong columns, the same bytes). Weights of 20 distinct
layers, 4.7 GB, so nothing comes from the L2; 20 launches a CUDA graph.
"""
from __future__ import annotations

import pickle
import sys

from scripts.probe_cuda_gemv import gemv_kernel
from scripts.sweep import kernel_entry, load

I, K, BLOCK, LAYERS = 14336, 4096, 64, 20
# Appended to gemv.cu, whose DotRows, WARPS and LANES it uses.
VARIANTS_SOURCE = r"""
namespace {
template <bool SUM, bool ADJACENT>
__device__ __forceinline__ void probe_swiglu(const __nv_bfloat16* x, const __nv_bfloat16* w, __nv_bfloat16* out,
                                             int block, int K) {
  const int lane = threadIdx.x % LANES, j = blockIdx.x * WARPS + threadIdx.x / LANES;
  const int gate = ADJACENT ? 2 * j : (j / block) * 2 * block + j % block;
  const int row[2] = {gate, ADJACENT ? gate + 1 : gate + block};
  DotRows<1, 2> dot;
  dot.run(x, nullptr, w, row, K, [] {});
  if (lane != 0) return;
  const float scale = SUM ? dot.row_scale(0, K, 1e-5f) : 1.0f;
  const float g = dot.acc[0][0] * scale, u = dot.acc[0][1] * scale;
  out[j] = __float2bfloat16(g / (1.0f + __expf(-g)) * u);
}
}  // namespace
#define PROBE_SWIGLU(NAME, SUM, ADJACENT)                                                          \
  extern "C" __global__ void __launch_bounds__(WARPS * LANES) NAME(                                \
      const __nv_bfloat16* x, const __nv_bfloat16* w, __nv_bfloat16* out, int block, int K) {      \
    probe_swiglu<SUM, ADJACENT>(x, w, out, block, K);                                              \
  }
"""
VARIANTS = {"no null check": (True, False), "no null check, no x^2": (False, False),
            "no null check, adjacent": (True, True), "no null check, no x^2, adjacent": (False, True)}
SIGNATURE = {"x": "*bf16", "w": "*bf16", "out": "*bf16", "block": "i32", "K": "i32"}


def compile_all(path: str) -> None:
    from kiln.plugins.linear import gemv
    from kiln.plugins.nvcc import NvccKernel

    built = {"engine": kernel_entry(gemv.swiglu_kernels("bfloat16", {"K": K, "I": I, "block": BLOCK})[0]),
             "plain r2": kernel_entry(gemv_kernel(1, 2))}
    for i, (label, (total, adjacent)) in enumerate(VARIANTS.items()):
        name = f"probe_swiglu_{i}"
        instance = VARIANTS_SOURCE + f"PROBE_SWIGLU({name}, {str(total).lower()}, {str(adjacent).lower()})"
        built[label] = kernel_entry(NvccKernel(gemv.SOURCE, name, instance, SIGNATURE, gemv.WARPS))
    with open(path, "wb") as f:
        pickle.dump(built, f)
    print(f"{len(built)} kernels -> {path}")


def run_all(path: str) -> None:
    import torch

    from scripts.gpu_timing import replay_ms

    with open(path, "rb") as f:
        built = pickle.load(f)
    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(2 * I, K, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02 for _ in range(LAYERS)]
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = torch.empty(1, 2 * I, device="cuda", dtype=torch.bfloat16)
    fns = {label: load(entry)[0] for label, entry in built.items()}
    grid = (I // 8, 1, 1)
    launches = {
        "engine": lambda w: fns["engine"].launch(grid, [x.data_ptr(), 0, w.data_ptr(), out.data_ptr(), I, BLOCK,
                                                        1e-5, K], stream()),
        "plain r2": lambda w: fns["plain r2"].launch(grid, [x.data_ptr(), w.data_ptr(), 0, 0, out.data_ptr(), 2 * I,
                                                            K], stream()),
        **{label: (lambda w, fn=fns[label]: fn.launch(grid, [x.data_ptr(), w.data_ptr(), out.data_ptr(), BLOCK, K],
                                                      stream())) for label in VARIANTS}}
    print(f"W_gu {2 * I}x{K} bf16 ({2 * I * K * 2 / 1e6:.0f} MB), one row, us per launch:")
    for _ in range(2):   # the second round shows the spread between rounds
        for label, launch in launches.items():
            us = replay_ms(lambda: [launch(w) for w in weights]) * 1e3 / LAYERS
            print(f"  {us:7.2f}  {2 * I * K * 2 / us / 1e6:5.2f} TB/s  {label}")


if __name__ == "__main__":
    {"compile": compile_all, "run": run_all}[sys.argv[1]](sys.argv[2])
