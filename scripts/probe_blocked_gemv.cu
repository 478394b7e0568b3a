// A tensor-core decode GEMM over 8x8-blocked weights (a developer's probe: scripts/probe_blocked_gemv.py).
//
// Question: does a tensor-core GEMV stream its weights as fast as the CUDA-core GEMV (plugins/linear/gemv.cu)
// when its loads have the GEMV's shape? The two tensor-core GEMVs tried so far (sessions 22 and 23 of
// BENCHMARKS.md) read row-major weights in the MMA's fragment order, a quad of lanes 64 bytes of each of 8
// rows per load, or staged them through shared memory, and streamed at 3.5-3.7 TB/s where the GEMV's warp,
// reading 512 contiguous bytes of one row per load, reached 4.1-4.3. Here the weights are stored in blocks
// of 8 rows x 16 bytes (8 bf16 or 16 e4m3 values of each row; blocks of a row group in K order: W[n / 8]
// [k / e][n % 8][k % e]), so that lane (g, q)'s 16-byte piece of row g in block 4s + q is exactly the B
// fragment mma.sync wants of that row for two MMAs, and a warp's load is 512 contiguous bytes. A dot
// product may take k in any order: the piece's physical k (32s + 8q + j for bf16) is the same for every
// row group of lane q, and x's piece at those k, loaded by lane (g, q) for token g, is the A fragment. x
// is the MMA's 16-row operand (tokens g and g + 8; zero past T), the weights its 8-column one. The same
// memory layout, read as 8-row x 16-byte core matrices, is wgmma's K-major layout without swizzle, so a
// TMA tile of it (BN / 8 row groups x BK bytes) is one contiguous box per row group: what prefill GEMMs
// would read if the engine stored its weights so.
//
// BLOCKED false reads row-major weights with the same lanes' k and everything else the same: the control
// that says whether the layout (a warp's 512 contiguous bytes against a quad's 64 of each of 8 rows) or the
// kernel's form made the difference.
//
// A warp takes R row groups of 8 weight rows over one of `parts` ranges of K; the block's 8 warps are
// 8 / parts row-group slots x parts, summed through shared memory. U pieces of each row group a lane per
// iteration, the next iteration's in flight while this one's are multiplied (as gemv.cu's stream_rows).
// Built for programmatic dependent launch: the first weight loads are issued before the wait. Compiled
// appended to plugins/linear/gemv.cu, whose WARPS, LANES, stream_load and dependent-launch halves it takes.
namespace {

// c += A B for one m16n8 tile: A's fragment (a0..a3), B's (b0, b1); bf16 k16 or e4m3 k32.
template <bool FP8>
__device__ __forceinline__ void mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
  if constexpr (FP8)
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// A lane's piece j..j+7 (bf16) or j..j+15 (e4m3) feeds two MMAs: words x, y (k slots 2q, 2q + 1 and 2q + 8,
// 2q + 9 of bf16's k16; 4q..4q + 3 and 4q + 16..4q + 19 of e4m3's k32) and words z, w.
template <bool FP8>
__device__ __forceinline__ void mma_piece(float (&c)[4], uint4 lo, uint4 hi, uint4 w) {
  mma<FP8>(c, lo.x, hi.x, lo.y, hi.y, w.x, w.y);
  mma<FP8>(c, lo.z, hi.z, lo.w, hi.w, w.z, w.w);
}

// out[t, n] = (x[t] . W[n]) (* x_scale[t] * w_scale[n] for e4m3) (+ residual[t, n]) for t < T <= 8 * TH.
// x [T, K] and W blocked, both of the element type (bf16, or e4m3 with FP8); `row_bytes` = K's bytes.
template <bool FP8, bool BLOCKED, int TH, int R, int U>
__device__ __forceinline__ void blocked_gemv(const uint4* x, const uint4* w, const float* w_scale,
                                             const float* x_scale, const __nv_bfloat16* residual,
                                             __nv_bfloat16* out, int T, int N, int row_bytes, int parts) {
  __shared__ float partial[WARPS][R][LANES][4];
  launch_dependents();
  const int warp = threadIdx.x / LANES, lane = threadIdx.x % LANES, g = lane / 4, q = lane % 4;
  const int slots = WARPS / parts, part = warp / slots, slot = warp % slots;
  const int group0 = (blockIdx.x * slots + slot) * R;   // the warp's first row group
  const int pieces = row_bytes / 64;                    // a row group's pieces a lane: 512 bytes a warp each
  const int first = part * pieces / parts, end = (part + 1) * pieces / parts;
  const int x_row = row_bytes / 16;                     // x's row in 16-byte pieces
  // Lane (g, q)'s piece s of row g of a group: block 4s + q of the group's (8 pieces each), or row-major.
  const int stride = BLOCKED ? 32 : 4;
  const uint4* rows[R];
#pragma unroll
  for (int r = 0; r < R; ++r)
    rows[r] = BLOCKED ? w + size_t(group0 + r) * (row_bytes / 2) + q * 8 + g
                      : w + (size_t(group0 + r) * 8 + g) * x_row + q;

  auto load = [&](uint4(&buf)[R][U], int s0, bool guard) {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < R; ++r)
        buf[r][u] = !guard || s0 + u < end ? stream_load(rows[r] + (s0 + u) * stride) : make_uint4(0, 0, 0, 0);
  };
  float c[R][4] = {};
  auto multiply = [&](const uint4(&buf)[R][U], int s0, bool guard) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int s = s0 + u;
      if (guard && s >= end) break;
      const uint4 zero = make_uint4(0, 0, 0, 0);
      const uint4 lo = g < T ? x[size_t(g) * x_row + 4 * s + q] : zero;
      const uint4 hi = TH > 1 && g + 8 < T ? x[size_t(g + 8) * x_row + 4 * s + q] : zero;
#pragma unroll
      for (int r = 0; r < R; ++r) mma_piece<FP8>(c[r], lo, hi, buf[r][u]);
    }
  };

  const int full = (end - first) / U;
  uint4 a[R][U], b[R][U];
  if (full > 0) load(a, first, false);
  wait_inputs();   // x and the residual are the step's: read after the kernel before has written them
