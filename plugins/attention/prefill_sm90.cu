// Causal paged prefill attention for Hopper on CuTe's building blocks (`plugins.attention.prefill_sm90`),
// compiled appended to plugins/linear/cute_sm90.cu: bf16 q and cache, heads of D = 128, cache blocks of 16
// tokens, no sliding window.
//
// A block takes BM = 128 query tokens of one head of one sequence: a producer warpgroup (one thread issuing
// every TMA load) and two consumer warpgroups of 64 query rows each. The producer loads the query tile once
// and then the key and value tiles of BN keys into a ring of STAGES stages, gathering the sequence's cache
// blocks through its block table: a box of 16 tokens x 64 dims of one kv head per block and half. Blocks
// past the keys the tile sees are read at a slot past the cache, which TMA fills with zeros. Each consumer
// warpgroup computes S = Q K^T by wgmma from shared memory, masks the keys past each query's position on the
// tiles that cross the diagonal, keeps the online softmax's row max and sum in registers (exp2, the scale
// folded into log2 units), and adds P V by wgmma with P from registers (its sums' layout is the A operand's)
// and V from shared memory, read as the MN-major operand (dims contiguous, as the cache holds them).
// SCHEDULE says what overlaps the softmax: PLAIN, nothing planned (the two warpgroups share the tensor cores
// as the warps are scheduled); PINGPONG, the other warpgroup's GEMMs (they take turns issuing theirs, on
// two named barriers); OVERLAP, the warpgroup's own next GEMMs (FlashAttention-3's pipelining within a
// warpgroup: tile j's Q K^T and tile j - 1's P V are issued together, and tile j's softmax runs while P V
// does, on a second set of registers for P).
//
// Work: `tiles` tile ids a head: sequence s (counted from first_seq; those before it have one query row each,
// a mixed step's decode rows) owns the tile ids from (its first query row) / BM + s on, as many as its
// queries fill; the rest are spare. Work item w is head w % heads of tile id tiles - 1 - w / heads, so that
// walking the items in order starts the longest tiles (the last queries of a sequence see the most keys)
// first. Block b takes items b, b + gridDim.x, ...: with a grid of one block per item each takes one; with
// one per SM (persistent) the producer loads the next item's query tile (two buffers) and keys while the
// consumers finish the current one and store it. Every warp that needs an item's tile finds it itself.
namespace kiln_cute {

constexpr int ATT_D = 128, ATT_BM = 128, ATT_BLOCK = 16;
enum Schedule { PLAIN = 0, PINGPONG = 1, OVERLAP = 2 };

template <int BN, int STAGES>
struct PrefillTiles {
  using MmaS = decltype(make_tiled_mma(SM90::GMMA::ss_op_selector<bf16, bf16, float, Shape<_64, Int<BN>, _16>>(),
                                       Layout<Shape<_2, _1, _1>>{}));
  using MmaO = decltype(make_tiled_mma(
      SM90::GMMA::rs_op_selector<bf16, bf16, float, Shape<_64, Int<ATT_D>, _16>, GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<_2, _1, _1>>{}));
  // Q [BM, D] (two buffers) and K [BN, D] K-major; V [D, BN] MN-major (dims contiguous): all three as TMA writes them, one
  // region of rows x BK dims (one 128-byte swizzle row) per half of D.
  using LayoutQ = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<bf16>{}, Shape<Int<ATT_BM>, Int<ATT_D>, _2>{}));
  using LayoutK = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<bf16>{}, Shape<Int<BN>, Int<ATT_D>, Int<STAGES>>{}));
  using LayoutV = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<bf16>{}, Shape<Int<ATT_D>, Int<BN>, Int<STAGES>>{},
                                         Step<_2, _1, _3>{}));
  static constexpr uint32_t Q_BYTES = ATT_BM * ATT_D * sizeof(bf16), KV_BYTES = 2 * BN * ATT_D * sizeof(bf16);
  struct Shared {
    alignas(1024) bf16 q[2 * ATT_BM * ATT_D];
    alignas(1024) bf16 k[STAGES * BN * ATT_D];
    alignas(1024) bf16 v[STAGES * BN * ATT_D];
    Ring<STAGES> ring;
    alignas(8) uint64_t q_full[2];
    alignas(8) uint64_t q_empty[2];   // one arrival per consumer warpgroup once its last Q K^T is done
  };
  static constexpr int SHARED_BYTES = sizeof(Shared) + 1024;
};

