// FP8 (W8A8) decode GEMVs for one row of x, compiled appended to gemv.cu (whose K loop, `stream_rows`,
// they share): e4m3 weights [N, K] with a float32 scale per row, x bf16, out bf16. The "gemv1" buckets
// of FP8 linear, linear_residual, norm_qkv_rope (whose entry gemv_fp8_qkv.cu adds) and norm_swiglu
// (`plugins.linear.gemv` builds them for the FP8 targets only: the conversions below are sm_89's).
//
// x is quantized as `plugins.fp8` defines it (per token: the GEMM input's largest magnitude over 448,
// a correctly rounded division, round to nearest even, saturating), but by every block itself rather
// than by a pre-pass: each block loads the whole row once its first weight pieces are in flight, and
// stages it into shared memory while they are. The Triton path's pre-pass is a launch and a one-program
// walk of the row per GEMM (about 0.5 ms of a 3.3 ms FP8 step at batch 1 on an H200, BENCHMARKS.md
// session 13); here it is spread over the blocks and hidden behind their loads. The GEMM input is the one the bf16 kernels
// multiply: x for linear; for the norm plugins the RMSNorm'd row rounded to bf16 (times an unfolded norm
// weight, rounded again). Its e4m3 values are exact in f16, which is how shared memory holds them. A
// lane turns its weight pieces (16 e4m3 values each) into f16 pairs with integer shifts (`e4m3_pairs`)
// and multiplies them with packed f16 FMAs, a piece's products summed in f16 and then in f32; the
// result is acc * x_scale * w_scale[n] as in `plugins.fp8.fp8_linear`, whose products are summed in
// f32 throughout (the f16 partial sums add an error near f16's 2^-11, under the bf16 output's 2^-9).
// An entry built STATIC takes the op's static activation scale (`x_static`, one float32 fixed at build
// time) instead: it divides by that, and finds no largest magnitude, so the entries without a norm skip
// the block's reduction altogether. Entries built without it take x_static as 0 and never read it.
//
// Shared memory holds the row as 16-byte units (8 values): unit q of the row at (q % 2) * K / 16 + q / 2,
// so the two halves of a weight piece's x come from two arrays that consecutive lanes read without bank
// conflicts. Every kernel needs K % 16 == 0, K <= the KMAX it was built for, 16-byte aligned x and
// weights, and 256 threads.
//
// At one row the down projection's x is the SwiGLU GEMV's output, and with a static scale nothing in its
// staging needs the whole row: the SwiGLU entry built HANDOFF stages each value it stores (`hand_on`) into
// a global row in that layout, and the linear entry built PRESTAGED multiplies that row as it is, with no
// staging and no block barrier, which stalled the weight stream (BENCHMARKS.md sessions 46-48).
#include <cuda_fp16.h>
#include <cuda_fp8.h>

namespace {

constexpr float E4M3_MAX = 448.0f;
constexpr float MIN_SCALE = 1.0f / (448.0f * 512.0f);   // plugins.fp8.MIN_SCALE

__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16(v)); }

// v / scale correctly rounded, as `__fdiv_rn` gives it, from the scale's correctly rounded reciprocal
// (`__frcp_rn`, once a row): the product is within an ulp of the quotient, its remainder exact in an FMA,
// and one more FMA rounds correctly (Markstein's theorem; no overflow or underflow here: |v| / scale stays
// inside float32's normal range, or rounds to zero in e4m3 either way). __fdiv_rn takes a reciprocal and
// its checks for every value: in down's staging (K = 14,336) that was about 1 us of each block's time.
__device__ __forceinline__ float divided(float v, float scale, float inverse) {
  const float q = v * inverse;
  return __fmaf_rn(__fmaf_rn(-q, scale, v), inverse, q);
}

// The sum and the largest of one value per thread, over the block; every thread gets both.
__device__ __forceinline__ float2 block_sum_max(float sum, float amax) {
  __shared__ float2 part[WARPS];
#pragma unroll
  for (int s = LANES / 2; s > 0; s /= 2) {
    sum += __shfl_xor_sync(0xffffffffu, sum, s);
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, s));
  }
  if (threadIdx.x % LANES == 0) part[threadIdx.x / LANES] = make_float2(sum, amax);
  __syncthreads();
  float2 total = part[0];
#pragma unroll
  for (int w = 1; w < WARPS; ++w) total = make_float2(total.x + part[w].x, fmaxf(total.y, part[w].y));
  __syncthreads();   // `part` is written again by the next call
  return total;
}

