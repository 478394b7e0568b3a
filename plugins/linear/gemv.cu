// Decode GEMVs for one or two rows of x (bf16 in and out, fp32 sums), in CUDA C++: the "gemv1" and
// "gemv2" buckets of linear and linear_residual (so attention_o_proj's o_proj and the LM head too) and
// the "gemv1" buckets of norm_qkv_rope and norm_swiglu (`plugins.linear.gemv` builds them with nvcc and
// says which ops, rows and shapes they serve).
//
// Why not Triton: at batch 1 and 2 a projection is a stream of weights, and Triton's smallest MMA
// tile (16 rows) with split-K lost 2-3 us a kernel to the reduction and the pipeline's ramp (H200,
// scripts/probe_cuda_gemv.py, BENCHMARKS.md session 21). Here each warp owns R weight rows and every
// lane loads 16-byte pieces of them (8 bf16) straight into registers, U pieces a row per iteration,
// the next iteration's pieces in flight while this one's are multiplied: 2 * R * U loads of 16 bytes
// per lane, no shared memory, no split-K. x comes through L1 (every warp of a block reads the same x),
// its squares summed on the way for the fused RMSNorm. Whether the SwiGLU GEMV takes an unfolded norm
// weight is a template argument: a runtime null check cost it 2.5 us of 58 (H200,
// scripts/probe_swiglu_gemv.py). The fused qkv keeps the null check: as a template argument its
// kernel took 18.1 us a layer in the engine's step against 15.9 (profile_decode.py, two H200 runs;
// why was not found: the PTX loads in the same order, registers went from 124 to 99). After a
// butterfly over the warp's lanes, lane t * R + r finishes output (t, r); the epilogue's operands
// (residual, bias, positions, cache slots) are loaded before the K loop, so their latency hides
// behind it, and a RoPE row (whose address needs the position) once the first weight pieces are in
// flight.
//
// Each kernel is built for programmatic dependent launch (sm_90 on; the runtime launches it so where
// its meta says "pdl"): it lets the next kernel's blocks start at once (`launch_dependents`), and it
// issues its first weight loads before it waits for the kernel before it (`wait_inputs`). Weights, bias
// and the norm weight are the engine's constants; everything else (x, the residual, positions, cache
// slots) is read after the wait. So a step's chain of GEMVs streams weights across kernel boundaries
// instead of draining and ramping at each. The order that matters is the SASS's, not the PTX's, and
// tests/test_gemv_sass.py checks it there: ptxas issued the wait ahead of the first weight loads until
// `stream_rows` put a basic block between them, and an x read with `ld.global.nc` ahead of the wait
// (`input_load` says why).
//
// Every kernel needs K % 8 == 0 and 16-byte aligned x and weights, and grid (rows / (8 * R), 1, 1)
// with 256 threads: `plugins.linear.gemv` builds a bucket only for shapes that meet that.
#include <cuda_bf16.h>
#include <stdint.h>

