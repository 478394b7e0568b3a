"""Which of `attention`'s kernels serve a step, at which tiling: the Triton kernels of `flash` (paged
flash attention, the split-KV combine), `decode_fp8`'s CUDA decode for an e4m3 cache and the KV-cache
write of `cache_write`. `aot_kernels` lists them for a build, with the launch rules their metas state;
`run` launches them through Triton's JIT (the tests, in the interpreter too), and the driver launcher
(`launch`) does the same from an engine's cubins.
"""
from __future__ import annotations

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

from kiln.plugins.attention import decode_fp8, prefill_sm90
from kiln.plugins.attention.flash import attention_kernel, combine_splits_kernel
from kiln.plugins.aot import FP8_POINTER, POINTER_TYPES, TARGET_CC, AotKernel, absent_as_none, pointer_params
from kiln.plugins.linear import fp8
from kiln.plugins.nvcc import NvccKernel
from kiln.plugins.attention.cache_write import check_layout, layer_scales, write_kv, write_kv_aot
from kiln.plugins.step_inputs import decode_rows

MAX_SPLITS = 32             # S=1, 8192 keys on an H200: 16 splits give 1.7 TB/s, 32 give 2.1
SPLIT_MIN_KEYS = 256        # fewer keys per split than this cost more to merge than they save
TARGET_PROGRAMS = 512       # about 4 programs per SM on an H100/H200: enough to fill the GPU
SEQ_CHUNK = 128             # sequences read per step of the in-kernel prefix sum
PREFILL = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
# sm_90 and later have the shared memory for 128x128 tiles (sm_89's 99 KiB does not): on an H200
# (scripts/tune_attention.py, 2026-11-30) 1.03x SDPA's flash attention at 2k causal tokens and
# 1.09x at 8k, against 1.04x and 0.95x with PREFILL.
PREFILL_SM90 = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2}
SM90_TARGETS = ("sm_90", "sm_100")
# One pipeline stage: on an H100 (scripts/ab_decode.py, 16 layers of Llama-3-8B's shape, 128-token contexts,
# BENCHMARKS.md session 38) decode steps took 0.1% less time at b=1, 0.6% at b=8 and 0.5% at b=64 than with two,
# and 0.2% more at b=256 (within that size's spread); tune_attention.py had it 1-1.5% slower only past 256
# sequences of 256 keys or more.
DECODE = {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1}
# An e4m3 cache's decode is bound by converting K and V, not by their bytes, so it takes 2 warps; with
# v's blocks transposed, 128-key tiles: on an H200 (scripts/tune_attention.py with KILN_TUNE_FP8_KV=1,
# 2026-12-03) 153.4 us at 256 x 1,024 keys, 407.3 at 256 x 3,072 and 551.5 at 512 x 2,048 (3.5-3.95 TB/s),
# against 163.6, 456.7 and 617.3 with 64-key tiles and 196.2, 551.8 and 745.0 before the transposition.
DECODE_FP8_KV = {**DECODE, "BLOCK_N": 128, "num_warps": 2, "num_stages": 2}
# The decode kernels a step of one sequence takes on sm_90 on, by the role it would take otherwise: built
# EARLY (`flash`), they read the first tile of earlier keys while the qkv GEMV still runs, with the registers
# that costs: 153-168 a thread against 126-128 (sm_90, Llama-3-8B's heads), too many for batches of 8, whose
# 512 programs then need two waves (session 47's form of it, at about 200, took b=8 2-3% slower).
EARLY_ROLES = {"decode_one": "decode", "decode_one_split": "decode_split"}


def _head_block(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))  # tl.dot needs 16 or more


