// A decode GEMM for 1-16 rows of x on the tensor cores with no shared-memory staging of the weights,
// for scripts/probe_cuda_gemv.py (a developer's probe, not an engine kernel; not yet run on a GPU).
//
// out[t, n] = sum_k x[t, k] w[n, k] (+ bias[n]) (+ residual[t, n]), bf16 in and out, fp32 sums. A block
// owns 16 weight rows (one mma.m16n8k16's M, W as the A operand) and splits K among its KSPLIT warps;
// x^T is the B operand, 8 rows of x per n-tile (NT tiles: up to 8 * NT rows). Each lane loads
// 16-byte pieces of weight rows g and g + 8 (g = lane / 4) straight into registers, U pieces a row
// per iteration with the next iteration's in flight, as `plugins/linear/gemv.cu` does, and feeds
// them to the MMA as they are: the sum over k does not depend on the order of k, so within each
// 32-wide piece of K the fragments' k positions are permuted so that lane (g, q = lane % 4) holds
// k = 8q .. 8q + 7 contiguously: the first MMA of a piece takes physical k 8q + {0, 1} as the
// fragment's k = 2q + {0, 1} and 8q + {2, 3} as 2q + 8 + {0, 1}, the second MMA 8q + {4..7}; x's
// fragments are loaded with the same permutation, so every product pairs the same k. The warps'
// partial tiles are summed through shared memory at the end.
//
// Assumes N % 16 == 0, K % (32 * KSPLIT * U) == 0 and T <= 8 * NT (the probe's shapes). It compiles
// appended to `plugins/linear/gemv.cu` (scripts/probe_cuda_gemv.py's `mma_kernel`), whose includes,
// LANES and stream_load it uses.
namespace {

// d += A (16x16, rows g / g + 8, k 2q.. / 2q + 8..) x B (16x8, k 2q.. / 2q + 8.., column g), bf16 in, fp32 sums.
__device__ __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

template <int NT, int KSPLIT, int U>
__device__ __forceinline__ void mma_gemv(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                                         const __nv_bfloat16* __restrict__ bias,
                                         const __nv_bfloat16* __restrict__ residual, __nv_bfloat16* __restrict__ out,
                                         int T, int N, int K) {
  __shared__ float partial[KSPLIT][NT][LANES][4];
  const int warp = threadIdx.x / LANES, lane = threadIdx.x % LANES, g = lane / 4, q = lane % 4;
  const int n0 = blockIdx.x * 16;
  const int pieces = K / 32 / KSPLIT;          // 32-wide K pieces of this warp
  const int first = warp * pieces;
  const uint4* lo = reinterpret_cast<const uint4*>(w + static_cast<size_t>(n0 + g) * K) + q;
  const uint4* hi = reinterpret_cast<const uint4*>(w + static_cast<size_t>(n0 + g + 8) * K) + q;
  const uint4* xv[NT];
  bool live[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    live[j] = 8 * j + g < T;
    xv[j] = reinterpret_cast<const uint4*>(x + static_cast<size_t>(live[j] ? 8 * j + g : 0) * K) + q;
  }
  float d[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) d[j][i] = 0.0f;

  uint4 a_lo[U], a_hi[U], b_lo[U], b_hi[U];
  auto load = [&](uint4 (&l)[U], uint4 (&h)[U], int it) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int piece = (first + it * U + u) * 4;   // in 16-byte units: 4 lanes of a quad take 32 k
      l[u] = stream_load(lo + piece);
      h[u] = stream_load(hi + piece);
    }
  };
  auto multiply = [&](const uint4 (&l)[U], const uint4 (&h)[U], int it) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int piece = (first + it * U + u) * 4;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const uint4 b = live[j] ? __ldg(xv[j] + piece) : make_uint4(0, 0, 0, 0);
        mma(d[j], l[u].x, h[u].x, l[u].y, h[u].y, b.x, b.y);
        mma(d[j], l[u].z, h[u].z, l[u].w, h[u].w, b.z, b.w);
      }
    }
  };
  const int iters = pieces / U;
  load(a_lo, a_hi, 0);
#pragma unroll 1
  for (int it = 0; it < iters; it += 2) {
    if (it + 1 < iters) load(b_lo, b_hi, it + 1);
    multiply(a_lo, a_hi, it);
    if (it + 2 < iters) load(a_lo, a_hi, it + 2);
    if (it + 1 < iters) multiply(b_lo, b_hi, it + 1);
  }
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) partial[warp][j][lane][i] = d[j][i];
  __syncthreads();
  if (warp != 0) return;
  // d[j][i]: weight row g (i < 2) or g + 8, x row 8 * j + 2q + i % 2.
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float v = 0.0f;
#pragma unroll
      for (int s = 0; s < KSPLIT; ++s) v += partial[s][j][lane][i];
      const int t = 8 * j + 2 * q + i % 2, n = n0 + g + 8 * (i / 2);
      if (t < T) {
        if (bias != nullptr) v += __bfloat162float(bias[n]);
        if (residual != nullptr) v += __bfloat162float(residual[static_cast<size_t>(t) * N + n]);
        out[static_cast<size_t>(t) * N + n] = __float2bfloat16(v);
      }
    }
}

}  // namespace

#define MMA_GEMV(NT, KSPLIT, U)                                                                                \
  extern "C" __global__ void __launch_bounds__(KSPLIT * LANES) mma_gemv_nt##NT##_k##KSPLIT##_u##U(             \
      const __nv_bfloat16* x, const __nv_bfloat16* w, const __nv_bfloat16* bias, const __nv_bfloat16* residual, \
      __nv_bfloat16* out, int T, int N, int K) {                                                               \
    mma_gemv<NT, KSPLIT, U>(x, w, bias, residual, out, T, N, K);                                               \
  }

MMA_GEMV(1, 4, 4)
MMA_GEMV(1, 8, 2)
MMA_GEMV(1, 8, 4)
MMA_GEMV(2, 4, 4)
MMA_GEMV(2, 8, 2)
MMA_GEMV(2, 8, 4)
