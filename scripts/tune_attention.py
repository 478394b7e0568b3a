"""Sweep the decode attention kernel's tiles as the engine runs them (a developer's tool).

    PYTHONPATH=. python3 scripts/tune_attention.py compile cubins.pkl   # anywhere: AOT, no GPU needed
    PYTHONPATH=. python3 scripts/tune_attention.py run cubins.pkl       # on the GPU

`compile` builds `attention_kernel` (decode, and split-KV decode that merges its own parts as the
engine's does) and the split combine kernel (which the CUDA e4m3 split kernel takes) for Llama-3-8B's
heads (32 query, 8 KV, head_dim 128, 16-token cache blocks) at each tiling into cubins, as build-engine
does; `run` loads them through `runtime.cuda_driver`, launches them on grids chosen as the engine's
launcher chooses them (the split count from the batch and the engine's 4,352-token bound,
`choose_num_splits`), checks the output against the plugin's reference for a few sequences, and times
each in a CUDA graph of 20 launches that cycle through enough KV caches that none is read from the L2.
Printed per batch and context: the best tilings with the KV bytes they stream per second.

With KILN_TUNE_FP8_KV=1 (at compile and at run) the decode kernels read an e4m3 cache (unit
scales, v's blocks transposed), as an engine built with --kv-cache-dtype fp8 does, and KV bytes
count one per element; the CUDA decode kernel for such a cache (`plugins/attention/decode_fp8.cu`)
is swept beside Triton's at 2, 4 and 8 warps, at the engine's split count and a few around it. The
device's copy rate, measured as bench-engine measures it, heads the output.

Prefill (`compile ... prefill`, `run ... prefill`): the same kernel at prefill tilings, and the CuTe
prefill kernel (`plugins/attention/prefill_sm90.cu`, labelled "cute"; it needs nvcc and
`nvidia-cutlass`'s headers; each tiling launched a block a tile and persistent), over whole causal
prompts of 2k and 8k tokens (one sequence, and four of 2k), each checked against and timed beside
`torch.nn.functional.scaled_dot_product_attention` on the flash backend in the same run, with TFLOP/s
counted over the causal half.
"""
from __future__ import annotations

import itertools
import os
import pickle
import sys
from concurrent.futures import ProcessPoolExecutor

from kiln.plugins.aot import AotKernel, absent_as_none, pointer_params
from kiln.plugins.attention.flash import attention_kernel, combine_splits_kernel
from kiln.plugins.attention.kernels import MAX_SPLITS, SEQ_CHUNK, _head_block, choose_num_splits, decode_blocks
from scripts.gpu_timing import copy_rate, graph_us
from scripts.sweep import try_compile

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
MAX_KEYS = 4352            # the bench engine's max_seq_len: the launcher's split rule reads it
# The last two are offline 2048/2048's decode steps: hundreds of sequences at 2-4k context.
CASES = ((1, 128), (1, 2048), (8, 1024), (32, 4096), (64, 128), (64, 1024), (256, 128), (256, 1024), (1024, 256),
         (256, 3072), (448, 3072), (512, 2048))
L2_ROTATION = 200_000_000  # bytes of KV cycled through, 4x the H200's L2


FP8_KV = os.environ.get("KILN_TUNE_FP8_KV") == "1"

PREFILL_CASES = ((1, 2048), (1, 8192), (4, 2048))
PREFILL_MAX_KEYS = 8192