// Unit p of the GEMM input from x's unit v: its 8 values, RMSNorm'd as the bf16 path rounds them (NORM).
template <bool NORM, bool NORM_WEIGHT>
__device__ __forceinline__ void gemm_input(float (&f)[VEC], uint4 v, const uint4* norm, int p, float rstd) {
  unpack(v, f);
  if (NORM) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) f[i] = round_bf16(f[i] * rstd);
  }
  if (NORM && NORM_WEIGHT) {
    float g[VEC];
    unpack(__ldg(norm + p), g);
#pragma unroll
    for (int i = 0; i < VEC; ++i) f[i] = round_bf16(f[i] * g[i]);
  }
}

// x's row (at most KMAX values) as the block's threads hold it for staging: unit threadIdx.x + 256 i in
// v[i]. x is the kernel before's output, so `load` waits for it (`wait_inputs`), behind the block's first
// weight pieces: with programmatic dependent launch those are in flight while the kernel before ends.
// (Without it, x's loads queued behind them in a memory system they saturate; loading x first took the
// qkv GEMV from 15.8 to 12.2 us, session 23. With it, the two orders were within 0.5 us of each other,
// except o_proj with 4 pieces a row, 5.8 us weights first against 7.6 for x first with 2; session 24.)
template <int KMAX>
struct XRow {
  static constexpr int PER_THREAD = (KMAX / VEC + WARPS * LANES - 1) / (WARPS * LANES);
  uint4 v[PER_THREAD];

  __device__ __forceinline__ void load(const __nv_bfloat16* x, int K) {
    wait_inputs();
    const uint4* xv = reinterpret_cast<const uint4*>(x);
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
      const int p = threadIdx.x + i * WARPS * LANES;
      v[i] = p < K / VEC ? input_load(xv + p) : make_uint4(0, 0, 0, 0);
    }
  }

  // The row quantized to e4m3 into `xs` (as f16, in the layout of the file's header); returns its
  // scale: *x_static (STATIC), else its own, found in the pass that finds rstd: the largest |x| (or with an
  // unfolded norm weight |x * g|) times rstd, rounded to bf16 (`plugins.fp8.normed_row_scales`).
  template <bool NORM, bool NORM_WEIGHT, bool STATIC>
  __device__ __forceinline__ float stage(const __nv_bfloat16* norm, const float* x_static, uint4* xs, int K,
                                         float eps) const {
    const uint4* nv = reinterpret_cast<const uint4*>(norm);
    const int units = K / VEC, half = K / 16;
    float sum = 0.0f, amax = 0.0f;
    if (NORM || !STATIC) {
#pragma unroll
      for (int i = 0; i < PER_THREAD; ++i) {
        const int p = threadIdx.x + i * WARPS * LANES;
        float f[VEC], g[VEC];
        unpack(v[i], f);   // zeros past the row
        if (NORM_WEIGHT && !STATIC) unpack(p < units ? __ldg(nv + p) : make_uint4(0, 0, 0, 0), g);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          sum = fmaf(f[j], f[j], sum);
          amax = fmaxf(amax, fabsf(NORM_WEIGHT && !STATIC ? f[j] * g[j] : f[j]));
        }
      }
    }
    const float2 stats = NORM || !STATIC ? block_sum_max(sum, amax) : make_float2(0.0f, 0.0f);
    const float rstd = NORM ? rsqrtf(stats.x / K + eps) : 1.0f;
    amax = NORM ? round_bf16(stats.y * rstd) : stats.y;
    const float scale = STATIC ? *x_static : fmaxf(__fdiv_rn(amax, E4M3_MAX), MIN_SCALE);
    const float inverse = __frcp_rn(scale);
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
      const int p = threadIdx.x + i * WARPS * LANES;
      if (p >= units) continue;
      float f[VEC];
      gemm_input<NORM, NORM_WEIGHT>(f, v[i], nv, p, rstd);
      // Each group of four values as the pairs (0, 2) and (1, 3): how `e4m3_pairs` unpacks a weight word.
      uint32_t h[VEC / 2];
