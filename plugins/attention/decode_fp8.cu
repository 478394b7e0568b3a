// Decode attention over an e4m3 KV cache, in CUDA C++: the "decode" and "decode_split" kernels of
// `attention` (and so attention_o_proj) for engines built with --kv-cache-dtype fp8 on the FP8
// targets (`plugins.attention.decode_fp8` says which shapes it serves).
//
// Why not Triton: a decode step of an e4m3 cache is bound by turning its bytes into MMA operands,
// not by the bytes. Triton stages each K/V tile in shared memory, reads it back with ldmatrix,
// repacks the bytes into pairs and converts them, holding a whole 128-key tile in registers (255
// registers with spills at 2 warps). Here every lane loads its MMA fragments straight from global
// memory in 16-byte pieces and converts them in registers; nothing goes through shared memory until
// the warps merge their results at the end.
//
// One block per (sequence, kv head, split), its warps taking 64-key chunks in turn, each with its own
// online softmax, merged through shared memory at the end. Keys are the M dimension of S^T = K Q^T
// (mma.m16n8k16, the group's query heads as its 8 columns), and S^T's fragments, moved by shuffles,
// are the B operand of O^T = V^T P^T. A dot product takes its k in any order as long as both operands
// agree, and a chunk's keys may take any rows, so both are chosen for the loads:
// - QK: lane (g, c) holds d values [c * D/4, (c + 1) * D/4) of two keys, 16-byte pieces of their K
//   rows; each 4-byte word is two A register pairs, the same d values of q the B pair.
// - PV: lane (g, c) reads 16 keys (one 16-byte piece of a transposed v block, `cache_write.v_offset`)
//   of d rows g and g + 8 of every 16-row tile; word t of a piece is the A operand of k-step t, and
//   the QK rows are assigned keys so that S^T's rows land where those words need them.
//
// Launch: grid (S, kv heads, splits), WARPS * 32 threads; kv heads run fastest in launch order so
// that a sequence's heads read its cache blocks together. Parameters are the Triton decode kernel's.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

namespace {

constexpr int LANES = 32;
constexpr int CHUNK = 64;                 // keys a warp takes per iteration: 4 k-steps of 16
constexpr int STEPS = CHUNK / 16;
constexpr float FLOOR = -1.0e30f;         // a finite floor: no inf - inf for fully masked rows

__device__ __forceinline__ uint4 stream_load(const uint8_t* p) {
  uint4 v;
  // The cache is read once a step: no L1 line for it.
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

__device__ __forceinline__ uint32_t half2_bits(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// Four e4m3 bytes b0..b3 of a word as two f16x2 registers, (b0, b1) and (b2, b3). (Building the f16
// bits with shifts and masks instead, the value times 2^-8 with the factor folded into the scales,
// was 3-7% slower on an H200: BENCHMARKS.md, session 31.)
__device__ __forceinline__ void to_f16(uint32_t w, uint32_t& first, uint32_t& second) {
  __half2_raw a = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E4M3);
  __half2_raw b = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3);
  first = static_cast<uint32_t>(a.x) | (static_cast<uint32_t>(a.y) << 16);
  second = static_cast<uint32_t>(b.x) | (static_cast<uint32_t>(b.y) << 16);
}

// The key (0..63 within its chunk) of QK row g (+ 8 when `upper`) in k-step t: page group g / 2 of
// the chunk's four 16-key groups, so that PV lane c finds rows 2c, 2c + 8, 2c + 1, 2c + 9 at the
// keys its word t holds as (first, second) pairs: 16 c + 4 t + (0, 1) and (2, 3).
__device__ __forceinline__ int key_of(int g, int upper, int t) { return 16 * (g >> 1) + 4 * t + 2 * (g & 1) + upper; }

__device__ __forceinline__ void mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float group_max(float v) {   // over the 8 lanes of a column (lane bits 2-4)
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 4));
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 8));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 16));
}

__device__ __forceinline__ float group_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 4);
  v += __shfl_xor_sync(0xffffffffu, v, 8);
  return v + __shfl_xor_sync(0xffffffffu, v, 16);
}

__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16(x); }
template <> __device__ __forceinline__ __half from_float(float x) { return __float2half(x); }

