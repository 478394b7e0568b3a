"""Sweep the decode GEMMs' tilings, split-K included, as the engine runs them (a developer's tool).

    PYTHONPATH=. python3 scripts/tune_gemm.py compile cubins.pkl [NAME]  # anywhere: AOT, no GPU needed
    PYTHONPATH=. python3 scripts/tune_gemm.py run cubins.pkl [ALL.txt]   # on the GPU

`compile` builds every configuration into a cubin with `plugins.aot` (as build-engine does),
spread over the CPU's cores; `run` loads them with `runtime.cuda_driver` (as the CUDA executor
does), checks each against torch's matmul, and times it in a CUDA graph of 20 launches (median
of 5 replays, after `gpu_timing.WARM_S` of them). Printed: the best configurations per shape with
the bandwidth of weights they reach, beside the device copy rate measured in the same run; ALL.txt
gets every configuration's time.

Shapes: Llama-3-8B's projections (qkv, o, gate/up, down) at T = 1 and 64, or one rank's of
a TP engine with KILN_TUNE_TP=2 (or 4). KILN_TUNE_FP8=1 sweeps the W8A8 kernels instead (e4m3
weights and e4m3 rows of x as the quantize pre-pass leaves them, with their scales; checked
against the dequantized product). Kernels: the split-K
GEMM `linear_kernel` at tilings and K splits, `norm_swiglu_kernel` at its tiles (and K splits
at T = 64) on W_gu both plain and interleaved as the engine holds it, and
`norm_qkv_rope_kernel` (checked against its plugin's reference) at programs per head, K tiles,
K splits and depths, at T = 64 also with its row scales from the pre-pass; then the persistent
TMA `tma_norm_swiglu_kernel` at T = 64 and the row-scale pre-pass itself; and the medium bucket's
split-K GEMM on the narrow weights at T = 256 (or the rows KILN_TUNE_MEDIUM_ROWS names). NAME (comma-separated) compiles only the configurations of those shapes
or kernels (a label's first word: splitk, medium, norm_swiglu, norm_qkv_rope), and KILN_TUNE_T=64 (comma-separated) only
those at these row counts.
"""
from __future__ import annotations

import itertools
import os
import pickle
import sys
from concurrent.futures import ProcessPoolExecutor

import triton

from kiln.builder.passes.fold import GATE_UP_BLOCK, interleave
from kiln.plugins.aot import AotKernel, absent_as_none, pointer_params
from kiln.plugins.linear.kernels import linear_kernel, split_signature
from scripts.gpu_timing import graph_us
from scripts.sweep import try_compile

