"""Triton kernels for `attention`: paged flash attention and the split-KV combine (the KV-cache
write is `cache_write`'s).

Programs map to work straight from the step inputs, with no derived buffers: along grid axis 0,
sequence s owns the program ids from `cu[s] * G // BLOCK_M + s` on (cu = packed start of its
queries, G = query heads per kv head), which leaves room for its `ceil(n * G / BLOCK_M)` query
blocks; each program finds its sequence by a prefix sum over `query_lens` (O(S) int loads).
The decode kernels (`PURE_DECODE`: T == S, one query per sequence) skip that search: sequence
s owns the `decode_blocks` program ids from s * decode_blocks on. A mixed step runs both: the
decode kernel over its D leading one-token sequences (the decode rows, which the scheduler
puts first: `step_inputs.decode_rows`), then the prefill kernel over the rest, its programs
counted from sequence `first_seq` = D (whose queries start at row D). In the prefill kernel's
128-row tiles a decode row fills 4 rows of 128: on an H200 a step of 448 decode rows of
3,072-token contexts and one 3,072-token prompt took 170 ms that way, against 36 for the decode
rows alone (BENCHMARKS.md, session 29). A block's rows are (query token, head of the group)
pairs in that order, so every program shares one kv head's K/V tiles across its whole GQA group.
Grid axis 1 is the kv head; axis 2 splits the key range of each block (split-KV, for decode
steps with few sequences), the parts being merged by `_combine_splits_kernel`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from kiln.plugins.attention import decode_fp8
from kiln.plugins.aot import FP8_POINTER, POINTER_TYPES, TARGET_CC, AotKernel, pointer_params
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
DECODE = {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
# An e4m3 cache's decode is bound by converting K and V, not by their bytes, so it takes 2 warps; with
# v's blocks transposed, 128-key tiles: on an H200 (scripts/tune_attention.py with KILN_TUNE_FP8_KV=1,
# 2026-12-03) 153.4 us at 256 x 1,024 keys, 407.3 at 256 x 3,072 and 551.5 at 512 x 2,048 (3.5-3.95 TB/s),
# against 163.6, 456.7 and 617.3 with 64-key tiles and 196.2, 551.8 and 745.0 before the transposition.
DECODE_FP8_KV = {**DECODE, "BLOCK_N": 128, "num_warps": 2}


@triton.jit
def _dot(a, b, INTERPRETER: tl.constexpr):
    # Triton's interpreter multiplies bf16 tiles as their raw uint16 bits (triton-lang/triton
    # #11584); fp32 copies hold the same values, so the products and fp32 sums do not change.
    if INTERPRETER:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _find_sequence(query_lens_ptr, first_seq, num_seqs, pid, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                   SEQ_CHUNK: tl.constexpr):
    """(sequence, first packed query row, query count) of the sequence that owns program `pid`,
    counting sequences and query rows from `first_seq` (0 for the sequence first_seq)."""
    count = tl.full([], 0, tl.int32)
    q_start = tl.full([], 0, tl.int32)
    q_end = tl.full([], 0, tl.int32)
    carry = tl.full([], 0, tl.int32)
    for base in range(0, num_seqs - first_seq, SEQ_CHUNK):
        idx = base + tl.arange(0, SEQ_CHUNK)
        valid = idx < num_seqs - first_seq
        lens = tl.load(query_lens_ptr + first_seq + idx, mask=valid, other=0)
        incl = tl.cumsum(lens, 0) + carry
        excl = incl - lens
        owned = valid & (excl * GROUP // BLOCK_M + idx <= pid)
        count += tl.sum(owned.to(tl.int32), 0)
        # Starts only grow with idx, so the largest owned one belongs to the last owner.
        q_start = tl.maximum(q_start, tl.max(tl.where(owned, excl, 0), 0))
        q_end = tl.maximum(q_end, tl.max(tl.where(owned, incl, 0), 0))
        carry += tl.sum(lens, 0)
    return count - 1, q_start, q_end - q_start


@triton.jit
def _attend(q, acc, m, l, start, hi, pos, window, table, k_cache_ptr, v_cache_ptr, kv_head, d, d_ok, qk_scale,
            NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
            MASKED: tl.constexpr, V_T: tl.constexpr, INTERPRETER: tl.constexpr):
    """One key tile of the online softmax: returns the updated (acc, m, l). Unmasked, every key
    of the tile is below `hi` and seen by every row. V_T: v's cache blocks are transposed (an
    e4m3 cache's, `cache_write.v_offset`)."""
    keys = start + tl.arange(0, BLOCK_N)
    if MASKED:
        key_ok = keys < hi
        page = tl.load(table + keys // BLOCK_SIZE, mask=key_ok, other=0)
    else:
        page = tl.load(table + keys // BLOCK_SIZE)
    slot = page.to(tl.int64) * BLOCK_SIZE + keys % BLOCK_SIZE
    kv_off = (slot * NUM_KV_HEADS + kv_head) * HEAD_DIM
    if MASKED:
        k_t = tl.load(k_cache_ptr + kv_off[None, :] + d[:, None], mask=d_ok[:, None] & key_ok[None, :], other=0.0)
    else:
        k_t = tl.load(k_cache_ptr + kv_off[None, :] + d[:, None], mask=d_ok[:, None], other=0.0)
    s = _dot(q, k_t.to(q.dtype), INTERPRETER) * qk_scale
    if MASKED:
        seen = (keys[None, :] <= pos[:, None]) & key_ok[None, :]
        seen = seen & ((window <= 0) | (pos[:, None] - keys[None, :] < window))
        s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    if V_T:
        v = _load_v_transposed(v_cache_ptr, table, start, hi, kv_head, d, d_ok, NUM_KV_HEADS, HEAD_DIM,
                               BLOCK_SIZE, BLOCK_N, MASKED)
    elif MASKED:
        v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.0)
    else:
        v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=d_ok[None, :], other=0.0)
    acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v.to(q.dtype), INTERPRETER)
    return acc, m_new, l