namespace {

constexpr int WARPS = 8;
constexpr int LANES = 32;
constexpr int VEC = 8;  // bf16 values in one 16-byte piece
constexpr int U = 4;    // pieces of each row a lane loads per iteration

__device__ __forceinline__ uint4 stream_load(const uint4* p) {
  uint4 v;
  // Weights are read once a step: no L1 line for them.
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// A 16-byte piece of x, which the kernel before writes: a coherent load, never `ld.global.nc`. ptxas takes
// an .nc load to read memory that nothing writes while the kernel runs, and moved the FP8 GEMVs' x loads
// ahead of `wait_inputs` in the SASS: they could read x before the kernel before had written it (until
// session 45; tests/test_gemv_sass.py).
__device__ __forceinline__ uint4 input_load(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ void unpack(uint4 v, float (&f)[VEC]) {
  const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(u[i] << 16);
    f[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
  }
}

__device__ __forceinline__ float bf16(const __nv_bfloat16* p) { return __bfloat162float(*p); }

// Programmatic dependent launch's two halves (no-ops before sm_90, and when launched without it).
__device__ __forceinline__ void launch_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Returns once the kernel before this one has finished and its writes are visible. Nothing the step
// writes may be read before it.
__device__ __forceinline__ void wait_inputs() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

template <bool B>
struct Guard {
  static constexpr bool value = B;
};

// Pieces it * U .. it * U + U - 1 (each a lane's 16 bytes, LANES of them a step) of R weight rows into
// buf. GUARD: the iteration may run past the row's `pieces` (only the last one, when the row is not a
// multiple of U * LANES pieces); the full iterations take no guard, as a branch around each load would
// leave fewer of them in flight.
template <int R, int U, bool GUARD>
__device__ __forceinline__ void load(uint4 (&buf)[R][U], const uint4* const (&rows)[R], int it, int lane,
                                     int pieces) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int piece = (it * U + u) * LANES + lane;
#pragma unroll
    for (int r = 0; r < R; ++r)
      buf[r][u] = !GUARD || piece < pieces ? stream_load(rows[r] + piece) : make_uint4(0, 0, 0, 0);
  }
}

// One warp's walk over R weight rows of `pieces` 16-byte pieces: U pieces a row per lane an iteration,
// the next iteration's in flight while `multiply(buf, it, Guard<...>{})` takes this one's. `early()`
// runs once the first weight pieces are in flight (with BOTH, the first two iterations'): the wait for
// the kernel before (`wait_inputs`), then what needs its writes (x's staging in `gemv_fp8.cu`, an
// epilogue operand such as the residual or the RoPE row of a position), behind them.
template <int R, int U, bool BOTH = false, class Early, class Multiply>
__device__ __forceinline__ void stream_rows(const uint4* const (&rows)[R], int pieces, int lane, Early early,
                                            Multiply multiply) {
  const int full = pieces / (U * LANES);   // iterations wholly inside the row
  uint4 a[R][U], b[R][U];
  if (full > 0) load<R, U, false>(a, rows, 0, lane, pieces);
  if (BOTH && full > 1) load<R, U, false>(b, rows, 1, lane, pieces);
  // A branch ends the basic block of those loads: ptxas schedules within a block, and without one it
  // issued `early()`'s wait first and the loads after it (SASS, ptxas 13.0). On an H100 (BENCHMARKS.md
  // session 45) the loads ahead of the wait took the 16-layer b=1 step from 1.876 to 1.855 ms in FP8 and
  // from 2.783 to 2.746 in bf16. (A row never has fewer than no pieces: the trap is never taken.)
  if (pieces < 0) __trap();
  early();
  // Two register buffers with static names: indexing one array by `it & 1` would put it in local memory.
#pragma unroll 1
  for (int it = 0; it < full; it += 2) {
    if (it + 1 < full && !(BOTH && it == 0)) load<R, U, false>(b, rows, it + 1, lane, pieces);
    multiply(a, it, Guard<false>{});
    if (it + 2 < full) load<R, U, false>(a, rows, it + 2, lane, pieces);
    if (it + 1 < full) multiply(b, it + 1, Guard<false>{});
  }
  if (full * U * LANES < pieces) {
    load<R, U, true>(a, rows, full, lane, pieces);
    multiply(a, full, Guard<true>{});
  }
}

// Adds v over the warp's lanes (a butterfly: every lane gets the sum).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int s = LANES / 2; s > 0; s /= 2) v += __shfl_xor_sync(0xffffffffu, v, s);
  return v;
}

// The K loop of one warp over bf16 weights: acc[t][r] = x[t] . w[rows[r]] (x times norm's weights when
// norm is given), and sumsq[t] = x[t] . x[t] (before the norm weight), summed over the lanes.
template <int T, int R>
struct DotRows {
  float acc[T][R];
  float sumsq[T];