// Bytes of a 16-key piece at keys base.. outside [lo, hi) set to zero (past the context a slot holds
// anything, NaN bits too, and p = 0 must stay 0).
__device__ __forceinline__ uint4 keep_keys(uint4 v, int base, int lo, int hi) {
  uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint32_t mask = 0;
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const int key = base + 4 * i + b;
      mask |= (key >= lo && key < hi) ? (0xffu << (8 * b)) : 0u;
    }
    w[i] &= mask;
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

template <int KVH, int D, int BS>
struct Cache {
  const uint8_t* k;
  const uint8_t* v;
  const int* table;
  int kv_head, last_page;

  // Block of the 16-key group starting at `key` (clamped to the sequence's last block: past the
  // context the table may hold anything).
  __device__ __forceinline__ int page(int key) const { return __ldg(table + min(key / BS, last_page)); }
  __device__ __forceinline__ const uint8_t* k_row(int page, int key, int piece) const {
    return k + ((static_cast<int64_t>(page) * BS + key % BS) * KVH + kv_head) * D + piece;
  }
  __device__ __forceinline__ const uint8_t* v_row(int page, int key, int d) const {
    return v + ((static_cast<int64_t>(page) * KVH + kv_head) * D + d) * BS + key % BS;
  }
};

template <int D>
struct Warp {
  static constexpr int KSTEPS = D / 16;   // QK k-steps over d; also PV's 16-row tiles of d
  static constexpr int PIECES = D / 64;   // 16-byte pieces of a K row per lane
  uint32_t qf[KSTEPS][2];                 // q as QK's B operand
  float acc[KSTEPS][4];                   // O^T: d rows 16 i + g (+ 8), heads 2c, 2c + 1
  float m[2], l[2];                       // heads 2c, 2c + 1 (l: this lane's share)
};

template <int KVH, int D, int BS, bool MASKED>
__device__ __forceinline__ void attend_chunk(Warp<D>& w, const Cache<KVH, D, BS>& cache, int start, int lo,
                                             int hi, float qk_scale, int g, int c) {
  constexpr int KSTEPS = Warp<D>::KSTEPS, PIECES = Warp<D>::PIECES;
  const int kpage = cache.page(start + 16 * (g >> 1));
  const int vpage = cache.page(start + 16 * c);
  uint4 kr[STEPS][2][PIECES];
#pragma unroll
  for (int t = 0; t < STEPS; ++t)
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int p = 0; p < PIECES; ++p)
        kr[t][u][p] = stream_load(cache.k_row(kpage, start + key_of(g, u, t), c * (D / 4) + 16 * p));
  uint4 vr[KSTEPS][2];
#pragma unroll
  for (int i = 0; i < KSTEPS; ++i)
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      vr[i][u] = stream_load(cache.v_row(vpage, start + 16 * c, 16 * i + g + 8 * u));
      if (MASKED) vr[i][u] = keep_keys(vr[i][u], start + 16 * c, lo, hi);
    }

  float s[STEPS][4];
#pragma unroll
  for (int t = 0; t < STEPS; ++t) {
    s[t][0] = s[t][1] = s[t][2] = s[t][3] = 0.0f;
#pragma unroll
    for (int j = 0; j < KSTEPS; ++j) {
      uint32_t a0, a1, a2, a3;
      to_f16(word(kr[t][0][j / 4], j % 4), a0, a2);
      to_f16(word(kr[t][1][j / 4], j % 4), a1, a3);
      mma(s[t], a0, a1, a2, a3, w.qf[j][0], w.qf[j][1]);
    }
  }
  float top[2] = {FLOOR, FLOOR};
#pragma unroll
  for (int t = 0; t < STEPS; ++t)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float x = s[t][i] * qk_scale;
      if (MASKED) {
        const int key = start + key_of(g, i >> 1, t);
        x = (key >= lo && key < hi) ? x : -INFINITY;
      }
      s[t][i] = x;
      top[i & 1] = fmaxf(top[i & 1], x);
    }
  float alpha[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float m_new = fmaxf(w.m[h], group_max(top[h]));
    alpha[h] = exp2_approx(w.m[h] - m_new);
    w.m[h] = m_new;
    w.l[h] *= alpha[h];
  }
  uint32_t even[STEPS], odd[STEPS];   // P^T pairs (rows g, g + 8) of heads 2c and 2c + 1
