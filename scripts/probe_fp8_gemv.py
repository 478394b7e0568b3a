"""How should the FP8 GEMVs (`plugins/linear/gemv_fp8.cu`) split their work? (a developer's probe)

    PYTHONPATH=. python3 scripts/probe_fp8_gemv.py    # on the GPU (nvcc there builds the variants)

For Llama-3-8B's four projections at one row of x, each variant of weight rows a warp (R, or output
columns for the SwiGLU GEMV) and pieces a row per lane an iteration (UF) is built with `plugins.nvcc`
for this GPU, checked against the plugin's reference on one layer, and timed through its plugin's
launcher over 20 layers of e4m3 weights (1-2.3 GB, so nothing comes from the L2) in a CUDA graph
(`gpu_timing.graph_us`), launched for programmatic dependent launch as the engine launches them (the
engine's split also without); beside it the device copy rate measured in the same run.
"""
from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor

import torch

from kiln.plugins import get_plugin
from kiln.bench.hardware import copy_bandwidth
from kiln.plugins.fp8 import quantize_rows
from kiln.plugins.linear import gemv
from kiln.plugins.nvcc import NvccKernel, compile_cubin
from kiln.runtime.cuda_driver import device_arch, load_kernel
from scripts.gpu_timing import REPEAT, graph_us

LAYERS = REPEAT
HEADS, KV_HEADS, D = 32, 8, 128


# Per projection, each variant's (rows a warp (SwiGLU: columns; qkv: none), pieces a row per lane an
# iteration), the engine's first.
SPLITS = {
    "o_proj": [(gemv.FP8_LINEAR_ROWS, gemv.FP8_LINEAR_PIECES), (2, 2), (1, 4), (1, 8)],
    "down": [(gemv.FP8_LINEAR_ROWS, gemv.FP8_LINEAR_PIECES), (2, 2), (1, 4), (1, 8)],
    "gate_up": [(gemv.FP8_SWIGLU_COLS, gemv.FP8_SWIGLU_PIECES), (1, 4), (2, 2), (4, 2)],
    "qkv": [(0, gemv.FP8_QKV_PIECES), (0, 1), (0, 4)],
}


