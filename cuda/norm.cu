// RMSNorm, and the residual add fused with it. One CTA per row.
#include "common.cuh"

namespace k25::cuda {

namespace {

constexpr int kThreads = 256;

__device__ float block_sum(float v, float* shared) {
  v = warp_sum(v);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < kThreads / 32 ? shared[lane] : 0.0f;
  v = warp_sum(v);
  __syncthreads();
  return v;
}

// out = w * round_T(x * rsqrt(mean(x^2) + eps)), each product rounded to T, as
// transformers computes it (the norm in float32, then the weight in the model dtype).
template <typename T, bool kAdd>
__global__ void __launch_bounds__(kThreads) rms_norm_kernel(T* x, int64_t x_stride, const T* delta, const T* w,
                                                            T* out, int64_t out_stride, int n, float eps) {
  __shared__ float shared[kThreads / 32];
  T* xr = x + blockIdx.x * x_stride;
  const T* dr = kAdd ? delta + blockIdx.x * static_cast<int64_t>(n) : nullptr;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < n; i += kThreads) {
    float v = to_f(xr[i]);
    if (kAdd) {
      v = round_to<T>(v + to_f(dr[i]));
      xr[i] = from_f<T>(v);
    }
    ss += v * v;
  }
  const float inv = rsqrtf(block_sum(ss, shared) / static_cast<float>(n) + eps);
  T* o = out + blockIdx.x * out_stride;
  for (int i = threadIdx.x; i < n; i += kThreads) {
    o[i] = from_f<T>(to_f(w[i]) * round_to<T>(to_f(xr[i]) * inv));
  }
}

}  // namespace

void rms_norm(DType t, const void* x, int64_t x_stride, const void* w, void* out, int64_t out_stride,
              int64_t rows, int32_t n, float eps, cudaStream_t stream) {
  if (rows <= 0) return;
  K25_DISPATCH_DTYPE(t, rms_norm_kernel<T, false><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
                            static_cast<T*>(const_cast<void*>(x)), x_stride, nullptr, static_cast<const T*>(w),
                            static_cast<T*>(out), out_stride, n, eps));
}

void add_rms_norm(DType t, void* h, const void* delta, const void* w, void* out, int64_t rows, int32_t n,
                  float eps, cudaStream_t stream) {
  if (rows <= 0) return;
  K25_DISPATCH_DTYPE(t, rms_norm_kernel<T, true><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
                            static_cast<T*>(h), n, static_cast<const T*>(delta), static_cast<const T*>(w),
                            static_cast<T*>(out), n, n, eps));
}

}  // namespace k25::cuda