// (sequence, its query tile, the sequence's first row in q) owning tile id `pid`, counting sequences and
// query rows from first_seq; the sequence is -1 for a spare id. By a whole warp: 32 sequences a step.
__device__ __forceinline__ void find_tile(const int* query_lens, int first_seq, int num_seqs, int pid, int& seq,
                                          int& block, int& first_row) {
  const int lane = threadIdx.x % 32;
  int carry = 0, owner = -1, owner_start = 0, owner_len = 0;
  for (int base = 0; base < num_seqs - first_seq; base += 32) {
    const int i = base + lane;
    const int len = i < num_seqs - first_seq ? query_lens[first_seq + i] : 0;
    int incl = len;
    CUTE_UNROLL
    for (int d = 1; d < 32; d *= 2) {
      const int up = __shfl_up_sync(0xffffffff, incl, d);
      if (lane >= d) incl += up;
    }
    const int excl = carry + incl - len;
    const unsigned owned = __ballot_sync(0xffffffff, i < num_seqs - first_seq && excl / ATT_BM + i <= pid);
    if (owned) {
      const int last = 31 - __clz(owned);
      owner = base + last;
      owner_start = __shfl_sync(0xffffffff, excl, last);
      owner_len = __shfl_sync(0xffffffff, len, last);
    }
    carry += __shfl_sync(0xffffffff, incl, 31);
  }
  block = pid - (owner_start / ATT_BM + owner);
  seq = owner >= 0 && block * ATT_BM < owner_len ? first_seq + owner : -1;
  first_row = first_seq + owner_start;   // the sequences before first_seq have one row each
}

// Work item w's tile: its head and sequence (-1: a spare id), query tile and first row in q, and the keys it
// sees. By a whole warp; the same in every lane.
struct PrefillTile {
  int head, seq, block, first_row, q_len;
  int tile_pos;    // position of the tile's first query
  int hi;          // keys the tile sees
};

__device__ __forceinline__ PrefillTile prefill_tile(int w, int tiles, int heads, const int* query_lens,
                                                    const int* context_lens, int first_seq, int num_seqs) {
  PrefillTile t;
  t.head = w % heads;
  find_tile(query_lens, first_seq, num_seqs, tiles - 1 - w / heads, t.seq, t.block, t.first_row);
  if (t.seq < 0) return t;
  t.q_len = query_lens[t.seq];
  const int first_pos = context_lens[t.seq] - t.q_len;   // position of the sequence's first query
  t.tile_pos = first_pos + t.block * ATT_BM;
  t.hi = first_pos + min(t.q_len - 1, t.block * ATT_BM + ATT_BM - 1) + 1;
  return t;
}

