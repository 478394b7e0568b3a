// A decode GEMM for 1-16 rows of x on the tensor cores with the weights loaded straight into the MMA's
// registers, for scripts/probe_cuda_gemv.py (a developer's probe, not an engine kernel).
//
// out[t, n] = sum_k x[t, k] w[n, k] (+ bias[n]) (+ residual[t, n]), bf16 in and out, fp32 sums. W is
// mma.m16n8k16's A operand (16 weight rows), x^T its B operand (8 rows of x an n-tile, NT tiles). A dot
// product does not care in which order it visits k, so the MMA's k positions may map to any k of the
// row as long as A and B map them alike: lane (g = lane / 4, q = lane % 4) loads a 16-byte piece of
// weight rows g and g + 8 and the same piece of x row g, and its 8 values feed two MMAs, values 0-3
// as the fragment's k (2q, 2q + 1, 2q + 8, 2q + 9) of the first and values 4-7 of the second. So the
// weights need no shared memory and no ldmatrix, and x comes as one 128-bit load per weight piece pair
// (session 22's form, weights through swizzled shared memory, lost from T = 4 on to x's 32-bit loads).
//
// A block owns 16 * R weight rows; its KW warps take turns over K, U pieces a row per lane an
// iteration (the four lanes of a row read 64 contiguous bytes per load), the next iteration's pieces
// in flight while this one's are multiplied. The warps' partial tiles are summed through shared
// memory at the end. Assumes N % (16 * R) == 0, K % (32 * U * KW) == 0 and T <= 8 * NT. It compiles
// appended to `plugins/linear/gemv.cu` (scripts/probe_cuda_gemv.py's `mma_kernel`), whose LANES and
// stream_load it uses.
namespace {

__device__ __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

template <int NT, int R, int U>
struct Pieces {
  uint4 w[R][2][U];   // weight rows 16r + g and 16r + g + 8
  uint4 x[NT][U];     // x row 8j + g
};

template <int NT, int R, int KW, int U>
__device__ __forceinline__ void mma_gemv(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                                         const __nv_bfloat16* __restrict__ bias,
                                         const __nv_bfloat16* __restrict__ residual, __nv_bfloat16* __restrict__ out,
                                         int T, int N, int K) {
  __shared__ float partial[KW][R][NT][LANES][4];
  const int warp = threadIdx.x / LANES, lane = threadIdx.x % LANES, g = lane / 4, q = lane % 4;
  const int n0 = blockIdx.x * 16 * R;
  const uint4* wrow[R][2];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      wrow[r][h] = reinterpret_cast<const uint4*>(w + static_cast<size_t>(n0 + 16 * r + g + 8 * h) * K) + q;
  const uint4* xrow[NT];
  bool live[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    live[j] = 8 * j + g < T;
    xrow[j] = reinterpret_cast<const uint4*>(x + static_cast<size_t>(live[j] ? 8 * j + g : 0) * K) + q;
  }
  float d[R][NT][4];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) d[r][j][i] = 0.0f;

  const int iters = K / (32 * U * KW);   // each warp's iterations: 4 lanes x U pieces a row each
  using P = Pieces<NT, R, U>;
  auto load = [&](P& p, int it) {
    const int base = (it * KW + warp) * 4 * U;
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h) p.w[r][h][u] = stream_load(wrow[r][h] + base + 4 * u);
#pragma unroll
      for (int j = 0; j < NT; ++j) p.x[j][u] = live[j] ? __ldg(xrow[j] + base + 4 * u) : make_uint4(0, 0, 0, 0);
    }
  };
  auto multiply = [&](const P& p) {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const uint4 lo = p.w[r][0][u], hi = p.w[r][1][u], b = p.x[j][u];
          mma(d[r][j], lo.x, hi.x, lo.y, hi.y, b.x, b.y);
          mma(d[r][j], lo.z, hi.z, lo.w, hi.w, b.z, b.w);
        }
  };
  P a, b;
  if (iters > 0) load(a, 0);
#pragma unroll 1
  for (int it = 0; it < iters; it += 2) {
    if (it + 1 < iters) load(b, it + 1);
    multiply(a);
    if (it + 2 < iters) load(a, it + 2);
    if (it + 1 < iters) multiply(b);
  }
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) partial[warp][r][j][lane][i] = d[r][j][i];
  __syncthreads();
  // Warp s sums tile (r, j) = s, s + KW, ...: d[i] is weight row 16r + g (i < 2) or + 8, x row 8j + 2q + i % 2.
#pragma unroll 1
  for (int tile = warp; tile < R * NT; tile += KW) {
    const int r = tile / NT, j = tile % NT;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float v = 0.0f;
#pragma unroll
      for (int s = 0; s < KW; ++s) v += partial[s][r][j][lane][i];
      const int t = 8 * j + 2 * q + i % 2, n = n0 + 16 * r + g + 8 * (i / 2);
      if (t < T) {
        if (bias != nullptr) v += __bfloat162float(bias[n]);
        if (residual != nullptr) v += __bfloat162float(residual[static_cast<size_t>(t) * N + n]);
        out[static_cast<size_t>(t) * N + n] = __float2bfloat16(v);
      }
    }
  }
}

}  // namespace

#define MMA_GEMV(NT, R, KW, U)                                                                                 \
  extern "C" __global__ void __launch_bounds__(KW * LANES) mma_gemv_nt##NT##_r##R##_k##KW##_u##U(              \
      const __nv_bfloat16* x, const __nv_bfloat16* w, const __nv_bfloat16* bias, const __nv_bfloat16* residual, \
      __nv_bfloat16* out, int T, int N, int K) {                                                               \
    mma_gemv<NT, R, KW, U>(x, w, bias, residual, out, T, N, K);                                                \
  }

MMA_GEMV(1, 1, 8, 2)
MMA_GEMV(1, 1, 8, 4)
MMA_GEMV(1, 1, 4, 4)
MMA_GEMV(1, 2, 4, 2)
MMA_GEMV(1, 2, 8, 2)
MMA_GEMV(1, 1, 4, 2)
MMA_GEMV(2, 1, 8, 2)
MMA_GEMV(2, 1, 4, 4)
MMA_GEMV(2, 2, 4, 2)
