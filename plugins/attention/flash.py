"""The Triton kernels of `attention`: paged flash attention and the split-KV combine (the KV-cache
write is `cache_write`'s; which kernel serves which step, at which tiling, is `kernels`').

Programs map to work straight from the step inputs, with no derived buffers: along grid axis 0,
sequence s owns the program ids from `cu[s] * G // BLOCK_M + s` on (cu = packed start of its
queries, G = query heads per kv head), which leaves room for its `ceil(n * G / BLOCK_M)` query
blocks; each program finds its sequence by a prefix sum over `query_lens` (O(S) int loads).
The decode kernels (`PURE_DECODE`: T == S, one query per sequence) skip that search: sequence
s owns the `kernels.decode_blocks` program ids from s * decode_blocks on. A mixed step runs both: the
decode kernel over its D leading one-token sequences (the decode rows, which the scheduler
puts first: `step_inputs.decode_rows`), then the prefill kernel over the rest, its programs
counted from sequence `first_seq` = D (whose queries start at row D). In the prefill kernel's
128-row tiles a decode row fills 4 rows of 128: on an H200 a step of 448 decode rows of
3,072-token contexts and one 3,072-token prompt took 170 ms that way, against 36 for the decode
rows alone (BENCHMARKS.md, session 29). A block's rows are (query token, head of the group)
pairs in that order, so every program shares one kv head's K/V tiles across its whole GQA group.
Grid axis 1 is the kv head; axis 2 splits the key range of each block (split-KV, for decode
steps with few sequences). The decode kernel's parts are merged by the last of them to finish (an
arrival count per program row and kv head), saving a launch and a round trip through memory; the
other kernels' parts, and `decode_fp8`'s, by `combine_splits_kernel`. Built for an FP8 engine's o_proj
with a static scale (h_ptr given), the decode kernels and the combine also write their output quantized
for o_proj's GEMM (`linear.fp8`'s handoff). Built with PDL (sm_90 on), the decode kernels and the
combine are programmatic dependent launches: each waits for the kernel before it, then lets the next
start, so each launch overlaps the end of the kernel before (o_proj's GEMV issues its first weight loads
before it waits). Built EARLY for a step of one sequence, the decode kernels let the next kernel start
first and read their first tile of earlier keys before they wait, so that the chain of loads (context
length, block table, cache) runs while the qkv GEMV does; only the newest key is the qkv kernel's: its
block-table entry is read before the wait too, its K and V beside q after it, and it is attended last.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kiln.plugins.linear.fp8 import HANDOFF_ROWS, store_handoff, to_e4m3

_HANDOFF_MAX = tl.constexpr(HANDOFF_ROWS[1])
# The newest key's tile in an EARLY kernel: one key, in the smallest tile a dot takes.
NEWEST_N = tl.constexpr(16)


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
            MASKED: tl.constexpr, V_T: tl.constexpr, INTERPRETER: tl.constexpr, k_pre=None, v_pre=None):
    """One key tile of the online softmax: returns the updated (acc, m, l). Unmasked, every key
    of the tile is below `hi` and seen by every row. V_T: v's cache blocks are transposed (an
    e4m3 cache's, `cache_write.v_offset`). v is loaded after the scores, as measured fastest
    (BENCHMARKS.md session 49: loading it beside k was not). k_pre, v_pre: the tile as `_preload` read it."""
    keys = start + tl.arange(0, BLOCK_N)
    if MASKED:
        key_ok = keys < hi
    if k_pre is None:
        if MASKED:
            page = tl.load(table + keys // BLOCK_SIZE, mask=key_ok, other=0)
        else:
            page = tl.load(table + keys // BLOCK_SIZE)
        slot = page.to(tl.int64) * BLOCK_SIZE + keys % BLOCK_SIZE
        kv_off = (slot * NUM_KV_HEADS + kv_head) * HEAD_DIM
        if MASKED:
            k_t = tl.load(k_cache_ptr + kv_off[None, :] + d[:, None], mask=d_ok[:, None] & key_ok[None, :],
                          other=0.0)
        else:
            k_t = tl.load(k_cache_ptr + kv_off[None, :] + d[:, None], mask=d_ok[:, None], other=0.0)
    else:
        k_t = k_pre
    s = _dot(q, k_t.to(q.dtype), INTERPRETER) * qk_scale
    if MASKED:
        seen = (keys[None, :] <= pos[:, None]) & key_ok[None, :]
        seen = seen & ((window <= 0) | (pos[:, None] - keys[None, :] < window))
        s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    if v_pre is not None:
        v = v_pre
    elif V_T:
        v = _load_v_transposed(v_cache_ptr, table, start, hi, kv_head, d, d_ok, NUM_KV_HEADS, HEAD_DIM,
                               BLOCK_SIZE, BLOCK_N, MASKED)
    elif MASKED:
        v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.0)
    else:
        v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=d_ok[None, :], other=0.0)
    acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v.to(q.dtype), INTERPRETER)
    return acc, m_new, l


@triton.jit
def _preload(start, hi, table, k_cache_ptr, v_cache_ptr, kv_head, d, d_ok, NUM_KV_HEADS: tl.constexpr,
             HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The key tile from `start` of a bf16 cache, keys below `hi` (the rest zeros): (k transposed, v), for
    `_attend`."""
    keys = start + tl.arange(0, BLOCK_N)
    key_ok = keys < hi
    page = tl.load(table + keys // BLOCK_SIZE, mask=key_ok, other=0)
    kv_off = ((page.to(tl.int64) * BLOCK_SIZE + keys % BLOCK_SIZE) * NUM_KV_HEADS + kv_head) * HEAD_DIM
    k_t = tl.load(k_cache_ptr + kv_off[None, :] + d[:, None], mask=d_ok[:, None] & key_ok[None, :], other=0.0)
    v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.0)
    return k_t, v


