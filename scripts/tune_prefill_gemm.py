"""Sweep the GEMMs of prefill chunks and large batches beside cuBLAS (a developer's tool).

    PYTHONPATH=. python3 scripts/tune_prefill_gemm.py compile cubins.pkl   # anywhere: AOT, no GPU needed
    PYTHONPATH=. python3 scripts/tune_prefill_gemm.py run cubins.pkl [ALL.txt]  # on the GPU

Kernels: the persistent TMA GEMM of `plugins.linear.tma` at tilings, depths, warps and grouping,
with a persistent grid (one program per SM) and a one-tile-per-program grid, the pointer-load
GEMM `linear_kernel` at its prefill and medium tiles, and the engine's own kernels for each
projection (the plugins' `aot_kernels` through their launchers, which take the bucket serving T and
run its pre-passes, the fused epilogues included), labelled "engine", and the CUTLASS route: the
CuTe GEMM of `plugins.linear.cute_gemm` (nvcc, sm_90a, TMA descriptors made on the host) at its
tilings (with K split in parts too, where its workspace fits), and for qkv with norm_qkv_rope's
epilogue at its own, labelled "cute" (it needs nvcc and `nvidia-cutlass`'s headers; without them the
sweep goes on without it). `compile` builds each into
a cubin with `plugins.aot` as build-engine does; `run` loads them through `runtime.cuda_driver` as the CUDA
executor does, checks each against torch, and times it in a CUDA graph (weights cycled beyond the
L2), beside `torch.mm` (cuBLAS) on the same shapes and the GEMM rate measured as bench-engine does
(bf16 8192^3). Shapes: Llama-3-8B's projections (or those KILN_TUNE_SHAPES names) at T = 256, 1024,
4096 and 8192 (or KILN_TUNE_ROWS). With KILN_TUNE_FP8=1 (compile and run alike) the TMA GEMM is
swept with e4m3 operands (K tiles twice as long, the same bytes) and per-row scales, beside
cuBLAS FP8 (torch._scaled_mm) on the same e4m3 tensors; the pointer and engine kernels are left out.
"""
from __future__ import annotations

import itertools
import os
import pickle
import sys
from concurrent.futures import ProcessPoolExecutor

from kiln.plugins.aot import AotKernel, absent_as_none, compile_cubin, pointer_params
from kiln.plugins.linear import cute_gemm
from kiln.plugins.linear.kernels import linear_kernel
from kiln.plugins.linear.launch import launch_cute_qkv, map_rows
from kiln.plugins.linear.tma import tma_linear_kernel
from kiln.plugins.nvcc import NvccKernel, nvcc_path
from scripts.gpu_timing import graph_us
from scripts.sweep import try_compile

L2_ROTATION = 200_000_000  # bytes of weight copies cycled through, 4x the H200's L2
SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
# KILN_TUNE_SHAPES=gate_up (comma-separated) sweeps only those projections; compile and run alike.
SHAPES = {name: SHAPES[name] for name in os.environ.get("KILN_TUNE_SHAPES", ",".join(SHAPES)).split(",")}
# KILN_TUNE_ROWS=256 (comma-separated) sweeps only those row counts; compile and run alike.
ROWS = tuple(int(r) for r in os.environ.get("KILN_TUNE_ROWS", "256,1024,4096,8192").split(","))
# (block_m, block_n, block_k, warps, stages, group_m)
TMA_TILES = [(128, 128, 64, 4, 4, 8), (128, 128, 64, 8, 4, 8), (128, 256, 64, 8, 3, 8), (256, 128, 64, 8, 3, 8),
             (64, 128, 64, 4, 4, 8), (64, 256, 64, 4, 4, 8), (128, 256, 64, 8, 3, 16), (128, 256, 64, 8, 3, 4)]
