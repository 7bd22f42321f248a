// RoPE (rotate-half convention) and the paged KV-cache write, fused or separate.
#include "common.cuh"

namespace k25::cuda {

namespace {

__device__ __forceinline__ int64_t kv_head_offset(const KVCache& kv, int64_t block, int layer, int which, int head) {
  const int64_t head_elems = static_cast<int64_t>(kv.block_size) * kv.head_dim;
  return ((block * kv.num_layers + layer) * 2 + which) * kv.num_kv_heads * head_elems + head * head_elems;
}

// One pair (i, i + d/2) of one head: x * cos + rotate_half(x) * sin, with cos and sin
// rounded to T and every product and sum rounded to T, as in transformers.
template <typename T>
__device__ __forceinline__ void rotate_pair(float x1, float x2, float c, float s, float* y1, float* y2) {
  c = round_to<T>(c);
  s = round_to<T>(s);
  *y1 = round_to<T>(round_to<T>(x1 * c) + round_to<T>(-x2 * s));
  *y2 = round_to<T>(round_to<T>(x2 * c) + round_to<T>(x1 * s));
}

// grid: rows; block: (num_heads + 2 * num_kv_heads) * head_dim / 2 threads at most,
// looping. mode bit 0: rotate q and k; bit 1: write k and v to the cache.
template <typename T, int kMode>
__global__ void rope_kv_kernel(T* qkv, int64_t row_stride, const int32_t* positions, const int64_t* slots,
                               int num_heads, int num_kv_heads, int head_dim, const float* cos, const float* sin,
                               KVCache kv, int layer) {
  const int64_t t = blockIdx.x;
  T* row = qkv + t * row_stride;
  const int half = head_dim / 2;
  const int pos = positions ? positions[t] : 0;
  const float* c = cos + static_cast<int64_t>(pos) * half;
  const float* s = sin + static_cast<int64_t>(pos) * half;
  const int64_t slot = (kMode & 2) ? slots[t] : 0;
  const int64_t block = slot / (kv.block_size > 0 ? kv.block_size : 1);
  const int off = static_cast<int>(slot - block * (kv.block_size > 0 ? kv.block_size : 1));
  T* cache = static_cast<T*>(kv.data);
  // q and k pairs: rotated in place (q) or into the cache (k, when writing).
  const int pairs = (num_heads + num_kv_heads) * half;
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int head = p / half, i = p % half;
    T* x = row + head * head_dim;
    float y1 = to_f(x[i]), y2 = to_f(x[i + half]);
    if (kMode & 1) rotate_pair<T>(y1, y2, c[i], s[i], &y1, &y2);
    if (head >= num_heads && (kMode & 2)) {
      T* kd = cache + kv_head_offset(kv, block, layer, 0, head - num_heads) + static_cast<int64_t>(off) * head_dim;
      kd[i] = from_f<T>(y1);
      kd[i + half] = from_f<T>(y2);
    } else if (kMode & 1) {
      x[i] = from_f<T>(y1);
      x[i + half] = from_f<T>(y2);
    }
  }
  if (kMode & 2) {
    const T* v = row + (num_heads + num_kv_heads) * head_dim;
    for (int e = threadIdx.x; e < num_kv_heads * head_dim; e += blockDim.x) {
      const int head = e / head_dim, d = e % head_dim;
      cache[kv_head_offset(kv, block, layer, 1, head) + static_cast<int64_t>(off) * head_dim + d] = v[e];
    }
  }
}

template <int kMode>
void launch(DType t, void* qkv, int64_t row_stride, const int32_t* positions, const int64_t* slots, int64_t rows,
            int num_heads, int num_kv_heads, int head_dim, const float* cos, const float* sin, KVCache kv, int layer,
            cudaStream_t stream) {
  if (rows <= 0) return;
  const int threads = 128;
  K25_DISPATCH_DTYPE(t, rope_kv_kernel<T, kMode><<<static_cast<unsigned>(rows), threads, 0, stream>>>(
                            static_cast<T*>(qkv), row_stride, positions, slots, num_heads, num_kv_heads, head_dim,
                            cos, sin, kv, layer));
}

}  // namespace

void rope_write_kv(DType t, void* qkv, int64_t row_stride, const int32_t* positions, const int64_t* slots,
                   int64_t rows, int32_t num_heads, const float* cos, const float* sin, KVCache kv,
                   int32_t layer, cudaStream_t stream) {
  launch<3>(t, qkv, row_stride, positions, slots, rows, num_heads, kv.num_kv_heads, kv.head_dim, cos, sin, kv, layer,
            stream);
}

void rope_inplace(DType t, void* qkv, int64_t row_stride, const int32_t* positions, int64_t rows,
                  int32_t num_heads, int32_t num_kv_heads, int32_t head_dim, const float* cos, const float* sin,
                  cudaStream_t stream) {
  launch<1>(t, qkv, row_stride, positions, nullptr, rows, num_heads, num_kv_heads, head_dim, cos, sin, KVCache{}, 0,
            stream);
}

void write_kv(DType t, const void* qkv, int64_t row_stride, const int64_t* slots, int64_t rows, int32_t num_heads,
              KVCache kv, int32_t layer, cudaStream_t stream) {
  launch<2>(t, const_cast<void*>(qkv), row_stride, nullptr, slots, rows, num_heads, kv.num_kv_heads, kv.head_dim,
            nullptr, nullptr, kv, layer, stream);
}

}  // namespace k25::cuda