  template <bool GUARD>
  __device__ __forceinline__ void multiply(const uint4 (&buf)[R][U], const uint4* x, const uint4* norm, int it,
                                           int lane, int k8) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int piece = (it * U + u) * LANES + lane;
      if (GUARD && piece >= k8) continue;
      float xf[T][VEC];
#pragma unroll
      for (int t = 0; t < T; ++t) {
        unpack(input_load(x + t * k8 + piece), xf[t]);
#pragma unroll
        for (int i = 0; i < VEC; ++i) sumsq[t] = fmaf(xf[t][i], xf[t][i], sumsq[t]);
      }
      if (norm != nullptr) {
        float g[VEC];
        unpack(__ldg(norm + piece), g);
#pragma unroll
        for (int t = 0; t < T; ++t)
#pragma unroll
          for (int i = 0; i < VEC; ++i) xf[t][i] *= g[i];
      }
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

  template <class Early>
  __device__ __forceinline__ void run(const __nv_bfloat16* x, const __nv_bfloat16* norm, const __nv_bfloat16* w,
                                      const int (&row)[R], int K, Early early) {
    const int lane = threadIdx.x % LANES, k8 = K / VEC;
    const uint4* rows[R];
#pragma unroll
    for (int r = 0; r < R; ++r) rows[r] = reinterpret_cast<const uint4*>(w + static_cast<size_t>(row[r]) * K);
#pragma unroll
    for (int t = 0; t < T; ++t) {
      sumsq[t] = 0.0f;
#pragma unroll
      for (int r = 0; r < R; ++r) acc[t][r] = 0.0f;
    }
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    const uint4* nv = reinterpret_cast<const uint4*>(norm);
    stream_rows<R, U>(rows, k8, lane, early, [&](const uint4(&buf)[R][U], int it, auto guard) {
      multiply<decltype(guard)::value>(buf, xv, nv, it, lane, k8);
    });
#pragma unroll
    for (int t = 0; t < T; ++t) {
      sumsq[t] = warp_sum(sumsq[t]);
#pragma unroll
      for (int r = 0; r < R; ++r) acc[t][r] = warp_sum(acc[t][r]);
    }
  }

  // Output (t, r) = (lane / R, lane % R)'s sum, for lanes below T * R (every lane holds every sum).
  __device__ __forceinline__ float mine(int lane) const {
    float v = 0.0f;
#pragma unroll
    for (int t = 0; t < T; ++t)
#pragma unroll
      for (int r = 0; r < R; ++r)
        if (lane == t * R + r) v = acc[t][r];
    return v;
  }

  __device__ __forceinline__ float row_scale(int t, int K, float eps) const {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < T; ++i)
      if (i == t) s = sumsq[i];
    return rsqrtf(s / K + eps);
  }
};

// out[t, n] = x[t] . w[n] (+ bias[n]) (+ residual[t, n]) for N weight rows, R consecutive ones a warp.
template <int T, int R>
__device__ __forceinline__ void linear(const __nv_bfloat16* x, const __nv_bfloat16* w, const __nv_bfloat16* bias,
                                       const __nv_bfloat16* residual, __nv_bfloat16* out, int N, int K) {
  const int lane = threadIdx.x % LANES, first = (blockIdx.x * WARPS + threadIdx.x / LANES) * R;
  const int t = lane / R, n = first + lane % R;
  const bool owner = lane < T * R;
  launch_dependents();
  float extra = 0.0f;
  if (owner && bias != nullptr) extra += bf16(bias + n);
  int row[R];
#pragma unroll
  for (int r = 0; r < R; ++r) row[r] = first + r;
  DotRows<T, R> dot;
  dot.run(x, nullptr, w, row, K, [&] {
    wait_inputs();
    if (owner && residual != nullptr) extra += bf16(residual + static_cast<size_t>(t) * N + n);
  });
  const float v = dot.mine(lane);
  if (owner) out[static_cast<size_t>(t) * N + n] = __float2bfloat16(v + extra);
}

// A value of the paged cache as its type stores it: bf16 as it is here, e4m3 scaled in gemv_fp8.cu.
template <class Cache>
__device__ __forceinline__ void put(Cache* p, float v, float scale);
template <>
__device__ __forceinline__ void put(__nv_bfloat16* p, float v, float) { *p = __float2bfloat16(v); }

