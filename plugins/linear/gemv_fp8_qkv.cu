// norm_qkv_rope's FP8 decode GEMV for one row of x (RMSNorm, q/k/v projection, RoPE, the KV-cache write),
// compiled appended to gemv.cu and gemv_fp8.cu, whose staging and K loop it shares (`plugins.linear.gemv`
// builds it). The cache is bf16, or e4m3 with a scale per layer, k or v, and head.
#include <cuda_fp8.h>

namespace {

// A value of an e4m3 cache: v / scale, saturating at +-448, ties to even (`plugins.fp8.to_e4m3`).
template <>
__device__ __forceinline__ void put(__nv_fp8_storage_t* p, float v, float scale) {
  *p = __nv_cvt_float_to_fp8(__fdiv_rn(v, scale), __NV_SATFINITE, __NV_E4M3);
}

// RMSNorm + q/k/v projection (+ bias) + RoPE with e4m3 weights: `qkv_rope` of gemv.cu otherwise. Cache:
// bf16, or e4m3 (`__nv_fp8_storage_t`) with kv_scales [layers, 2, KVH].
template <int UF, int KMAX, bool NORM_WEIGHT, bool STATIC, class Cache>
__device__ __forceinline__ void fp8_qkv_rope(const __nv_bfloat16* x, const __nv_bfloat16* norm, const uint8_t* w,
                                             const float* w_scale, const float* x_static,
                                             const __nv_bfloat16* bias, const int* positions,
                                             const float* rope, Cache* kv, const int* slots, const float* kv_scales,
                                             int kv_block, __nv_bfloat16* out, int num_slots, int layer, float eps,
                                             int H, int KVH, int D, int K) {
  __shared__ uint4 xs[KMAX / VEC];
  const int lane = threadIdx.x % LANES, pair = blockIdx.x * WARPS + threadIdx.x / LANES;
  const int half = D / 2, h = pair / half, j = pair % half;
  const int row[2] = {h * D + j, h * D + j + half};
  const bool is_q = h < H, is_v = h >= H + KVH, owner = lane == 0;
  float rc = 1.0f, rs = 0.0f, b0 = 0.0f, b1 = 0.0f, ws0 = 0.0f, ws1 = 0.0f, kv_scale = 1.0f;
  int slot = 0, pos = 0;
  launch_dependents();
  if (owner) {
    if (bias != nullptr) b0 = bf16(bias + row[0]), b1 = bf16(bias + row[1]);
    ws0 = w_scale[row[0]], ws1 = w_scale[row[1]];
  }
  XRow<KMAX> xr;
  Fp8DotRows<2, UF> dot;
  float scale;
  dot.run(w, row, K, xs, [&] {
    xr.load(x, K);
    if (owner && !is_v) pos = positions[0];
    if (owner && !is_q) slot = slots[0];
    if (owner && !is_q && kv_scales != nullptr)
      kv_scale = kv_scales[(layer * 2 + (is_v ? 1 : 0)) * KVH + (is_v ? h - H - KVH : h - H)];
    scale = xr.template stage<true, NORM_WEIGHT, STATIC>(norm, x_static, xs, K, eps);
    if (owner && !is_v) {
      const float* r = rope + static_cast<size_t>(pos) * D + j;
      rc = r[0];
      rs = r[half];
    }
  });
  if (!owner) return;
  rope_store(dot.acc[0] * scale * ws0 + b0, dot.acc[1] * scale * ws1 + b1, rc, rs, out, kv, kv_scale, 0, h, j,
             slot, num_slots, layer, H, KVH, D, kv_block);
}

}  // namespace

#define KILN_GEMV_FP8_QKV_ROPE(NAME, UF, KMAX, NORM_WEIGHT, STATIC)                                     \
  extern "C" __global__ void __launch_bounds__(WARPS * LANES)                                           \
      NAME(const __nv_bfloat16* x, const __nv_bfloat16* norm, const uint8_t* w, const float* w_scale,   \
           const float* x_static, const __nv_bfloat16* bias, const int* positions, const float* rope,   \
           __nv_bfloat16* kv, const int* slots, __nv_bfloat16* out, int num_slots, int layer, float eps,\
           int H, int KVH, int D, int K) {                                                              \
    fp8_qkv_rope<UF, KMAX, NORM_WEIGHT, STATIC>(x, norm, w, w_scale, x_static, bias, positions, rope, kv,\
                                                slots, nullptr, 0, out, num_slots, layer, eps, H, KVH, D, K);\
  }

// The same with an e4m3 cache (v's blocks of kv_block slots transposed) and its scales.
#define KILN_GEMV_FP8_QKV_ROPE_FP8_KV(NAME, UF, KMAX, NORM_WEIGHT, STATIC)                              \
  extern "C" __global__ void __launch_bounds__(WARPS * LANES)                                           \
      NAME(const __nv_bfloat16* x, const __nv_bfloat16* norm, const uint8_t* w, const float* w_scale,   \
           const float* x_static, const __nv_bfloat16* bias, const int* positions, const float* rope,   \
           uint8_t* kv, const int* slots, const float* kv_scales, int kv_block, __nv_bfloat16* out,     \
           int num_slots, int layer, float eps, int H, int KVH, int D, int K) {                         \
    fp8_qkv_rope<UF, KMAX, NORM_WEIGHT, STATIC>(x, norm, w, w_scale, x_static, bias, positions, rope,   \
                                                reinterpret_cast<__nv_fp8_storage_t*>(kv), slots,       \
                                                kv_scales, kv_block, out, num_slots, layer, eps, H, KVH,\
                                                D, K);                                                  \
  }