L2_ROTATION = 200_000_000  # bytes of weight copies cycled through, 4x the H200's L2
# KILN_TUNE_TP=r sweeps one rank's shapes of a TP r engine: column-parallel weights (qkv, gate/up)
# keep 1/r of their rows, row-parallel ones (o_proj, down) 1/r of their columns.
TP = int(os.environ.get("KILN_TUNE_TP", "1"))
SHAPES = {"qkv": (6144 // TP, 4096), "o_proj": (4096, 4096 // TP), "gate_up": (28672 // TP, 4096),
          "down": (4096, 14336 // TP)}
FP8 = os.environ.get("KILN_TUNE_FP8", "0") == "1"
# The GEMM operands' pointer type, and the scales' (absent unless FP8).
OPERAND, SCALE = ("*fp8e4nv", "*fp32") if FP8 else ("*bf16", "constexpr")
WEIGHT_BYTES = 1 if FP8 else 2


def configs() -> list[tuple[str, dict, AotKernel]]:
    """(shape name, what the run needs, kernel) for every configuration swept."""
    from kiln.plugins.norm_swiglu.kernels import norm_swiglu_kernel

    out = []
    for (name, (n, k)), t in itertools.product(SHAPES.items(), (1, 64)):
        bm = 16 if t == 1 else 64
        # At T = 64 also 128 weight rows, 8 K parts and 6 stages, which read x fewer times over
        # (none beat 32-64 rows and 1-2 parts on an H200: BENCHMARKS.md, session 16).
        space = (([32, 64, 128], [128, 256], [1, 2, 4, 8], [3, 4, 6]) if t == 1 else
                 ([32, 64, 128], [64, 128], [1, 2, 4, 8], [3, 4, 6]))
        if FP8:   # K tiles of the same bytes and more: e4m3 elements are half as wide
            space = (space[0], [2 * bk for bk in space[1]] + [1024] * (t == 1), *space[2:])
        for bn, bk, split, stages in itertools.product(*space):
            if (k // split) % bk or (name == "gate_up" and split > 2):
                continue
            signature = {"x_ptr": OPERAND, "x_scale_ptr": SCALE, "w_ptr": OPERAND, "w_scale_ptr": SCALE,
                         "bias_ptr": "constexpr", "residual_ptr": "constexpr",
                         "out_ptr": "*bf16", **split_signature(split), "T": "i32", "N": "constexpr",
                         "K": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
                         "UPCAST_DOT": "constexpr", "SPLIT_K": "constexpr"}
            constexprs = {"N": n, "K": k, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "UPCAST_DOT": False,
                          "SPLIT_K": split}
            grid = (triton.cdiv(t, bm), n // bn, split)
            out.append((name, {"kind": "splitk", "n": n, "k": k, "t": t, "grid": grid, "split": split,
                               "label": f"splitk bm{bm} bn{bn} bk{bk} split{split} s{stages}"},
                        AotKernel(linear_kernel, signature, absent_as_none(signature, constexprs), num_warps=4, num_stages=stages,
                                  aligned=pointer_params(signature))))
        if name == "gate_up":
            inter = n // 2
            space = (([32, 64], [128], [3, 4, 6], [4, 8], [1]) if t == 1 else
                     ([64, 128, 256], [64, 128], [3, 4], [4, 8], [1, 2]))
            if FP8:
                space = (space[0], [2 * bk for bk in space[1]], *space[2:])
            # bf16 at T = 64 also with the row scales from the pre-pass (x_scale_ptr), on the engine's W_gu.
            for bn, bk, stages, warps, split, gu, prescaled in itertools.product(*space, [GATE_UP_BLOCK, inter],
                                                                                 [False, True]):
                if prescaled and (FP8 or t == 1 or gu != GATE_UP_BLOCK):
                    continue
                signature = {"x_ptr": OPERAND, "x_scale_ptr": "*fp32" if prescaled else SCALE, "norm_ptr": "constexpr", "w_ptr": OPERAND,
                             "w_scale_ptr": SCALE, "out_ptr": "*bf16", "q_ptr": "constexpr", "q_scale_ptr": "constexpr",
                             "q_static_ptr": "constexpr", **split_signature(split),
                             "T": "i32", "eps": "fp32",
                             "I": "constexpr", "K": "constexpr", "GU_BLOCK": "constexpr",
                             "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
                             "UPCAST_DOT": "constexpr", "SPLIT_K": "constexpr", "GELU_TANH": "constexpr",
                             "ROUND_E4M3": "constexpr"}
                constexprs = {"I": inter, "K": k, "GU_BLOCK": gu, "BLOCK_M": bm, "BLOCK_N": bn // 2,
                              "BLOCK_K": bk, "UPCAST_DOT": False, "SPLIT_K": split, "GELU_TANH": False}
                grid = (triton.cdiv(t, bm), inter // (bn // 2), split)
                out.append(("norm_swiglu", {"kind": "norm_swiglu", "n": n, "k": k, "t": t, "grid": grid, "split": split,
                                            "gu_block": gu, "prescaled": prescaled,
                                            "label": f"norm_swiglu bm{bm} bn{bn} bk{bk} split{split} s{stages} "
                                                     f"w{warps} gu{gu}{' prescaled' * prescaled}"},
                            AotKernel(norm_swiglu_kernel, signature, absent_as_none(signature, constexprs),
                                      num_warps=warps, num_stages=stages, aligned=pointer_params(signature))))
    return out + _medium_configs() + _tma_norm_swiglu_configs() + _norm_qkv_rope_configs()


# KILN_TUNE_T=64 (comma-separated): compile only the configurations at these row counts.
ROWS_ONLY = tuple(int(r) for r in os.environ.get("KILN_TUNE_T", "").split(",") if r)
# KILN_TUNE_MEDIUM_ROWS=128,256 (comma-separated): the row counts of the medium-bucket sweep.
MEDIUM_ROWS = tuple(int(r) for r in os.environ.get("KILN_TUNE_MEDIUM_ROWS", "256").split(","))


def _medium_configs() -> list[tuple[str, dict, AotKernel]]:
    """The split-K GEMM on the narrow weights (qkv's shape, o_proj, down) at MEDIUM_ROWS (the
    medium bucket's largest batch by default): row blocks of 64 and 128, K unsplit or split."""
    out = []
    for name, t, (bm, bn, split, stages) in itertools.product(
            ("qkv", "o_proj", "down"), MEDIUM_ROWS, itertools.product([64, 128], [64, 128], [1, 2, 4, 8], [3, 4])):
        n, k = SHAPES[name]
        bk = 64 * 2 // WEIGHT_BYTES
        if (k // split) % bk:
            continue
        signature = {"x_ptr": OPERAND, "x_scale_ptr": SCALE, "w_ptr": OPERAND, "w_scale_ptr": SCALE,
                     "bias_ptr": "constexpr", "residual_ptr": "constexpr", "out_ptr": "*bf16",
                     **split_signature(split), "T": "i32", "N": "constexpr", "K": "constexpr",
                     "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
                     "UPCAST_DOT": "constexpr", "SPLIT_K": "constexpr"}
        constexprs = {"N": n, "K": k, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "UPCAST_DOT": False,
                      "SPLIT_K": split}
        out.append((name, {"kind": "splitk", "n": n, "k": k, "t": t, "grid": (-(-t // bm), n // bn, split),
                           "split": split, "label": f"medium bm{bm} bn{bn} bk{bk} split{split} s{stages}"},
                    AotKernel(linear_kernel, signature, absent_as_none(signature, constexprs),
                              num_warps=4 if bm * bn < 128 * 128 else 8, num_stages=stages,
                              aligned=pointer_params(signature))))
    return out


def _tma_norm_swiglu_configs() -> list[tuple[str, dict, AotKernel]]:
    """The persistent TMA norm + SwiGLU kernel at T = 64 with 64- and 128-row tiles (its row scales
    from a pre-pass, which the run times as `row_scale`), and that pre-pass at T = 1 and 64."""
    from kiln.plugins.linear.tma import row_scale_kernel
    from kiln.plugins.norm_swiglu.kernels import tma_norm_swiglu_kernel

    n, k = SHAPES["gate_up"]
    inter, t = n // 2, 64
    out = []
    for bm, bn, bk, stages, warps in itertools.product([64, 128], [64, 128], [64, 128], [3, 4, 5], [4, 8]):
        signature = {"x_ptr": OPERAND, "scale_ptr": "*fp32", "w_ptr": OPERAND, "w_scale_ptr": SCALE,
                     "out_ptr": "*bf16", "T": "i32", "I": "constexpr", "K": "constexpr", "GU_BLOCK": "constexpr",
                     "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "GROUP_M": "constexpr",
                     "UPCAST_DOT": "constexpr", "GELU_TANH": "constexpr"}
        constexprs = {"I": inter, "K": k, "GU_BLOCK": GATE_UP_BLOCK, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk,
                      "GROUP_M": 8, "UPCAST_DOT": False, "GELU_TANH": False}
        grid = (min(inter // bn, 132), 1, 1)
        out.append(("norm_swiglu", {"kind": "tma_norm_swiglu", "n": n, "k": k, "t": t, "grid": grid,
                                    "gu_block": GATE_UP_BLOCK,
                                    "label": f"tma_norm_swiglu bm{bm} bn{2 * bn} bk{bk} s{stages} w{warps}"},
                    AotKernel(tma_norm_swiglu_kernel, signature, absent_as_none(signature, constexprs),
                              num_warps=warps, num_stages=stages, aligned=pointer_params(signature))))
    for t in () if FP8 else (1, 64, 256):   # FP8's rows come from the quantize pre-pass instead
        signature = {"x_ptr": "*bf16", "scale_ptr": "*fp32", "T": "i32", "eps": "fp32", "K": "constexpr",
                     "BLOCK_K": "constexpr"}
        out.append(("row_scale", {"kind": "row_scale", "n": 1, "k": k, "t": t, "grid": (t, 1, 1),
                                  "label": "row_scale w8"},
                    AotKernel(row_scale_kernel, signature, {"K": k, "BLOCK_K": 4096}, num_warps=8, num_stages=1,
                              aligned=pointer_params(signature))))
    return out


QKV_HEADS = (32 // TP, 8 // TP, 128)  # Llama-3-8B: query heads, KV heads, head_dim


def _norm_qkv_rope_configs() -> list[tuple[str, dict, AotKernel]]:
    """The fused norm + qkv + RoPE kernel: programs per head (its weight rows per program), K
    tile, K split and pipeline depth, at T = 1 and 64."""
    from kiln.plugins.norm_qkv_rope.kernels import norm_qkv_rope_kernel

    heads, kv_heads, d = QKV_HEADS
    k = SHAPES["qkv"][1]
    out = []
    for t in (1, 64, 256):
        bm = 16 if t == 1 else 64
        # bf16 from T = 64 also with the row scales from the pre-pass (x_scale_ptr), the row sums
        # left out; T = 256 (the medium bucket) at the tilings that do not split K.
        for head_split, bk, split, stages, prescaled in itertools.product(
                [1, 2, 4, 8], [64, 128, 256, 512][FP8:], [1, 2, 4], [3, 4, 6], [False, True]):
            if (k // split) % bk or (prescaled and (FP8 or t == 1)) or (t == 256 and (split > 1 or bk > 128)):
                continue
            signature = {"x_ptr": OPERAND, "x_scale_ptr": "*fp32" if prescaled else SCALE, "norm_ptr": "constexpr", "w_ptr": OPERAND,
                         "w_scale_ptr": SCALE, "bias_ptr": "constexpr",
                         "q_norm_ptr": "constexpr", "k_norm_ptr": "constexpr", "pos_ptr": "*i32", "rope_ptr": "*fp32",
                         "kv_ptr": "*bf16", "slot_ptr": "*i32", "kv_scale_ptr": "constexpr", "out_ptr": "*bf16",
                         **split_signature(split),
                         "T": "i32", "num_slots": "i32", "layer": "i32", "eps": "fp32", "K": "constexpr",
                         "H": "constexpr", "KVH": "constexpr", "D": "constexpr", "HEAD_SPLIT": "constexpr",
                         "BLOCK_M": "constexpr", "BLOCK_K": "constexpr", "UPCAST_DOT": "constexpr",
                         "SPLIT_K": "constexpr", "BLOCK_SIZE": "constexpr"}
            constexprs = {"K": k, "H": heads, "KVH": kv_heads, "D": d, "HEAD_SPLIT": head_split, "BLOCK_M": bm,
                          "BLOCK_K": bk, "UPCAST_DOT": False, "SPLIT_K": split, "BLOCK_SIZE": 1}
            grid = (triton.cdiv(t, bm), (heads + 2 * kv_heads) * head_split, split)
            out.append(("norm_qkv_rope", {"kind": "norm_qkv_rope", "n": (heads + 2 * kv_heads) * d, "k": k, "t": t,
                                          "grid": grid, "split": split,
                                          "prescaled": prescaled,
                                          "label": f"norm_qkv_rope bm{bm} bn{d // head_split} bk{bk} "
                                                   f"split{split} s{stages}{' prescaled' * prescaled}"},
                        AotKernel(norm_qkv_rope_kernel, signature, absent_as_none(signature, constexprs),
                                  num_warps=4, num_stages=stages, aligned=pointer_params(signature))))
    return out


def _compile(index: int):
    return index, try_compile(configs()[index][2])


def compile_all(path: str, only: str | None = None) -> None:
    names = None if only is None else only.split(",")
    chosen = [i for i, (name, info, _) in enumerate(configs())
              if (names is None or name in names or info["label"].split()[0] in names)
              and (not ROWS_ONLY or info["t"] in ROWS_ONLY)]
    count = len(chosen)
    with ProcessPoolExecutor(os.cpu_count()) as pool:
        cubins = dict(pool.map(_compile, chosen))
    entries = [(name, info, kernel.signature, cubins[i]) for i, (name, info, kernel) in enumerate(configs())
               if i in cubins]
    with open(path, "wb") as f:
        pickle.dump(entries, f)
    print(f"{count} configurations, {sum(isinstance(c, str) for c in cubins.values())} failed to compile")


def run_all(path: str, every: str | None = None) -> None:
    import torch

    from kiln.plugins.fp8 import dequantize_rows, quantize_rows
    from kiln.runtime.cuda_driver import CudaError, load_kernel

    with open(path, "rb") as f:
        entries = pickle.load(f)
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_tbs = 2 * src.numel() / graph_us(lambda: dst.copy_(src)) / 1e6
    print(f"device copy: {copy_tbs:.2f} TB/s (bytes read + written)")
    src = dst = None
    gen = torch.Generator(device="cuda").manual_seed(0)
    data, results = {}, {}
    part = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    count = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")
    scratch = torch.empty(16 << 20, dtype=torch.uint8, device="cuda")   # device-made TMA descriptors
    for name, info, signature, cubin in entries:
        key = (name, info["t"], info.get("gu_block"))
        if isinstance(cubin, str):
            print(f"  {name} T={info['t']} {info['label']}: did not compile ({cubin})")
            continue
        n, k, t = info["n"], info["k"], info["t"]
        if key not in data:
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
            scales = []
            if FP8:   # the operands as the pre-pass and the build leave them; the reference dequantized
                if info["kind"] != "splitk":   # the pre-pass quantizes the RMSNorm'd row
                    x = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)
                (x, x_scale), (w, w_scale) = quantize_rows(x), quantize_rows(w)
                scales = [x_scale, w_scale]
                ref = dequantize_rows(x, x_scale) @ dequantize_rows(w, w_scale).T
            else:
                ref = x.float() @ w.float().T
            if name == "norm_qkv_rope":
                # FP8: the reference normalizes the dequantized rows again (about 1% off).
                ref = _qkv_reference(dequantize_rows(x, scales[0]), dequantize_rows(w, scales[1]), t) if FP8 \
                    else _qkv_reference(x, w, t)
            if name == "row_scale":
                ref = torch.rsqrt(x.float().pow(2).mean(-1) + 1e-5)
            if name == "norm_swiglu":
                if not FP8:
                    ref = ref * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
                g, u = ref.chunk(2, dim=-1)
                ref = torch.nn.functional.silu(g) * u
            # Copies enough that the launches of one graph stream 200 MB of weights between two
            # reads of the same copy: a weight under the L2's 50 MB would otherwise be timed
            # from the L2 (the first sweep overstated o_proj and qkv so).
            if info.get("gu_block", n // 2) != n // 2:   # the engine's layout (`builder.passes.fold`)
                w = interleave(w, info["gu_block"])
                if scales:   # FP8: a scale a weight row, which moves with it
                    scales[1] = interleave(scales[1].reshape(-1, 1), info["gu_block"]).reshape(scales[1].shape)
            copies = [w] + [w.clone() for _ in range(-(-L2_ROTATION // w.nbytes) - 1)] * (name != "row_scale")
            data[key] = (x, copies, ref, scales)
        x, copies, ref, scales = data[key]
        out = torch.empty_like(ref, dtype=torch.float32 if name == "row_scale" else torch.bfloat16)
        try:
            fn = load_kernel(cubin.binary, cubin.name, [signature[p] for p in signature if signature[p] != "constexpr"],
                             cubin.num_warps, cubin.shared_bytes, cubin.global_scratch)
            fn.scratch = (scratch.data_ptr(), scratch.numel() // max(cubin.global_scratch, 1))
        except CudaError as e:  # more shared memory than a block may have
            print(f"  {name} T={info['t']} {info['label']}: does not load ({e})")
            continue
        workspace = [part.data_ptr(), count.data_ptr()] if info.get("split", 1) > 1 else []
        # x and w lead every kernel's arguments, each followed by its scales when FP8.
        operands = [[t.data_ptr() for t in ((x, scales[0], w, scales[1]) if FP8 else (x, w))] for w in copies]
        if info.get("prescaled"):   # x, then its row scales, as the pre-pass leaves them
            row_scale = torch.rsqrt(x.float().pow(2).mean(-1) + 1e-5)
            operands = [[ops[0], row_scale.data_ptr(), *ops[1:]] for ops in operands]
        if info["kind"] == "norm_qkv_rope":
            q_ctx = _qkv_context(t)
            arg_lists = [[*ops, q_ctx["pos"].data_ptr(), q_ctx["rope"].data_ptr(), q_ctx["kv"].data_ptr(),
                          q_ctx["slot"].data_ptr(), out.data_ptr(), *workspace, t,
                          q_ctx["kv"].shape[2] * q_ctx["kv"].shape[3], 0, 1e-5] for ops in operands]
        elif info["kind"] == "tma_norm_swiglu" and FP8:   # x quantized with its scales, as the pre-pass leaves it
            arg_lists = [[*ops, out.data_ptr(), t] for ops in operands]
        elif info["kind"] == "tma_norm_swiglu":
            row_scale = torch.rsqrt(x.float().pow(2).mean(-1) + 1e-5)
            arg_lists = [[x.data_ptr(), row_scale.data_ptr(), w.data_ptr(), out.data_ptr(), t] for w in copies]
        elif info["kind"] == "row_scale":
            arg_lists = [[x.data_ptr(), out.data_ptr(), t, 1e-5]]
        elif info["kind"] == "splitk":
            arg_lists = [[*ops, out.data_ptr(), *workspace, t] for ops in operands]
        else:
            arg_lists = [[*ops, out.data_ptr(), *workspace, t, 1e-5] for ops in operands]
        turn = itertools.count()

        def call():
            fn.launch(info["grid"], arg_lists[next(turn) % len(arg_lists)], torch.cuda.current_stream().cuda_stream)
        us = graph_us(call)
        out.zero_()
        fn.launch(info["grid"], arg_lists[0], torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        results.setdefault((name, t, n, k), []).append((us, info["label"], err))
    for (name, t, n, k), rows in results.items():
        rows.sort()
        nbytes = n * k * WEIGHT_BYTES
        print(f"{name} N={n} K={k} T={t}: weights {nbytes / 1e6:.0f} MB")
        for us, label, err in rows[:8]:
            print(f"  {us:7.1f} us  {nbytes / us / 1e6:5.2f} TB/s ({nbytes / us / 1e6 / copy_tbs:4.0%} of copy)"
                  f"  rel err {err:.1e}  {label}")
        if every:
            with open(every, "a") as f:
                f.writelines(f"{name} T={t} {us:.1f} us rel err {err:.1e} {label}\n" for us, label, err in rows)
        bad = [(label, err) for _, label, err in rows if not err < 2e-2]
        for label, err in bad:
            print(f"  WRONG: {label} rel err {err:.2e}")


_QKV_CONTEXTS: dict = {}


def _qkv_context(t: int) -> dict:
    """Positions, a RoPE table, a one-layer KV cache and slots for the fused qkv kernel at T = t
    (the same tensors for the reference and every configuration)."""
    import torch

    if t not in _QKV_CONTEXTS:
        heads, kv_heads, d = QKV_HEADS
        gen = torch.Generator(device="cuda").manual_seed(1)
        _QKV_CONTEXTS[t] = {"pos": torch.arange(t, dtype=torch.int32, device="cuda") + 100,
                            "rope": torch.randn(4096, d, device="cuda", generator=gen),
                            "kv": torch.zeros(1, 2, max(8, t // 16), 16, kv_heads, d, device="cuda", dtype=torch.bfloat16),
                            "slot": torch.arange(t, dtype=torch.int32, device="cuda")}
    return _QKV_CONTEXTS[t]


def _qkv_reference(x, w, t: int):
    """The rotated q of the plugin's PyTorch reference (float32), what the kernel writes to its output."""
    from kiln.plugins.norm_qkv_rope.reference import norm_qkv_rope

    heads, kv_heads, d = QKV_HEADS
    ctx = _qkv_context(t)
    return norm_qkv_rope(x.float(), None, w.float(), None, None, None, ctx["pos"], ctx["rope"], ctx["kv"].float(),
                         ctx["slot"], 1e-5, 0, heads, kv_heads, d)


if __name__ == "__main__":
    {"compile": compile_all, "run": run_all}[sys.argv[1]](*sys.argv[2:])