FP8 = os.environ.get("KILN_TUNE_FP8") == "1"
POINTER_TILES = [(128, 128, 64, 8, 4), (64, 64, 64, 4, 4), (128, 256, 64, 8, 3)]
# The CuTe GEMM's tilings: (block_m, block_n, stages, group_m, parts of K), K tiles 64; those whose block_n does
# not divide a shape's N skip it. At 256 rows 128 tiles of 128x64 or 64x128 fill the GPU once for a 4096-row
# weight, and 128x96 or 64x192 for qkv's 6144 rows; wider tiles read less shared memory per MMA. 128x128 tiles
# over halves of K are 128 work items too, each reading a third less per MMA than a 128x64 tile (128x256 in 4
# parts spills).
CUTE_TILES = [(128, 64, 8, 8, 1), (64, 128, 8, 8, 1), (128, 96, 8, 8, 1), (64, 192, 6, 8, 1), (128, 128, 6, 8, 1),
              (128, 256, 4, 8, 1), (128, 128, 6, 8, 2), (128, 128, 7, 8, 2)]
# The CuTe qkv GEMM's tilings (block_m, rotary pairs a tile, stages, group_m), with norm_qkv_rope's epilogue,
# for the qkv shape (Llama-3-8B's heads, `QKV_HEADS`).
CUTE_QKV_TILES = [(128, 48, 8, 8), (64, 96, 6, 8), (128, 64, 6, 8), (64, 64, 8, 8)]
QKV_HEADS = {"heads": 32, "kv_heads": 8, "head_dim": 128}


def configs() -> list[tuple[str, dict, AotKernel]]:
    out = []
    operand, scale = ("*fp8e4nv", "*fp32") if FP8 else ("*bf16", "constexpr")
    for (name, (n, k)), (bm, bn, bk, warps, stages, group) in itertools.product(SHAPES.items(), TMA_TILES):
        bk *= 2 if FP8 else 1
        signature = {"x_ptr": operand, "x_scale_ptr": scale, "w_ptr": operand, "w_scale_ptr": scale,
                     "bias_ptr": "constexpr", "residual_ptr": "constexpr", "out_ptr": "*bf16", "T": "i32",
                     "N": "constexpr", "K": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
                     "BLOCK_K": "constexpr", "GROUP_M": "constexpr", "UPCAST_DOT": "constexpr"}
        constexprs = {"N": n, "K": k, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group, "UPCAST_DOT": False}
        out.append((name, {"kind": "tma", "n": n, "k": k, "bm": bm, "bn": bn,
                           "label": f"tma bm{bm} bn{bn} bk{bk} w{warps} s{stages} g{group}"},
                    AotKernel(tma_linear_kernel, signature, absent_as_none(signature, constexprs), num_warps=warps,
                              num_stages=stages, aligned=pointer_params(signature))))
    for (name, (n, k)), (bm, bn, bk, warps, stages) in itertools.product(SHAPES.items(), [] if FP8 else POINTER_TILES):
        signature = {"x_ptr": "*bf16", "x_scale_ptr": "constexpr", "w_ptr": "*bf16", "w_scale_ptr": "constexpr",
                     "bias_ptr": "constexpr", "residual_ptr": "constexpr",
                     "out_ptr": "*bf16", "part_ptr": "constexpr", "count_ptr": "constexpr", "T": "i32",
                     "N": "constexpr", "K": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
                     "BLOCK_K": "constexpr", "UPCAST_DOT": "constexpr", "SPLIT_K": "constexpr"}
        constexprs = {"N": n, "K": k, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "UPCAST_DOT": False, "SPLIT_K": 1}
        out.append((name, {"kind": "pointer", "n": n, "k": k, "bm": bm, "bn": bn,
                           "label": f"pointer bm{bm} bn{bn} bk{bk} w{warps} s{stages}"},
                    AotKernel(linear_kernel, signature, absent_as_none(signature, constexprs), num_warps=warps,
                              num_stages=stages, aligned=pointer_params(signature))))
    return out + cute_configs()


