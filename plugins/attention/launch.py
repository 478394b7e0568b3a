"""Driver launch of `attention`'s AOT kernels: KV-cache write, paged attention (prefill,
decode, or split-KV decode: Triton's merges its parts itself, the CUDA one's parts take the combine
kernel), picked as `kernels.run` picks them (an e4m3 cache's decode by the CUDA kernels of `decode_fp8`,
and on sm_90 a prefill without a sliding window by the CuTe kernel of `prefill_sm90`, where the engine
has them).

The split-KV workspaces come from the executor's scratch buffers, allocated once for the
engine's bounds (`scratch_bytes`), so a step allocates nothing. See `plugins.driver_launch`
for the launcher contract.
"""
from __future__ import annotations

import torch

from kiln.plugins.attention import prefill_sm90
from kiln.plugins.attention.kernels import EARLY_ROLES, choose_num_splits, padded
from kiln.plugins.driver_launch import check_aligned, grid, ptr
from kiln.plugins.linear.fp8 import HANDOFF

FP32_BYTES = 4


def _roles(metas: list[dict]) -> dict[str, int]:
    """Index of each attention kernel by its meta's role (write_kv, prefill, decode, ...)."""
    return {m["role"]: i for i, m in enumerate(metas) if "role" in m}


def _max_split_rows(attrs: dict, limits: dict[str, int]) -> int:
    """Most (token, split) pairs any step within the bounds can need: splits only happen in
    pure decode steps (T == S), so this is the largest S * num_splits over S <= bounds."""
    max_keys = limits["B"] * limits["block_size"]
    return max(s * choose_num_splits(s, s, attrs["num_kv_heads"], max_keys)
               for s in range(1, min(limits["S"], limits["T"]) + 1))


def scratch_bytes(attrs: dict, limits: dict[str, int]) -> dict[str, int]:
    """Split-KV workspaces: part [T, heads, splits, head_dim], stats [T, heads, splits, 2], and the
    arrivals Triton's split kernel counts: one int32 a program row and kv head, at most T * heads (a
    program row holds one query head or more of its sequence). The arena starts them zeroed."""
    rows = _max_split_rows(attrs, limits) * attrs["num_heads"]
    return {"attention_part": rows * attrs["head_dim"] * FP32_BYTES, "attention_stats": rows * 2 * FP32_BYTES,
            "attention_arrivals": limits["T"] * attrs["num_heads"] * torch.int32.itemsize}


def launch(kernels: list, metas: list[dict], inputs: list, attrs: dict, out: torch.Tensor,
           dims: dict[str, int], stream: int, scratch: dict[str, torch.Tensor],
           handoff_scale: torch.Tensor | None = None) -> None:
    """inputs: q, k?, v?, kv_cache, slot_mapping, block_tables, query_lens, context_lens, kv_scales?
    (an e4m3 cache's, which the kernels were then built to take). `handoff_scale`: the static scale of
    the GEMM after (attention_o_proj's), for decode kernels built to hand it their output in e4m3."""
    q, k, v, kv_cache, slot_mapping, block_tables, query_lens, context_lens, kv_scales = padded(inputs, 9)
    # This layer's [2, kv heads] scales, or nothing for kernels built without them.
    scales = [] if kv_scales is None else [kv_scales[attrs["layer"]].data_ptr()]
    if not kv_cache.is_contiguous() or any(t.stride(-1) != 1 for t in (q, out)):
        raise ValueError("attention needs a contiguous kv_cache and q, out rows with contiguous columns")
    roles = _roles(metas)
    layer = attrs["layer"]
    k_cache, v_cache = kv_cache[layer, 0], kv_cache[layer, 1]
    tokens, seqs = q.shape[0], query_lens.shape[0]
    names = {"T": tokens, "S": seqs}
    # Stream order puts every cache write before the attention kernel reads it.
    if k is not None and v is not None:
        i = roles["write_kv"]
        check_aligned(metas[i], k, v, k_cache, v_cache)
        kernels[i].launch(grid(metas[i]["grid"], names),
                          [k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                           slot_mapping.data_ptr(), *scales, k.stride(0), v.stride(0)], stream)
    max_keys = block_tables.shape[1] * kv_cache.shape[3]

    def attend(role: str, names: dict[str, int], num_seqs: int, first_seq: int, splits: int) -> None:
        part = stats = None
        i = roles[role]
        merges = metas[i].get("merges", False)
        if role.endswith("_split"):
            count = names["T"] * attrs["num_heads"] * splits
            part = scratch["attention_part"][:count * attrs["head_dim"] * FP32_BYTES]
            stats = scratch["attention_stats"][:count * 2 * FP32_BYTES]
        check_aligned(metas[i], q, k_cache, v_cache, out)
        kernels[i].launch(grid(metas[i]["grid"], {**names, "num_splits": splits}),
                          [q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), ptr(part),
                           ptr(stats), *([scratch["attention_arrivals"].data_ptr()] if merges else []),
                           block_tables.data_ptr(), query_lens.data_ptr(), context_lens.data_ptr(),
                           *scales, *handoff_args(metas[i]), num_seqs, first_seq, q.stride(0), out.stride(0),
                           block_tables.stride(0), attrs["scale"], attrs["window"]], stream)
        if part is not None and not merges:
            i = roles["combine_splits"]
            kernels[i].launch(grid(metas[i]["grid"], names),
                              [part.data_ptr(), stats.data_ptr(), out.data_ptr(), *handoff_args(metas[i]),
                               out.stride(0), splits], stream)

    def handoff_args(meta: dict) -> list[int]:
        if not meta.get("handoff"):
            return []
        if handoff_scale is None:
            raise ValueError("attention's decode kernels were built to hand o_proj its input in e4m3 and were given "
                             "no scale: the engine's kernels and plan disagree; rebuild the engine")
        return [scratch[name].data_ptr() for name in HANDOFF] + [handoff_scale.data_ptr()]

    # An e4m3 cache's CUDA decode kernels where the build made them (`decode_fp8`), else Triton's.
    decoder = "decode_fp8" if "decode_fp8" in roles else "decode"

    def decode(rows: int) -> None:
        splits = choose_num_splits(rows, rows, attrs["num_kv_heads"], max_keys)
        role = decoder if splits == 1 else f"{decoder}_split"
        if rows == 1:
            # One sequence's decode: its EARLY kernel where the build made one (sm_90 on, a bf16 cache).
            role = next((one for one, other in EARLY_ROLES.items() if other == role and one in roles), role)
        attend(role, {"T": rows, "S": rows}, rows, 0, splits)

    if tokens == seqs:
        decode(seqs)
        return
    # A mixed step: its D leading decode rows by the decode kernel, the rest by the prefill
    # kernel (see `kernels`' docstring); dims without D (a caller of its own) run all as prefill.
    first = dims.get("D", 0)
    if first:
        decode(first)
    if "prefill_cute" in roles and attrs["window"] <= 0:
        i = roles["prefill_cute"]
        check_aligned(metas[i], q, k_cache, v_cache, out)
        # A block a tile: on an H200 that ran 1 x 2k, 1 x 8k and 4 x 2k causal tokens 3-6% faster than one
        # block per SM walking the tiles (BENCHMARKS.md, session 36).
        prefill_sm90.launch(kernels[i], q, k_cache, v_cache, out, block_tables, query_lens, context_lens, first,
                            attrs["num_heads"], attrs["scale"], stream, None)
        return
    attend("prefill", {"T": tokens - first, "S": seqs - first}, seqs, first, 1)
