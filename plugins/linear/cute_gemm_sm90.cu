// The GEMM of the linear plugin's CUTLASS route (`plugins.linear.cute_gemm`), compiled appended to
// cute_sm90.cu, with two epilogues:
//
//   KILN_CUTE_GEMM: out[T, N] (bf16) = x[T, K] . w[N, K]^T (+ bias[N]) (+ residual[T, N]), fp32 sums,
//   bias and residual optional (null): linear and linear_residual; KILN_CUTE_GEMM_SPLIT, the same with K
//   split in PARTS (below);
//   KILN_CUTE_QKV: norm_qkv_rope with a folded norm weight and a bf16 cache: s = (x[T, K] . w_qkv^T)
//   * row_scale[t] (+ bias), rotate-half RoPE on q and k, q to out[T, heads * D], k and v into their
//   slots of the paged KV cache [layers, 2, num_slots, kv_heads, D].
//
// Persistent: one block per SM, a producer warpgroup and WGS consumer warpgroups of 64 rows each, so
// tiles of BM = 64 x WGS rows of x by BN weight rows. Tiles go in groups of GROUP_M row tiles, a
// group's row tiles fastest, so the blocks running at once share a few weight tiles and a few x tiles,
// which the L2 holds. x is read as [rows, K], where rows may be the whole buffer's (the engine's
// pointers never move) and T, the rows of this step, masks the stores: rows past T are read (or
// zero-filled past the descriptor) and never written. N and K are multiples of the tile (weights are
// fixed at build time). Grid (min(row tiles x column tiles, SMs), 1, 1); x boxes [BM, 128 bytes].
//
// Split-K (PARTS > 1): a work item is a tile's part of K (parts fastest, so a tile's parts run at once). Each
// consumer warpgroup's 64 rows of a tile are a sub-tile of `gather_parts`, whose last part to arrive runs the
// epilogue. At 256 rows a 128x64 tile reads 192 bytes of x and w per 64x64x1
// MMA and K step, a 128x128 tile 128: wider tiles over halves of K give the same 128 tiles for 132 SMs with a
// third less to read.
//
// The plain GEMM's weight tile is BN consecutive rows of w, one box. The qkv GEMM's holds PAIRS
// rotary pairs: RoPE rotates column j of a head with column j + D/2, and a thread's wgmma sums come in
// columns 8 apart, so a tile is the pairs' first-half rows followed by their second-half rows (BN = 2 x
// PAIRS), loaded in boxes of BOX rows, which never straddle a head (BOX divides D/2), and a pair's two
// sums sit in one thread. Its column tiles number (heads + 2 kv_heads) x D / 2 / PAIRS, and the q, k
// and v heads follow each other in w_qkv's rows as in the plugin's reference.
namespace kiln_cute {

template <int WGS, int BN, int STAGES>
struct GemmTiles {
  static constexpr int BM = 64 * WGS;
  static constexpr int THREADS = 128 * (WGS + 1);
  using Mma = decltype(make_tiled_mma(SM90::GMMA::ss_op_selector<bf16, bf16, float, Shape<_64, Int<BN>, Int<BK>>>(),
                                      Layout<Shape<Int<WGS>, _1, _1>>{}));
  static constexpr uint32_t STAGE_BYTES = (BM + BN) * BK * sizeof(bf16);
  struct Shared {
    alignas(1024) bf16 x[STAGES * BM * BK];
    alignas(1024) bf16 w[STAGES * BN * BK];
    Ring<STAGES> ring;
    int last[WGS];   // split-K: whether the warpgroup's part of the current tile is the last to arrive
  };
  static constexpr int SHARED_BYTES = sizeof(Shared) + 1024;   // + the slack to align the base to 1 KiB
};

// Row and column tile of persistent tile `t`: GROUP_M row tiles at a time, row tiles fastest.
template <int GROUP_M>
__device__ __forceinline__ void tile_of(int t, int m_tiles, int n_tiles, int& m_tile, int& n_tile) {
  const int per_group = GROUP_M * n_tiles;
  const int first = (t / per_group) * GROUP_M;
  const int rows = min(m_tiles - first, GROUP_M);
  m_tile = first + (t % per_group) % rows;
  n_tile = (t % per_group) / rows;
}

// The plain GEMM's weight tile: rows n_tile x BN on, one box.
template <int BN>
struct WeightRows {
  __device__ __forceinline__ void load(const CUtensorMap* w_map, uint64_t* full, bf16* tile, int k, int n_tile) const {
    SM90_TMA_LOAD_2D::copy(w_map, full, EVICT_NORMAL, tile, k * BK, n_tile * BN);
  }
};

// The qkv GEMM's weight tile: pairs n_tile x PAIRS on, their first-half rows then their second-half rows.
template <int PAIRS, int BOX, int D>
struct RotaryPairRows {
  static_assert((D / 2) % BOX == 0 && PAIRS % BOX == 0 && BOX % 8 == 0,
                "a box of pairs lies in one head and fills whole 8-row swizzle atoms");
  __device__ __forceinline__ void load(const CUtensorMap* w_map, uint64_t* full, bf16* tile, int k, int n_tile) const {
    CUTE_UNROLL
    for (int b = 0; b < PAIRS / BOX; ++b) {
      const int pair = n_tile * PAIRS + b * BOX;
      const int row = pair / (D / 2) * D + pair % (D / 2);
      SM90_TMA_LOAD_2D::copy(w_map, full, EVICT_NORMAL, tile + b * BOX * BK, k * BK, row);
      SM90_TMA_LOAD_2D::copy(w_map, full, EVICT_NORMAL, tile + (PAIRS + b * BOX) * BK, k * BK, row + D / 2);
    }
  }
};

// out = sums (+ bias) (+ residual). An epilogue's `prefetch` loads what it adds before the tile's K loop
// (`gemm`), so that the loads are in flight during it: at 129-256 rows a block has one tile, and loads
// issued after the loop would each be a memory round trip the launch waits for. The residual may be
// `out` itself: each element is read and written by the same thread, and its tile's loads go out before
// any of its stores.
template <int BN>
struct BiasResidual {
  const __nv_bfloat16* bias;
  const __nv_bfloat16* residual;
  __nv_bfloat16* out;
  int N;