def configs(kind: str = "decode") -> list[tuple[dict, AotKernel]]:
    cache = "*fp8e4nv" if FP8_KV and kind == "decode" else "*bf16"
    signature = {
        "q_ptr": "*bf16", "k_cache_ptr": cache, "v_cache_ptr": cache, "out_ptr": "*bf16",
        "part_ptr": "*fp32", "stats_ptr": "*fp32", "arrivals_ptr": "constexpr", "block_tables_ptr": "*i32",
        "query_lens_ptr": "*i32",
        "context_lens_ptr": "*i32", **({"scale_ptr": "*fp32"} if cache == "*fp8e4nv" else {}), "num_seqs": "i32", "first_seq": "i32",
        "q_stride": "i32", "out_stride": "i32",
        "table_stride": "i32", "scale": "fp32", "window": "i32",
        **{name: "constexpr" for name in ("NUM_HEADS", "NUM_KV_HEADS", "HEAD_DIM", "BLOCK_SIZE", "BLOCK_M",
                                          "BLOCK_N", "BLOCK_D", "SEQ_CHUNK", "SPLIT", "PURE_DECODE",
                                          "INTERPRETER")}}
    out = []
    # Decode: the engine's search-free decode kernels (PURE_DECODE) at every tiling, and the
    # general kernel (programs find their sequence by a prefix sum) at the engine's tiling.
    space = (((False, True), (16,), (32, 64, 128), (2, 4, 8), (1, 2, 3), (True,)) if kind == "decode" else
             ((False,), (64, 128), (32, 64, 128), (4, 8), (1, 2, 3), (False,)))
    extra = [(False, 16, 64, 4, 2, False), (True, 16, 64, 4, 2, False)] if kind == "decode" else []
    for split, block_m, block_n, warps, stages, pure in [*itertools.product(*space), *extra]:
        constexprs = {"NUM_HEADS": HEADS, "NUM_KV_HEADS": KV_HEADS, "HEAD_DIM": HEAD_DIM, "BLOCK_SIZE": BLOCK_SIZE,
                      "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_D": _head_block(HEAD_DIM),
                      "SEQ_CHUNK": SEQ_CHUNK, "SPLIT": split, "PURE_DECODE": pure, "INTERPRETER": False}
        label = f"bn{block_n} w{warps} s{stages}" if kind == "decode" else f"bm{block_m} bn{block_n} w{warps} s{stages}"
        if kind == "decode" and not pure:
            label += " prefix-sum"
        # A split kernel merges its own parts, as the engine's does, counting arrivals.
        sig = {**signature, "arrivals_ptr": "*i32"} if split else signature
        out.append(({"split": split, "merges": split, "block_m": block_m, "pure": pure, "label": label},
                    AotKernel(attention_kernel, sig, absent_as_none(sig, constexprs), num_warps=warps,
                              num_stages=stages, aligned=pointer_params(sig))))
    combine = {"part_ptr": "*fp32", "stats_ptr": "*fp32", "out_ptr": "*bf16", "out_stride": "i32", "num_splits": "i32",
               "NUM_HEADS": "constexpr", "HEAD_DIM": "constexpr", "BLOCK_D": "constexpr", "MAX_SPLITS": "constexpr"}
    if kind == "decode" and FP8_KV:
        out += cuda_configs()
    if kind == "prefill":
        out += cute_prefill_configs()
    out.append(({"combine": True, "label": "combine"},
                AotKernel(combine_splits_kernel, combine, {"NUM_HEADS": HEADS, "HEAD_DIM": HEAD_DIM,
                                                            "BLOCK_D": _head_block(HEAD_DIM), "MAX_SPLITS": MAX_SPLITS},
                          aligned=("part_ptr", "stats_ptr", "out_ptr"))))
    return out


def cuda_configs() -> list[tuple[dict, object]]:
    """The CUDA decode kernel for an e4m3 cache (`plugins/attention/decode_fp8.cu`) at each warp count,
    split and not."""
    from kiln.plugins.attention import decode_fp8
    from kiln.plugins.nvcc import NvccKernel

    out = []
    for split, warps in itertools.product((False, True), (2, 4, 8)):
        name = f"tune_decode_fp8_w{warps}{'_split' if split else ''}"
        instance = (f"KILN_DECODE_FP8_KV({name}, __nv_bfloat16, {HEADS}, {KV_HEADS}, {HEAD_DIM}, {BLOCK_SIZE}, "
                    f"{warps}, {str(split).lower()})")
        out.append(({"split": split, "pure": True, "cuda": True, "label": f"cuda w{warps}"},
                    NvccKernel(decode_fp8.SOURCE, name, instance, decode_fp8.SIGNATURE, warps)))
    return out


# The CuTe prefill kernel's tilings: (keys a tile, stages, what overlaps the softmax: prefill_sm90.SCHEDULES).
# 64-key tiles waste less of the diagonal's; with 4 stages they spill (nvcc 13.0).
CUTE_PREFILL_TILES = [(bn, stages, schedule) for bn, stages in ((128, 2), (64, 3))
                      for schedule in ("plain", "pingpong", "overlap")]


