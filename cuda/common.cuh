// Element-type helpers shared by the kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "k25_cuda.h"

namespace k25::cuda {

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_f(float x);
template <>
__device__ __forceinline__ float from_f<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Rounds a float to the element type and back: the value PyTorch would hold in T.
template <typename T>
__device__ __forceinline__ float round_to(float x) { return to_f(from_f<T>(x)); }

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Calls f.template operator()<T>() with T matching the runtime dtype.
#define K25_DISPATCH_DTYPE(dtype, ...)                      \
  switch (dtype) {                                          \
    case DType::kF32: { using T = float; __VA_ARGS__; break; }          \
    case DType::kF16: { using T = __half; __VA_ARGS__; break; }         \
    case DType::kBF16: { using T = __nv_bfloat16; __VA_ARGS__; break; } \
  }

}  // namespace k25::cuda
