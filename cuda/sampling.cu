// Device-side pieces of sampling: greedy argmax per row, and the hand-off of sampled ids
// from one decode step to the next without a trip through the host.
#include <cfloat>

#include "common.cuh"

namespace k25::cuda {

namespace {

// A value and its index packed so that unsigned order is "larger value, then lower index":
// the float's bits mapped to an order-preserving unsigned key in the high word, the
// index's complement in the low word. 0 means "nothing seen" (NaN is skipped, as the
// comparison-based scan skipped it).
__device__ __forceinline__ unsigned long long pack_best(float v, int i) {
  const unsigned b = __float_as_uint(__fadd_rn(v, 0.0f));  // -0 -> +0: equal values tie on the index
  const unsigned key = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  return (static_cast<unsigned long long>(key) << 32) | (0xFFFFFFFFu - static_cast<unsigned>(i));
}

__device__ __forceinline__ unsigned long long block_max(unsigned long long v) {
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  __shared__ unsigned long long s[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) s[warp] = v;
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x / 32) ? s[lane] : 0ull;
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Pass 1, grid (chunks, rows): the best of one chunk of a row. A 128K-vocab row split over
// 64 CTAs reads at full bandwidth instead of through one SM (29 us -> a few).
__global__ void argmax_chunk_kernel(const float* x, int n, int chunk, unsigned long long* part) {
  const float* row = x + static_cast<int64_t>(blockIdx.y) * n;
  const int begin = blockIdx.x * chunk, end = min(n, begin + chunk);
  unsigned long long best = 0;
  for (int i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const float v = row[i];
    if (v == v) best = max(best, pack_best(v, i));
  }
  best = block_max(best);
  if (threadIdx.x == 0) part[static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x] = best;
}

// Pass 2, one warp per row: the best of the chunks' bests.
__global__ void argmax_final_kernel(const unsigned long long* part, int chunks, int32_t* out) {
  unsigned long long best = 0;
  for (int c = threadIdx.x; c < chunks; c += 32) best = max(best, part[static_cast<int64_t>(blockIdx.x) * chunks + c]);
  for (int o = 16; o > 0; o >>= 1) best = max(best, __shfl_xor_sync(0xffffffffu, best, o));
  if (threadIdx.x == 0) out[blockIdx.x] = best ? static_cast<int32_t>(0xFFFFFFFFu - static_cast<unsigned>(best)) : INT_MAX;
}

// ids[r] = last[prev[r]] where prev[r] >= 0 (the id sampled for that row of the previous
// step); other rows keep the id the host wrote. An id outside the vocabulary (argmax of a
// row without a finite logit) becomes 0: that sequence fails when its result is collected,
// and this step's row for it is discarded, but the embedding lookup must stay in bounds.
__global__ void take_previous_ids_kernel(int32_t* ids, const int32_t* prev, const int32_t* last, int n, int vocab) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r < n && prev[r] >= 0) {
    const int32_t v = last[prev[r]];
    ids[r] = v >= 0 && v < vocab ? v : 0;
  }
}

}  // namespace

void take_previous_ids(int32_t* ids, const int32_t* prev_rows, const int32_t* last_ids, int32_t n, int32_t vocab,
                       cudaStream_t stream) {
  if (n <= 0) return;
  take_previous_ids_kernel<<<(n + 127) / 128, 128, 0, stream>>>(ids, prev_rows, last_ids, n, vocab);
}

int32_t argmax_chunks(int32_t n) { return n >= 4096 ? min(64, n / 2048) : 1; }

void argmax_rows(const float* x, int64_t rows, int32_t n, int32_t* out, void* scratch, cudaStream_t stream) {
  if (rows <= 0) return;
  const int chunks = argmax_chunks(n);
  const int chunk = (n + chunks - 1) / chunks;
  auto* part = static_cast<unsigned long long*>(scratch);
  argmax_chunk_kernel<<<dim3(chunks, static_cast<unsigned>(rows)), 256, 0, stream>>>(x, n, chunk, part);
  argmax_final_kernel<<<static_cast<unsigned>(rows), 32, 0, stream>>>(part, chunks, out);
}

}  // namespace k25::cuda