#pragma unroll
      for (int j = 0; j < VEC / 2; ++j) {
        const int a = (j / 2) * 4 + j % 2;
        // Saturating at +-448 as the reference's clamp does; the pair's first value goes to the low byte.
        const __nv_fp8x2_storage_t q = __nv_cvt_float2_to_fp8x2(
            make_float2(divided(f[a], scale, inverse), divided(f[a + 2], scale, inverse)), __NV_SATFINITE,
            __NV_E4M3);
        const __half2_raw pair = __nv_cvt_fp8x2_to_halfraw2(q, __NV_E4M3);
        h[j] = static_cast<uint32_t>(pair.x) | (static_cast<uint32_t>(pair.y) << 16);
      }
      xs[(p % 2) * half + p / 2] = make_uint4(h[0], h[1], h[2], h[3]);
    }
    __syncthreads();
    return scale;
  }
};

// A word of 4 e4m3 weights as two f16 pairs, values (0, 2) and (1, 3), each 2^-8 times the weight: sign
// to bit 15 of its half, the 7 exponent and mantissa bits below it to bits 7-13 (f16's exponent bias is 8
// more than e4m3's, and e4m3's subnormals land on f16's). Integer shifts and masks only: sm_90 converts
// e4m3 and f16 at a sixteenth of the FMA rate, which held the first version of this GEMV at 2.9 TB/s.
__device__ __forceinline__ void e4m3_pairs(uint32_t w, __half2& even, __half2& odd) {
  const uint32_t e = ((w << 8) & 0x80008000u) | ((w << 7) & 0x3f803f80u);
  const uint32_t o = (w & 0x80008000u) | ((w >> 1) & 0x3f803f80u);
  even = *reinterpret_cast<const __half2*>(&e);
  odd = *reinterpret_cast<const __half2*>(&o);
}

__device__ __forceinline__ __half2 as_half2(uint32_t v) { return *reinterpret_cast<const __half2*>(&v); }

// The K loop of one warp over R e4m3 weight rows: acc[r] = xq . w[rows[r]], summed over the lanes, with
// xq staged in shared memory by the caller's `early` step (`XRow::stage`), or HANDED in global memory by
// the kernel before (`hand_on`), read with coherent loads (`input_load` says why) after the caller's wait.
template <int R, int UF, bool HANDED = false>
struct Fp8DotRows {
  float acc[R];

  template <bool GUARD>
  // xs holds a piece's two halves `pieces` units apart (the layout of the file's header).
  __device__ __forceinline__ void multiply(const uint4 (&buf)[R][UF], const uint4* xs, int it, int lane, int pieces) {
#pragma unroll
    for (int u = 0; u < UF; ++u) {
      const int piece = (it * UF + u) * LANES + lane;
      if (GUARD && piece >= pieces) continue;
      const uint4 x0 = HANDED ? input_load(xs + piece) : xs[piece];
      const uint4 x1 = HANDED ? input_load(xs + pieces + piece) : xs[pieces + piece];
      const uint32_t xw[VEC] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const uint32_t ww[4] = {buf[r][u].x, buf[r][u].y, buf[r][u].z, buf[r][u].w};
        // A piece's 16 products summed in f16 pairs (at most 8 a half: the e4m3 magnitudes keep each
        // partial sum under 6,300, where f16 ends at 65,504), then in f32.
        __half2 sum = __float2half2_rn(0.0f);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          __half2 even, odd;
          e4m3_pairs(ww[i], even, odd);
          sum = __hfma2(even, as_half2(xw[2 * i]), sum);
          sum = __hfma2(odd, as_half2(xw[2 * i + 1]), sum);
        }
        const float2 wide = __half22float2(sum);
        acc[r] += wide.x + wide.y;
      }
    }
  }

  template <class Early>
  __device__ __forceinline__ void run(const uint8_t* w, const int (&row)[R], int K, const uint4* xs, Early early) {
    const int lane = threadIdx.x % LANES, pieces = K / 16;
    const uint4* rows[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      rows[r] = reinterpret_cast<const uint4*>(w + static_cast<size_t>(row[r]) * K);
      acc[r] = 0.0f;
    }
    // x is staged behind two iterations' weight pieces (`stream_rows`' BOTH), which go out before the wait
    // for the kernel before. Once the wait came after the first loads (session 45), two iterations for every
    // entry took the 16-layer b=1 step on an H100 from 1.775 to 1.762 ms per token and from 1.762 to 1.756
    // calibrated; before, only rows of 8,192 or more took two (down, 21.5 to 19.2 us on an H200; gate/up and
    // qkv were slower then). The bf16 GEMVs stay at one: two made their step 0.8% slower (BENCHMARKS.md
    // session 46).
    stream_rows<R, UF, true>(rows, pieces, lane, early, [&](const uint4(&buf)[R][UF], int it, auto guard) {
      multiply<decltype(guard)::value>(buf, xs, it, lane, pieces);
    });
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = warp_sum(acc[r]) * 256.0f;   // the weights were taken at 2^-8
  }

  // Row r's sum, for lane r < R (every lane holds every sum).
  __device__ __forceinline__ float mine(int lane) const {
    float v = 0.0f;
#pragma unroll
    for (int r = 0; r < R; ++r)
      if (lane == r) v = acc[r];
    return v;
  }
};