#pragma unroll 1
  for (int it = 0; it < full; it += 2) {
    if (it + 1 < full) load(b, first + (it + 1) * U, false);
    multiply(a, first + it * U, false);
    if (it + 2 < full) load(a, first + (it + 2) * U, false);
    if (it + 1 < full) multiply(b, first + (it + 1) * U, false);
  }
  if (first + full * U < end) {
    load(a, first + full * U, true);
    multiply(a, first + full * U, true);
  }

  if (parts > 1) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int i = 0; i < 4; ++i) partial[warp][r][lane][i] = c[r][i];
    __syncthreads();
    if (part != 0) return;
    for (int p = 1; p < parts; ++p)
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int i = 0; i < 4; ++i) c[r][i] += partial[p * slots + slot][r][lane][i];
  }
  // Lane (g, q) holds tokens g (c0, c1) and g + 8 (c2, c3) of the row group's rows 2q and 2q + 1.
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int n = (group0 + r) * 8 + 2 * q;
#pragma unroll
    for (int h = 0; h < TH; ++h) {
      const int t = g + 8 * h;
      if (t >= T) continue;
      float v0 = c[r][2 * h], v1 = c[r][2 * h + 1];
      if constexpr (FP8) {
        v0 *= x_scale[t] * w_scale[n];
        v1 *= x_scale[t] * w_scale[n + 1];
      }
      if (residual != nullptr) {
        const __nv_bfloat162 add = *reinterpret_cast<const __nv_bfloat162*>(residual + size_t(t) * N + n);
        v0 += __low2float(add);
        v1 += __high2float(add);
      }
      *reinterpret_cast<__nv_bfloat162*>(out + size_t(t) * N + n) = __floats2bfloat162_rn(v0, v1);
    }
  }
}

}  // namespace

// Grid (N * parts / (64 * R), 1, 1), 256 threads; x and W 16-byte aligned, K's bytes a multiple of 64.
#define KILN_PROBE_BLOCKED(NAME, FP8, BLOCKED, TH, R, U)                                                               \
  extern "C" __global__ void __launch_bounds__(256) NAME(const uint4* x, const uint4* w, const float* w_scale,         \
                                                         const float* x_scale, const __nv_bfloat16* residual,          \
                                                         __nv_bfloat16* out, int T, int N, int row_bytes,              \
                                                         int parts) {                                                  \
    blocked_gemv<FP8, BLOCKED, TH, R, U>(x, w, w_scale, x_scale, residual, out, T, N, row_bytes, parts);               \
  }