def cute_prefill_configs() -> list[tuple[dict, object]]:
    """The CuTe prefill kernel (`plugins/attention/prefill_sm90.cu`) at its tilings (none without nvcc or
    CUTLASS's headers)."""
    from kiln.plugins.attention import prefill_sm90
    from kiln.plugins.nvcc import nvcc_path

    if nvcc_path() is None:
        return []
    try:
        return [({"cute": True, "label": f"cute bm{prefill_sm90.BLOCK_M} bn{bn} s{stages} {schedule}"},
                 prefill_sm90.kernel(bn, stages, schedule)) for bn, stages, schedule in CUTE_PREFILL_TILES]
    except RuntimeError:
        return []


def _compile(job: tuple[str, int]):
    kind, index = job
    return index, try_compile(configs(kind)[index][1])


def compile_all(path: str, kind: str = "decode") -> None:
    count = len(configs(kind))
    with ProcessPoolExecutor(os.cpu_count()) as pool:
        cubins = dict(pool.map(_compile, [(kind, i) for i in range(count)]))
    with open(path, "wb") as f:
        pickle.dump([(info, kernel.signature, cubins[i]) for i, (info, kernel) in enumerate(configs(kind))], f)
    print(f"{count} configurations, {sum(isinstance(c, str) for c in cubins.values())} failed to compile")