// out[n] = xq . w[n] * x_scale * w_scale[n] (+ bias[n]) (+ residual[n]), R consecutive rows a warp.
// PRESTAGED: xq is `staged`, the row the kernel before staged (`hand_on`) with the static scale; x unused.
template <int R, int UF, int KMAX, bool STATIC, bool PRESTAGED = false>
__device__ __forceinline__ void fp8_linear(const __nv_bfloat16* x, const uint4* staged, const uint8_t* w,
                                           const float* w_scale, const float* x_static, const __nv_bfloat16* bias,
                                           const __nv_bfloat16* residual, __nv_bfloat16* out, int N, int K) {
  static_assert(STATIC || !PRESTAGED, "a staged row was divided by the static scale");
  __shared__ uint4 xs[PRESTAGED ? 1 : KMAX / VEC];
  const int lane = threadIdx.x % LANES, first = (blockIdx.x * WARPS + threadIdx.x / LANES) * R;
  const int n = first + lane % R;
  const bool owner = lane < R;
  launch_dependents();
  float extra = 0.0f, ws = 0.0f;
  if (owner) {
    ws = w_scale[n];
    if (bias != nullptr) extra += bf16(bias + n);
  }
  int row[R];
#pragma unroll
  for (int r = 0; r < R; ++r) row[r] = first + r;
  XRow<KMAX> xr;
  Fp8DotRows<R, UF, PRESTAGED> dot;
  float scale;
  dot.run(w, row, K, PRESTAGED ? staged : xs, [&] {
    if (PRESTAGED) wait_inputs();
    else xr.load(x, K);
    if (owner && residual != nullptr) extra += bf16(residual + n);
    scale = PRESTAGED ? *x_static : xr.template stage<false, false, STATIC>(nullptr, x_static, xs, K, 0.0f);
  });
  const float v = dot.mine(lane);
  if (owner) out[n] = __float2bfloat16(v * scale * ws + extra);
}

// Output column j of I, stored as y, into `staged` as the down projection's `XRow::stage` would stage it
// with the static scale `scale`: the same division and conversions, unit j / 8 where the header puts it,
// and the value at its place among the unit's pairs (0, 2), (1, 3), (4, 6), (5, 7).
__device__ __forceinline__ void hand_on(__half* staged, float scale, int j, int I, __nv_bfloat16 y) {
  const int unit = j / VEC, i = j % VEC;
  const int at = ((unit % 2) * (I / 16) + unit / 2) * VEC + (i / 4) * 4 + (i % 2) * 2 + (i % 4) / 2;
  const float q = divided(__bfloat162float(y), scale, __frcp_rn(scale));
  staged[at] = __half(__nv_cvt_fp8_to_halfraw(__nv_cvt_float_to_fp8(q, __NV_SATFINITE, __NV_E4M3), __NV_E4M3));
}