def variants() -> dict[str, list[tuple[str, NvccKernel, bool]]]:
    """Per projection: (label, kernel, launched for programmatic dependent launch) of each split of
    SPLITS (duplicates dropped), and the engine's without PDL second."""
    pairs = (HEADS + 2 * KV_HEADS) * D // 2
    out: dict[str, list] = {}
    for shape, splits in SPLITS.items():
        out[shape] = []
        for r, uf in dict.fromkeys(splits):
            name = f"p_{shape}_{r}_{uf}"
            if shape in ("o_proj", "down"):
                k = 4096 if shape == "o_proj" else 14336
                call, signature, groups, meta = (f"KILN_GEMV_FP8_LINEAR({name}, {r}, {uf}, {k})",
                                                 gemv.FP8_LINEAR_SIGNATURE, 4096 // (8 * r), {})
            elif shape == "gate_up":
                call, signature, groups, meta = (f"KILN_GEMV_FP8_SWIGLU({name}, {r}, {uf}, 4096, false, false)",
                                                 gemv.FP8_SWIGLU_SIGNATURE, 14336 // (8 * r), {"block": 64})
            else:
                call, signature, groups = (f"KILN_GEMV_FP8_QKV_ROPE({name}, {uf}, 4096, false)", gemv.FP8_QKV_SIGNATURE,
                                           pairs // 8)
                meta = {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": D}
            kernel = gemv._fp8_kernel(name, call, signature, gemv._meta(1, groups, **meta))
            label = (f"{'COLS' if shape == 'gate_up' else 'R'}={r} " if r else "") + f"UF={uf}"
            out[shape].append((label, kernel, True))
        out[shape].insert(1, (f"{out[shape][0][0]} no PDL", out[shape][0][1], False))
    return out


def cases(shape: str, g: torch.Generator) -> tuple[str, list[list], torch.Tensor, dict]:
    """(plugin, per layer its inputs, the output, attrs) on the GPU."""
    randn = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    bf = lambda t: t.to(torch.bfloat16)  # noqa: E731
    if shape in ("o_proj", "down"):
        k = 4096 if shape == "o_proj" else 14336
        x, res = bf(randn(1, k)), bf(randn(1, 4096))
        layers = [[x, *quantize_rows(randn(4096, k) / 32)] for _ in range(LAYERS)]
        return "linear_residual", [[x, w, None, res, s] for x, w, s in layers], bf(randn(1, 4096)), \
            {"parallel": "none", "heads": 0, "all_reduce": False}
    if shape == "gate_up":
        x = bf(randn(1, 4096))
        layers = [[x, None, *quantize_rows(randn(2 * 14336, 4096) / 16)] for _ in range(LAYERS)]
        return "norm_swiglu", layers, bf(randn(1, 14336)), {"eps": 1e-5, "block": 64, "activation": "silu"}
    x = bf(randn(1, 4096))
    angles = torch.arange(64)[:, None] * 10000.0 ** (-torch.arange(0, D, 2) / D)
    rope = torch.cat([angles.cos(), angles.sin()], dim=1).cuda()
    cache = bf(randn(1, 2, 4, 16, KV_HEADS, D))
    pos, slots = torch.tensor([5], dtype=torch.int32, device="cuda"), torch.tensor([9], dtype=torch.int32, device="cuda")
    layers = []
    for _ in range(LAYERS):
        w, s = quantize_rows(randn((HEADS + 2 * KV_HEADS) * D, 4096) / 16)
        layers.append([x, None, w, None, None, None, pos, rope, cache, slots, None, s])
    attrs = {"eps": 1e-5, "layer": 0, "num_heads": HEADS, "num_kv_heads": KV_HEADS, "head_dim": D}
    return "norm_qkv_rope", layers, bf(randn(1, HEADS * D)), attrs


def main() -> None:
    arch = device_arch()
    print(f"copy rate {copy_bandwidth('cuda')[0] / 1e9:,.0f} GB/s ({torch.cuda.get_device_name()}, {arch})")
    g = torch.Generator(device="cuda").manual_seed(0)
    built_all = variants()
    kernels = list({k.entry: k for b in built_all.values() for _, k, _ in b}.values())
    with ThreadPoolExecutor(8) as pool:   # nvcc runs as a process: eight at once
        cubins = dict(zip([k.entry for k in kernels], pool.map(lambda k: compile_cubin(k, arch), kernels)))
    for shape, built in built_all.items():
        plugin, layers, out, attrs = cases(shape, g)
        launcher = __import__(f"kiln.plugins.{plugin}.launch", fromlist=["launch"])
        want = get_plugin(plugin).call_reference([t.cpu() if isinstance(t, torch.Tensor) else t for t in layers[0]],
                                                 attrs).float()
        weight_bytes = sum(t.numel() * t.element_size() for t in layers[0][1:] if isinstance(t, torch.Tensor)
                           and t.dtype == torch.float8_e4m3fn)
        for label, kernel, programmatic in built:
            cubin = cubins[kernel.entry]
            fn = load_kernel(cubin.binary, cubin.name, list(kernel.signature.values()), cubin.num_warps,
                             cubin.shared_bytes, cubin.global_scratch)
            fn.programmatic = programmatic
            def run(inputs: list) -> None:
                launcher.launch([fn], [kernel.meta], inputs, attrs, out, {"T": 1},
                                torch.cuda.current_stream().cuda_stream, {})

            run(layers[0])
            torch.cuda.synchronize()
            err = float((out.float().cpu() - want).abs().max() / want.abs().max())
            # A graph of REPEAT launches, the next layer's weights each (Python's launch cost, about
            # 5 us, would hide the kernels).
            layer = itertools.cycle(layers)
            us = graph_us(lambda: run(next(layer)))
            print(f"{shape:8s} {label:22s} {us:7.2f} us  {weight_bytes / us / 1e6:5.2f} TB/s  err {err:.1e}"
                  f"{'  WRONG' if err > 2e-2 else ''}")


if __name__ == "__main__":
    main()
