// The decode GEMM of the linear plugin's CUTLASS route (`plugins.linear.cute_gemm`), compiled appended to
// cute_sm90.cu: a candidate that scripts/probe_cuda_gemv.py sweeps, not an engine kernel.
//
//   out[T, N] (bf16) = x[T, K] . w[N, K]^T (+ residual[T, N]), fp32 sums, in bf16 or in e4m3:
//   out = (x_q . w_q^T) * x_scale[t] * w_scale[n], x and w quantized per row.
//
// KILN_CUTE_DECODE, for decode steps of up to TT rows ("swap AB"; rows past TT are not computed: the
// launch keeps T <= TT, `cute_gemm.decode_grid`): the weights are wgmma's 64-row A
// operand and x its TT-column B operand, so no MMA work is spent on padding rows. A block takes 64
// weight rows over one of gridDim.y equal parts of K; 160 threads, warps 0-3 the consumer, warp 4
// the producer. With parts (split-K), each block's sums go to `gather_parts` (a tile is its sub-tile),
// and the last of a tile's blocks to arrive writes the tile. It is launched for
// programmatic dependent launch: the producer issues its first STAGES weight loads before it waits
// for the kernel before it, and x's loads and the epilogue's reads and writes after. Grid (N / 64,
// parts, 1); w boxes [64, 128 bytes], x boxes [TT, 128 bytes].
namespace kiln_cute {

// A decode step reads each weight once and x from every block: the L2 keeps x, not the weights.
constexpr uint64_t EVICT_FIRST = static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_FIRST);
constexpr uint64_t EVICT_LAST = static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_LAST);

constexpr int BW = 64;   // weight rows a block: one consumer warpgroup
constexpr int DECODE_THREADS = 160;

template <class E, int TT, int STAGES>
struct DecodeTiles {
  static constexpr int KT = K_TILE_BYTES / sizeof(E);   // elements of a K tile
  using Mma = decltype(make_tiled_mma(SM90::GMMA::ss_op_selector<E, E, float, Shape<_64, Int<TT>, Int<KT>>>()));
  static constexpr uint32_t W_BYTES = BW * K_TILE_BYTES, X_BYTES = TT * K_TILE_BYTES;
  struct Shared {
    alignas(1024) E w[STAGES * BW * KT];
    alignas(1024) E x[STAGES * TT * KT];
    Ring<STAGES> ring;
    int last[1];   // whether this block is its tile's last part to arrive (`gather_parts`)
  };
  static constexpr int SHARED_BYTES = sizeof(Shared) + 1024;
};