// RMSNorm + gate/up projection + act(gate) * up with e4m3 weights: `swiglu` of gemv.cu otherwise, with
// COLS output columns a warp (their gate and up rows), so a block stages x once for 8 * COLS of them.
// HANDOFF: each output also goes to `staged` for the down projection (`hand_on`, *out_scale its scale).
template <int COLS, int UF, int KMAX, bool GELU_TANH, bool NORM_WEIGHT, bool STATIC, bool HANDOFF = false>
__device__ __forceinline__ void fp8_swiglu(const __nv_bfloat16* x, const __nv_bfloat16* norm, const uint8_t* w,
                                           const float* w_scale, const float* x_static, __nv_bfloat16* out,
                                           __half* staged, const float* out_scale, int I, int block, float eps,
                                           int K) {
  __shared__ uint4 xs[KMAX / VEC];
  const int lane = threadIdx.x % LANES, first = (blockIdx.x * WARPS + threadIdx.x / LANES) * COLS;
  int row[2 * COLS];
#pragma unroll
  for (int c = 0; c < COLS; ++c) {
    const int j = first + c, gate = (j / block) * 2 * block + j % block;
    row[2 * c] = gate;
    row[2 * c + 1] = gate + block;
  }
  const bool owner = lane < COLS;
  float wg = 0.0f, wu = 0.0f;
#pragma unroll
  for (int c = 0; c < COLS; ++c)
    if (lane == c) wg = w_scale[row[2 * c]], wu = w_scale[row[2 * c + 1]];
  const float handoff_scale = HANDOFF && owner ? *out_scale : 0.0f;
  launch_dependents();
  XRow<KMAX> xr;
  Fp8DotRows<2 * COLS, UF> dot;
  float scale;
  dot.run(w, row, K, xs, [&] {
    xr.load(x, K);
    scale = xr.template stage<true, NORM_WEIGHT, STATIC>(norm, x_static, xs, K, eps);
  });
  if (!owner) return;
  float g = 0.0f, u = 0.0f;
#pragma unroll
  for (int c = 0; c < COLS; ++c)
    if (lane == c) g = dot.acc[2 * c] * scale * wg, u = dot.acc[2 * c + 1] * scale * wu;
  const float z = GELU_TANH ? 1.5957691216057308f * (g + 0.044715f * g * g * g) : g;
  const __nv_bfloat16 y = __float2bfloat16(g / (1.0f + __expf(-z)) * u);
  out[first + lane] = y;
  if (HANDOFF) hand_on(staged, handoff_scale, first + lane, I, y);
}

}  // namespace

#define KILN_GEMV_FP8_LINEAR(NAME, R, UF, KMAX, STATIC)                                                 \
  extern "C" __global__ void __launch_bounds__(WARPS * LANES)                                           \
      NAME(const __nv_bfloat16* x, const uint8_t* w, const float* w_scale, const float* x_static,       \
           const __nv_bfloat16* bias, const __nv_bfloat16* residual, __nv_bfloat16* out, int N, int K) {\
    fp8_linear<R, UF, KMAX, STATIC>(x, nullptr, w, w_scale, x_static, bias, residual, out, N, K);       \
  }

// The down projection at one row, its x staged by the SwiGLU GEMV before it (`KILN_GEMV_FP8_SWIGLU_HANDOFF`).
#define KILN_GEMV_FP8_LINEAR_PRESTAGED(NAME, R, UF, KMAX, STATIC)                                       \
  extern "C" __global__ void __launch_bounds__(WARPS * LANES)                                           \
      NAME(const __half* staged, const uint8_t* w, const float* w_scale, const float* x_static,         \
           const __nv_bfloat16* bias, const __nv_bfloat16* residual, __nv_bfloat16* out, int N, int K) {\
    fp8_linear<R, UF, KMAX, STATIC, true>(nullptr, reinterpret_cast<const uint4*>(staged), w, w_scale,  \
                                          x_static, bias, residual, out, N, K);                         \
  }

#define KILN_GEMV_FP8_SWIGLU(NAME, COLS, UF, KMAX, GELU_TANH, NORM_WEIGHT, STATIC)                      \
  extern "C" __global__ void __launch_bounds__(WARPS * LANES)                                           \
      NAME(const __nv_bfloat16* x, const __nv_bfloat16* norm, const uint8_t* w, const float* w_scale,   \
           const float* x_static, __nv_bfloat16* out, int I, int block, float eps, int K) {             \
    fp8_swiglu<COLS, UF, KMAX, GELU_TANH, NORM_WEIGHT, STATIC>(x, norm, w, w_scale, x_static, out,      \
                                                               nullptr, nullptr, I, block, eps, K);     \
  }

// The same, its output staged for the down projection at one row too (`KILN_GEMV_FP8_LINEAR_PRESTAGED`).
#define KILN_GEMV_FP8_SWIGLU_HANDOFF(NAME, COLS, UF, KMAX, GELU_TANH, NORM_WEIGHT, STATIC)              \
  extern "C" __global__ void __launch_bounds__(WARPS * LANES)                                           \
      NAME(const __nv_bfloat16* x, const __nv_bfloat16* norm, const uint8_t* w, const float* w_scale,   \
           const float* x_static, __nv_bfloat16* out, __half* staged, const float* out_scale, int I,    \
           int block, float eps, int K) {                                                               \
    fp8_swiglu<COLS, UF, KMAX, GELU_TANH, NORM_WEIGHT, STATIC, true>(x, norm, w, w_scale, x_static, out,\
                                                                     staged, out_scale, I, block, eps, K);\
  }
