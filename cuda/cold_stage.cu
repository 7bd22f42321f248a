// Cold blocks gathered a layer ahead (docs/offload.md "Cold blocks on CUDA"): one layer's K
// and V of each of a step's cold blocks, copied from the L2 pool (pinned host memory mapped
// into the device's address space) into a device buffer, on a stream beside the layers.
#include "common.cuh"

namespace k25::cuda {

namespace {

constexpr int kGatherThreads = 256;
constexpr int kGatherCtas = 32;  // 32 x 256 threads x 4 loads of 16 B: 512 KB in flight over the bus
constexpr int kGatherUnroll = 4;

// slots[0]: the entry count (clamped to capacity); slots[1 + j]: entry j's L2 slot. Entry j's
// slice (slice_vecs 16-byte words at `offset` in its slot) goes to dst + j * slice_vecs.
__global__ void gather_cold_layer_kernel(uint4* __restrict__ dst, const uint8_t* __restrict__ l2, int64_t slot_bytes,
                                         int64_t offset, int64_t slice_vecs, const int32_t* __restrict__ slots,
                                         int32_t capacity) {
  const int32_t count = min(slots[0], capacity);
  const int64_t total = static_cast<int64_t>(count) * slice_vecs;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; base < total;
       base += step * kGatherUnroll) {
    uint4 v[kGatherUnroll];
    // Every load first, then the stores: the bus's latency is paid once per round.
#pragma unroll
    for (int u = 0; u < kGatherUnroll; ++u) {
      const int64_t i = base + u * step;
      if (i < total) {
        const int64_t j = i / slice_vecs;
        const uint4* src = reinterpret_cast<const uint4*>(l2 + slots[1 + j] * slot_bytes + offset);
        v[u] = src[i - j * slice_vecs];
      }
    }
#pragma unroll
    for (int u = 0; u < kGatherUnroll; ++u) {
      const int64_t i = base + u * step;
      if (i < total) dst[i] = v[u];
    }
  }
}

}  // namespace

void gather_cold_layer(void* dst, const void* l2, int64_t slot_bytes, int64_t offset, int64_t slice_bytes,
                       const int32_t* slots, int32_t capacity, cudaStream_t stream) {
  gather_cold_layer_kernel<<<kGatherCtas, kGatherThreads, 0, stream>>>(
      static_cast<uint4*>(dst), static_cast<const uint8_t*>(l2), slot_bytes, offset, slice_bytes / 16, slots, capacity);
}

}  // namespace k25::cuda
