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

// grid: (rows, heads), one CTA per (token, head) so that a decode step (one row) still
// spreads over ~50 SMs instead of looping 20 times on one (9.2 us -> latency of one pass);
// block: head_dim / 2 threads, one (i, i + d/2) pair each. blockIdx.y counts the q heads,
// then the k heads, then the v heads; in mode 2 (cache write only) it starts at the k
// heads. mode bit 0: rotate q and k; bit 1: write k and v to the cache.
template <typename T, int kMode>
__global__ void rope_kv_kernel(T* qkv, int64_t row_stride, const int32_t* positions, const int64_t* slots,
                               int num_heads, int num_kv_heads, int head_dim, const float* cos, const float* sin,
                               KVCache kv, int layer) {
  pdl_wait();
  pdl_trigger();
  const int64_t t = blockIdx.x;
  const int head = static_cast<int>(blockIdx.y) + ((kMode & 1) ? 0 : num_heads);
  const int half = head_dim / 2;
  const int i = threadIdx.x;
  T* x = qkv + t * row_stride + static_cast<int64_t>(head) * head_dim;
  const bool is_v = head >= num_heads + num_kv_heads;
  if (!is_v) {
    float y1 = to_f(x[i]), y2 = to_f(x[i + half]);
    if (kMode & 1) {
      const int64_t pos = positions[t];
      rotate_pair<T>(y1, y2, cos[pos * half + i], sin[pos * half + i], &y1, &y2);
    }
    if (head < num_heads || !(kMode & 2)) {
      x[i] = from_f<T>(y1);
      x[i + half] = from_f<T>(y2);
      return;
    }
    const int64_t slot = slots[t];
    const int64_t block = slot / kv.block_size;
    T* kd = static_cast<T*>(kv.data) + kv_head_offset(kv, block, layer, 0, head - num_heads) +
            (slot - block * kv.block_size) * head_dim;
    kd[i] = from_f<T>(y1);
    kd[i + half] = from_f<T>(y2);
    return;
  }
  const int64_t slot = slots[t];
  const int64_t block = slot / kv.block_size;
  T* vd = static_cast<T*>(kv.data) + kv_head_offset(kv, block, layer, 1, head - num_heads - num_kv_heads) +
          (slot - block * kv.block_size) * head_dim;
  vd[i] = x[i];
  vd[i + half] = x[i + half];
}

template <int kMode>
void launch(DType t, void* qkv, int64_t row_stride, const int32_t* positions, const int64_t* slots, int64_t rows,
            int num_heads, int num_kv_heads, int head_dim, const float* cos, const float* sin, KVCache kv, int layer,
            cudaStream_t stream) {
  if (rows <= 0) return;
  const int heads = kMode == 3 ? num_heads + 2 * num_kv_heads : kMode == 1 ? num_heads + num_kv_heads : 2 * num_kv_heads;
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(heads));
  K25_DISPATCH_DTYPE(t, launch_pdl(rope_kv_kernel<T, kMode>, grid, head_dim / 2, 0, stream, static_cast<T*>(qkv),
                                   row_stride, positions, slots, num_heads, num_kv_heads, head_dim, cos, sin, kv,
                                   layer));
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