@triton.jit
def _load_v_transposed(v_cache_ptr, table, start, hi, kv_head, d, d_ok, NUM_KV_HEADS: tl.constexpr,
                       HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """The [BLOCK_N, BLOCK_D] v tile of keys start.. from transposed cache blocks, loaded as
    [runs, HEAD_DIM, RUN] so that Triton sees each run of RUN keys contiguous (16-byte copies into
    shared memory, and 32-bit reads of four keys for the dot). A run is a cache block, or the
    tile's share of one when blocks are longer than tiles; `start` is a multiple of RUN."""
    RUN: tl.constexpr = BLOCK_SIZE if BLOCK_SIZE < BLOCK_N else BLOCK_N
    first = start + tl.arange(0, BLOCK_N // RUN) * RUN   # each run's first key
    j = tl.arange(0, RUN)
    if MASKED:
        page = tl.load(table + first // BLOCK_SIZE, mask=first < hi, other=0)
    else:
        page = tl.load(table + first // BLOCK_SIZE)
    base = (page.to(tl.int64) * NUM_KV_HEADS + kv_head) * HEAD_DIM * BLOCK_SIZE + first % BLOCK_SIZE
    ptrs = v_cache_ptr + base[:, None, None] + d[None, :, None] * BLOCK_SIZE + j[None, None, :]
    ok = d_ok[None, :, None]
    if MASKED:
        # Past the context the slots hold anything (NaN bits too): zeros keep p * v at 0.
        ok = ok & ((first[:, None, None] + j[None, None, :]) < hi)
    vt = tl.load(ptrs, mask=ok, other=0.0)
    return tl.reshape(tl.permute(vt, (0, 2, 1)), (BLOCK_N, d.shape[0]))


@triton.jit
def _attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_ptr, stats_ptr,
                      block_tables_ptr, query_lens_ptr, context_lens_ptr, scale_ptr,
                      num_seqs, first_seq, q_stride, out_stride, table_stride, scale, window,
                      NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_D: tl.constexpr, SEQ_CHUNK: tl.constexpr, SPLIT: tl.constexpr,
                      PURE_DECODE: tl.constexpr, INTERPRETER: tl.constexpr):
    GROUP: tl.constexpr = NUM_HEADS // NUM_KV_HEADS
    kv_head = tl.program_id(1)
    pid = tl.program_id(0)
    if not PURE_DECODE:
        # Longest first: a causal block's keys grow with its position, and the GPU starts programs
        # in launch order (axis 0 fastest), so the launch walks the blocks from the last down, every
        # kv head's in turn, and the short blocks fill the tail of the launch.
        launch = pid + kv_head * tl.num_programs(0)
        kv_head = launch % NUM_KV_HEADS
        pid = tl.num_programs(0) - 1 - launch // NUM_KV_HEADS
    if PURE_DECODE:
        # A pure decode step (T == S): sequence s has one query, packed at row s, and owns
        # DECODE_BLOCKS programs in a row. No prefix sum over the query lengths: at 1,024
        # sequences that search cost every program more than its keys did.
        DECODE_BLOCKS: tl.constexpr = (GROUP + BLOCK_M - 1) // BLOCK_M
        seq = tl.program_id(0) // DECODE_BLOCKS
        block = tl.program_id(0) % DECODE_BLOCKS
        q_start = seq
        q_len = 1
    else:
        seq, q_start, q_len = _find_sequence(query_lens_ptr, first_seq, num_seqs, pid, GROUP, BLOCK_M, SEQ_CHUNK)
        block = pid - (q_start * GROUP // BLOCK_M + seq)
        if block * BLOCK_M >= q_len * GROUP:
            return  # spare program: the grid is sized for the worst packing
        # The sequences before first_seq have one query row each.
        seq += first_seq
        q_start += first_seq
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = tok < q_len
    first_pos = tl.load(context_lens_ptr + seq) - q_len  # position of the sequence's first query
    pos = first_pos + tok
    # Keys this block can see: up to its last query, from its first query's window start.
    hi = first_pos + tl.minimum(q_len - 1, (block * BLOCK_M + BLOCK_M - 1) // GROUP) + 1
    lo = tl.where(window > 0, tl.maximum(first_pos + block * BLOCK_M // GROUP - window + 1, 0), 0)
    if scale_ptr is not None:
        # Transposed v tiles start on a cache block (or a tile within one); the window's mask
        # hides the keys this adds.
        V_RUN: tl.constexpr = BLOCK_SIZE if BLOCK_SIZE < BLOCK_N else BLOCK_N
        lo = lo // V_RUN * V_RUN
    if SPLIT:
        chunk = tl.cdiv(tl.cdiv(hi - lo, tl.num_programs(2)), BLOCK_N) * BLOCK_N
        lo = lo + tl.program_id(2) * chunk
        hi = tl.minimum(hi, lo + chunk)

    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_rows = q_start + tok
    q = tl.load(q_ptr + q_rows[:, None] * q_stride + head[:, None] * HEAD_DIM + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if scale_ptr is not None and q.dtype == tl.bfloat16:
        # The dots take their operands in q's dtype. An e4m3 value converts to fp16 in one
        # instruction per pair and to bf16 through fp16 in two; e4m3 and bf16 q values (within
        # fp16's range) are exact in fp16, and p gains precision.
        q = q.to(tl.float16)
    # A finite floor keeps rows whose keys are all masked so far free of inf - inf.
    m = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    qk_scale = scale * 1.4426950408889634  # exp2 instead of exp
    if scale_ptr is not None:
        # An e4m3 cache (scale_ptr: this layer's [2, kv heads] scales) holds k / k_scale and
        # v / v_scale, converted exactly to q's dtype in _attend. Every key and value of this
        # program has its kv head's scale, so k * k_scale is applied to the scores (q.k * k_scale)
        # and v * v_scale to the accumulated p.v, once, instead of to each loaded element.
        qk_scale = qk_scale * tl.load(scale_ptr + kv_head)
    table = block_tables_ptr + seq.to(tl.int64) * table_stride
    # Whole key tiles that every row of the block sees (causal: up to its first query; no window)
    # take no mask: in a long prefill that is all but the tiles on the diagonal.
    visible = lo
    if window <= 0:
        first_query = first_pos + block * BLOCK_M // GROUP
        visible = lo + tl.maximum(tl.minimum(hi, first_query + 1) - lo, 0) // BLOCK_N * BLOCK_N
    for start in range(lo, visible, BLOCK_N):
        acc, m, l = _attend(q, acc, m, l, start, hi, pos, window, table, k_cache_ptr, v_cache_ptr, kv_head, d,
                            d_ok, qk_scale, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, scale_ptr is not None,
                            INTERPRETER)
    for start in range(visible, hi, BLOCK_N):
        acc, m, l = _attend(q, acc, m, l, start, hi, pos, window, table, k_cache_ptr, v_cache_ptr, kv_head, d,
                            d_ok, qk_scale, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, scale_ptr is not None,
                            INTERPRETER)

    if scale_ptr is not None:
        acc = acc * tl.load(scale_ptr + NUM_KV_HEADS + kv_head)
    if SPLIT:
        # Unnormalised partial result and its (max, sum) for _combine_splits_kernel.
        part = (q_rows.to(tl.int64) * NUM_HEADS + head) * tl.num_programs(2) + tl.program_id(2)
        tl.store(part_ptr + part[:, None] * HEAD_DIM + d[None, :], acc,
                 mask=row_ok[:, None] & d_ok[None, :])
        tl.store(stats_ptr + part * 2, m, mask=row_ok)
        tl.store(stats_ptr + part * 2 + 1, l, mask=row_ok)
    else:
        o = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(out_ptr + q_rows[:, None] * out_stride + head[:, None] * HEAD_DIM + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _combine_splits_kernel(part_ptr, stats_ptr, out_ptr, out_stride, num_splits,
                           NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                           MAX_SPLITS: tl.constexpr):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, MAX_SPLITS)
    sp_ok = sp < num_splits
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    part = (tok.to(tl.int64) * NUM_HEADS + head) * num_splits + sp
    m = tl.load(stats_ptr + part * 2, mask=sp_ok, other=float("-inf"))
    l = tl.load(stats_ptr + part * 2 + 1, mask=sp_ok, other=0.0)
    w = tl.exp2(m - tl.max(m, 0))
    acc = tl.load(part_ptr + part[:, None] * HEAD_DIM + d[None, :],
                  mask=sp_ok[:, None] & d_ok[None, :], other=0.0)
    o = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + tok * out_stride + head * HEAD_DIM + d, o.to(out_ptr.dtype.element_ty), mask=d_ok)


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
    part = stats = None
    if split:
        part = torch.empty(tokens, heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        stats = torch.empty(tokens, heads, num_splits, 2, dtype=torch.float32, device=q.device)
    layer = attrs["layer"]
    _attention_kernel[grid](
        q, kv_cache[layer, 0], kv_cache[layer, 1], out, part, stats,
        block_tables, query_lens, context_lens, layer_scales(kv_scales, attrs["layer"]),
        seqs, first_seq, q.stride(0), out.stride(0), block_tables.stride(0), attrs["scale"], attrs["window"],
        NUM_HEADS=heads, NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=kv_cache.shape[3],
        BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"], BLOCK_D=_head_block(head_dim), SEQ_CHUNK=SEQ_CHUNK,
        SPLIT=split, PURE_DECODE=decode, INTERPRETER=isinstance(_attention_kernel, InterpretedFunction),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if split:
        _combine_splits_kernel[(tokens, heads)](
            part, stats, out, out.stride(0), num_splits, NUM_HEADS=heads, HEAD_DIM=head_dim,
            BLOCK_D=_head_block(head_dim), MAX_SPLITS=MAX_SPLITS)


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
    """Kernels for `shapes` keys heads, kv_heads, head_dim, block_size (cache block) and fp8_kv
    (the cache is e4m3; default False).

    The launcher passes kv_cache + (2 * layer + 0 or 1) * num_blocks * block_size * kv_heads *
    head_dim elements as the k and v cache pointers, and step inputs as they are; with fp8_kv,
    kv_scales + layer * 2 * kv_heads as scale_ptr (the kernels built without it take none). With
    num_splits > 1 it also passes fp32 workspaces part [T, heads, num_splits, head_dim] and stats
    [T, heads, num_splits, 2], and launches the combine kernel after the attention kernel. An e4m3
    cache of the shapes `decode_fp8` serves also gets its CUDA decode kernels (roles decode_fp8 and
    decode_fp8_split), which the launcher takes where they are (the build had nvcc).
    """
    ptr = POINTER_TYPES[dtype]
    fp8_kv = shapes.get("fp8_kv", False)
    cache = FP8_POINTER if fp8_kv else ptr
    scales = {"scale_ptr": "*fp32" if fp8_kv else "constexpr"}
    scale_const = {} if fp8_kv else {"scale_ptr": None}
    heads, kv_heads, head_dim = shapes["heads"], shapes["kv_heads"], shapes["head_dim"]
    common = {"NUM_HEADS": heads, "NUM_KV_HEADS": kv_heads, "HEAD_DIM": head_dim,
              "BLOCK_D": _head_block(head_dim)}
    attention_sig = {
        "q_ptr": ptr, "k_cache_ptr": cache, "v_cache_ptr": cache, "out_ptr": ptr,
        "part_ptr": "*fp32", "stats_ptr": "*fp32", "block_tables_ptr": "*i32",
        "query_lens_ptr": "*i32", "context_lens_ptr": "*i32", **scales, "num_seqs": "i32", "first_seq": "i32",
        "q_stride": "i32",
        "out_stride": "i32", "table_stride": "i32", "scale": "fp32", "window": "i32",
        **{name: "constexpr" for name in ("NUM_HEADS", "NUM_KV_HEADS", "HEAD_DIM", "BLOCK_SIZE",
                                          "BLOCK_M", "BLOCK_N", "BLOCK_D", "SEQ_CHUNK", "SPLIT",
                                          "PURE_DECODE", "INTERPRETER")}}
    # A layer's scales start 2 * kv_heads floats apart: not always 16-byte aligned.
    aligned = tuple(p for p in pointer_params(attention_sig) if p != "scale_ptr")
    kernels = [write_kv_aot(ptr, cache, fp8_kv, kv_heads * head_dim, head_dim, shapes["block_size"])]
    group = heads // kv_heads
    for role, cfg, split, when, targets in (
            ("prefill", PREFILL, False, MIXED, tuple(t for t in TARGET_CC if t not in SM90_TARGETS)),
            ("prefill", PREFILL_SM90, False, MIXED, SM90_TARGETS),
            ("decode", DECODE_FP8_KV if fp8_kv else DECODE, False, f"{DECODE_ROWS}, and choose_num_splits(...) == 1",
             None),
            ("decode_split", DECODE_FP8_KV if fp8_kv else DECODE, True,
             f"{DECODE_ROWS}, and num_splits = choose_num_splits(...) > 1", None)):
        decode = role != "prefill"
        rows = (f"S * {decode_blocks(heads, kv_heads, cfg['BLOCK_M'])}" if decode
                else f"T * {group} // {cfg['BLOCK_M']} + S")
        kernels.append(AotKernel(
            _attention_kernel, attention_sig,
            {**common, "BLOCK_SIZE": shapes["block_size"], "BLOCK_M": cfg["BLOCK_M"],
             "BLOCK_N": cfg["BLOCK_N"], "SEQ_CHUNK": SEQ_CHUNK, "SPLIT": split, "PURE_DECODE": decode,
             "INTERPRETER": False, **scale_const},
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], aligned=aligned,
            targets=targets,
            meta={"role": role, "when": when, "pointer_alignment": 16,
                  "grid": f"({rows}, {kv_heads}, {'num_splits' if split else 1})"}))
    if decode_fp8.serves(dtype, shapes):
        kernels += decode_fp8.kernels(dtype, shapes, DECODE_ROWS)
    kernels.append(AotKernel(
        _combine_splits_kernel,
        {"part_ptr": "*fp32", "stats_ptr": "*fp32", "out_ptr": ptr, "out_stride": "i32",
         "num_splits": "i32", "NUM_HEADS": "constexpr", "HEAD_DIM": "constexpr",
         "BLOCK_D": "constexpr", "MAX_SPLITS": "constexpr"},
        {"NUM_HEADS": heads, "HEAD_DIM": head_dim, "BLOCK_D": _head_block(head_dim),
         "MAX_SPLITS": MAX_SPLITS},
        aligned=("part_ptr", "stats_ptr", "out_ptr"),
        meta={"role": "combine_splits", "grid": f"(T, {heads}, 1)", "pointer_alignment": 16,
              "when": "after a decode_split attention kernel"}))
    return kernels