// w_scale and x_scale are e4m3's per-row scales (null for bf16).
template <class E, int TT, int STAGES>
__device__ __forceinline__ void decode(const CUtensorMap* w_map, const CUtensorMap* x_map, const float* w_scale,
                                       const float* x_scale, const __nv_bfloat16* residual, __nv_bfloat16* out,
                                       float* part, int* count, int T, int N, int K) {
  using D = DecodeTiles<E, TT, STAGES>;
  constexpr int KT = D::KT;
  extern __shared__ unsigned char raw[];
  auto& s = aligned_shared<1024, typename D::Shared>(raw);
  const int tile = blockIdx.x, parts = gridDim.y, k_tiles = K / KT;
  const int k_first = blockIdx.y * k_tiles / parts, k_count = (blockIdx.y + 1) * k_tiles / parts - k_first;

  launch_dependents();
  if (threadIdx.x == 128) {
    prefetch_tma_descriptor(w_map);
    prefetch_tma_descriptor(x_map);
    s.ring.init(1);
  }
  __syncthreads();

  if (threadIdx.x >= 128) {
    if (threadIdx.x != 128) return;
    // The weights are the engine's constants: the first stages' loads go out before the wait for the
    // kernel that writes x.
    const int early = min(k_count, STAGES);
    for (int i = 0; i < early; ++i) {
      s.ring.acquire(i, D::W_BYTES + D::X_BYTES);
      SM90_TMA_LOAD_2D::copy(w_map, &s.ring.full[i], EVICT_FIRST, s.w + i * BW * KT, (k_first + i) * KT, tile * BW);
    }
    wait_inputs();
    for (int i = 0; i < early; ++i)
      SM90_TMA_LOAD_2D::copy(x_map, &s.ring.full[i], EVICT_LAST, s.x + i * TT * KT, (k_first + i) * KT, 0);
    for (int i = early; i < k_count; ++i) {
      const int stage = s.ring.acquire(i, D::W_BYTES + D::X_BYTES);
      SM90_TMA_LOAD_2D::copy(w_map, &s.ring.full[stage], EVICT_FIRST, s.w + stage * BW * KT, (k_first + i) * KT,
                             tile * BW);
      SM90_TMA_LOAD_2D::copy(x_map, &s.ring.full[stage], EVICT_LAST, s.x + stage * TT * KT, (k_first + i) * KT, 0);
    }
    return;
  }

  typename D::Mma mma;
  Tensor sw = make_tensor(make_smem_ptr(s.w), SmemTile<E, BW, STAGES>{});
  Tensor sx = make_tensor(make_smem_ptr(s.x), SmemTile<E, TT, STAGES>{});
  auto thread = mma.get_thread_slice(threadIdx.x);
  Tensor w_frag = thread.make_fragment_A(thread.partition_A(sw));
  Tensor x_frag = thread.make_fragment_B(thread.partition_B(sx));
  Tensor acc = partition_fragment_C(mma, Shape<Int<BW>, Int<TT>>{});
  Tensor where = thread.partition_C(make_identity_tensor(Shape<Int<BW>, Int<TT>>{}));   // (weight row, token)
  accumulate(mma, w_frag, x_frag, acc, s.ring, 0, k_count, threadIdx.x == 0);
  if (k_count == 0) clear(acc);   // more parts than K tiles: this one adds nothing, and still counts
  wait_inputs();   // the epilogue reads the residual and writes out: both the kernels before may touch

  if (parts > 1 && !gather_parts(acc, part, count, tile, blockIdx.y, parts, 0, s.last)) return;
  CUTE_UNROLL
  for (int i = 0; i < size(acc); ++i) {
    const int n = tile * BW + get<0>(where(i)), t = get<1>(where(i));
    if (t < T) {
      const size_t at = size_t(t) * N + n;
      float v = acc(i);
      if constexpr (sizeof(E) == 1) v *= w_scale[n] * x_scale[t];
      if (residual != nullptr) v += __bfloat162float(residual[at]);
      out[at] = __float2bfloat16_rn(v);
    }
  }
}
}  // namespace kiln_cute

// KILN_CUTE_DECODE: x and w of ELEMENT (kiln_cute::bf16 or kiln_cute::e4m3), up to TT rows of x (8, 16,
// 32 or 64), STAGES K tiles in flight.
#define KILN_CUTE_DECODE(NAME, ELEMENT, TT, STAGES, SMEM)                                                           \
  static_assert(kiln_cute::DecodeTiles<ELEMENT, TT, STAGES>::SHARED_BYTES <= (SMEM),                              \
                "the launch gives too little shared memory");                                                       \
  extern "C" __global__ void __launch_bounds__(kiln_cute::DECODE_THREADS)                                           \
      NAME(const __grid_constant__ CUtensorMap w_map, const __grid_constant__ CUtensorMap x_map,                    \
           const float* w_scale, const float* x_scale, const __nv_bfloat16* residual, __nv_bfloat16* out,           \
           float* part, int* count, int T, int N, int K) {                                                           \
    kiln_cute::decode<ELEMENT, TT, STAGES>(&w_map, &x_map, w_scale, x_scale, residual, out, part, count, T, N, K);  \
  }