@triton.jit
def _load_one_key(off, ok, k_cache_ptr, v_cache_ptr, d, d_ok, N: tl.constexpr):
    """One key's K and V of a bf16 cache row at `off` (where `ok`) as the first of an N-key tile, the others
    zeros: (k transposed, v), for `_attend`."""
    first = (tl.arange(0, N) == 0) & ok
    k_t = tl.load(k_cache_ptr + off + d[:, None] + 0 * first[None, :], mask=d_ok[:, None] & first[None, :],
                  other=0.0)
    v = tl.load(v_cache_ptr + off + d[None, :] + 0 * first[:, None], mask=first[:, None] & d_ok[None, :], other=0.0)
    return k_t, v


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
def attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_ptr, stats_ptr, arrivals_ptr,
                      block_tables_ptr, query_lens_ptr, context_lens_ptr, scale_ptr, h_ptr, h_scale_ptr, h_static_ptr,
                      num_seqs, first_seq, q_stride, out_stride, table_stride, scale, window,
                      NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_D: tl.constexpr, SEQ_CHUNK: tl.constexpr, SPLIT: tl.constexpr,
                      PURE_DECODE: tl.constexpr, INTERPRETER: tl.constexpr, PDL: tl.constexpr = False,
                      ROUND_E4M3: tl.constexpr = False, EARLY: tl.constexpr = False):
    if PDL and not EARLY:
        # Launched as a programmatic dependent (sm_90 on): wait for the qkv kernel before, then let the
        # next kernel's programs start.
        gdc_wait()
        gdc_launch_dependents()
    if PDL and EARLY:
        # The next kernel (o_proj's GEMV) may start now; this one waits below, after its early reads.
        gdc_launch_dependents()
    GROUP: tl.constexpr = NUM_HEADS // NUM_KV_HEADS
    # The GPU starts programs in launch order (axis 0 fastest). The kv heads run fastest in it, so that a
    # block's heads run together: a decode sequence's heads then read its cache blocks (their rows
    # interleaved) at once.
    launch = tl.program_id(0) + tl.program_id(1) * tl.num_programs(0)
    kv_head = launch % NUM_KV_HEADS
    pid = launch // NUM_KV_HEADS
    if not PURE_DECODE:
        # Longest first: a causal block's keys grow with its position, so the launch walks the blocks
        # from the last down and the short blocks fill the tail of the launch.
        pid = tl.num_programs(0) - 1 - pid
    if PURE_DECODE:
        # A pure decode step (T == S): sequence s has one query, packed at row s, and owns
        # DECODE_BLOCKS programs in a row. No prefix sum over the query lengths: at 1,024
        # sequences that search cost every program more than its keys did.
        DECODE_BLOCKS: tl.constexpr = (GROUP + BLOCK_M - 1) // BLOCK_M
        seq = pid // DECODE_BLOCKS
        block = pid % DECODE_BLOCKS
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
        live = tl.cdiv(hi - lo, chunk)   # the parts with keys; the rest stay empty
        lo = lo + tl.program_id(2) * chunk
        hi = tl.minimum(hi, lo + chunk)

    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    if EARLY:
        tl.static_assert(PURE_DECODE and scale_ptr is None, "EARLY: a decode step's kernel over a bf16 cache")
        table = block_tables_ptr + seq.to(tl.int64) * table_stride
        # One sequence's decode (kernels.EARLY_ROLES): its first tile of keys from earlier steps is read
        # before the wait for the qkv kernel, which writes only q and the newest key, at first_pos. The
        # context lengths and block tables are the step's inputs, copied in before its first kernel.
        old_hi = tl.minimum(hi, first_pos)
        k_pre, v_pre = _preload(lo, old_hi, table, k_cache_ptr, v_cache_ptr, kv_head, d, d_ok, NUM_KV_HEADS,
                                HEAD_DIM, BLOCK_SIZE, BLOCK_N)
        # The newest key's cache row, found before the wait too: its K and V are then loaded beside q, one
        # round trip after the wait where the table, K and V had been three (BENCHMARKS.md session 57).
        newest = (lo <= first_pos) & (first_pos < hi)
        newest_page = tl.load(table + first_pos // BLOCK_SIZE)
        newest_off = ((newest_page.to(tl.int64) * BLOCK_SIZE + first_pos % BLOCK_SIZE) * NUM_KV_HEADS
                      + kv_head) * HEAD_DIM
        if PDL:
            gdc_wait()
        k_new, v_new = _load_one_key(newest_off, newest, k_cache_ptr, v_cache_ptr, d, d_ok, NEWEST_N)
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
    if EARLY:
        acc, m, l = _attend(q, acc, m, l, lo, old_hi, pos, window, table, k_cache_ptr, v_cache_ptr, kv_head, d,
                            d_ok, qk_scale, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, False, INTERPRETER,
                            k_pre, v_pre)
        lo += BLOCK_N   # the other earlier keys' tiles as any decode's, masked; the newest key's after them
        keys_hi = old_hi
    else:
        table = block_tables_ptr + seq.to(tl.int64) * table_stride
        keys_hi = hi
    # Whole key tiles that every row of the block sees (causal: up to its first query; no window)
    # take no mask: in a long prefill that is all but the tiles on the diagonal.
    visible = lo
    if window <= 0 and not EARLY:
        first_query = first_pos + block * BLOCK_M // GROUP
        visible = lo + tl.maximum(tl.minimum(hi, first_query + 1) - lo, 0) // BLOCK_N * BLOCK_N
    for start in range(lo, visible, BLOCK_N):
        acc, m, l = _attend(q, acc, m, l, start, hi, pos, window, table, k_cache_ptr, v_cache_ptr, kv_head, d,
                            d_ok, qk_scale, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, scale_ptr is not None,
                            INTERPRETER)
    for start in range(visible, keys_hi, BLOCK_N):
        acc, m, l = _attend(q, acc, m, l, start, keys_hi, pos, window, table, k_cache_ptr, v_cache_ptr, kv_head, d,
                            d_ok, qk_scale, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, scale_ptr is not None,
                            INTERPRETER)
    if EARLY:
        if newest:
            acc, m, l = _attend(q, acc, m, l, first_pos, first_pos + 1, pos, window, table, k_cache_ptr,
                                v_cache_ptr, kv_head, d, d_ok, qk_scale, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NEWEST_N,
                                True, False, INTERPRETER, k_new, v_new)

    if scale_ptr is not None:
        acc = acc * tl.load(scale_ptr + NUM_KV_HEADS + kv_head)
    if SPLIT:
        # Unnormalised partial result and its (max, sum) for combine_splits_kernel.
        part = (q_rows.to(tl.int64) * NUM_HEADS + head) * tl.num_programs(2) + tl.program_id(2)
        tl.store(part_ptr + part[:, None] * HEAD_DIM + d[None, :], acc,
                 mask=row_ok[:, None] & d_ok[None, :])
        tl.store(stats_ptr + part * 2, m, mask=row_ok)
        tl.store(stats_ptr + part * 2 + 1, l, mask=row_ok)
        if arrivals_ptr is None:
            return   # combine_splits_kernel merges the parts
        # The last of the block's parts to arrive merges them all. The barrier puts every thread's
        # stores before the one thread's release (the atomic), whose result reaches the others through
        # shared memory after another barrier: the acquire of their stores.
        tl.debug_barrier()
        arrival = arrivals_ptr + pid * NUM_KV_HEADS + kv_head
        if tl.atomic_add(arrival, 1, sem="acq_rel", scope="gpu") < tl.num_programs(2) - 1:
            return
        tl.store(arrival, 0)   # ready for the next launch
        acc, l = _merge_parts(part_ptr, stats_ptr, part - tl.program_id(2), live, row_ok, d, d_ok, HEAD_DIM)
    o = (acc / tl.where(l > 0, l, 1.0)[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + q_rows[:, None] * out_stride + head[:, None] * HEAD_DIM + d[None, :],
             o, mask=row_ok[:, None] & d_ok[None, :])
    if h_ptr is not None:
        _hand_off(o, q_rows, head, row_ok, d, d_ok, h_ptr, h_scale_ptr, h_static_ptr, NUM_HEADS, HEAD_DIM,
                  ROUND_E4M3, EARLY)


@triton.jit
def _merge_parts(part_ptr, stats_ptr, first, live, row_ok, d, d_ok, HEAD_DIM: tl.constexpr):
    """(sum of acc, sum of l) over the `live` parts from part index `first` on of each row, each part
    weighted by 2^(m - the largest m), as combine_splits_kernel weighs them, without the empty parts (their
    acc and l are 0). One pass, rescaling as the largest m grows, so that up to PARTS parts (every part of
    a short context's) cost one round of loads. `.cg` loads: the other programs' stores are in the L2, not
    in this SM's L1."""
    acc = tl.zeros([row_ok.shape[0], d.shape[0]], tl.float32)
    l = tl.zeros([row_ok.shape[0]], tl.float32)
    top = tl.full([row_ok.shape[0]], -1.0e30, tl.float32)
    PARTS: tl.constexpr = 4
    for base in range(0, live, PARTS):
        s = first[:, None] + base + tl.arange(0, PARTS)[None, :]
        s_ok = row_ok[:, None] & (base + tl.arange(0, PARTS) < live)[None, :]
        m_s = tl.load(stats_ptr + s * 2, mask=s_ok, other=-1.0e30, cache_modifier=".cg")
        l_s = tl.load(stats_ptr + s * 2 + 1, mask=s_ok, other=0.0, cache_modifier=".cg")
        a = tl.load(part_ptr + s[:, :, None] * HEAD_DIM + d[None, None, :], mask=s_ok[:, :, None] & d_ok[None, None, :],
                    other=0.0, cache_modifier=".cg")
        new_top = tl.maximum(top, tl.max(m_s, 1))
        alpha = tl.exp2(top - new_top)
        w = tl.exp2(m_s - new_top[:, None])
        l = l * alpha + tl.sum(l_s * w, 1)
        acc = acc * alpha[:, None] + tl.sum(a * w[:, :, None], 1)
        top = new_top
    return acc, l


@triton.jit
def _hand_off(o, q_rows, head, row_ok, d, d_ok, h_ptr, h_scale_ptr, h_static_ptr, NUM_HEADS: tl.constexpr,
              HEAD_DIM: tl.constexpr, ROUND_E4M3: tl.constexpr, STAGED: tl.constexpr = False):
    """The output rows o [rows, BLOCK_D] (query row q_rows, head `head` each), as stored, quantized with
    the static scale at h_static_ptr for o_proj's GEMM (`linear.fp8`'s handoff): e4m3 values to h
    [T, NUM_HEADS * HEAD_DIM], the scale to h_scale[T] from head 0's row; only the rows the handoff
    holds (HANDOFF_ROWS' most). STAGED (an EARLY kernel's: one row): the row as o_proj's one-row GEMV
    stages it for itself instead (`gemv_fp8.cu`'s header: the e4m3 values as f16, unit u of 8 values at
    (u % 2) * K / 16 + u / 2, each unit's values in the order 0, 2, 1, 3, 4, 6, 5, 7), which that GEMV
    reads there (meta "prestaged")."""
    if STAGED:
        K: tl.constexpr = NUM_HEADS * HEAD_DIM
        col = head[:, None] * HEAD_DIM + d[None, :]
        unit, i = col // 8, col % 8
        at = ((unit % 2) * (K // 16) + unit // 2) * 8 + (i // 4) * 4 + (i % 2) * 2 + (i % 4) // 2
        scale = tl.load(h_static_ptr + tl.zeros_like(q_rows))
        staged = h_ptr.to(tl.pointer_type(tl.float16))
        tl.store(staged + at, to_e4m3(o, scale, ROUND_E4M3).to(tl.float16), mask=row_ok[:, None] & d_ok[None, :])
    else:
        ok = row_ok & (q_rows < _HANDOFF_MAX)
        offs = q_rows.to(tl.int64)[:, None] * (NUM_HEADS * HEAD_DIM) + head[:, None] * HEAD_DIM + d[None, :]
        store_handoff(o, q_rows, offs, ok[:, None] & d_ok[None, :], ok & (head == 0), h_ptr, h_scale_ptr,
                      h_static_ptr, ROUND_E4M3)


@triton.jit
def combine_splits_kernel(part_ptr, stats_ptr, out_ptr, h_ptr, h_scale_ptr, h_static_ptr, out_stride, num_splits,
                           NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                           MAX_SPLITS: tl.constexpr, PDL: tl.constexpr = False, ROUND_E4M3: tl.constexpr = False):
    if PDL:
        # The next kernel (o_proj's GEMV) may start now: it waits for this one before reading.
        gdc_launch_dependents()
        gdc_wait()
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
    o = (tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + tok * out_stride + head * HEAD_DIM + d, o, mask=d_ok)
    if h_ptr is not None:
        one = tl.zeros((1,), tl.int32)
        _hand_off(tl.reshape(o, (1, BLOCK_D)), tok + one, head + one, one == 0, d, d_ok, h_ptr, h_scale_ptr,
                  h_static_ptr, NUM_HEADS, HEAD_DIM, ROUND_E4M3)