  struct Loaded {
    float2 add[BN / 4];   // size(acc) / 2
  };

  template <class Where>
  __device__ __forceinline__ Loaded prefetch(const Where& where, int row0, int n_tile, int M) const {
    Loaded loaded;
    const int col0 = n_tile * BN;
    CUTE_UNROLL
    for (int i = 0; i < BN / 2; i += 2) {
      const int row = row0 + get<0>(where(i)), col = col0 + get<1>(where(i));
      float2& add = loaded.add[i / 2];
      add = make_float2(0.f, 0.f);
      if (row < M && bias != nullptr)
        add = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(bias + col));
      if (row < M && residual != nullptr) {
        const float2 r = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(residual + size_t(row) * N + col));
        add.x += r.x;
        add.y += r.y;
      }
    }
    return loaded;
  }

  template <class Acc, class Where>
  __device__ __forceinline__ void store(const Acc& acc, const Where& where, int row0, int n_tile, int M,
                                        const Loaded& loaded) const {
    check_layout<BN>(acc, where);
    const int col0 = n_tile * BN;
    CUTE_UNROLL
    for (int i = 0; i < BN / 2; i += 2) {
      const int row = row0 + get<0>(where(i)), col = col0 + get<1>(where(i));
      if (row < M)
        *reinterpret_cast<__nv_bfloat162*>(out + size_t(row) * N + col) =
            __floats2bfloat162_rn(acc(i) + loaded.add[i / 2].x, acc(i + 1) + loaded.add[i / 2].y);
    }
  }
};

// norm_qkv_rope's epilogue over a RotaryPairRows tile: a pair's first-half sums at index i, its
// second-half ones PAIRS / 2 indices on (its column + PAIRS). Its inputs (row scales, positions and their
// angles, slots, bias) are loaded before the K loop (`prefetch`, as BiasResidual's), through the read-only
// path.
template <int PAIRS, int D>
struct RotaryQkv {
  const float* row_scale;        // [T]: rsqrt(mean(x^2) + eps), the row-scale pre-pass's
  const __nv_bfloat16* bias;     // [(heads + 2 kv_heads) x D] or null
  const int* positions;          // [T]
  const float* rope;             // [positions, D]: cos of the D/2 angles, then their sin
  __nv_bfloat16* kv;
  const int* slots;              // [T]
  __nv_bfloat16* out;
  int num_slots, layer, heads, kv_heads;

