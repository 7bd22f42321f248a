// RMSNorm, and the residual add fused with it. One CTA per row.
#include <cstdint>

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
  pdl_wait();
  pdl_trigger();
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

// The same with 16-byte loads and the row held in registers: one read of x (and delta),
// one write of out (and h). A row of the scalar kernel is a chain of dependent 2-byte
// loads, so a decode step's norms (one row each) were latency-bound at ~14 us.
template <typename T, bool kAdd, int kVecs>
__global__ void __launch_bounds__(kThreads) rms_norm_vec_kernel(T* x, int64_t x_stride, const T* delta, const T* w,
                                                                T* out, int64_t out_stride, int n, float eps) {
  constexpr int kElems = 16 / sizeof(T);
  __shared__ float shared[kThreads / 32];
  // The weight's loads are issued first: before the previous kernel (which writes x) has
  // ended, and their latency overlaps the reduction (a decode step's rows are latency-bound).
  uint4 wv[kVecs];
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    const int idx = (threadIdx.x + k * kThreads) * kElems;
    if (idx < n) wv[k] = *reinterpret_cast<const uint4*>(w + idx);
  }
  pdl_wait();
  pdl_trigger();
  T* xr = x + blockIdx.x * x_stride;
  const T* dr = kAdd ? delta + blockIdx.x * static_cast<int64_t>(n) : nullptr;
  float v[kVecs][kElems];
  float ss = 0.0f;
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    const int idx = (threadIdx.x + k * kThreads) * kElems;
    if (idx >= n) continue;
    uint4 xv = *reinterpret_cast<const uint4*>(xr + idx);
    const T* xe = reinterpret_cast<const T*>(&xv);
    uint4 dv;
    if (kAdd) dv = *reinterpret_cast<const uint4*>(dr + idx);
    const T* de = reinterpret_cast<const T*>(&dv);
#pragma unroll
    for (int e = 0; e < kElems; ++e) {
      float f = to_f(xe[e]);
      if (kAdd) f = round_to<T>(f + to_f(de[e]));
      v[k][e] = f;
      ss += f * f;
    }
    if (kAdd) {
      uint4 hv;
      T* he = reinterpret_cast<T*>(&hv);
#pragma unroll
      for (int e = 0; e < kElems; ++e) he[e] = from_f<T>(v[k][e]);
      *reinterpret_cast<uint4*>(xr + idx) = hv;
    }
  }
  const float inv = rsqrtf(block_sum(ss, shared) / static_cast<float>(n) + eps);
  T* o = out + blockIdx.x * out_stride;
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    const int idx = (threadIdx.x + k * kThreads) * kElems;
    if (idx >= n) continue;
    const T* we = reinterpret_cast<const T*>(&wv[k]);
    uint4 ov;
    T* oe = reinterpret_cast<T*>(&ov);
#pragma unroll
    for (int e = 0; e < kElems; ++e) oe[e] = from_f<T>(to_f(we[e]) * round_to<T>(v[k][e] * inv));
    *reinterpret_cast<uint4*>(o + idx) = ov;
  }
}

template <typename T, bool kAdd>
void launch_norm(T* x, int64_t x_stride, const T* delta, const T* w, T* out, int64_t out_stride, int64_t rows, int n,
                 float eps, cudaStream_t stream) {
  constexpr int kElems = 16 / sizeof(T);
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool vec_ok = n % kElems == 0 && x_stride % kElems == 0 && out_stride % kElems == 0 && aligned(x) &&
                      aligned(w) && aligned(out) && (!kAdd || aligned(delta));
  const int vecs = (n + kThreads * kElems - 1) / (kThreads * kElems);
  const unsigned grid = static_cast<unsigned>(rows);
  if (vec_ok && vecs <= 8) {
    switch (vecs) {
      case 1: return launch_pdl(rms_norm_vec_kernel<T, kAdd, 1>, grid, kThreads, 0, stream, x, x_stride, delta, w, out, out_stride, n, eps);
      case 2: return launch_pdl(rms_norm_vec_kernel<T, kAdd, 2>, grid, kThreads, 0, stream, x, x_stride, delta, w, out, out_stride, n, eps);
      case 3:
      case 4: return launch_pdl(rms_norm_vec_kernel<T, kAdd, 4>, grid, kThreads, 0, stream, x, x_stride, delta, w, out, out_stride, n, eps);
      default: return launch_pdl(rms_norm_vec_kernel<T, kAdd, 8>, grid, kThreads, 0, stream, x, x_stride, delta, w, out, out_stride, n, eps);
    }
  }
  launch_pdl(rms_norm_kernel<T, kAdd>, grid, kThreads, 0, stream, x, x_stride, delta, w, out, out_stride, n, eps);
}

}  // namespace

void rms_norm(DType t, const void* x, int64_t x_stride, const void* w, void* out, int64_t out_stride,
              int64_t rows, int32_t n, float eps, cudaStream_t stream) {
  if (rows <= 0) return;
  K25_DISPATCH_DTYPE(t, launch_norm<T, false>(static_cast<T*>(const_cast<void*>(x)), x_stride, nullptr,
                                              static_cast<const T*>(w), static_cast<T*>(out), out_stride, rows, n, eps,
                                              stream));
}

void add_rms_norm(DType t, void* h, const void* delta, const void* w, void* out, int64_t rows, int32_t n,
                  float eps, cudaStream_t stream) {
  if (rows <= 0) return;
  K25_DISPATCH_DTYPE(t, launch_norm<T, true>(static_cast<T*>(h), n, static_cast<const T*>(delta),
                                             static_cast<const T*>(w), static_cast<T*>(out), n, rows, n, eps, stream));
}

}  // namespace k25::cuda
