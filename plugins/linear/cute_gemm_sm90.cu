// A Hopper GEMM on CUTLASS's CuTe building blocks, compiled by nvcc for sm_90a: the CUTLASS route of
// the prefill and large-batch GEMMs (`plugins.linear.cute_gemm` describes it to the build; a
// candidate that scripts/tune_prefill_gemm.py sweeps, not yet an engine kernel).
//
//   out[M, N] (bf16) = x[M, K] (bf16, row-major) . w[N, K]^T (bf16, weights row-major), fp32 sums.
//
// The TMA descriptors are kernel parameters the host makes once (`runtime.cuda_driver.
// encode_tensor_map`): x as [rows, K] in boxes of [BM, 64], where rows may be the whole buffer's
// (the engine's pointers never move), w as [N, K] in boxes of [BN, 64], both with the 128-byte
// swizzle. M, the rows of this step, is a plain argument: it counts the row tiles and masks the
// stores, so rows past M are read (or zero-filled past the descriptor) and never written.
// N % BN == 0 and K % 64 == 0 (weights are fixed at build time).
//
// Persistent and warp-specialized: one block per SM, 384 threads. Warpgroup 0 is the producer (one
// thread issues every TMA load into a ring of STAGES shared-memory stages), warpgroups 1 and 2 the
// consumers (wgmma from shared memory, 64 rows each, one K tile's MMAs kept in flight). Stages pass
// between them on mbarriers: "full" (the producer's expected bytes, completed by the TMA) and
// "empty" (one arrival per consumer warpgroup once its MMAs of the stage are done). Tiles go in
// groups of GROUP_M row tiles, a group's row tiles fastest: the blocks running at once share a few
// weight column tiles and a few activation row tiles, which the L2 holds.
//
// Launch: grid (min(row tiles x N / BN, SMs), 1, 1), 384 threads, SMEM bytes of dynamic shared memory
// (the instance's last argument, which the compiler checks is enough).
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
using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
using EmptyBarrier = cutlass::arch::ClusterBarrier;

constexpr int BM = 128;        // two consumer warpgroups of 64 rows
constexpr int BK = 64;         // one 128-byte swizzle row of bf16
constexpr int THREADS = 384;

