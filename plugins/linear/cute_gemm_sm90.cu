// Hopper GEMMs on CUTLASS's CuTe building blocks, compiled by nvcc for sm_90a: the CUTLASS route of
// the linear plugin's GEMMs (`plugins.linear.cute_gemm` describes them to the build). KILN_CUTE_GEMM
// serves linear and linear_residual's 129-256-row bucket for narrow weights; KILN_CUTE_DECODE is a
// candidate that scripts/probe_cuda_gemv.py sweeps, not an engine kernel.
//
//   out[T, N] (bf16) = x[T, K] (bf16, row-major) . w[N, K]^T (bf16, weights row-major) (+ bias[N])
//   (+ residual[T, N]), fp32 sums, bias and residual optional (null);
//   the decode kernel also in e4m3: out = (x_q . w_q^T) * x_scale[t] * w_scale[n], x and w per row.
//
// Both kernels read x and w through TMA descriptors the host makes once (`runtime.cuda_driver.
// encode_tensor_map`, 128-byte swizzle, boxes 128 bytes wide in K): x as [rows, K], where rows may be the
// whole buffer's (the engine's pointers never move), w as [N, K]. T, the rows of this step, is a plain
// argument that masks the stores, so rows past T are read (or zero-filled past the descriptor) and
// never written. N and K are multiples of the tile (weights are fixed at build time). A ring of STAGES
// shared-memory stages passes K tiles from a producer (one thread issuing every TMA load) to a
// consumer warpgroup's wgmma on mbarriers: "full" (armed with the stage's bytes, completed by the
// TMA) and "empty" (one arrival per consumer warpgroup once its MMAs of the stage are done).
//
// KILN_CUTE_GEMM, for prefill chunks and large batches: persistent (one block per SM, 384 threads),
// tiles of 128 rows of x by BN weight rows; warpgroup 0 produces, warpgroups 1 and 2 take 64 rows
// each. Tiles go in groups of GROUP_M row tiles, a group's row tiles fastest, so the blocks running
// at once share a few weight tiles and a few x tiles, which the L2 holds. Grid (min(row tiles x N /
// BN, SMs), 1, 1); x boxes [128, 64], w boxes [BN, 64].
//
// KILN_CUTE_DECODE, for decode steps of up to TT rows ("swap AB"; rows past TT are not computed: the
// launch keeps T <= TT, `cute_gemm.decode_grid`): the weights are wgmma's 64-row A
// operand and x its TT-column B operand, so no MMA work is spent on padding rows. A block takes 64
// weight rows over one of gridDim.y equal parts of K; 160 threads, warps 0-3 the consumer, warp 4
// the producer. With parts (split-K), each block stores its fp32 sums in its slot of `part` and the
// last of a tile's blocks to arrive (an atomic count per tile in `count`, reset for the next launch,
// so both need zeroing once) adds the slots in order and writes the tile. It is launched for
// programmatic dependent launch: the producer issues its first STAGES weight loads before it waits
// for the kernel before it, and x's loads and the epilogue's reads and writes after. Grid (N / 64,
// parts, 1); w boxes [64, 128 bytes], x boxes [TT, 128 bytes].
#include <cuda.h>
#include <cuda_bf16.h>
#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>

namespace kiln_cute {
using namespace cute;
using bf16 = cutlass::bfloat16_t;
using e4m3 = cutlass::float_e4m3_t;
using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
using EmptyBarrier = cutlass::arch::ClusterBarrier;

constexpr int K_TILE_BYTES = 128;   // a K tile: one 128-byte swizzle row
constexpr int BK = K_TILE_BYTES / sizeof(bf16);
constexpr uint64_t EVICT_NORMAL = static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_NORMAL);
// A decode step reads each weight once and x from every block: the L2 keeps x, not the weights.
constexpr uint64_t EVICT_FIRST = static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_FIRST);
constexpr uint64_t EVICT_LAST = static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_LAST);

// K-major shared tiles of `rows` x 128 bytes in 128-byte swizzle atoms of 8 rows, one per stage: what a
// TMA box of [rows, 128 bytes] with the 128-byte swizzle writes, and what wgmma reads.
template <class E, int ROWS, int STAGES>
using SmemTile = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<E>{},
                                        Shape<Int<ROWS>, Int<K_TILE_BYTES / sizeof(E)>, Int<STAGES>>{}));

