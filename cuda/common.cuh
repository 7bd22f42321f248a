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

template <typename T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() { return DType::kF32; }
template <>
constexpr DType dtype_of<__half>() { return DType::kF16; }
template <>
constexpr DType dtype_of<__nv_bfloat16>() { return DType::kBF16; }

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

// Split count actually used for a derived decode of `span` keys: enough ranges of at least
// kMinSplitKeys keys, at most decode_splits (short contexts use few CTAs, long ones many).
__device__ __forceinline__ int derived_splits(int span, int decode_splits) {
  return max(1, min(decode_splits, (span + kMinSplitKeys - 1) / kMinSplitKeys));
}

// Work item `item` of a batch: from the list, or for a decode-only batch with device-derived
// splits, (sequence, KV head, split) from the index and the key range from context_lens.
// partial == kNoWork: an unused split of a short context (the CTA has nothing to do).
constexpr int kNoWork = -2;
__device__ __forceinline__ AttnWork attn_work(const AttnBatch& batch, int num_kv_heads, int window, int item) {
  if (batch.decode_splits <= 0) return batch.work[item];
  AttnWork w;
  const int S_max = batch.decode_splits;
  const int per_seq = num_kv_heads * S_max;
  w.seq = item / per_seq;
  w.kv_head = (item % per_seq) / S_max;
  const int split = item % S_max;
  const int ctx = batch.context_lens[w.seq];
  const int first = window > 0 ? max(0, ctx - window) : 0;
  const int64_t span = ctx - first;
  const int S = derived_splits(static_cast<int>(span), S_max);
  w.q_begin = 0;
  w.q_end = 1;
  w.key_begin = first + static_cast<int>(span * min(split, S) / S);
  w.key_end = first + static_cast<int>(span * min(split + 1, S) / S);
  w.partial = split >= S ? kNoWork : (S > 1 ? item : -1);
  return w;
}

// Calls f.template operator()<T>() with T matching the runtime dtype.
#define K25_DISPATCH_DTYPE(dtype, ...)                      \
  switch (dtype) {                                          \
    case DType::kF32: { using T = float; __VA_ARGS__; break; }          \
    case DType::kF16: { using T = __half; __VA_ARGS__; break; }         \
    case DType::kBF16: { using T = __nv_bfloat16; __VA_ARGS__; break; } \
  }

}  // namespace k25::cuda
