// Linear layers of a batch-1 decode step: y = x W^T (+ b), x [M][K], W [N][K] row-major
// (torch's Linear weight), M <= kGemvMaxRows (the kernel takes any M; one is built), 2-byte
// types. Launched with programmatic dependent launch, so W's first loads and the launch
// itself overlap the kernel before (cuBLAS's kernels do not chain that way).
//
// Such a product reads W once and does almost no arithmetic per byte, so it runs at the
// speed W streams in. A CTA of 256 threads takes 256 / kTPR output features; the kTPR
// threads of a feature split its row into 16-byte chunks and issue all their loads (up to
// kLoads each, then the next batch) before any arithmetic, so each thread has ~128 bytes
// in flight; W bypasses L1 (read once), x is read through L1 (every CTA reads it). Sums
// are float32 (a chunk's eight products in order, then chunks, then a warp and a CTA
// reduction), and y is rounded to T once, as cuBLAS's bf16 GEMM rounds its float result.
#include <cstdint>
#include <cstdlib>

#include "common.cuh"

namespace k25::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kLoads = 8;  // 16-byte loads of W in flight per thread
constexpr int kElems = 8;  // 2-byte elements per 16-byte chunk

__device__ __forceinline__ uint4 load_streaming(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

template <typename T>
__device__ __forceinline__ float dot8(const uint4& a, const uint4& b, float acc) {
  const T* ae = reinterpret_cast<const T*>(&a);
  const T* be = reinterpret_cast<const T*>(&b);
#pragma unroll
  for (int e = 0; e < kElems; ++e) acc = fmaf(to_f(ae[e]), to_f(be[e]), acc);
  return acc;
}

template <typename T, int M, int kTPR>
__global__ void __launch_bounds__(kThreads) gemv_kernel(const T* __restrict__ x, int64_t x_stride,
                                                        const T* __restrict__ w, const T* __restrict__ bias,
                                                        T* __restrict__ y, int64_t y_stride, int N, int K) {
  constexpr int kRows = kThreads / kTPR;       // output features per CTA
  constexpr int kWarpsPerRow = kTPR / 32;
  __shared__ float part[kThreads / 32][M];
  const int t = threadIdx.x % kTPR;
  const int r = threadIdx.x / kTPR;
  const int n = blockIdx.x * kRows + r;
  const int chunks = K / kElems;
  float acc[M];
#pragma unroll
  for (int m = 0; m < M; ++m) acc[m] = 0.0f;
  const uint4* wr = reinterpret_cast<const uint4*>(w + static_cast<int64_t>(n < N ? n : 0) * K);
  uint4 wv[kLoads];
  auto load_w = [&](int c0) {
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int c = c0 + i * kTPR;
      wv[i] = c < chunks && n < N ? load_streaming(wr + c) : make_uint4(0, 0, 0, 0);
    }
  };
  // The first batch of W is in flight before the previous kernel (which writes x) ends.
  load_w(t);
  pdl_wait();
  pdl_trigger();
  if (n < N) {
    for (int c0 = t; c0 < chunks; c0 += kTPR * kLoads) {
      if (c0 != t) load_w(c0);
#pragma unroll
      for (int i = 0; i < kLoads; ++i) {
        const int c = c0 + i * kTPR;
        if (c < chunks) {
#pragma unroll
          for (int m = 0; m < M; ++m) {
            const uint4 xv = __ldg(reinterpret_cast<const uint4*>(x + m * x_stride) + c);
            acc[m] = dot8<T>(wv[i], xv, acc[m]);
          }
        }
      }
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m) acc[m] = warp_sum(acc[m]);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (kWarpsPerRow == 1) {
    if (lane == 0 && n < N) {
      const float b = bias ? to_f(bias[n]) : 0.0f;
#pragma unroll
      for (int m = 0; m < M; ++m) y[m * y_stride + n] = from_f<T>(acc[m] + b);
    }
    return;
  }
  if (lane == 0) {
#pragma unroll
    for (int m = 0; m < M; ++m) part[warp][m] = acc[m];
  }
  __syncthreads();
  if (t < M && n < N) {
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < kWarpsPerRow; ++j) s += part[r * kWarpsPerRow + j][t];
    y[t * y_stride + n] = from_f<T>(s + (bias ? to_f(bias[n]) : 0.0f));
  }
}

// Threads per output feature: the fewest (a warp at least, a CTA at most) that cover a row
// with kLoads / 2 loads each (measured on the H200 for the 8B shape at one row: 128
// threads for K = 4096 and 256 for 14336 were the fastest of 32-256); K25_GEMV_TPR (32, 64, 128 or 256) overrides it for
// sweeps (read at every call).
int threads_per_row(int K) {
  if (const char* e = std::getenv("K25_GEMV_TPR")) {
    const int v = std::atoi(e);
    if (v == 32 || v == 64 || v == 128 || v == 256) return v;
  }
  const int chunks = K / kElems;
  int tpr = 32;
  while (tpr < kThreads && tpr * (kLoads / 2) < chunks) tpr *= 2;
  return tpr;
}

template <typename T, int M>
void launch_m(const T* x, int64_t x_stride, const T* w, const T* bias, T* y, int64_t y_stride, int N, int K,
              cudaStream_t stream) {
  const int tpr = threads_per_row(K);
  const unsigned grid = static_cast<unsigned>((N + kThreads / tpr - 1) / (kThreads / tpr));
  switch (tpr) {
    case 32: return launch_pdl(gemv_kernel<T, M, 32>, grid, kThreads, 0, stream, x, x_stride, w, bias, y, y_stride, N, K);
    case 64: return launch_pdl(gemv_kernel<T, M, 64>, grid, kThreads, 0, stream, x, x_stride, w, bias, y, y_stride, N, K);
    case 128: return launch_pdl(gemv_kernel<T, M, 128>, grid, kThreads, 0, stream, x, x_stride, w, bias, y, y_stride, N, K);
    default: return launch_pdl(gemv_kernel<T, M, 256>, grid, kThreads, 0, stream, x, x_stride, w, bias, y, y_stride, N, K);
  }
}

template <typename T>
void launch(const T* x, int64_t x_stride, const T* w, const T* bias, T* y, int64_t y_stride, int M, int N, int K,
            cudaStream_t stream) {
  static_assert(kGemvMaxRows == 1, "one instance per row count");
  (void)M;
  launch_m<T, 1>(x, x_stride, w, bias, y, y_stride, N, K, stream);
}

}  // namespace

void gemv(DType t, const void* x, int64_t x_stride, const void* w, const void* bias, void* y, int64_t y_stride,
          int32_t M, int32_t N, int32_t K, cudaStream_t stream) {
  if (M <= 0 || N <= 0) return;
  switch (t) {
    case DType::kF16:
      return launch(static_cast<const __half*>(x), x_stride, static_cast<const __half*>(w),
                    static_cast<const __half*>(bias), static_cast<__half*>(y), y_stride, M, N, K, stream);
    case DType::kBF16:
      return launch(static_cast<const __nv_bfloat16*>(x), x_stride, static_cast<const __nv_bfloat16*>(w),
                    static_cast<const __nv_bfloat16*>(bias), static_cast<__nv_bfloat16*>(y), y_stride, M, N, K,
                    stream);
    default: return;  // float32 goes to cuBLAS (gemv_supported says so)
  }
}

}  // namespace k25::cuda