template <int STAGES>
struct Ring {
  alignas(8) uint64_t full[STAGES];
  alignas(8) uint64_t empty[STAGES];

  __device__ void init(int consumers) {   // by one thread, before the block's first barrier
    for (int i = 0; i < STAGES; ++i) {
      FullBarrier::init(&full[i], 1);
      EmptyBarrier::init(&empty[i], consumers);
    }
    cutlass::arch::fence_barrier_init();
  }
  // The producer's turn `it`: waits until its stage is free (a fresh stage is at once) and arms it for
  // `bytes` of TMA loads.
  __device__ int acquire(int it, uint32_t bytes) {
    const int stage = it % STAGES;
    EmptyBarrier::wait(&empty[stage], ((it / STAGES) & 1) ^ 1);
    FullBarrier::arrive_and_expect_tx(&full[stage], bytes);
    return stage;
  }
  __device__ int wait_full(int it) {
    const int stage = it % STAGES;
    FullBarrier::wait(&full[stage], (it / STAGES) & 1);
    return stage;
  }
  __device__ void release(int stage) { EmptyBarrier::arrive(&empty[stage]); }
};

// A consumer warpgroup's sums over `k_tiles` K tiles from ring turn `it` on: each tile's wgmma run
// while the next stage fills; a stage is released once the MMAs after it are issued and its own are
// done. Returns the next turn.
template <class Mma, class FragA, class FragB, class Acc, class R>
__device__ __forceinline__ int accumulate(Mma& mma, const FragA& a, const FragB& b, Acc& acc, R& ring, int it,
                                          int k_tiles, bool signals) {
  mma.accumulate_ = GMMA::ScaleOut::Zero;
  int pending = -1;   // the stage whose MMAs may still run
  for (int k = 0; k < k_tiles; ++k, ++it) {
    const int stage = ring.wait_full(it);
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(a); ++kb) {
      cute::gemm(mma, a(_, _, kb, stage), b(_, _, kb, stage), acc);
      mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    warpgroup_wait<1>();
    warpgroup_fence_operand(acc);
    if (pending >= 0 && signals) ring.release(pending);
    pending = stage;
  }
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc);
  if (pending >= 0 && signals) ring.release(pending);
  return it;
}

__device__ __forceinline__ void launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

__device__ __forceinline__ void wait_inputs() {   // for the kernel before, under programmatic launch
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

template <uintptr_t ALIGN, class T>
__device__ __forceinline__ T& aligned_shared(unsigned char* raw) {
  return *reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(raw) + ALIGN - 1) & ~(ALIGN - 1));
}

// ---- KILN_CUTE_GEMM ----

constexpr int BM = 128;
constexpr int GEMM_THREADS = 384;