def _case(seqs: int, context: int, gen):
    """Inputs of one decode step: `seqs` sequences with `context` cached tokens each (the last is
    the current token's, written before attention), and copies of the KV cache to cycle through."""
    import torch

    per_seq = -(-context // BLOCK_SIZE)
    blocks = seqs * per_seq
    tables = torch.randperm(blocks, generator=gen).view(seqs, per_seq).to(torch.int32)
    table_cols = -(-MAX_KEYS // BLOCK_SIZE)
    padded = torch.zeros(seqs, table_cols, dtype=torch.int32)
    padded[:, :per_seq] = tables
    dtype = torch.float8_e4m3fn if FP8_KV else torch.bfloat16
    one = blocks * BLOCK_SIZE * KV_HEADS * HEAD_DIM * 2 * dtype.itemsize  # k and v
    caches = [torch.randn(2, blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen).to("cuda", dtype)
              for _ in range(max(1, -(-L2_ROTATION // one)))]
    ref = caches[0].float().cpu()
    if FP8_KV:
        for cache in caches:
            # v's blocks [block_size, kv_heads, head_dim] as an e4m3 cache holds them, transposed.
            cache[1].view(-1).copy_(cache[1].permute(0, 2, 3, 1).reshape(-1))
    return {"ref": ref, "q": torch.randn(seqs, HEADS * HEAD_DIM, generator=gen).to("cuda", torch.bfloat16),
            "tables": padded.cuda(), "query_lens": torch.ones(seqs, dtype=torch.int32, device="cuda"),
            "context_lens": torch.full((seqs,), context, dtype=torch.int32, device="cuda"),
            "caches": caches, "kv_bytes": one}


def run_all(path: str, kind: str = "decode") -> None:
    import torch

    if kind == "prefill":
        run_prefill(path)
        return

    from kiln.plugins.attention.reference import paged_attention

    gen = torch.Generator().manual_seed(0)
    loaded = _load(path)
    copy = copy_rate()
    print(f"device copy {copy:.2f} TB/s (bytes read + written)")
    combine = next(fn for info, fn in loaded if info.get("combine"))
    part = torch.empty(256 * HEADS * MAX_SPLITS * HEAD_DIM, dtype=torch.float32, device="cuda")
    stats = torch.empty(256 * HEADS * MAX_SPLITS * 2, dtype=torch.float32, device="cuda")
    arrivals = torch.zeros(256 * HEADS, dtype=torch.int32, device="cuda")  # each merging launch leaves it at zero
    scale = HEAD_DIM ** -0.5
    unit_scales = torch.ones(2 * KV_HEADS, dtype=torch.float32, device="cuda")  # kept alive: its address is passed
    kv_scales = [unit_scales.data_ptr()] if FP8_KV else []
    for seqs, context in CASES:
        case = _case(seqs, context, gen)
        splits = choose_num_splits(seqs, seqs, KV_HEADS, MAX_KEYS)
        q, out = case["q"], torch.empty_like(case["q"])
        ref_cache = case["ref"][None]
        check = min(seqs, 4)
        ref = paged_attention(q[:check].float().cpu(), ref_cache, case["tables"][:check].cpu(),
                              case["query_lens"][:check].cpu(), case["context_lens"][:check].cpu(), 0, HEADS,
                              KV_HEADS, HEAD_DIM, scale, 0)
        rows = []
        for (info, fn), count in [(entry, n) for entry in loaded if not entry[0].get("combine")
                                  for n in _split_counts(entry[0], splits)]:
            turn = itertools.count()
            programs = seqs * decode_blocks(HEADS, KV_HEADS, 16) if info["pure"] else seqs * (HEADS // KV_HEADS) // 16 + seqs
            grid = (programs, KV_HEADS, count)

            def call(cache=None):
                kv = cache if cache is not None else case["caches"][next(turn) % len(case["caches"])]
                stream = torch.cuda.current_stream().cuda_stream
                fn.launch(grid, [q.data_ptr(), kv[0].data_ptr(), kv[1].data_ptr(), out.data_ptr(), part.data_ptr(),
                                 stats.data_ptr(), *([arrivals.data_ptr()] if info.get("merges") else []),
                                 case["tables"].data_ptr(), case["query_lens"].data_ptr(),
                                 case["context_lens"].data_ptr(), *kv_scales, seqs, 0, q.stride(0), out.stride(0),
                                 case["tables"].stride(0), scale, 0], stream)
                if count > 1 and not info.get("merges"):
                    combine.launch((seqs, HEADS, 1), [part.data_ptr(), stats.data_ptr(), out.data_ptr(),
                                                      out.stride(0), count], stream)
            us = graph_us(call)
            out.zero_()
            call(case["caches"][0])
            torch.cuda.synchronize()
            err = ((out[:check].float().cpu() - ref).norm() / ref.norm()).item()
            rows.append((us, info["label"] + (f" {count} splits" if count != splits else ""), err))
        rows.sort()
        print(f"batch {seqs}, context {context}: {splits} split(s), KV {case['kv_bytes'] / 1e6:.1f} MB")
        for us, label, err in rows[:6]:
            rate = case['kv_bytes'] / us / 1e6
            print(f"  {us:7.1f} us  {rate:5.2f} TB/s of KV ({rate / copy:4.0%} of copy)  rel err {err:.1e}  {label}")
        for label in ("bn64 w4 s2", "bn64 w4 s1", "bn128 w2 s2", *(f"cuda w{w}" for w in (2, 4, 8))):
            current = [r for r in rows if r[1] == label]
            if current:
                print(f"  {label}: {current[0][0]:.1f} us")
        for us, label, err in rows:
            if not err < 2e-2:
                print(f"  WRONG: {label} rel err {err:.2e}")


def _split_counts(info: dict, rule: int) -> list[int]:
    """The split counts to time an entry at: the engine's rule, and for the CUDA kernel (whose blocks
    are larger than Triton's programs) a few around it, each where the entry's SPLIT flag serves it."""
    counts = {rule} if not info.get("cuda") else {rule, max(1, rule // 2), min(MAX_SPLITS, 2 * rule), 2, 4}
    return sorted(n for n in counts if (n > 1) == info["split"])


def _load(path: str) -> list:
    from kiln.runtime.cuda_driver import CudaError, load_kernel

    with open(path, "rb") as f:
        entries = pickle.load(f)
    loaded = []
    for info, signature, cubin in entries:
        if isinstance(cubin, str):
            print(f"  {info['label']}: did not compile ({cubin})")
            continue
        try:
            loaded.append((info, load_kernel(cubin.binary, cubin.name,
                                             [t for t in signature.values() if t != "constexpr"],
                                             cubin.num_warps, cubin.shared_bytes)))
        except CudaError as e:
            print(f"  {info['label']}: does not load ({e})")
    return loaded


def run_prefill(path: str) -> None:
    """Whole causal prompts through the paged kernel's prefill tilings, beside SDPA (flash)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kiln.plugins.attention import prefill_sm90

    loaded = _load(path)
    gen = torch.Generator().manual_seed(0)
    scale = HEAD_DIM ** -0.5
    table_cols = PREFILL_MAX_KEYS // BLOCK_SIZE
    for seqs, length in PREFILL_CASES:
        tokens = seqs * length
        per_seq = length // BLOCK_SIZE
        tables = torch.zeros(seqs, table_cols, dtype=torch.int32)
        tables[:, :per_seq] = torch.randperm(seqs * per_seq, generator=gen).view(seqs, per_seq).to(torch.int32)
        q = torch.randn(tokens, HEADS * HEAD_DIM, generator=gen).to("cuda", torch.bfloat16)
        k = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen).to("cuda", torch.bfloat16)
        v = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen).to("cuda", torch.bfloat16)
        cache = torch.zeros(2, seqs * per_seq, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        slots = (tables[:, :per_seq, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).reshape(-1).cuda()
        cache[0].view(-1, KV_HEADS, HEAD_DIM)[slots] = k
        cache[1].view(-1, KV_HEADS, HEAD_DIM)[slots] = v
        tables = tables.cuda()
        lens = torch.full((seqs,), length, dtype=torch.int32, device="cuda")
        # SDPA's layout: [seqs, heads, length, head_dim], K/V repeated over each GQA group.
        sq = q.view(seqs, length, HEADS, HEAD_DIM).transpose(1, 2)
        sk, sv = (t.view(seqs, length, KV_HEADS, HEAD_DIM).transpose(1, 2).repeat_interleave(HEADS // KV_HEADS, 1)
                  for t in (k, v))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            ref = torch.nn.functional.scaled_dot_product_attention(sq, sk, sv, is_causal=True, scale=scale)
            sdpa_us = graph_us(lambda: torch.nn.functional.scaled_dot_product_attention(
                sq, sk, sv, is_causal=True, scale=scale))
        ref = ref.transpose(1, 2).reshape(tokens, HEADS * HEAD_DIM).float()
        flops = 4 * seqs * length * length / 2 * HEADS * HEAD_DIM
        out = torch.empty_like(q)
        rows = [(sdpa_us, "SDPA flash", 0.0)]
        for info, fn in [entry for entry in loaded if not entry[0].get("combine")]:
            if info.get("cute"):   # a block a tile, and persistent
                for sms in (None, torch.cuda.get_device_properties(0).multi_processor_count):
                    def call():
                        prefill_sm90.launch(fn, q, cache[0], cache[1], out, tables, lens, lens, 0, HEADS, scale,
                                            torch.cuda.current_stream().cuda_stream, sms)
                    out.zero_()
                    call()
                    torch.cuda.synchronize()
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    rows.append((graph_us(call), info["label"] + (" persistent" if sms else ""), err))
                continue
            grid = (tokens * (HEADS // KV_HEADS) // info["block_m"] + seqs, KV_HEADS, 1)
            args = [q.data_ptr(), cache[0].data_ptr(), cache[1].data_ptr(), out.data_ptr(), 0, 0, tables.data_ptr(),
                    lens.data_ptr(), lens.data_ptr(), seqs, 0, q.stride(0), out.stride(0), tables.stride(0), scale, 0]
            out.zero_()
            fn.launch(grid, args, torch.cuda.current_stream().cuda_stream)
            torch.cuda.synchronize()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            # The stream is read at each call: graph_us captures on a stream of its own.
            us = graph_us(lambda: fn.launch(grid, args, torch.cuda.current_stream().cuda_stream))
            rows.append((us, info["label"], err))
        rows.sort()
        print(f"prefill {seqs} x {length} tokens: SDPA flash {sdpa_us:.0f} us = {flops / sdpa_us / 1e6:.0f} TFLOP/s")
        for us, label, err in rows[:8]:
            print(f"  {us:8.0f} us {flops / us / 1e6:4.0f} TFLOP/s ({sdpa_us / us:4.2f}x SDPA) rel err {err:.1e}  {label}")
        current = [r for r in rows if r[1] == "bm64 bn64 w4 s2"]
        if current:
            print(f"  engine's tile now: {current[0][0]:.0f} us ({sdpa_us / current[0][0]:.2f}x SDPA)")
        for us, label, err in rows:
            if not err < 2e-2:
                print(f"  WRONG: {label} rel err {err:.2e}")


if __name__ == "__main__":
    {"compile": compile_all, "run": run_all}[sys.argv[1]](*sys.argv[2:])