#pragma unroll
  for (int t = 0; t < STEPS; ++t) {
    float p[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      p[i] = exp2_approx(s[t][i] - w.m[i & 1]);
      w.l[i & 1] += p[i];
    }
    even[t] = half2_bits(p[0], p[2]);
    odd[t] = half2_bits(p[1], p[3]);
  }
#pragma unroll
  for (int i = 0; i < KSTEPS; ++i) {
    w.acc[i][0] *= alpha[0];
    w.acc[i][1] *= alpha[1];
    w.acc[i][2] *= alpha[0];
    w.acc[i][3] *= alpha[1];
  }
  // PV's B operand for head g: rows (2c, 2c + 8) from lane (2c, g / 2), rows (2c + 1, 2c + 9) from
  // lane (2c + 1, g / 2), each the even or odd head of that lane's pair.
  const int from0 = 4 * (2 * c) + (g >> 1), from1 = from0 + 4;
#pragma unroll
  for (int t = 0; t < STEPS; ++t) {
    const uint32_t e0 = __shfl_sync(0xffffffffu, even[t], from0), o0 = __shfl_sync(0xffffffffu, odd[t], from0);
    const uint32_t e1 = __shfl_sync(0xffffffffu, even[t], from1), o1 = __shfl_sync(0xffffffffu, odd[t], from1);
    const uint32_t b0 = (g & 1) ? o0 : e0, b1 = (g & 1) ? o1 : e1;
#pragma unroll
    for (int i = 0; i < KSTEPS; ++i) {
      uint32_t a0, a1, a2, a3;
      to_f16(word(vr[i][0], t), a0, a2);
      to_f16(word(vr[i][1], t), a1, a3);
      mma(w.acc[i], a0, a1, a2, a3, b0, b1);
    }
  }
}

