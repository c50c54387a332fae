// Small pieces every kernel of this folder uses: element conversions, fp8 storage, vector loads.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

namespace paged_attention {

constexpr int WARP_SIZE = 32;

// ---- float <-> the three element types a model runs in ----------------------------------------
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// ---- What a cache element holds (vLLM's kv_cache_dtype strings) ---------------------------------
// kAuto: the input's own type, copied bit for bit. The fp8 kinds store one byte per element,
// q = saturate(x / scale) rounded to nearest even, and read back as float(q) * scale.
enum class KvDtype : int { kAuto = 0, kFp8E4M3 = 1, kFp8E5M2 = 2 };

template <typename scalar_t, KvDtype KV> struct CacheElement { using type = uint8_t; };
template <typename scalar_t> struct CacheElement<scalar_t, KvDtype::kAuto> { using type = scalar_t; };

template <typename scalar_t, KvDtype KV>
__device__ __forceinline__ typename CacheElement<scalar_t, KV>::type to_cache(scalar_t v, float scale) {
  if constexpr (KV == KvDtype::kAuto) {
    return v;
  } else {
    // SATFINITE: values beyond the format's largest finite number clamp to it (no inf).
    constexpr __nv_fp8_interpretation_t kind = KV == KvDtype::kFp8E4M3 ? __NV_E4M3 : __NV_E5M2;
    return static_cast<uint8_t>(__nv_cvt_float_to_fp8(to_float(v) / scale, __NV_SATFINITE, kind));
  }
}

// ---- Vector loads -------------------------------------------------------------------------------
// N elements of T read as one 4-, 8- or 16-byte load: the alignment makes the compiler emit a
// single ld.global.v2/v4 instead of N narrow loads. Callers guarantee the address is aligned.
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T e[N];
};

template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_vec(const T* p) {
  return *reinterpret_cast<const Vec<T, N>*>(p);
}

// ---- Reductions ---------------------------------------------------------------------------------
// Sum or max over the lanes of a warp whose index differs only in the bits below `width`:
// width = 32 reduces the whole warp, width = 2 reduces pairs of neighbouring lanes.
template <int width>
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int m = width / 2; m >= 1; m /= 2) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

template <int width>
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int m = width / 2; m >= 1; m /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
}

// Sum or max over a whole thread block of GROUP values at once; every thread gets the results.
// `scratch` holds NUM_WARPS * GROUP floats and may be reused by the next call (the leading
// barrier protects it).
template <int NUM_WARPS, int GROUP, bool IS_MAX>
__device__ __forceinline__ void block_reduce_group(float (&v)[GROUP], float* scratch) {
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
#pragma unroll
  for (int g = 0; g < GROUP; ++g) v[g] = IS_MAX ? warp_max<WARP_SIZE>(v[g]) : warp_sum<WARP_SIZE>(v[g]);
  __syncthreads();                       // the previous user of scratch is done with it
  if (lane == 0) {
#pragma unroll
    for (int g = 0; g < GROUP; ++g) scratch[warp * GROUP + g] = v[g];
  }
  __syncthreads();
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    const float x = lane < NUM_WARPS ? scratch[lane * GROUP + g] : (IS_MAX ? -INFINITY : 0.f);
    v[g] = IS_MAX ? warp_max<WARP_SIZE>(x) : warp_sum<WARP_SIZE>(x);
  }
}

template <int NUM_WARPS, bool IS_MAX>
__device__ __forceinline__ float block_reduce(float v, float* scratch) {
  float one[1] = {v};
  block_reduce_group<NUM_WARPS, 1, IS_MAX>(one, scratch);
  return one[0];
}

}  // namespace paged_attention
