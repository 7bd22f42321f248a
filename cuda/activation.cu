// SiLU(gate) * up, with gate and up side by side in each row.
#include "common.cuh"

namespace k25::cuda {

namespace {

template <typename T>
__global__ void silu_mul_kernel(const T* gu, T* out, int64_t rows, int n) {
  pdl_wait();
  pdl_trigger();
  const int64_t total = rows * n;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / n, c = i % n;
    const float g = to_f(gu[r * 2 * n + c]);
    const float u = to_f(gu[r * 2 * n + n + c]);
    // transformers: silu(gate) in T, then times up in T.
    out[i] = from_f<T>(round_to<T>(g / (1.0f + __expf(-g))) * u);
  }
}

}  // namespace

void silu_mul(DType t, const void* gu, void* out, int64_t rows, int32_t n, cudaStream_t stream) {
  const int64_t total = rows * n;
  if (total <= 0) return;
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>((total + threads - 1) / threads, 65536));
  K25_DISPATCH_DTYPE(t, launch_pdl(silu_mul_kernel<T>, blocks, threads, 0, stream, static_cast<const T*>(gu),
                                   static_cast<T*>(out), rows, n));
}

}  // namespace k25::cuda
