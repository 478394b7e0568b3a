// The FP8 SwiGLU GEMV of Hopper (sm_90a): `fp8_swiglu` of gemv_fp8.cu (compiled appended to gemv.cu and
// that file) with the products on the tensor cores. At one row the f16 K loop there is arithmetic-bound
// on gate/up: turning e4m3 weights into f16 pairs takes five integer operations a word, and sm_90 has
// no mma.sync for e4m3 (nvcc emulates it with the slow conversions). wgmma has: a warpgroup's
// m64n8k32 multiplies 64 weight rows, read from the lanes' registers as loaded, by a 32-value slice
// of x in shared memory, one instruction for 2,048 weights. On an H100 (scripts/probe_fp8_gemv.py)
// the f16 loop took gate/up 47.9 us where its weight bytes take 39.8 at the copy rate, and 39.0
// without the arithmetic.
//
// Layout. wgmma's A fragment gives lane (g, t) = (lane / 4, lane % 4) of a warp four e4m3 words: row g
// of the warp's 16 at k = 4t..4t+3 and 16+4t..16+4t+3, row g + 8 at the same. A dot product does not
// care how k is ordered as long as x is ordered alike, so each lane loads a 16-byte piece of row g and
// one of row g + 8 at byte 16t of a 64-byte chunk of the row (four lanes read a row's 64 bytes), and
// the chunk is two steps: bytes 0-7 of the pieces, then bytes 8-15. The staged x (`WgmmaB`) holds
// each step's 32 values in the order those words take them. x is wgmma's B, N = 8 columns of K-major
// 8-by-16-byte core matrices; only column 0 is x: the descriptor's row stride (16 bytes, fixed for
// core matrices without swizzling) makes columns 1-7 other bytes of the row, whose products land in
// output columns nobody reads. Column 0 of the result is in lanes t = 0: rows g and g + 8.
//
// A warp's 16 rows are the gate and up rows of 8 output columns (row g gate, row g + 8 up), so lane
// 4g finishes column g; a block's 8 warps take 64 columns. Every kernel needs K % 16 == 0, K <= the
// KMAX it was built for, 16-byte aligned x and weights, I % 64 == 0 and 256 threads.
namespace {

constexpr int WGMMA_CHUNK = 64;   // bytes of a weight row the four lanes of a row load an iteration step
constexpr int XS_PAD = 128;       // past the staged row: what columns 1-7 of the last step read

// x's row as wgmma's B (see the header): unit p (values 8p..8p+7, byte 16t + 8h of chunk c) goes to
// step 2c + h, its first four values at k = 4t.., the next four at k = 16 + 4t...
struct WgmmaB {
  __device__ static int units(int K) { return (K + WGMMA_CHUNK - 1) / WGMMA_CHUNK * (WGMMA_CHUNK / VEC); }

  __device__ static void put(void* xs, int p, int K, const float (&f)[VEC], float scale) {
    uint32_t q[2];
#pragma unroll
    for (int w = 0; w < 2; ++w)
      q[w] = static_cast<uint32_t>(e4m3x2(f[4 * w], f[4 * w + 1], scale)) |
             (static_cast<uint32_t>(e4m3x2(f[4 * w + 2], f[4 * w + 3], scale)) << 16);
    uint8_t* step = static_cast<uint8_t*>(xs) + (p / 8) * WGMMA_CHUNK + (p % 2) * 32 + ((p % 8) / 2) * 4;
    *reinterpret_cast<uint32_t*>(step) = q[0];
    *reinterpret_cast<uint32_t*>(step + 16) = q[1];
  }

  // wgmma reads shared memory through the async proxy: the generic writes above must be made visible
  // to it before the block's barrier.
  __device__ static void publish() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
};

// A shared-memory matrix descriptor for wgmma: no swizzling, core matrices 16 bytes apart both ways.
__device__ __forceinline__ uint64_t step_descriptor(const uint8_t* step) {
  const uint64_t address = static_cast<uint32_t>(__cvta_generic_to_shared(step));
  return ((address & 0x3ffff) >> 4) | (uint64_t{16 >> 4} << 16) | (uint64_t{16 >> 4} << 32);
}

// d += A (the four words, e4m3) x B (the step's descriptor), m64n8k32, f32 sums.
__device__ __forceinline__ void wgmma_step(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                           uint64_t b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, 1, 1, 1;"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b));
}

template <int UF, int KMAX, bool GELU_TANH, bool NORM_WEIGHT, bool STATIC>
__device__ __forceinline__ void fp8_swiglu_wgmma(const __nv_bfloat16* x, const __nv_bfloat16* norm,
                                                 const uint8_t* w, const float* w_scale, const float* x_static,
                                                 __nv_bfloat16* out, int I, int block, float eps, int K) {
  __shared__ alignas(128) uint8_t xs[(KMAX + WGMMA_CHUNK - 1) / WGMMA_CHUNK * WGMMA_CHUNK + XS_PAD];
  const int lane = threadIdx.x % LANES, t = lane % 4;
  const int col = (blockIdx.x * WARPS + threadIdx.x / LANES) * 8 + lane / 4;
  const int gate = (col / block) * 2 * block + col % block;
  const uint4* rows[2] = {reinterpret_cast<const uint4*>(w + static_cast<size_t>(gate) * K),
                          reinterpret_cast<const uint4*>(w + static_cast<size_t>(gate + block) * K)};
  const bool owner = t == 0;
  float wg = 0.0f, wu = 0.0f;
  if (owner) wg = w_scale[gate], wu = w_scale[gate + block];
  launch_dependents();
  XRow<KMAX> xr;
  float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  float scale;
  stream_rows<2, UF, KMAX >= LONG_ROW, 4>(
      rows, K / 16, t,
      [&] {
        xr.load(x, K);
        scale = xr.template stage<true, NORM_WEIGHT, STATIC, WgmmaB>(norm, x_static, xs, K, eps);
      },
      [&](const uint4(&buf)[2][UF], int it, auto guard) {
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
        for (int u = 0; u < UF; ++u) {
          const int chunk = it * UF + u;
          if (decltype(guard)::value && chunk * WGMMA_CHUNK >= K) continue;   // the same in every warp
          const uint4 g = buf[0][u], up = buf[1][u];
          const uint8_t* step = xs + chunk * WGMMA_CHUNK;
          wgmma_step(d, g.x, up.x, g.y, up.y, step_descriptor(step));
          wgmma_step(d, g.z, up.z, g.w, up.w, step_descriptor(step + 32));
        }
        // The next iteration's loads overwrite these registers: the products must have read them.
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
      });
  if (!owner) return;
  const float g = d[0] * scale * wg, u = d[2] * scale * wu;
  const float z = GELU_TANH ? 1.5957691216057308f * (g + 0.044715f * g * g * g) : g;
  out[col] = __float2bfloat16(g / (1.0f + __expf(-z)) * u);
}

}  // namespace

#define KILN_GEMV_FP8_SWIGLU_WGMMA(NAME, UF, KMAX, GELU_TANH, NORM_WEIGHT, STATIC)                      \
  extern "C" __global__ void __launch_bounds__(WARPS * LANES)                                           \
      NAME(const __nv_bfloat16* x, const __nv_bfloat16* norm, const uint8_t* w, const float* w_scale,   \
           const float* x_static, __nv_bfloat16* out, int I, int block, float eps, int K) {             \
    fp8_swiglu_wgmma<UF, KMAX, GELU_TANH, NORM_WEIGHT, STATIC>(x, norm, w, w_scale, x_static, out, I,   \
                                                               block, eps, K);                          \
  }