template <int BN, int STAGES, int SCHEDULE>
__device__ __forceinline__ void prefill(const CUtensorMap* q_map, const CUtensorMap* k_map, const CUtensorMap* v_map,
                                        __nv_bfloat16* out, const int* block_tables, const int* query_lens,
                                        const int* context_lens, int num_seqs, int first_seq, int tiles, int heads,
                                        int out_stride, int table_stride, int num_slots, int kv_heads, float scale) {
  using P = PrefillTiles<BN, STAGES>;
  extern __shared__ unsigned char raw[];
  auto& s = aligned_shared<1024, typename P::Shared>(raw);
  const int work = tiles * heads, group = heads / kv_heads;
  auto tile_of = [&](int w) { return prefill_tile(w, tiles, heads, query_lens, context_lens, first_seq, num_seqs); };

  if (threadIdx.x == 0) {
    prefetch_tma_descriptor(q_map);
    prefetch_tma_descriptor(k_map);
    prefetch_tma_descriptor(v_map);
    s.ring.init(2);
    for (int b = 0; b < 2; ++b) {
      FullBarrier::init(&s.q_full[b], 1);
      EmptyBarrier::init(&s.q_empty[b], 2);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (threadIdx.x < 128) {
    // Warp 0 finds the tiles and its first thread issues every load; the rest of the producer's registers
    // go to the consumers.
    cutlass::arch::warpgroup_reg_dealloc<24>();
    if (threadIdx.x >= 32) return;
    int it = 0, n = 0;   // the ring's turn; the tiles loaded so far (their query buffer n % 2)
    for (int w = blockIdx.x; w < work; w += gridDim.x) {
      const PrefillTile t = tile_of(w);
      if (t.seq < 0) continue;
      if (threadIdx.x == 0) {
        const int buf = n % 2;
        EmptyBarrier::wait(&s.q_empty[buf], ((n / 2) & 1) ^ 1);
        FullBarrier::arrive_and_expect_tx(&s.q_full[buf], P::Q_BYTES);
        for (int h = 0; h < 2; ++h)
          SM90_TMA_LOAD_2D::copy(q_map, &s.q_full[buf], EVICT_NORMAL, s.q + (2 * buf + h) * ATT_BM * BK,
                                 t.head * ATT_D + h * BK, t.first_row + t.block * ATT_BM);
        const int* table = block_tables + size_t(t.seq) * table_stride;
        const int kv_head = t.head / group, kv_tiles = (t.hi + BN - 1) / BN;
        for (int j = 0; j < kv_tiles; ++j, ++it) {
          const int stage = s.ring.acquire(it, P::KV_BYTES);
          for (int b = 0; b < BN / ATT_BLOCK; ++b) {
            const int key = j * BN + b * ATT_BLOCK;
            const int slot = key < t.hi ? table[key / ATT_BLOCK] * ATT_BLOCK : num_slots;   // past the cache: zeros
            for (int h = 0; h < 2; ++h) {
              const int at = stage * BN * ATT_D + h * BN * BK + b * ATT_BLOCK * BK;
              SM90_TMA_LOAD_3D::copy(k_map, &s.ring.full[stage], EVICT_NORMAL, s.k + at, h * BK, kv_head, slot);
              SM90_TMA_LOAD_3D::copy(v_map, &s.ring.full[stage], EVICT_NORMAL, s.v + at, h * BK, kv_head, slot);
            }
          }
        }
      }
      __syncwarp();
      ++n;
    }
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<240>();
  typename P::MmaS mma_s;
  typename P::MmaO mma_o;
  const int thread = threadIdx.x - 128;
  auto thr_s = mma_s.get_thread_slice(thread);
  auto thr_o = mma_o.get_thread_slice(thread);
  Tensor q_frag = thr_s.make_fragment_A(thr_s.partition_A(make_tensor(make_smem_ptr(s.q), typename P::LayoutQ{})));
  Tensor k_frag = thr_s.make_fragment_B(thr_s.partition_B(make_tensor(make_smem_ptr(s.k), typename P::LayoutK{})));
  Tensor v_frag = thr_o.make_fragment_B(thr_o.partition_B(make_tensor(make_smem_ptr(s.v), typename P::LayoutV{})));
  Tensor scores = partition_fragment_C(mma_s, Shape<Int<ATT_BM>, Int<BN>>{});
  Tensor acc = partition_fragment_C(mma_o, Shape<Int<ATT_BM>, Int<ATT_D>>{});
  // P as the A operand: per 16 keys, the 8 values a thread holds of its two rows, in the order of its sums.
  Tensor p = make_tensor<bf16>(Layout<Shape<Shape<_2, _2, _2>, _1, Int<BN / 16>>>{});
  Tensor where = thr_s.partition_C(make_identity_tensor(Shape<Int<ATT_BM>, Int<BN>>{}));
  Tensor where_o = thr_o.partition_C(make_identity_tensor(Shape<Int<ATT_BM>, Int<ATT_D>>{}));
  check_layout<BN>(scores, where);
  check_layout<ATT_D>(acc, where_o);
  static_assert(decltype(size(p))::value == BN / 2, "P: the thread's sums of its two rows");

  // PINGPONG: warpgroup w issues its GEMMs when named barrier w completes, then lets the other one issue its.
  const int wg = thread / 128;
  auto my_turn = [&] {
    if constexpr (SCHEDULE == PINGPONG) cutlass::arch::NamedBarrier::arrive_and_wait(256, wg);
  };
  auto their_turn = [&] {
    if constexpr (SCHEDULE == PINGPONG) cutlass::arch::NamedBarrier::arrive(256, 1 - wg);
  };
  if (wg == 1) their_turn();   // warpgroup 0 goes first, and the turns go on from tile to tile

  const float log2_scale = scale * 1.4426950408889634f;   // exp2 instead of exp
  // The current tile's: its query buffer, first ring turn, the first key tile crossing its diagonal; the
  // positions of the thread's two query rows, their running maxima and sums, and the factor a new maximum
  // scales the sums so far by.
  int buf = 0, it = 0, unmasked = 0, pos[2];
  float row_max[2], row_sum[2], alpha[2];

  // S = Q K^T of the stage's keys, issued (warpgroup_wait to have it).
  auto issue_s = [&](int stage) {
    warpgroup_fence_operand(scores);
    warpgroup_arrive();
    mma_s.accumulate_ = GMMA::ScaleOut::Zero;
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(q_frag); ++kb) {
      cute::gemm(mma_s, q_frag(_, _, kb, buf), k_frag(_, _, kb, stage), scores);
      mma_s.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
  };
  // O += P V of the stage's values, issued. P's registers are the MMA's operand until it is done: fenced
  // after the wait, so that nothing else takes them before.
  auto issue_pv = [&](int stage) {
    warpgroup_fence_operand(p);
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(p); ++kb) cute::gemm(mma_o, p(_, _, kb), v_frag(_, _, kb, stage), acc);
    warpgroup_commit_batch();
  };
  auto pv_done = [&] {
    warpgroup_fence_operand(acc);
    warpgroup_fence_operand(p);
  };
  // Key tile j's online softmax: masks the keys past each query's position (and past the context) on the
  // tiles that cross the diagonal, takes the new row maxima (and alpha), and leaves the exponentials in
  // `scores`, their row sums added.
  auto softmax = [&](int j) {
    warpgroup_fence_operand(scores);
    if (j >= unmasked) {
      CUTE_UNROLL
      for (int i = 0; i < size(scores); ++i)
        if (j * BN + get<1>(where(i)) > pos[(i / 2) % 2]) scores(i) = -INFINITY;
    }
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      float m = row_max[r];
      CUTE_UNROLL
      for (int g = 0; g < BN / 8; ++g)
        m = fmaxf(m, fmaxf(scores(4 * g + 2 * r), scores(4 * g + 2 * r + 1)) * log2_scale);
      m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, 1));   // the row's four threads
      m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, 2));
      alpha[r] = exp2f(row_max[r] - m);
      row_max[r] = m;
      row_sum[r] *= alpha[r];
    }
    CUTE_UNROLL
    for (int i = 0; i < size(scores); ++i) {
      const int r = (i / 2) % 2;
      scores(i) = exp2f(scores(i) * log2_scale - row_max[r]);
      row_sum[r] += scores(i);
    }
  };
  // P from the exponentials, and the sums so far rescaled to the new maxima.
  auto next_p = [&] {
    CUTE_UNROLL
    for (int i = 0; i < size(scores); ++i) p(i) = bf16(scores(i));
    CUTE_UNROLL
    for (int i = 0; i < size(acc); ++i) acc(i) *= alpha[(i / 2) % 2];
  };
  // The tile's keys, `kv_tiles` ring turns from `it` on, into acc (and row_sum).
  auto attend = [&](int kv_tiles) {
    if constexpr (SCHEDULE == OVERLAP) {
      int prev = s.ring.wait_full(it);
      issue_s(prev);
      warpgroup_wait<0>();
      softmax(0);
      next_p();
      for (int j = 1; j < kv_tiles; ++j) {
        const int stage = s.ring.wait_full(it + j);
        issue_s(stage);
        issue_pv(prev);
        warpgroup_wait<1>();   // S of key tile j; P V of tile j - 1 may still run
        softmax(j);
        warpgroup_wait<0>();
        pv_done();
        if (thread % 128 == 0) s.ring.release(prev);
        next_p();
        prev = stage;
      }
      issue_pv(prev);
      warpgroup_wait<0>();
      pv_done();
      if (thread % 128 == 0) s.ring.release(prev);
    } else {
      for (int j = 0; j < kv_tiles; ++j) {
        const int stage = s.ring.wait_full(it + j);
        my_turn();
        issue_s(stage);
        their_turn();
        warpgroup_wait<0>();
        softmax(j);
        next_p();
        my_turn();
        issue_pv(stage);
        their_turn();
        warpgroup_wait<0>();
        pv_done();
        if (thread % 128 == 0) s.ring.release(stage);
      }
    }
  };

  int n = 0;   // the tiles taken so far
  for (int w = blockIdx.x; w < work; w += gridDim.x) {
    const PrefillTile t = tile_of(w);
    if (t.seq < 0) continue;
    const int kv_tiles = (t.hi + BN - 1) / BN;
    buf = n % 2;
    unmasked = (t.tile_pos + 1) / BN;
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      pos[r] = t.tile_pos + get<0>(where(2 * r));
      row_max[r] = -1.0e30f;   // a finite floor: no inf - inf for rows whose keys are all masked so far
      row_sum[r] = 0.f;
    }
    clear(acc);
    FullBarrier::wait(&s.q_full[buf], (n / 2) & 1);
    attend(kv_tiles);
    if (thread % 128 == 0) EmptyBarrier::arrive(&s.q_empty[buf]);   // its Q K^T are done: the next tile's Q
    it += kv_tiles;
    ++n;

    const int q_row_base = t.block * ATT_BM;   // query index within the sequence of the tile's first row
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      row_sum[r] += __shfl_xor_sync(0xffffffff, row_sum[r], 1);
      row_sum[r] += __shfl_xor_sync(0xffffffff, row_sum[r], 2);
      row_sum[r] = row_sum[r] > 0.f ? 1.f / row_sum[r] : 1.f;
    }
    CUTE_UNROLL
    for (int i = 0; i < size(acc); i += 2) {
      const int r = (i / 2) % 2, row = get<0>(where_o(i)), col = get<1>(where_o(i));
      if (q_row_base + row < t.q_len)
        *reinterpret_cast<__nv_bfloat162*>(out + size_t(t.first_row + q_row_base + row) * out_stride +
                                           t.head * ATT_D + col) =
            __floats2bfloat162_rn(acc(i) * row_sum[r], acc(i + 1) * row_sum[r]);
    }
  }
}
}  // namespace kiln_cute

