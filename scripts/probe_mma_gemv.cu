// A decode GEMM for 1-16 rows of x on the tensor cores, weights staged through shared memory, for
// scripts/probe_cuda_gemv.py (a developer's probe, not an engine kernel).
//
// out[t, n] = sum_k x[t, k] w[n, k] (+ bias[n]) (+ residual[t, n]), bf16 in and out, fp32 sums. A block
// owns 16 weight rows (one mma.m16n8k16's M: W is the A operand, x^T the B operand, 8 rows of x per
// n-tile, NT tiles) and its KW warps take turns over K in chunks of 128. A warp loads a chunk (16 rows
// x 256 bytes) with each half-warp reading 256 contiguous bytes of a row per load (session 22's first
// version read 64 bytes of each of 8 rows and lost to Triton), U chunks an iteration with the next
// iteration's in flight, stores it to its own shared-memory tile (16-byte units XOR-swizzled by row,
// so ldmatrix reads it without bank conflicts) and takes the MMA's A fragments from there with
// ldmatrix.x4. x's B fragments come straight from global memory (L1). The warps' partial tiles are
// summed through shared memory at the end.
//
// Assumes N % 16 == 0, K % (128 * U) == 0 and T <= 8 * NT. It compiles appended to
// `plugins/linear/gemv.cu` (scripts/probe_cuda_gemv.py's `mma_kernel`), whose LANES and stream_load it uses.
namespace {

constexpr int CHUNK = 128;                   // k per chunk
constexpr int UNITS = CHUNK / 8;             // 16-byte units of a chunk's row

__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&a)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
               : "r"(address));
}

// Byte offset of row r's 16-byte unit u in a warp's [16][CHUNK] bf16 tile.
__device__ __forceinline__ int tile_offset(int r, int u) { return r * CHUNK * 2 + ((u ^ (r & 7)) * 16); }

template <int NT, int KW, int U>
__device__ __forceinline__ void mma_gemv(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                                         const __nv_bfloat16* __restrict__ bias,
                                         const __nv_bfloat16* __restrict__ residual, __nv_bfloat16* __restrict__ out,
                                         int T, int N, int K) {
  __shared__ __align__(128) unsigned char tiles[KW][U][16 * CHUNK * 2];
  __shared__ float partial[KW][NT][LANES][4];
  const int warp = threadIdx.x / LANES, lane = threadIdx.x % LANES, g = lane / 4, q = lane % 4;
  const int n0 = blockIdx.x * 16;
  // This lane's loads: rows 2i + lane / 16 (i < 8), unit lane % 16 of each chunk.
  const int half = lane / 16, unit = lane % 16;
  const uint4* wrow = reinterpret_cast<const uint4*>(w + static_cast<size_t>(n0 + half) * K) + unit;
  const size_t row_step = static_cast<size_t>(2) * K / 8;   // two rows, in 16-byte units
  // ldmatrix.x4: lanes 8m .. 8m + 7 give the row addresses of matrix m = (rows 0-7 | 8-15) x (k 0-7 | 8-15).
  const int lrow = (lane & 7) + ((lane >> 3) & 1) * 8, lhalf = lane >> 4;
  const uint32_t tile_base = static_cast<uint32_t>(__cvta_generic_to_shared(&tiles[warp][0][0]));
  const uint32_t* xw[NT];
  bool live[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    live[j] = 8 * j + g < T;
    xw[j] = reinterpret_cast<const uint32_t*>(x + static_cast<size_t>(live[j] ? 8 * j + g : 0) * K) + q;
  }
  float d[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) d[j][i] = 0.0f;

  const int chunks = K / CHUNK;
  const int iters = (chunks / U - warp + KW - 1) / KW;   // iterations of U chunks this warp takes
  uint4 a[U][8], b[U][8];
  auto load = [&](uint4 (&buf)[U][8], int it) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int chunk = ((it * KW + warp) * U + u) * UNITS;
#pragma unroll
      for (int i = 0; i < 8; ++i) buf[u][i] = stream_load(wrow + i * row_step + chunk);
    }
  };
  auto multiply = [&](const uint4 (&buf)[U][8], int it) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      unsigned char* tile = tiles[warp][u];
#pragma unroll
      for (int i = 0; i < 8; ++i) *reinterpret_cast<uint4*>(tile + tile_offset(2 * i + half, unit)) = buf[u][i];
    }
    __syncwarp();
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k0 = ((it * KW + warp) * U + u) * CHUNK;
#pragma unroll
      for (int s = 0; s < CHUNK / 16; ++s) {
        uint32_t frag[4];
        ldmatrix_x4(frag, tile_base + u * 16 * CHUNK * 2 + tile_offset(lrow, 2 * s + lhalf));
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          // b0: x row 8j + g at k 2q, 2q + 1 of this 16; b1: at 8 + 2q, 9 + 2q (32-bit words of bf16 pairs).
          const int word = (k0 + 16 * s) / 2;
          const uint32_t b0 = live[j] ? __ldg(xw[j] + word) : 0u, b1 = live[j] ? __ldg(xw[j] + word + 4) : 0u;
          mma(d[j], frag, b0, b1);
        }
      }
    }
    __syncwarp();   // every lane's ldmatrix done before the tile is written again
  };
  if (iters > 0) load(a, 0);
#pragma unroll 1
  for (int it = 0; it < iters; it += 2) {
    if (it + 1 < iters) load(b, it + 1);
    multiply(a, it);
    if (it + 2 < iters) load(a, it + 2);
    if (it + 1 < iters) multiply(b, it + 1);
  }
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) partial[warp][j][lane][i] = d[j][i];
  __syncthreads();
  if (warp != 0) return;
  // d[j][i]: weight row g (i < 2) or g + 8, x row 8j + 2q + i % 2.
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float v = 0.0f;
#pragma unroll
      for (int s = 0; s < KW; ++s) v += partial[s][j][lane][i];
      const int t = 8 * j + 2 * q + i % 2, n = n0 + g + 8 * (i / 2);
      if (t < T) {
        if (bias != nullptr) v += __bfloat162float(bias[n]);
        if (residual != nullptr) v += __bfloat162float(residual[static_cast<size_t>(t) * N + n]);
        out[static_cast<size_t>(t) * N + n] = __float2bfloat16(v);
      }
    }
}

}  // namespace

#define MMA_GEMV(NT, KW, U)                                                                                    \
  extern "C" __global__ void __launch_bounds__(KW * LANES) mma_gemv_nt##NT##_k##KW##_u##U(                     \
      const __nv_bfloat16* x, const __nv_bfloat16* w, const __nv_bfloat16* bias, const __nv_bfloat16* residual, \
      __nv_bfloat16* out, int T, int N, int K) {                                                               \
    mma_gemv<NT, KW, U>(x, w, bias, residual, out, T, N, K);                                                   \
  }

MMA_GEMV(1, 4, 1)
MMA_GEMV(1, 4, 2)
MMA_GEMV(1, 8, 1)
MMA_GEMV(2, 4, 1)
MMA_GEMV(2, 4, 2)