def decode_blocks(heads: int, kv_heads: int, block_m: int) -> int:
    """Programs per sequence (and kv head) of a pure decode step: its query heads in blocks of block_m rows."""
    return triton.cdiv(heads // kv_heads, block_m)


def choose_num_splits(num_tokens: int, num_seqs: int, kv_heads: int, max_keys: int) -> int:
    """How many parts to split each block's keys into: only for pure decode steps (one token
    per sequence, known from shapes alone), when too few programs would otherwise run."""
    if num_tokens != num_seqs:
        return 1
    by_length = triton.cdiv(max_keys, SPLIT_MIN_KEYS)
    by_occupancy = TARGET_PROGRAMS // max(num_seqs * kv_heads, 1)
    return max(1, min(MAX_SPLITS, by_length, by_occupancy))


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_lens: torch.Tensor, context_lens: torch.Tensor, out: torch.Tensor,
                    attrs: dict, num_splits: int = 1, config: dict | None = None,
                    kv_scales: torch.Tensor | None = None, first_seq: int = 0) -> None:
    """Attention of q over the cache into out; `num_splits` > 1 takes the split-KV path;
    `kv_scales` [layers, 2, kv_heads] for an e4m3 cache; `first_seq`: a prefill launch for the
    sequences from this one on, the ones before it having one query row each (`run`)."""
    heads, kv_heads, head_dim = attrs["num_heads"], attrs["num_kv_heads"], attrs["head_dim"]
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be within 1..{MAX_SPLITS}, got {num_splits}")
    check_layout(kv_cache, q, out)
    tokens, seqs = q.shape[0], query_lens.shape[0]
    cfg = config or (PREFILL if tokens > seqs else DECODE_FP8_KV if kv_scales is not None else DECODE)
    block_m, group = cfg["BLOCK_M"], heads // kv_heads
    decode = tokens == seqs
    grid = (seqs * decode_blocks(heads, kv_heads, block_m) if decode
            else (tokens - first_seq) * group // block_m + seqs - first_seq, kv_heads, num_splits)
    split = num_splits > 1
    part = stats = arrivals = None
    if split:
        part = torch.empty(tokens, heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        stats = torch.empty(tokens, heads, num_splits, 2, dtype=torch.float32, device=q.device)
        # A decode kernel's last part to finish merges them (`flash`); a prefill split takes the combine.
        arrivals = torch.zeros(grid[0], kv_heads, dtype=torch.int32, device=q.device) if decode else None
    layer = attrs["layer"]
    attention_kernel[grid](
        q, kv_cache[layer, 0], kv_cache[layer, 1], out, part, stats, arrivals,
        block_tables, query_lens, context_lens, layer_scales(kv_scales, attrs["layer"]), None, None, None,
        seqs, first_seq, q.stride(0), out.stride(0), block_tables.stride(0), attrs["scale"], attrs["window"],
        NUM_HEADS=heads, NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=kv_cache.shape[3],
        BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"], BLOCK_D=_head_block(head_dim), SEQ_CHUNK=SEQ_CHUNK,
        SPLIT=split, PURE_DECODE=decode, INTERPRETER=isinstance(attention_kernel, InterpretedFunction), PDL=False,
        ROUND_E4M3=None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if split and not decode:
        combine_splits_kernel[(tokens, heads)](
            part, stats, out, None, None, None, out.stride(0), num_splits, NUM_HEADS=heads, HEAD_DIM=head_dim,
            BLOCK_D=_head_block(head_dim), MAX_SPLITS=MAX_SPLITS, PDL=False, ROUND_E4M3=None)


def run(inputs: list, attrs: dict, out: torch.Tensor) -> None:
    """inputs: q, k?, v?, kv_cache, slot_mapping, block_tables, query_lens, context_lens, kv_scales?
    (given for an e4m3 cache)."""
    q, k, v, kv_cache, slot_mapping, block_tables, query_lens, context_lens, kv_scales = padded(inputs, 9)
    # The launches are stream-ordered, so every cache write lands before attention reads.
    if k is not None and v is not None:
        write_kv(kv_cache, attrs["layer"], k, v, slot_mapping, kv_scales)
    max_keys = block_tables.shape[1] * kv_cache.shape[3]
    tokens, seqs = q.shape[0], query_lens.shape[0]
    first = decode_rows(query_lens) if tokens > seqs else 0
    if first:   # a mixed step's decode rows, by the decode kernel (see the module docstring)
        paged_attention(q[:first], kv_cache, block_tables[:first], query_lens[:first], context_lens[:first],
                        out[:first], attrs, choose_num_splits(first, first, attrs["num_kv_heads"], max_keys),
                        kv_scales=kv_scales)
    splits = choose_num_splits(tokens, seqs, attrs["num_kv_heads"], max_keys)
    paged_attention(q, kv_cache, block_tables, query_lens, context_lens, out, attrs, splits, kv_scales=kv_scales,
                    first_seq=first)


def padded(inputs: list, count: int) -> list:
    """`inputs` with absent trailing optional inputs (None) up to `count`."""
    return list(inputs) + [None] * (count - len(inputs))


# The launch rules the metas state (plugins/attention/launch.py follows them).
MIXED = "T > S: over the sequences from first_seq = D on, with T - D and S - D for T and S"
DECODE_ROWS = "T == S, or T > S and D > 0 over the first D sequences (T = S = D)"


def aot_kernels(dtype: str, shapes: dict) -> list[AotKernel | NvccKernel]:
    """Kernels for `shapes` keys heads, kv_heads, head_dim, block_size (cache block), fp8_kv
    (the cache is e4m3; default False) and handoff (for attention_o_proj's static FP8 o_proj: the
    unsplit decode kernel and the combine also write the output in e4m3, `linear.fp8`; default False).

    The launcher passes kv_cache + (2 * layer + 0 or 1) * num_blocks * block_size * kv_heads *
    head_dim elements as the k and v cache pointers, and step inputs as they are; with fp8_kv,
    kv_scales + layer * 2 * kv_heads as scale_ptr (the kernels built without it take none). With
    num_splits > 1 it also passes fp32 workspaces part [T, heads, num_splits, head_dim] and stats
    [T, heads, num_splits, 2]; to Triton's split kernel (meta "merges"), whose last part to finish merges
    them, an int32 count of arrivals a program row and kv head, zero before the launch (the kernel leaves it
    so), and after the CUDA one the combine kernel, which merges them. An e4m3
    cache of the shapes `decode_fp8` serves also gets its CUDA decode kernels (roles decode_fp8 and
    decode_fp8_split), which the launcher takes where they are (the build had nvcc); a bf16 cache of
    the shapes `prefill_sm90` serves gets its CuTe prefill for sm_90 (role prefill_cute). A bf16 cache's
    decode kernels also come built EARLY for sm_90 on (`EARLY_ROLES`), which the launcher takes for a step of
    one sequence.
    """
    ptr = POINTER_TYPES[dtype]
    fp8_kv = shapes.get("fp8_kv", False)
    cache = FP8_POINTER if fp8_kv else ptr
    scales = {"scale_ptr": "*fp32" if fp8_kv else "constexpr"}
    scale_const = {} if fp8_kv else {"scale_ptr": None}
    heads, kv_heads, head_dim = shapes["heads"], shapes["kv_heads"], shapes["head_dim"]
    common = {"NUM_HEADS": heads, "NUM_KV_HEADS": kv_heads, "HEAD_DIM": head_dim,
              "BLOCK_D": _head_block(head_dim)}
    no_handoff = {"h_ptr": "constexpr", "h_scale_ptr": "constexpr", "h_static_ptr": "constexpr"}
    attention_sig = {
        "q_ptr": ptr, "k_cache_ptr": cache, "v_cache_ptr": cache, "out_ptr": ptr,
        "part_ptr": "*fp32", "stats_ptr": "*fp32", "arrivals_ptr": "constexpr", "block_tables_ptr": "*i32",
        "query_lens_ptr": "*i32", "context_lens_ptr": "*i32", **scales, **no_handoff,
        "num_seqs": "i32", "first_seq": "i32",
        "q_stride": "i32",
        "out_stride": "i32", "table_stride": "i32", "scale": "fp32", "window": "i32",
        **{name: "constexpr" for name in ("NUM_HEADS", "NUM_KV_HEADS", "HEAD_DIM", "BLOCK_SIZE",
                                          "BLOCK_M", "BLOCK_N", "BLOCK_D", "SEQ_CHUNK", "SPLIT",
                                          "PURE_DECODE", "INTERPRETER", "ROUND_E4M3")}}
    # A layer's scales start 2 * kv_heads floats apart: not always 16-byte aligned.
    aligned = tuple(p for p in pointer_params(attention_sig) if p != "scale_ptr")
    kernels = [write_kv_aot(ptr, cache, fp8_kv, kv_heads * head_dim, head_dim, shapes["block_size"])]
    group = heads // kv_heads
    one = "the decode of one sequence (T = S = 1) that {} would take, where the GPU has PDL"
    early = () if fp8_kv else (("decode_one", DECODE, False, one.format("decode"), SM90_TARGETS),
                               ("decode_one_split", DECODE, True, one.format("decode_split"), SM90_TARGETS))
    for role, cfg, split, when, targets in (
            ("prefill", PREFILL, False, MIXED, tuple(t for t in TARGET_CC if t not in SM90_TARGETS)),
            ("prefill", PREFILL_SM90, False, MIXED, SM90_TARGETS),
            ("decode", DECODE_FP8_KV if fp8_kv else DECODE, False, f"{DECODE_ROWS}, and choose_num_splits(...) == 1",
             None),
            ("decode_split", DECODE_FP8_KV if fp8_kv else DECODE, True,
             f"{DECODE_ROWS}, and num_splits = choose_num_splits(...) > 1", None), *early):
        decode = role != "prefill"
        rows = (f"S * {decode_blocks(heads, kv_heads, cfg['BLOCK_M'])}" if decode
                else f"T * {group} // {cfg['BLOCK_M']} + S")
        meta = {"role": role, "when": when, "pointer_alignment": 16,
                "grid": f"({rows}, {kv_heads}, {'num_splits' if split else 1})", **({"pdl": True} if decode else {})}
        constexprs = {**common, "BLOCK_SIZE": shapes["block_size"], "BLOCK_M": cfg["BLOCK_M"],
                      "BLOCK_N": cfg["BLOCK_N"], "SEQ_CHUNK": SEQ_CHUNK, "SPLIT": split, "PURE_DECODE": decode,
                      "INTERPRETER": False, **scale_const}
        handoff = decode and shapes.get("handoff", False)
        signature = {**attention_sig, "PDL": "constexpr", **(HANDOFF_SIGNATURE if handoff else {})}
        if split:
            # Its last part to finish merges them, counting arrivals in "attention_arrivals" (launch.py).
            signature["arrivals_ptr"] = "*i32"
            meta["merges"] = True
        if handoff:
            meta.update(handoff=True, scratch=fp8.handoff_scratch(heads * head_dim))
        is_early = role in EARLY_ROLES
        kernels += [AotKernel(attention_kernel, {**signature, **({"EARLY": "constexpr"} if is_early else {})},
                              absent_as_none(signature, {**constexprs, "PDL": pdl, **handoff_rounding(handoff, pdl),
                                                         **({"EARLY": True} if is_early else {})}),
                              num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], aligned=aligned,
                              targets=group_targets, meta=meta)
                    for pdl, group_targets in _pdl_groups(decode, targets) if group_targets != ()]
    if decode_fp8.serves(dtype, shapes):   # its split kernel's parts take the combine kernel
        kernels += decode_fp8.kernels(dtype, shapes, DECODE_ROWS)
        handoff = shapes.get("handoff", False)
        combine = {"part_ptr": "*fp32", "stats_ptr": "*fp32", "out_ptr": ptr, **no_handoff, "out_stride": "i32",
                   "num_splits": "i32", "NUM_HEADS": "constexpr", "HEAD_DIM": "constexpr",
                   "BLOCK_D": "constexpr", "MAX_SPLITS": "constexpr", "PDL": "constexpr", "ROUND_E4M3": "constexpr",
                   **(HANDOFF_SIGNATURE if handoff else {})}
        meta = {"role": "combine_splits", "grid": f"(T, {heads}, 1)", "pointer_alignment": 16, "pdl": True,
                "when": "after a decode_fp8_split kernel"}
        if handoff:
            meta.update(handoff=True, scratch=fp8.handoff_scratch(heads * head_dim))
        kernels += [AotKernel(
            combine_splits_kernel, combine,
            absent_as_none(combine, {"NUM_HEADS": heads, "HEAD_DIM": head_dim, "BLOCK_D": _head_block(head_dim),
                                     "MAX_SPLITS": MAX_SPLITS, "PDL": pdl, **handoff_rounding(handoff, pdl)}),
            aligned=pointer_params(combine), targets=group_targets, meta=meta)
            for pdl, group_targets in _pdl_groups(True, None)]
    return kernels + prefill_sm90.engine_kernels(dtype, shapes)


# The handoff's parameters (`linear.fp8`): the e4m3 rows and their scales, and the static scale.
HANDOFF_SIGNATURE = {"h_ptr": FP8_POINTER, "h_scale_ptr": "*fp32", "h_static_ptr": "*fp32"}


def handoff_rounding(handoff: bool, pdl: bool) -> dict:
    """A handoff kernel's ROUND_E4M3 (None, unset, without one): first in float32 on sm_89 (never a PDL
    target), as the quantize pre-pass rounds there (`linear.fp8.TARGET_GROUPS`)."""
    return {"ROUND_E4M3": not pdl} if handoff else {}


def _pdl_groups(decode: bool, targets: tuple[str, ...] | None) -> list[tuple[bool, tuple[str, ...] | None]]:
    """(PDL, targets) of each build of a kernel built for `targets` (None: all). The decode kernels and the
    combine take part in programmatic dependent launch where the GPU has it (sm_90 on: meta "pdl"), so their
    launches overlap the end of the kernel before; the other targets get the plain kernel under the same meta."""
    if not decode:
        return [(False, targets)]
    every = targets or tuple(TARGET_CC)
    return [(pdl, tuple(t for t in every if (t in SM90_TARGETS) == pdl)) for pdl in (False, True)]