  static constexpr int HALF = D / 2, GROUPS = PAIRS / 8;

  // A thread's two rows (r) and GROUPS pairs of columns (g): what its epilogue reads.
  struct Loaded {
    float scale[2];
    size_t slot[2];
    float2 cos[2][GROUPS], sin[2][GROUPS];
    float2 bias_lo[GROUPS], bias_hi[GROUPS];
  };

  template <class Where>
  __device__ __forceinline__ Loaded prefetch(const Where& where, int row0, int n_tile, int M) const {
    Loaded loaded;
    CUTE_UNROLL
    for (int g = 0; g < GROUPS; ++g) {
      const int pair = n_tile * PAIRS + get<1>(where(4 * g));
      const int h = pair / HALF, j = pair % HALF;
      loaded.bias_lo[g] = loaded.bias_hi[g] = make_float2(0.f, 0.f);
      if (bias != nullptr) {
        loaded.bias_lo[g] = __bfloat1622float2(__ldg(reinterpret_cast<const __nv_bfloat162*>(bias + h * D + j)));
        loaded.bias_hi[g] =
            __bfloat1622float2(__ldg(reinterpret_cast<const __nv_bfloat162*>(bias + h * D + HALF + j)));
      }
    }
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      const int t = row0 + get<0>(where(2 * r));
      const bool live = t < M;
      loaded.scale[r] = live ? __ldg(row_scale + t) : 0.f;
      loaded.slot[r] = live ? __ldg(slots + t) : 0;
      const float* angles = rope + size_t(live ? __ldg(positions + t) : 0) * D;
      CUTE_UNROLL
      for (int g = 0; g < GROUPS; ++g) {
        // v's columns load angles they do not use: one branch less, and the loads are in flight anyway.
        const int j = (n_tile * PAIRS + get<1>(where(4 * g + 2 * r))) % HALF;
        loaded.cos[r][g] = __ldg(reinterpret_cast<const float2*>(angles + j));
        loaded.sin[r][g] = __ldg(reinterpret_cast<const float2*>(angles + HALF + j));
      }
    }
    return loaded;
  }

  template <class Acc, class Where>
  __device__ __forceinline__ void store(const Acc& acc, const Where& where, int row0, int n_tile, int M,
                                        const Loaded& loaded) const {
    check_layout<2 * PAIRS>(acc, where);
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      const int t = row0 + get<0>(where(2 * r));
      if (t >= M) continue;
      const float scale = loaded.scale[r];
      CUTE_UNROLL
      for (int g = 0; g < GROUPS; ++g) {
        const int i = 4 * g + 2 * r;
        const int pair = n_tile * PAIRS + get<1>(where(i));
        const int h = pair / HALF, j = pair % HALF;
        float2 lo = make_float2(acc(i) * scale + loaded.bias_lo[g].x, acc(i + 1) * scale + loaded.bias_lo[g].y);
        float2 hi = make_float2(acc(i + PAIRS / 2) * scale + loaded.bias_hi[g].x,
                                acc(i + 1 + PAIRS / 2) * scale + loaded.bias_hi[g].y);
        if (h < heads + kv_heads) {   // q and k rotate; v does not
          const float2 c = loaded.cos[r][g], s = loaded.sin[r][g];
          const float2 rotated = make_float2(lo.x * c.x - hi.x * s.x, lo.y * c.y - hi.y * s.y);
          hi = make_float2(hi.x * c.x + lo.x * s.x, hi.y * c.y + lo.y * s.y);
          lo = rotated;
        }
        __nv_bfloat16* head;
        if (h < heads) {
          head = out + (size_t(t) * heads + h) * D;
        } else {
          const bool v = h >= heads + kv_heads;
          const int kv_head = h - heads - (v ? kv_heads : 0);
          head = kv + ((size_t(layer) * 2 + v) * num_slots + loaded.slot[r]) * kv_heads * D + kv_head * D;
        }
        *reinterpret_cast<__nv_bfloat162*>(head + j) = __floats2bfloat162_rn(lo.x, lo.y);
        *reinterpret_cast<__nv_bfloat162*>(head + HALF + j) = __floats2bfloat162_rn(hi.x, hi.y);
      }
    }
  }
};