template <typename T, int H, int KVH, int D, int BS, int WARPS, bool SPLIT>
__device__ __forceinline__ void decode_attention(const T* __restrict__ q, const uint8_t* __restrict__ k_cache,
                                                 const uint8_t* __restrict__ v_cache, T* __restrict__ out,
                                                 float* __restrict__ part, float* __restrict__ stats,
                                                 const int* __restrict__ block_tables,
                                                 const int* __restrict__ context_lens,
                                                 const float* __restrict__ scales, int q_stride, int out_stride,
                                                 int table_stride, float scale, int window) {
  constexpr int GROUP = H / KVH;
  static_assert(GROUP <= 8, "a block's query heads are one 8-column MMA tile");
  static_assert(D == 64 || D == 128, "head_dim 64 or 128");
  static_assert(BS % 16 == 0, "cache blocks of a multiple of 16 keys");
  using W = Warp<D>;
  constexpr int KSTEPS = W::KSTEPS;
  const int lane = threadIdx.x % LANES, warp = threadIdx.x / LANES, g = lane >> 2, c = lane & 3;
  const int launch = blockIdx.x + blockIdx.y * gridDim.x;
  const int kv_head = launch % KVH, seq = launch / KVH;
  const int hi = context_lens[seq];
  const int lo = window > 0 ? max(hi - window, 0) : 0;
  int first = lo / CHUNK, last = (hi + CHUNK - 1) / CHUNK;
  if (SPLIT) {
    const int per = (last - first + gridDim.z - 1) / gridDim.z;
    first += blockIdx.z * per;
    last = min(last, first + per);
  }

  W w;
  {
    const T* qrow = q + static_cast<int64_t>(seq) * q_stride + (kv_head * GROUP + g) * D + c * (D / 4);
#pragma unroll
    for (int j = 0; j < KSTEPS; ++j) {
      float x[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      if (g < GROUP)
#pragma unroll
        for (int i = 0; i < 4; ++i) x[i] = to_float(qrow[4 * j + i]);
      // The same d values as the K words' pairs (to_f16).
      w.qf[j][0] = half2_bits(x[0], x[1]);
      w.qf[j][1] = half2_bits(x[2], x[3]);
    }
  }
#pragma unroll
  for (int i = 0; i < KSTEPS; ++i) w.acc[i][0] = w.acc[i][1] = w.acc[i][2] = w.acc[i][3] = 0.0f;
  w.m[0] = w.m[1] = FLOOR;
  w.l[0] = w.l[1] = 0.0f;

  // The cache holds k / k_scale and v / v_scale: k_scale goes into the scores, v_scale into the result.
  const float qk_scale = scale * 1.4426950408889634f * scales[kv_head];
  const Cache<KVH, D, BS> cache{k_cache, v_cache, block_tables + static_cast<int64_t>(seq) * table_stride, kv_head,
                                (hi - 1) / BS};
  for (int chunk = first + warp; chunk < last; chunk += WARPS) {
    const int start = chunk * CHUNK;
    if (start >= lo && start + CHUNK <= hi)
      attend_chunk<KVH, D, BS, false>(w, cache, start, lo, hi, qk_scale, g, c);
    else
      attend_chunk<KVH, D, BS, true>(w, cache, start, lo, hi, qk_scale, g, c);
  }
  w.l[0] = group_sum(w.l[0]);
  w.l[1] = group_sum(w.l[1]);

  // Merge the warps: each one's (max, sum) per head and its O^T, through shared memory.
  __shared__ float wm[WARPS][8], wl[WARPS][8];
  __shared__ float wacc[WARPS][8][D];
  if (g == 0) {
    wm[warp][2 * c] = w.m[0], wm[warp][2 * c + 1] = w.m[1];
    wl[warp][2 * c] = w.l[0], wl[warp][2 * c + 1] = w.l[1];
  }
#pragma unroll
  for (int i = 0; i < KSTEPS; ++i) {
    wacc[warp][2 * c][16 * i + g] = w.acc[i][0];
    wacc[warp][2 * c + 1][16 * i + g] = w.acc[i][1];
    wacc[warp][2 * c][16 * i + g + 8] = w.acc[i][2];
    wacc[warp][2 * c + 1][16 * i + g + 8] = w.acc[i][3];
  }
  __syncthreads();
  const float v_scale = scales[KVH + kv_head];
  for (int idx = threadIdx.x; idx < GROUP * D; idx += WARPS * LANES) {
    const int h = idx / D, d = idx % D;
    float top = FLOOR;
#pragma unroll
    for (int i = 0; i < WARPS; ++i) top = fmaxf(top, wm[i][h]);
    float sum = 0.0f, o = 0.0f;
#pragma unroll
    for (int i = 0; i < WARPS; ++i) {
      const float f = exp2_approx(wm[i][h] - top);
      sum += wl[i][h] * f;
      o += wacc[i][h][d] * f;
    }
    o *= v_scale;
    const int head = kv_head * GROUP + h;
    if (SPLIT) {
      // Unnormalised, with its (max, sum), for the combine kernel (kernels._combine_splits_kernel).
      const int64_t at = (static_cast<int64_t>(seq) * H + head) * gridDim.z + blockIdx.z;
      part[at * D + d] = o;
      if (d == 0) stats[2 * at] = top, stats[2 * at + 1] = sum;
    } else {
      out[static_cast<int64_t>(seq) * out_stride + head * D + d] = from_float<T>(sum > 0.0f ? o / sum : 0.0f);
    }
  }
}

}  // namespace

// NAME(q, k_cache, v_cache, out, part, stats, block_tables, query_lens, context_lens, scales, num_seqs,
// first_seq, q_stride, out_stride, table_stride, scale, window): the Triton decode kernel's parameters
// (query_lens, num_seqs and first_seq unused: a decode row is one query at row `seq`).
#define KILN_DECODE_FP8_KV(NAME, T, H, KVH, D, BS, WARPS, SPLIT)                                         \
  extern "C" __global__ void __launch_bounds__(WARPS * LANES)                                                 \
      NAME(const T* q, const uint8_t* k_cache, const uint8_t* v_cache, T* out, float* part, float* stats,     \
           const int* block_tables, const int* query_lens, const int* context_lens, const float* scales,      \
           int num_seqs, int first_seq, int q_stride, int out_stride, int table_stride, float scale,          \
           int window) {                                                                                      \
    decode_attention<T, H, KVH, D, BS, WARPS, SPLIT>(q, k_cache, v_cache, out, part, stats, block_tables, \
                                                          context_lens, scales, q_stride, out_stride,         \
                                                          table_stride, scale, window);                      \
  }
