// The CuTe building blocks of the linear plugin's Hopper kernels (`plugins.linear.cute_gemm`), built by
// nvcc for sm_90a on CUTLASS's headers: each kernel file (cute_gemm_sm90.cu, cute_decode_sm90.cu) is
// compiled appended to this one.
//
// Every kernel reads x and w through TMA descriptors the host makes once (`runtime.cuda_driver.
// encode_tensor_map`, 128-byte swizzle, boxes 128 bytes wide in K). A ring of STAGES shared-memory
// stages passes K tiles from a producer (one thread issuing every TMA load) to consumer warpgroups'
// wgmma on mbarriers: "full" (armed with the stage's bytes, completed by the TMA) and "empty" (one
// arrival per consumer warpgroup once its MMAs of the stage are done).
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

// K-major shared tiles of `rows` x 128 bytes in 128-byte swizzle atoms of 8 rows, one per stage: what a
// TMA box of [rows, 128 bytes] with the 128-byte swizzle writes, and what wgmma reads.
template <class E, int ROWS, int STAGES>
using SmemTile = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<E>{},
                                        Shape<Int<ROWS>, Int<K_TILE_BYTES / sizeof(E)>, Int<STAGES>>{}));

// A thread's sums come in column pairs (n, n + 1) for two rows 8 apart: index i = c + 2 r + 4 g holds
// column 8 g + c and row 8 r from the thread's first (wgmma's accumulator layout, asserted here).
template <int BN, class Acc, class Where>
__device__ __forceinline__ void check_layout(const Acc&, const Where&) {
  using Shapes = remove_cvref_t<decltype(shape<0>(std::declval<Acc>()))>;
  static_assert(is_same_v<Shapes, Shape<_2, _2, Int<BN / 8>>> && decltype(size(std::declval<Acc>()))::value == BN / 2,
                "wgmma's accumulator: column pairs, two rows, BN / 8 column groups a thread");
  using Strides = remove_cvref_t<decltype(stride<0>(std::declval<Where>()))>;
  static_assert(is_same_v<remove_cvref_t<decltype(get<0>(Strides{}))>, ScaledBasis<C<1>, 1>> &&
                    is_same_v<remove_cvref_t<decltype(get<1>(Strides{}))>, ScaledBasis<C<8>, 0>> &&
                    is_same_v<remove_cvref_t<decltype(get<2>(Strides{}))>, ScaledBasis<C<8>, 1>>,
                "wgmma's accumulator: index c + 2 r + 4 g is column 8 g + c and row 8 r");
}

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

// Split-K, by one consumer warpgroup (128 threads, named barrier `wg`): its sums of part `p` of `parts` go to
// its slot of sub-tile `sub` in `part` ([sub-tiles][parts][sums a thread][128 threads]: coalesced stores and
// loads), and the last part to arrive (an atomic count per sub-tile in `count`, which it resets, so both need
// zeroing once) adds every part's slot in order, the same sum whatever the order of arrival. True for the last,
// whose acc then holds the sum; `last[wg]` is shared memory for the verdict.
template <class Acc>
__device__ __forceinline__ bool gather_parts(Acc& acc, float* part, int* count, int sub, int p, int parts, int wg,
                                             int* last) {
  constexpr int N = decltype(size(acc))::value;
  const int thread = threadIdx.x % 128;
  float* slots = part + size_t(sub) * parts * N * 128;
  CUTE_UNROLL
  for (int i = 0; i < N; ++i) __stcg(slots + (p * N + i) * 128 + thread, acc(i));
  __threadfence();
  cutlass::arch::NamedBarrier::arrive_and_wait(128, wg);
  if (thread == 0) {
    last[wg] = atomicAdd(count + sub, 1) == parts - 1;
    __threadfence();
  }
  cutlass::arch::NamedBarrier::arrive_and_wait(128, wg);
  if (!last[wg]) return false;
  clear(acc);
  for (int q = 0; q < parts; ++q) {   // a part's loads in flight together
    CUTE_UNROLL
    for (int i = 0; i < N; ++i) acc(i) += __ldcg(slots + (q * N + i) * 128 + thread);
  }
  if (thread == 0) count[sub] = 0;
  return true;
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
}  // namespace kiln_cute
