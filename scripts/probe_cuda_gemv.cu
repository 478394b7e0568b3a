// A decode GEMV in CUDA C++ for scripts/probe_cuda_gemv.py (a developer's probe, not an engine kernel).
//
// out[t, n] = sum_k x[t, k] w[n, k] (+ residual[t, n]) for T <= 8 rows of x, bf16 in and out, fp32 sums.
// Each warp owns R weight rows; every lane streams 16-byte pieces of them (8 bf16) straight into
// registers, U pieces a row per iteration, with the next iteration's pieces loaded before this one's
// products (two register buffers): R * U * 2 loads of 16 bytes in flight per lane, no shared memory,
// no split-K, so a narrow weight keeps the DRAM busy without a reduction at the end. x is read
// through L1 (every warp of a block reads the same x). With PDL the first iteration's weight pieces
// are loaded before `griddepcontrol.wait` (weights do not depend on the previous kernel), so their
// DRAM latency overlaps the previous kernel's end; x and the residual are read after it.
//
// Assumes N % (8 * R) == 0 and K % (256 * U) == 0 (the probe's shapes).
#include <cuda_bf16.h>
#include <stdint.h>

namespace {

constexpr int WARPS = 8;
constexpr int LANES = 32;
constexpr int VEC = 8;  // bf16 values in one 16-byte load

__device__ __forceinline__ uint4 load_weight(const uint4* p) {
  uint4 v;
  // volatile keeps these loads in program order with griddepcontrol.wait; no L1 allocation for
  // data read once.
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ void unpack(uint4 v, float* f) {
  const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(u[i] << 16);
    f[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
  }
}

template <int T, int R, int U>
__device__ __forceinline__ void load_pieces(uint4 (&buf)[R][U], const uint4* const (&rows)[R], int it) {
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int u = 0; u < U; ++u) buf[r][u] = load_weight(rows[r] + (it * U + u) * LANES);
}

template <int T, int R, int U>
__device__ __forceinline__ void multiply(float (&acc)[T][R], const uint4 (&buf)[R][U], const uint4* x, int K,
                                         int it, int lane) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int piece = (it * U + u) * LANES + lane;  // in 16-byte units along a row
    float xf[T][VEC];
#pragma unroll
    for (int t = 0; t < T; ++t) unpack(__ldg(x + t * (K / VEC) + piece), xf[t]);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float wf[VEC];
      unpack(buf[r][u], wf);
#pragma unroll
      for (int t = 0; t < T; ++t)
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[t][r] = fmaf(wf[i], xf[t][i], acc[t][r]);
    }
  }
}

template <int T, int R, int U, bool PDL>
__device__ __forceinline__ void gemv(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                                     const __nv_bfloat16* __restrict__ residual, __nv_bfloat16* __restrict__ out,
                                     int N, int K) {
  const int warp = threadIdx.x / LANES, lane = threadIdx.x % LANES;
  const int n0 = (blockIdx.x * WARPS + warp) * R;
  const int iters = K / (LANES * VEC * U);
  const uint4* rows[R];
#pragma unroll
  for (int r = 0; r < R; ++r) rows[r] = reinterpret_cast<const uint4*>(w + static_cast<size_t>(n0 + r) * K) + lane;
  uint4 a[R][U], b[R][U];
  load_pieces<T, R, U>(a, rows, 0);
  if (PDL) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  }
  // The residual's load goes out before the loop, so it is not a round trip at the end.
  float res = 0.0f;
  const int mine_t = lane / R, mine_r = lane % R;
  if (residual != nullptr && lane < T * R) res = __bfloat162float(residual[mine_t * N + n0 + mine_r]);
  float acc[T][R];
#pragma unroll
  for (int t = 0; t < T; ++t)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[t][r] = 0.0f;
  const uint4* xv = reinterpret_cast<const uint4*>(x);
#pragma unroll 1
  for (int it = 0; it < iters; it += 2) {
    if (it + 1 < iters) load_pieces<T, R, U>(b, rows, it + 1);
    multiply<T, R, U>(acc, a, xv, K, it, lane);
    if (it + 2 < iters) load_pieces<T, R, U>(a, rows, it + 2);
    if (it + 1 < iters) multiply<T, R, U>(acc, b, xv, K, it + 1, lane);
  }
#pragma unroll
  for (int t = 0; t < T; ++t)
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int s = LANES / 2; s > 0; s /= 2) acc[t][r] += __shfl_xor_sync(0xffffffffu, acc[t][r], s);
  // Lane t * R + r writes out[t, n0 + r] (every lane holds every sum after the butterfly).
  float mine = 0.0f;
#pragma unroll
  for (int t = 0; t < T; ++t)
#pragma unroll
    for (int r = 0; r < R; ++r)
      if (lane == t * R + r) mine = acc[t][r];
  if (lane < T * R) out[mine_t * N + n0 + mine_r] = __float2bfloat16(mine + res);
}

}  // namespace

#define GEMV(T, R, U)                                                                                         \
  extern "C" __global__ void __launch_bounds__(WARPS * LANES) gemv_t##T##_r##R##_u##U(                        \
      const __nv_bfloat16* x, const __nv_bfloat16* w, const __nv_bfloat16* residual, __nv_bfloat16* out, int N, \
      int K) {                                                                                                \
    gemv<T, R, U, false>(x, w, residual, out, N, K);                                                         \
  }                                                                                                           \
  extern "C" __global__ void __launch_bounds__(WARPS * LANES) gemv_t##T##_r##R##_u##U##_pdl(                  \
      const __nv_bfloat16* x, const __nv_bfloat16* w, const __nv_bfloat16* residual, __nv_bfloat16* out, int N, \
      int K) {                                                                                                \
    gemv<T, R, U, true>(x, w, residual, out, N, K);                                                          \
  }

GEMV(1, 1, 4)
GEMV(1, 2, 2)
GEMV(1, 2, 4)
GEMV(1, 4, 2)
GEMV(1, 4, 4)
GEMV(2, 2, 4)
GEMV(4, 2, 2)
GEMV(4, 2, 4)
GEMV(8, 1, 4)
GEMV(8, 2, 2)
GEMV(8, 2, 4)
GEMV(8, 4, 2)