// KILN_CUTE_PREFILL: BN keys a tile, STAGES key and value tiles in flight, SCHEDULE (kiln_cute::PLAIN,
// PINGPONG or OVERLAP) what overlaps the softmax. SMEM is the dynamic shared memory the launch gives (checked here).
#define KILN_CUTE_PREFILL(NAME, BN, STAGES, SCHEDULE, SMEM)                                                         \
  static_assert(kiln_cute::PrefillTiles<BN, STAGES>::SHARED_BYTES <= (SMEM),                                    \
                "the launch gives too little shared memory");                                                       \
  extern "C" __global__ void __launch_bounds__(384, 1)                                                              \
      NAME(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,                    \
           const __grid_constant__ CUtensorMap v_map, __nv_bfloat16* out, const int* block_tables,                  \
           const int* query_lens, const int* context_lens, int num_seqs, int first_seq, int tiles, int heads,       \
           int out_stride, int table_stride, int num_slots, int kv_heads, float scale) {                            \
    kiln_cute::prefill<BN, STAGES, SCHEDULE>(&q_map, &k_map, &v_map, out, block_tables, query_lens, context_lens,   \
                                             num_seqs, first_seq, tiles, heads, out_stride, table_stride,         \
                                             num_slots, kv_heads, scale);                                          \
  }
