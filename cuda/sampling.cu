// Device-side pieces of sampling: greedy argmax per row.
#include <cfloat>

#include "common.cuh"

namespace k25::cuda {

namespace {

// Butterfly over the warp: every lane ends with the best (value, index); lowest index on ties.
__device__ __forceinline__ void warp_argmax(float& best, int& idx) {
  for (int o = 16; o > 0; o >>= 1) {
    const float ob = __shfl_xor_sync(0xffffffffu, best, o);
    const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
    if (ob > best || (ob == best && oi < idx)) {
      best = ob;
      idx = oi;
    }
  }
}

__global__ void argmax_kernel(const float* x, int n, int32_t* out) {
  const float* row = x + static_cast<int64_t>(blockIdx.x) * n;
  float best = -FLT_MAX;
  int idx = INT_MAX;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = row[i];
    if (v > best || (v == best && i < idx)) {
      best = v;
      idx = i;
    }
  }
  __shared__ float sb[32];
  __shared__ int si[32];
  warp_argmax(best, idx);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) {
    sb[warp] = best;
    si[warp] = idx;
  }
  __syncthreads();
  if (warp == 0) {
    const int warps = blockDim.x / 32;
    best = lane < warps ? sb[lane] : -FLT_MAX;
    idx = lane < warps ? si[lane] : INT_MAX;
    warp_argmax(best, idx);
    if (lane == 0) out[blockIdx.x] = idx;
  }
}

}  // namespace

void argmax_rows(const float* x, int64_t rows, int32_t n, int32_t* out, cudaStream_t stream) {
  if (rows <= 0) return;
  argmax_kernel<<<static_cast<unsigned>(rows), 1024, 0, stream>>>(x, n, out);
}

}  // namespace k25::cuda