def cute_configs() -> list[tuple[str, dict, NvccKernel]]:
    """The CuTe GEMM at each tiling for every bf16 shape its tiles divide, and the CuTe qkv GEMM at each of its
    tilings for the qkv shape (none without nvcc or CUTLASS's headers)."""
    if FP8 or nvcc_path() is None:
        return []
    try:
        kernels = {tiling: cute_gemm.gemm(*tiling) for tiling in CUTE_TILES}
        qkv = {tiling: cute_gemm.qkv(tiling[0], tiling[1], QKV_HEADS["head_dim"], *tiling[2:])
               for tiling in CUTE_QKV_TILES}
    except RuntimeError:
        return []
    out = [(name, {"kind": "cute", "n": n, "k": k, "bm": bm, "bn": bn, "parts": parts,
                   "label": f"cute bm{bm} bn{bn} bk{cute_gemm.k_tile()} s{stages} g{group}"
                            + (f" split-K {parts}" if parts > 1 else "")},
            kernels[(bm, bn, stages, group, parts)])
           for (name, (n, k)), (bm, bn, stages, group, parts) in itertools.product(SHAPES.items(), kernels)
           if n % bn == 0]
    if "qkv" in SHAPES:
        n, k = SHAPES["qkv"]
        out += [("qkv", {"kind": "cute_qkv", "n": n, "k": k, "bm": bm, "pairs": pairs,
                         "label": f"cute qkv + RoPE + KV write bm{bm} pairs{pairs} s{stages} g{group}"},
                 qkv[(bm, pairs, stages, group)]) for bm, pairs, stages, group in CUTE_QKV_TILES]
    return out


# The plugin and compile shapes of each projection as a Llama-3-8B engine builds it.
ENGINE = {"qkv": ("norm_qkv_rope", {"K": 4096, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128}),
          "o_proj": ("linear_residual", {"K": 4096, "N": 4096}),
          "gate_up": ("norm_swiglu", {"K": 4096, "I": 14336, "block": 64}),
          "down": ("linear_residual", {"K": 14336, "N": 4096})}


def engine_configs() -> list[tuple[str, dict, list[AotKernel]]]:
    """(shape name, info, kernels): each projection's plugin's sm_90 kernels, all of them (its launcher picks
    the bucket serving T and runs the pre-passes)."""
    import importlib
    out = []
    for name, (plugin, shapes) in ENGINE.items():
        if name not in SHAPES or FP8:
            continue
        kernels = [k for k in importlib.import_module(f"kiln.plugins.{plugin}.kernels").aot_kernels("bfloat16", shapes)
                   if k.targets is None or "sm_90" in k.targets]
        if nvcc_path() is None:
            kernels = [k for k in kernels if not isinstance(k, NvccKernel)]
        n, k = SHAPES[name]
        out.append((name, {"kind": plugin, "n": n, "k": k, "label": f"engine {plugin}"}, kernels))
    return out


def _compile(index: int):
    return index, try_compile(configs()[index][2])


def compile_all(path: str) -> None:
    entries = configs()
    # A CuTe GEMM takes N and K at launch: one cubin serves every shape of its tiling.
    first = {}
    for i, (_, _, kernel) in enumerate(entries):
        first.setdefault(kernel.entry if isinstance(kernel, NvccKernel) else i, i)
    with ProcessPoolExecutor(os.cpu_count()) as pool:
        built = dict(pool.map(_compile, first.values()))
    cubins = {i: built[first[kernel.entry if isinstance(kernel, NvccKernel) else i]]
              for i, (_, _, kernel) in enumerate(entries)}
    engine = [(name, info, [(k.signature, compile_cubin(k, "sm_90"), k.meta) for k in kernels])
              for name, info, kernels in engine_configs()]
    with open(path, "wb") as f:
        pickle.dump(([(name, info, kernel.signature, cubins[i]) for i, (name, info, kernel) in enumerate(entries)],
                     engine), f)
    cute = sum(info["kind"].startswith("cute") for _, info, _ in entries)
    print(f"{len(entries)} configurations ({cute} of the CuTe GEMMs), "
          f"{sum(isinstance(c, str) for c in cubins.values())} failed to compile")