template <int BN, int STAGES>
struct Tiles {
  // K-major shared tiles in 128-byte swizzle atoms of 8 rows: what a TMA box of [rows, 64] with the
  // 128-byte swizzle writes, and what wgmma reads.
  using SmemX = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<bf16>{}, Shape<Int<BM>, Int<BK>, Int<STAGES>>{}));
  using SmemW = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<bf16>{}, Shape<Int<BN>, Int<BK>, Int<STAGES>>{}));
  using Mma = decltype(make_tiled_mma(SM90::GMMA::ss_op_selector<bf16, bf16, float, Shape<_64, Int<BN>, Int<BK>>>(),
                                      Layout<Shape<_2, _1, _1>>{}));
  static constexpr uint32_t STAGE_BYTES = (BM + BN) * BK * sizeof(bf16);
  struct Shared {
    alignas(1024) bf16 x[STAGES * BM * BK];
    alignas(1024) bf16 w[STAGES * BN * BK];
    alignas(8) uint64_t full[STAGES];
    alignas(8) uint64_t empty[STAGES];
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
__device__ __forceinline__ void gemm(const CUtensorMap* x_map, const CUtensorMap* w_map, __nv_bfloat16* out, int M,
                                     int N, int K) {
  using T = Tiles<BN, STAGES>;
  extern __shared__ unsigned char raw[];
  auto& s = *reinterpret_cast<typename T::Shared*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
  const int m_tiles = (M + BM - 1) / BM, n_tiles = N / BN, k_tiles = K / BK, tiles = m_tiles * n_tiles;

  if (threadIdx.x == 0) {
    prefetch_tma_descriptor(x_map);
    prefetch_tma_descriptor(w_map);
    for (int i = 0; i < STAGES; ++i) {
      FullBarrier::init(&s.full[i], 1);
      EmptyBarrier::init(&s.empty[i], 2);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (threadIdx.x < 128) {
    // The producer's other 127 threads have nothing to do: give their registers to the consumers.
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (threadIdx.x != 0) return;
    int it = 0;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
      int m_tile, n_tile;
      tile_of<GROUP_M>(t, m_tiles, n_tiles, m_tile, n_tile);
      for (int k = 0; k < k_tiles; ++k, ++it) {
        const int stage = it % STAGES;
        EmptyBarrier::wait(&s.empty[stage], ((it / STAGES) & 1) ^ 1);   // a fresh stage passes at once
        FullBarrier::arrive_and_expect_tx(&s.full[stage], T::STAGE_BYTES);
        const uint64_t hint = static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_NORMAL);
        SM90_TMA_LOAD_2D::copy(x_map, &s.full[stage], hint, s.x + stage * BM * BK, k * BK, m_tile * BM);
        SM90_TMA_LOAD_2D::copy(w_map, &s.full[stage], hint, s.w + stage * BN * BK, k * BK, n_tile * BN);
      }
    }
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<232>();
  typename T::Mma mma;
  Tensor sx = make_tensor(make_smem_ptr(s.x), typename T::SmemX{});   // (BM, BK, STAGES)
  Tensor sw = make_tensor(make_smem_ptr(s.w), typename T::SmemW{});   // (BN, BK, STAGES)
  auto thread = mma.get_thread_slice(threadIdx.x - 128);
  Tensor x_frag = thread.make_fragment_A(thread.partition_A(sx));     // wgmma shared-memory descriptors
  Tensor w_frag = thread.make_fragment_B(thread.partition_B(sw));
  Tensor acc = partition_fragment_C(mma, Shape<Int<BM>, Int<BN>>{});
  Tensor where = thread.partition_C(make_identity_tensor(Shape<Int<BM>, Int<BN>>{}));   // (row, col) of each sum
  const bool signals = threadIdx.x % 128 == 0;   // one arrival on "empty" per warpgroup

  int it = 0;
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    int m_tile, n_tile;
    tile_of<GROUP_M>(t, m_tiles, n_tiles, m_tile, n_tile);
    mma.accumulate_ = GMMA::ScaleOut::Zero;
    int pending = -1;   // the stage whose MMAs may still run
    for (int k = 0; k < k_tiles; ++k, ++it) {
      const int stage = it % STAGES;
      FullBarrier::wait(&s.full[stage], (it / STAGES) & 1);
      warpgroup_fence_operand(acc);
      warpgroup_arrive();
      CUTE_UNROLL
      for (int kb = 0; kb < size<2>(x_frag); ++kb) {
        cute::gemm(mma, x_frag(_, _, kb, stage), w_frag(_, _, kb, stage), acc);
        mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      warpgroup_wait<1>();   // the K tile before this one is done with its stage
      warpgroup_fence_operand(acc);
      if (pending >= 0 && signals) EmptyBarrier::arrive(&s.empty[pending]);
      pending = stage;
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc);
    if (pending >= 0 && signals) EmptyBarrier::arrive(&s.empty[pending]);

    // A thread's sums come in column pairs (n, n + 1): one 4-byte store each.
    const int row0 = m_tile * BM, col0 = n_tile * BN;
    CUTE_UNROLL
    for (int i = 0; i < size(acc); i += 2) {
      const int row = row0 + get<0>(where(i)), col = col0 + get<1>(where(i));
      if (row < M)
        *reinterpret_cast<__nv_bfloat162*>(out + size_t(row) * N + col) = __floats2bfloat162_rn(acc(i), acc(i + 1));
    }
  }
}
}  // namespace kiln_cute

// One entry point per tiling: BN columns a tile, STAGES shared-memory stages, GROUP_M row tiles a
// group, SMEM the dynamic shared memory the launch gives.
#define KILN_CUTE_GEMM(NAME, BN, STAGES, GROUP_M, SMEM)                                                        \
  static_assert(kiln_cute::Tiles<BN, STAGES>::SHARED_BYTES <= (SMEM), "the launch gives too little shared memory"); \
  extern "C" __global__ void __launch_bounds__(kiln_cute::THREADS, 1)                                          \
      NAME(const __grid_constant__ CUtensorMap x_map, const __grid_constant__ CUtensorMap w_map,              \
           __nv_bfloat16* out, int M, int N, int K) {                                                          \
    kiln_cute::gemm<BN, STAGES, GROUP_M>(&x_map, &w_map, out, M, N, K);                                        \
  }