// Head h's columns (j, j + D / 2) of token t, rotated by RoPE (rc, rs: the cos and sin, 1 and 0 for v),
// to out [T, H * D] for a q head, else into the paged cache [layers, 2, num_slots, KVH, D] at `slot`
// (`put` there with the head's kv_scale). v_block > 0: v's cache blocks of v_block slots are transposed,
// [KVH * D, v_block] (an e4m3 cache's, `plugins.attention.cache_write.v_offset`).
template <class Cache>
__device__ __forceinline__ void rope_store(float lo, float hi, float rc, float rs, __nv_bfloat16* out, Cache* kv,
                                           float kv_scale, int t, int h, int j, int slot, int num_slots, int layer,
                                           int H, int KVH, int D, int v_block) {
  const int half = D / 2;
  const bool is_v = h >= H + KVH;
  const float rlo = lo * rc - hi * rs, rhi = hi * rc + lo * rs;
  if (h < H) {
    __nv_bfloat16* dst = out + static_cast<size_t>(t) * H * D + h * D + j;
    dst[0] = __float2bfloat16(rlo);
    dst[half] = __float2bfloat16(rhi);
    return;
  }
  const int kv_head = is_v ? h - H - KVH : h - H;
  const size_t row = static_cast<size_t>(KVH) * D;
  if (is_v && v_block > 0) {
    Cache* dst = kv + (static_cast<size_t>(layer * 2 + 1) * num_slots / v_block + slot / v_block) * row * v_block +
                 static_cast<size_t>(kv_head * D + j) * v_block + slot % v_block;
    put(dst, rlo, kv_scale);
    put(dst + static_cast<size_t>(half) * v_block, rhi, kv_scale);
    return;
  }
  const size_t cache_row = static_cast<size_t>(layer * 2 + (is_v ? 1 : 0)) * num_slots + slot;
  Cache* dst = kv + cache_row * row + kv_head * D + j;
  put(dst, rlo, kv_scale);
  put(dst + half, rhi, kv_scale);
}

// RMSNorm + q/k/v projection (+ bias) + rotate-half RoPE for q and k, q to out [T, H * D] and k, v
// into the paged cache [layers, 2, num_slots, KVH, D] at slot[t]. A warp takes head h's columns j and
// j + D / 2 (the pair RoPE rotates together).
template <int T>
__device__ __forceinline__ void qkv_rope(const __nv_bfloat16* x, const __nv_bfloat16* norm, const __nv_bfloat16* w,
                                         const __nv_bfloat16* bias, const int* positions, const float* rope,
                                         __nv_bfloat16* kv, const int* slots, __nv_bfloat16* out, int num_slots,
                                         int layer, float eps, int H, int KVH, int D, int K) {
  const int lane = threadIdx.x % LANES, pair = blockIdx.x * WARPS + threadIdx.x / LANES;
  const int half = D / 2, h = pair / half, j = pair % half;
  const int row[2] = {h * D + j, h * D + j + half};
  const bool is_q = h < H, is_v = h >= H + KVH, owner = lane < T;
  const int t = lane;
  float rc = 1.0f, rs = 0.0f, b0 = 0.0f, b1 = 0.0f;
  int slot = 0, pos = 0;
  launch_dependents();
  if (owner && bias != nullptr) b0 = bf16(bias + row[0]), b1 = bf16(bias + row[1]);
  DotRows<T, 2> dot;
  dot.run(x, norm, w, row, K, [&] {
    wait_inputs();
    if (owner && !is_v) pos = positions[t];
    if (owner && !is_q) slot = slots[t];
    if (owner && !is_v) {
      const float* r = rope + static_cast<size_t>(pos) * D + j;
      rc = r[0];
      rs = r[half];
    }
  });
  if (!owner) return;
  const float scale = dot.row_scale(t, K, eps);
  float lo = 0.0f, hi = 0.0f;
#pragma unroll
  for (int i = 0; i < T; ++i)
    if (i == t) lo = dot.acc[i][0] * scale + b0, hi = dot.acc[i][1] * scale + b1;
  rope_store(lo, hi, rc, rs, out, kv, 1.0f, t, h, j, slot, num_slots, layer, H, KVH, D, 0);
}