template <int BN, int STAGES>
struct GemmTiles {
  using Mma = decltype(make_tiled_mma(SM90::GMMA::ss_op_selector<bf16, bf16, float, Shape<_64, Int<BN>, Int<BK>>>(),
                                      Layout<Shape<_2, _1, _1>>{}));
  static constexpr uint32_t STAGE_BYTES = (BM + BN) * BK * sizeof(bf16);
  struct Shared {
    alignas(1024) bf16 x[STAGES * BM * BK];
    alignas(1024) bf16 w[STAGES * BN * BK];
    Ring<STAGES> ring;
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

template <int BN, int STAGES, int GROUP_M>
__device__ __forceinline__ void gemm(const CUtensorMap* x_map, const CUtensorMap* w_map, const __nv_bfloat16* bias,
                                     const __nv_bfloat16* residual, __nv_bfloat16* out, int M, int N, int K) {
  using G = GemmTiles<BN, STAGES>;
  extern __shared__ unsigned char raw[];
  auto& s = aligned_shared<1024, typename G::Shared>(raw);
  const int m_tiles = (M + BM - 1) / BM, n_tiles = N / BN, k_tiles = K / BK, tiles = m_tiles * n_tiles;

  if (threadIdx.x == 0) {
    prefetch_tma_descriptor(x_map);
    prefetch_tma_descriptor(w_map);
    s.ring.init(2);
  }
  __syncthreads();

  if (threadIdx.x < 128) {
    // The producer's other 127 threads have nothing to do: their registers go to the consumers.
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (threadIdx.x != 0) return;
    int it = 0;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
      int m_tile, n_tile;
      tile_of<GROUP_M>(t, m_tiles, n_tiles, m_tile, n_tile);
      for (int k = 0; k < k_tiles; ++k, ++it) {
        const int stage = s.ring.acquire(it, G::STAGE_BYTES);
        SM90_TMA_LOAD_2D::copy(x_map, &s.ring.full[stage], EVICT_NORMAL, s.x + stage * BM * BK, k * BK, m_tile * BM);
        SM90_TMA_LOAD_2D::copy(w_map, &s.ring.full[stage], EVICT_NORMAL, s.w + stage * BN * BK, k * BK, n_tile * BN);
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

  int it = 0;
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    int m_tile, n_tile;
    tile_of<GROUP_M>(t, m_tiles, n_tiles, m_tile, n_tile);
    it = accumulate(mma, x_frag, w_frag, acc, s.ring, it, k_tiles, signals);
    // A thread's sums come in column pairs (n, n + 1): one 4-byte load of bias and residual and one
    // 4-byte store each. Every load goes out before the first store: the residual may be `out` itself
    // (each element is read and written by the same thread), so the compiler would keep a load after
    // each earlier store, one memory round trip a pair.
    const int row0 = m_tile * BM, col0 = n_tile * BN;
    float2 add[size(acc) / 2];
    CUTE_UNROLL
    for (int i = 0; i < size(acc); i += 2) {
      const int row = row0 + get<0>(where(i)), col = col0 + get<1>(where(i));
      add[i / 2] = make_float2(0.f, 0.f);
      if (row < M && bias != nullptr)
        add[i / 2] = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(bias + col));
      if (row < M && residual != nullptr) {
        const float2 r = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(residual + size_t(row) * N + col));
        add[i / 2].x += r.x;
        add[i / 2].y += r.y;
      }
    }
    CUTE_UNROLL
    for (int i = 0; i < size(acc); i += 2) {
      const int row = row0 + get<0>(where(i)), col = col0 + get<1>(where(i));
      if (row < M)
        *reinterpret_cast<__nv_bfloat162*>(out + size_t(row) * N + col) =
            __floats2bfloat162_rn(acc(i) + add[i / 2].x, acc(i + 1) + add[i / 2].y);
    }
  }
}

// ---- KILN_CUTE_DECODE ----

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
    int last;   // whether this block is its tile's last part to arrive
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

  if (parts > 1) {
    // Every part stores its sums in its own slot; the last to arrive adds the slots in order (the same
    // sum whatever the arrival order), each thread the elements it holds.
    float* slot = part + size_t(tile) * parts * (BW * TT);
    CUTE_UNROLL
    for (int i = 0; i < size(acc); ++i)
      __stcg(slot + blockIdx.y * (BW * TT) + get<0>(where(i)) * TT + get<1>(where(i)), acc(i));
    __threadfence();
    cutlass::arch::NamedBarrier::arrive_and_wait(128, 0);
    if (threadIdx.x == 0) {
      s.last = atomicAdd(count + tile, 1) == parts - 1;
      __threadfence();
    }
    cutlass::arch::NamedBarrier::arrive_and_wait(128, 0);
    if (!s.last) return;
    clear(acc);
    for (int p = 0; p < parts; ++p) {   // a part's loads in flight together
      CUTE_UNROLL
      for (int i = 0; i < size(acc); ++i)
        acc(i) += __ldcg(slot + p * (BW * TT) + get<0>(where(i)) * TT + get<1>(where(i)));
    }
    if (threadIdx.x == 0) count[tile] = 0;
  }
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

// One entry point per tiling. SMEM is the dynamic shared memory the launch gives (checked here).
// KILN_CUTE_GEMM: BN weight rows a tile, STAGES K tiles in flight, GROUP_M row tiles a group.
#define KILN_CUTE_GEMM(NAME, BN, STAGES, GROUP_M, SMEM)                                                              \
  static_assert(kiln_cute::GemmTiles<BN, STAGES>::SHARED_BYTES <= (SMEM),                                       \
                "the launch gives too little shared memory");                                                       \
  extern "C" __global__ void __launch_bounds__(kiln_cute::GEMM_THREADS, 1)                                           \
      NAME(const __grid_constant__ CUtensorMap x_map, const __grid_constant__ CUtensorMap w_map,                    \
           const __nv_bfloat16* bias, const __nv_bfloat16* residual, __nv_bfloat16* out, int M, int N, int K) {       \
    kiln_cute::gemm<BN, STAGES, GROUP_M>(&x_map, &w_map, bias, residual, out, M, N, K);                              \
  }

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