template <int WGS, int BN, int STAGES, int GROUP_M, int PARTS, class Weights, class Epilogue>
__device__ __forceinline__ void gemm(const CUtensorMap* x_map, const CUtensorMap* w_map, const Weights& weights,
                                     const Epilogue& epilogue, int M, int n_tiles, int K, float* part = nullptr,
                                     int* count = nullptr) {
  using G = GemmTiles<WGS, BN, STAGES>;
  constexpr int BM = G::BM;
  extern __shared__ unsigned char raw[];
  auto& s = aligned_shared<1024, typename G::Shared>(raw);
  const int m_tiles = (M + BM - 1) / BM, k_tiles = K / BK, items = m_tiles * n_tiles * PARTS;
  // Work item t: tile t / PARTS (`tile_of`), K tiles [first, end) of its part t % PARTS.
  auto k_range = [&](int t, int& first, int& end) {
    first = (t % PARTS) * k_tiles / PARTS;
    end = (t % PARTS + 1) * k_tiles / PARTS;
  };

  if (threadIdx.x == 0) {
    prefetch_tma_descriptor(x_map);
    prefetch_tma_descriptor(w_map);
    s.ring.init(WGS);
  }
  __syncthreads();

  if (threadIdx.x < 128) {
    // The producer's other 127 threads have nothing to do: their registers go to the consumers.
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (threadIdx.x != 0) return;
    int it = 0;
    for (int t = blockIdx.x; t < items; t += gridDim.x) {
      int m_tile, n_tile, first, end;
      tile_of<GROUP_M>(t / PARTS, m_tiles, n_tiles, m_tile, n_tile);
      k_range(t, first, end);
      for (int k = first; k < end; ++k, ++it) {
        const int stage = s.ring.acquire(it, G::STAGE_BYTES);
        SM90_TMA_LOAD_2D::copy(x_map, &s.ring.full[stage], EVICT_NORMAL, s.x + stage * BM * BK, k * BK, m_tile * BM);
        weights.load(w_map, &s.ring.full[stage], s.w + stage * BN * BK, k, n_tile);
      }
    }
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<232>();
  typename G::Mma mma;
  Tensor sx = make_tensor(make_smem_ptr(s.x), SmemTile<bf16, BM, STAGES>{});   // (BM, BK, STAGES)
  Tensor sw = make_tensor(make_smem_ptr(s.w), SmemTile<bf16, BN, STAGES>{});   // (BN, BK, STAGES)
  auto thread = mma.get_thread_slice(threadIdx.x - 128);
  Tensor x_frag = thread.make_fragment_A(thread.partition_A(sx));     // wgmma shared-memory descriptors
  Tensor w_frag = thread.make_fragment_B(thread.partition_B(sw));
  Tensor acc = partition_fragment_C(mma, Shape<Int<BM>, Int<BN>>{});
  Tensor where = thread.partition_C(make_identity_tensor(Shape<Int<BM>, Int<BN>>{}));   // (row, col) of each sum
  const bool signals = threadIdx.x % 128 == 0;

  const int wg = (threadIdx.x - 128) / 128;
  int it = 0;
  for (int t = blockIdx.x; t < items; t += gridDim.x) {
    int m_tile, n_tile, first, end;
    tile_of<GROUP_M>(t / PARTS, m_tiles, n_tiles, m_tile, n_tile);
    k_range(t, first, end);
    // The epilogue's loads go out now and land during the K loop (a split's every part loads them; the
    // last to arrive uses them).
    const auto loaded = epilogue.prefetch(where, m_tile * BM, n_tile, M);
    it = accumulate(mma, x_frag, w_frag, acc, s.ring, it, end - first, signals);
    if constexpr (PARTS > 1) {
      if (end == first) clear(acc);   // more parts than K tiles: this one adds nothing, and still counts
      if (!gather_parts(acc, part, count, t / PARTS * WGS + wg, t % PARTS, PARTS, wg, s.last)) continue;
    }
    epilogue.store(acc, where, m_tile * BM, n_tile, M, loaded);
  }
}
}  // namespace kiln_cute