// RMSNorm + gate/up projection + act(gate) * up, act silu (SwiGLU) or tanh-approximated GELU (GeGLU),
// into out [T, I]. W_gu interleaves gate and up rows in blocks of `block` rows ([g0 u0 g1 u1 ...]; `block`
// = I for plain [W_gate; W_up]); a warp takes output column j: its gate row and, `block` rows on, its up row.
template <int T, bool GELU_TANH, bool NORM>
__device__ __forceinline__ void swiglu(const __nv_bfloat16* x, const __nv_bfloat16* norm, const __nv_bfloat16* w,
                                       __nv_bfloat16* out, int I, int block, float eps, int K) {
  const int lane = threadIdx.x % LANES, j = blockIdx.x * WARPS + threadIdx.x / LANES;
  const int gate = (j / block) * 2 * block + j % block;
  const int row[2] = {gate, gate + block};
  launch_dependents();
  DotRows<T, 2> dot;
  dot.run(x, NORM ? norm : nullptr, w, row, K, [] { wait_inputs(); });
  const int t = lane;
  if (t >= T) return;
  const float scale = dot.row_scale(t, K, eps);
  float g = 0.0f, u = 0.0f;
#pragma unroll
  for (int i = 0; i < T; ++i)
    if (i == t) g = dot.acc[i][0] * scale, u = dot.acc[i][1] * scale;
  // gelu_tanh(g) = g * sigmoid(2z), z = sqrt(2 / pi) (g + 0.044715 g^3): the Triton kernel's form.
  const float z = GELU_TANH ? 1.5957691216057308f * (g + 0.044715f * g * g * g) : g;
  out[static_cast<size_t>(t) * I + j] = __float2bfloat16(g / (1.0f + __expf(-z)) * u);
}

}  // namespace

// One entry point per macro call; `plugins.linear.gemv` compiles the file once per entry, with the call
// that defines it appended.
#define KILN_GEMV_LINEAR(NAME, T, R)                                                                    \
  extern "C" __global__ void __launch_bounds__(WARPS * LANES)                                           \
      NAME(const __nv_bfloat16* x, const __nv_bfloat16* w, const __nv_bfloat16* bias,                   \
           const __nv_bfloat16* residual, __nv_bfloat16* out, int N, int K) {                           \
    linear<T, R>(x, w, bias, residual, out, N, K);                                                      \
  }

#define KILN_GEMV_QKV_ROPE(NAME, T)                                                                     \
  extern "C" __global__ void __launch_bounds__(WARPS * LANES)                                           \
      NAME(const __nv_bfloat16* x, const __nv_bfloat16* norm, const __nv_bfloat16* w,                   \
           const __nv_bfloat16* bias, const int* positions, const float* rope, __nv_bfloat16* kv,       \
           const int* slots, __nv_bfloat16* out, int num_slots, int layer, float eps, int H, int KVH,   \
           int D, int K) {                                                                              \
    qkv_rope<T>(x, norm, w, bias, positions, rope, kv, slots, out, num_slots, layer, eps, H, KVH, D, K);   \
  }

#define KILN_GEMV_SWIGLU(NAME, T, GELU_TANH, NORM)                                                      \
  extern "C" __global__ void __launch_bounds__(WARPS * LANES)                                           \
      NAME(const __nv_bfloat16* x, const __nv_bfloat16* norm, const __nv_bfloat16* w,                   \
           __nv_bfloat16* out, int I, int block, float eps, int K) {                                    \
    swiglu<T, GELU_TANH, NORM>(x, norm, w, out, I, block, eps, K);                                      \
  }