def run_all(path: str, every: str | None = None) -> None:
    import torch

    from kiln.plugins.fp8 import dequantize_rows, quantize_rows
    from kiln.runtime.cuda_driver import CudaError, encode_tensor_map, load_kernel

    with open(path, "rb") as f:
        entries, engine = pickle.load(f)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    rate = 2 * 8192 ** 3 / graph_us(lambda: torch.mm(a, a)) / 1e6
    print(f"GEMM rate (bf16 8192^3, torch.mm): {rate:.0f} TFLOP/s; {sms} SMs")
    a = None
    scratch = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
    # the CuTe split-K GEMM's workspaces (`cute_gemm.split_workspace`: 8 MB and 512 bytes for o_proj at 256
    # rows); the counts zeroed once, as the kernel leaves them
    split_part = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    split_count = torch.zeros(1 << 20, dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights, results = {}, {}
    w_scales = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        if FP8:
            w, w_scales[name] = quantize_rows(w)
        weights[name] = [w] + [w.clone() for _ in range(-(-L2_ROTATION // w.nbytes) - 1)]
    for (name, (n, k)), t in itertools.product(SHAPES.items(), ROWS):
        x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        out = torch.empty(t, n, device="cuda", dtype=torch.bfloat16)
        turn = itertools.count()
        if FP8:
            x, x_scale = quantize_rows(x)
            w_scale = w_scales[name]
            ref = dequantize_rows(x, x_scale) @ dequantize_rows(weights[name][0], w_scale).T
            us = graph_us(lambda: out.copy_(torch._scaled_mm(
                x, weights[name][next(turn) % len(weights[name])].T, scale_a=x_scale[:, None],
                scale_b=w_scale[None, :], out_dtype=torch.bfloat16)))
            label = "cuBLAS FP8 torch._scaled_mm"
        else:
            ref = (x.float() @ weights[name][0].float().T)
            us = graph_us(lambda: torch.mm(x, weights[name][next(turn) % len(weights[name])].T, out=out))
            label = "cuBLAS torch.mm"
        results[(name, t)] = [(us, label, ((out.float() - ref).norm() / ref.norm()).item())]
        x_tiles = _in_whole_tiles(x)
        for cname, info, signature, cubin in entries:
            if cname != name:
                continue
            if isinstance(cubin, str):
                print(f"  {name} {info['label']}: did not compile ({cubin})")
                continue
            try:
                fn = load_kernel(cubin.binary, cubin.name, [s for s in signature.values() if s != "constexpr"],
                                 cubin.num_warps, cubin.shared_bytes, cubin.global_scratch)
                fn.scratch = (scratch.data_ptr(), scratch.numel() // max(cubin.global_scratch, 1))
            except CudaError as e:
                print(f"  {name} {info['label']}: does not load ({e})")
                continue
            if info["kind"] == "cute_qkv":
                us, err = _time_cute_qkv(fn, info, x_tiles, weights[name], t, sms)
                results[(name, t)].append((us, f"{info['label']} persistent", err))
                continue
            if info["kind"] == "cute" and info["parts"] > 1 and any(
                    size > buffer.nbytes for size, buffer in zip(
                        cute_gemm.split_workspace(t, n, info["bm"], info["bn"], info["parts"]),
                        (split_part, split_count))):
                continue   # split-K is for a few hundred rows; its workspace here would not fit
            tiles = -(-t // info["bm"]) * -(-n // info["bn"])
            grids = {"": None}
            if info["kind"] == "tma":
                grids = {"persistent": min(tiles, sms), "one tile each": tiles}
            elif info["kind"] == "cute":
                grids = {"persistent": cute_gemm.gemm_grid(t, n, k, info["bm"], info["bn"], sms, info["parts"])[0]}
            for gname, programs in grids.items():
                grid = (programs, 1, 1) if programs else (-(-t // info["bm"]), -(-n // info["bn"]), 1)
                if info["kind"] == "cute":
                    x_map = encode_tensor_map(x_tiles.data_ptr(), "bf16", (map_rows(x_tiles, info["bm"]), k),
                                              (info["bm"], cute_gemm.k_tile()))
                    split = [split_part.data_ptr(), split_count.data_ptr()] if info["parts"] > 1 else []
                    args = [[x_map, encode_tensor_map(w.data_ptr(), "bf16", (n, k), (info["bn"], cute_gemm.k_tile())),
                             0, 0, out.data_ptr(), *split, t, n, k] for w in weights[name]]
                elif FP8:
                    args = [[x.data_ptr(), x_scale.data_ptr(), w.data_ptr(), w_scale.data_ptr(), out.data_ptr(), t]
                            for w in weights[name]]
                else:
                    args = [[x.data_ptr(), w.data_ptr(), out.data_ptr(), t] for w in weights[name]]
                turn = itertools.count()

                def call():
                    fn.launch(grid, args[next(turn) % len(args)], torch.cuda.current_stream().cuda_stream)
                out.zero_()
                fn.launch(grid, args[0], torch.cuda.current_stream().cuda_stream)
                torch.cuda.synchronize()
                err = ((out.float() - ref).norm() / ref.norm()).item()
                us = graph_us(call)
                results[(name, t)].append((us, f"{info['label']} {gname}".strip(), err))
        for ename, info, kernels in engine:
            if ename == name:
                us, err = _time_engine(info, kernels, x, weights[name], t, scratch)
                results[(name, t)].append((us, info["label"], err))
        rows = sorted(results[(name, t)])
        flops = 2 * t * n * k
        cublas = next(us for us, label, _ in rows if label.startswith("cuBLAS"))
        print(f"{name} N={n} K={k} T={t}: cuBLAS {cublas:.1f} us = {flops / cublas / 1e6:.0f} TFLOP/s "
              f"({flops / cublas / 1e6 / rate:.0%} of rate)")
        best_cute = next(([r] for r in rows[6:] if r[1].startswith("cute") and r[2] < 2e-2), [])
        for us, label, err in rows[:6] + best_cute:
            print(f"  {us:8.1f} us {flops / us / 1e6:4.0f} TFLOP/s ({flops / us / 1e6 / rate:4.0%} of rate, "
                  f"{cublas / us:4.2f}x cuBLAS) rel err {err:.1e}  {label}")
        for us, label, err in rows:
            if not err < 2e-2:
                print(f"  WRONG: {label} rel err {err:.2e}")
        if every:
            with open(every, "a") as f:
                f.writelines(f"{name} T={t} {us:.1f} us {flops / us / 1e6:.0f} TFLOP/s rel err {err:.1e} {label}\n"
                             for us, label, err in rows)


def _time_engine(info: dict, kernels: list, x, weights: list, t: int, global_scratch) -> tuple[float, float]:
    """Time one projection's engine kernels through its plugin's launcher (the bucket serving t rows and its
    pre-passes, x in whole tiles as the engine's activations are) over the weight copies; returns (us,
    relative error against the plugin reference, the cache's too for qkv)."""
    import importlib

    import torch

    from kiln.plugins import get_plugin
    from kiln.runtime.cuda_driver import load_kernel
    from kiln.runtime.cuda_executor import op_scratch

    fns = []
    for signature, cubin, _ in kernels:
        fn = load_kernel(cubin.binary, cubin.name, [s for s in signature.values() if s != "constexpr"],
                         cubin.num_warps, cubin.shared_bytes, cubin.global_scratch)
        fn.scratch = (global_scratch.data_ptr(), global_scratch.numel() // max(cubin.global_scratch, 1))
        fns.append(fn)
    metas = [meta for _, _, meta in kernels]
    plugin, eps = info["kind"], 1e-5
    launcher = importlib.import_module(f"kiln.plugins.{plugin}.launch")
    x = _in_whole_tiles(x)
    kv = kv_ref = None
    if plugin == "linear_residual":
        attrs = {"parallel": "row", "heads": 0, "all_reduce": False}
        residual = torch.randn(t, info["n"], device="cuda", dtype=torch.bfloat16)
        inputs, out = [x, weights[0], None, residual], torch.empty_like(residual)
        ref = x.float() @ weights[0].float().T + residual.float()
    elif plugin == "norm_qkv_rope":
        attrs = {"eps": eps, "layer": 0, "num_heads": QKV_HEADS["heads"], "num_kv_heads": QKV_HEADS["kv_heads"],
                 "head_dim": QKV_HEADS["head_dim"]}
        out, pos, rope, kv, slots, ref, kv_ref = _qkv_case(x, weights[0], eps)
        inputs = [x, None, weights[0], None, None, None, pos, rope, kv, slots]
    else:
        attrs = {"eps": eps, "block": 64, "activation": "silu"}
        inputs, out = [x, None, weights[0]], torch.empty(t, info["n"] // 2, device="cuda", dtype=torch.bfloat16)
        ref = get_plugin(plugin).call_reference(inputs, {"eps": eps, "block": 64})
    limits = {"T": max(t, 128), "S": 1, "B": 1, "block_size": 16, "element_bytes": 2}
    scratch = {name: torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
               for name, nbytes in op_scratch(launcher, attrs, metas, limits).items()}
    slot = 1 if plugin == "linear_residual" else 2   # the weight's place among the inputs
    turn = itertools.count(0)

    def call():
        inputs[slot] = weights[next(turn) % len(weights)]
        launcher.launch(fns, metas, inputs, attrs, out, {"T": t}, torch.cuda.current_stream().cuda_stream, scratch)
    inputs[slot] = weights[0]
    launcher.launch(fns, metas, inputs, attrs, out, {"T": t}, torch.cuda.current_stream().cuda_stream, scratch)
    torch.cuda.synchronize()
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    if kv is not None:
        err = max(err, ((kv.float() - kv_ref.float()).norm() / kv_ref.float().norm()).item())
    return graph_us(call), err


def _in_whole_tiles(x):
    """x [T, K] as a view of a buffer of whole 128-row tiles, as the engine's activations are
    (`linear.launch.map_rows`)."""
    import torch
    return torch.cat([x, torch.zeros(-x.shape[0] % 128, x.shape[1], device=x.device, dtype=x.dtype)])[:x.shape[0]]


def _qkv_case(x, w, eps: float):
    """norm_qkv_rope's inputs for x's rows at positions 0..T-1 in a bf16 cache of one layer, slot t for
    token t, and the plugin reference's q and cache: (out, positions, rope, cache, slots, q ref, cache ref)."""
    import torch

    from kiln.plugins import get_plugin
    t, heads, kv_heads, d = x.shape[0], QKV_HEADS["heads"], QKV_HEADS["kv_heads"], QKV_HEADS["head_dim"]
    out = torch.empty(t, heads * d, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(t, dtype=torch.int32, device="cuda")
    angles = pos[:, None].float() * 500000.0 ** (-torch.arange(0, d, 2, device="cuda") / d)
    rope = torch.cat([angles.cos(), angles.sin()], dim=1).contiguous()
    kv = torch.zeros(1, 2, -(-t // 16), 16, kv_heads, d, device="cuda", dtype=torch.bfloat16)
    slots = torch.arange(t, dtype=torch.int32, device="cuda")
    kv_ref = kv.clone()
    ref = get_plugin("norm_qkv_rope").call_reference([x, None, w, None, None, None, pos, rope, kv_ref, slots],
                                                     {"eps": eps, "layer": 0, "num_heads": heads,
                                                      "num_kv_heads": kv_heads, "head_dim": d})
    return out, pos, rope, kv, slots, ref, kv_ref


def _time_cute_qkv(fn, info: dict, x, weights: list, t: int, sms: int) -> tuple[float, float]:
    """The CuTe qkv GEMM as norm_qkv_rope's launcher would run it (the row scales as the pre-pass makes them,
    x in whole tiles) over the weight copies; returns (us, the larger relative error of q and the cache)."""
    import torch

    eps = 1e-5
    out, pos, rope, kv, slots, ref, kv_ref = _qkv_case(x, weights[0], eps)
    scales = torch.rsqrt(x.float().pow(2).mean(dim=1) + eps)
    grid = cute_gemm.qkv_grid(t, *QKV_HEADS.values(), x.shape[1], info["bm"], info["pairs"], sms)
    turn = itertools.count(0)

    def call():
        launch_cute_qkv(fn, grid, info["bm"], info["pairs"], x, weights[next(turn) % len(weights)],
                        scales.data_ptr(), None, pos, rope, kv, slots, out, 0, QKV_HEADS["heads"],
                        QKV_HEADS["kv_heads"], torch.cuda.current_stream().cuda_stream)
    call()
    torch.cuda.synchronize()
    err = max(((out.float() - ref.float()).norm() / ref.float().norm()).item(),
              ((kv.float() - kv_ref.float()).norm() / kv_ref.float().norm()).item())
    return graph_us(call), err


if __name__ == "__main__":
    {"compile": compile_all, "run": run_all}[sys.argv[1]](*sys.argv[2:])