// One entry point per tiling. SMEM is the dynamic shared memory the launch gives (checked here); WGS
// consumer warpgroups (tiles of 64 x WGS rows), STAGES K tiles in flight, GROUP_M row tiles a group.
#define KILN_CUTE_GEMM_ENTRY(NAME, WGS, BN, STAGES, SMEM)                                                             \
  static_assert(kiln_cute::GemmTiles<WGS, BN, STAGES>::SHARED_BYTES <= (SMEM),                                  \
                "the launch gives too little shared memory");                                                       \
  extern "C" __global__ void __launch_bounds__(kiln_cute::GemmTiles<WGS, BN, STAGES>::THREADS, 1) NAME

// KILN_CUTE_GEMM: BN weight rows a tile.
#define KILN_CUTE_GEMM(NAME, WGS, BN, STAGES, GROUP_M, SMEM)                                                         \
  KILN_CUTE_GEMM_ENTRY(NAME, WGS, BN, STAGES, SMEM)(                                                                 \
      const __grid_constant__ CUtensorMap x_map, const __grid_constant__ CUtensorMap w_map,                         \
      const __nv_bfloat16* bias, const __nv_bfloat16* residual, __nv_bfloat16* out, int M, int N, int K) {           \
    kiln_cute::gemm<WGS, BN, STAGES, GROUP_M, 1>(&x_map, &w_map, kiln_cute::WeightRows<BN>{},                        \
                                                 kiln_cute::BiasResidual<BN>{bias, residual, out, N}, M, N / (BN), K); \
  }

// KILN_CUTE_GEMM_SPLIT: KILN_CUTE_GEMM with K in PARTS; part [tiles x WGS, PARTS, BN / 2, 128] fp32 and count
// [tiles x WGS] int32 zeroed once.
#define KILN_CUTE_GEMM_SPLIT(NAME, WGS, BN, STAGES, GROUP_M, PARTS, SMEM)                                             \
  KILN_CUTE_GEMM_ENTRY(NAME, WGS, BN, STAGES, SMEM)(                                                                 \
      const __grid_constant__ CUtensorMap x_map, const __grid_constant__ CUtensorMap w_map,                         \
      const __nv_bfloat16* bias, const __nv_bfloat16* residual, __nv_bfloat16* out, float* part, int* count, int M, \
      int N, int K) {                                                                                                \
    kiln_cute::gemm<WGS, BN, STAGES, GROUP_M, PARTS>(&x_map, &w_map, kiln_cute::WeightRows<BN>{},                    \
                                                     kiln_cute::BiasResidual<BN>{bias, residual, out, N}, M,          \
                                                     N / (BN), K, part, count);                                     \
  }

// KILN_CUTE_QKV: PAIRS rotary pairs a tile (2 x PAIRS weight rows), loaded in boxes of BOX rows, heads of
// D columns.
#define KILN_CUTE_QKV(NAME, WGS, PAIRS, BOX, D, STAGES, GROUP_M, SMEM)                                              \
  KILN_CUTE_GEMM_ENTRY(NAME, WGS, 2 * (PAIRS), STAGES, SMEM)(                                                         \
      const __grid_constant__ CUtensorMap x_map, const __grid_constant__ CUtensorMap w_map, const float* row_scale,  \
      const __nv_bfloat16* bias, const int* positions, const float* rope, __nv_bfloat16* kv, const int* slots,       \
      __nv_bfloat16* out, int M, int num_slots, int layer, int heads, int kv_heads, int K) {                         \
    kiln_cute::gemm<WGS, 2 * (PAIRS), STAGES, GROUP_M, 1>(                                                           \
        &x_map, &w_map, kiln_cute::RotaryPairRows<PAIRS, BOX, D>{},                                                  \
        kiln_cute::RotaryQkv<PAIRS, D>{row_scale, bias, positions, rope, kv, slots, out, num_slots, layer, heads,   \
                                       kv_heads},                                                                    \
        M, (heads + 2 * kv_heads) * ((D) / 2) / (PAIRS), K);                                                        \
  }
