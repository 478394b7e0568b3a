"""The CUDA decode attention for an e4m3 KV cache (`decode_fp8.cu`, CUDA C++ built by nvcc): the
"decode" and "decode_split" kernels of `attention` on the FP8 targets, ahead of the Triton ones.

It serves caches whose kv-head groups fit one 8-column MMA tile (at most 8 query heads per kv head),
head_dim 64 or 128 and cache blocks of a multiple of 16 keys; other shapes, and builds without nvcc,
take the Triton decode kernels.
"""
from __future__ import annotations

from pathlib import Path

from kiln.plugins.nvcc import NvccKernel

SOURCE = Path(__file__).with_name("decode_fp8.cu")
SIGNATURE = {"q_ptr": "*bf16", "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv", "out_ptr": "*bf16",
             "part_ptr": "*fp32", "stats_ptr": "*fp32", "block_tables_ptr": "*i32", "query_lens_ptr": "*i32",
             "context_lens_ptr": "*i32", "scale_ptr": "*fp32", "num_seqs": "i32", "first_seq": "i32",
             "q_stride": "i32", "out_stride": "i32", "table_stride": "i32", "scale": "fp32", "window": "i32"}
# Warps a block: on an H200 (scripts/tune_attention.py with KILN_TUNE_FP8_KV=1, 2026-12-03) 2 warps took
# 673.8 us at 448 sequences x 3,072 keys (4.18 TB/s of e4m3 K/V), 392.0 at 256 x 3,072 and 7.9 at one
# sequence of 2,048, against 685.1, 404.6 and 8.4 with 4 warps and 712.2, 408.6 and 9.2 for the Triton
# kernel it replaces (BENCHMARKS.md, session 31).
WARPS = 2
ROLES = ("decode_fp8", "decode_fp8_split")
ELEMENT = {"bfloat16": ("__nv_bfloat16", "*bf16"), "float16": ("__half", "*fp16")}


def serves(dtype: str, shapes: dict) -> bool:
    """Whether the CUDA kernel serves an attention of these `attention.aot_kernels` shapes."""
    heads, kv_heads = shapes["heads"], shapes["kv_heads"]
    return (shapes.get("fp8_kv", False) and dtype in ELEMENT and heads % kv_heads == 0 and heads // kv_heads <= 8
            and shapes["head_dim"] in (64, 128) and shapes["block_size"] % 16 == 0)


def kernels(dtype: str, shapes: dict, when: str) -> list[NvccKernel]:
    """The decode kernel and its split-KV form for `shapes` (see `serves`); `when`: the launch rule
    of the Triton decode kernels they take the place of."""
    element, pointer = ELEMENT[dtype]
    heads, kv_heads = shapes["heads"], shapes["kv_heads"]
    signature = {name: pointer if kind == "*bf16" else kind for name, kind in SIGNATURE.items()}
    out = []
    for role, split in zip(ROLES, (False, True)):
        entry = f"kiln_{role}_{dtype}_h{heads}_kv{kv_heads}_d{shapes['head_dim']}_b{shapes['block_size']}"
        instance = (f"KILN_DECODE_FP8_KV({entry}, {element}, {heads}, {kv_heads}, {shapes['head_dim']}, "
                    f"{shapes['block_size']}, {WARPS}, {str(split).lower()})")
        rule = f"{when}, and num_splits = choose_num_splits(...) {'>' if split else '=='} 1"
        out.append(NvccKernel(SOURCE, entry, instance, signature, WARPS, meta={
            "role": role, "when": f"{rule}; in place of the Triton kernel", "pointer_alignment": 16,
            "grid": f"(S, {kv_heads}, {'num_splits' if split else 1})"}))
    return out
