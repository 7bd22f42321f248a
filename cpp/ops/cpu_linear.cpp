// y = x w^T (+ b) for a few rows of x: the CPU decode step's linear layers.
//
// BLAS is built for large products: for 1-8 rows of the default model's shapes MKL's sgemm
// ran at 5-14 GFLOP/s on one thread of an AVX2 host, its time growing with the rows even
// where reading the weight once is the bound (bench/cpu_linear.py). Here each weight row is
// read once, as it lies ([N][K], K contiguous), with a software prefetch a page ahead, and
// serves every row of x: a register tile of up to kRows rows of x times kCols weight rows,
// each output a vector of partial sums over k (one lane per k mod kLanes) folded at the end.
// An output's arithmetic is the same whatever the number of rows and wherever its row and
// column fall in the tiles, so a row's result does not depend on the batch it is in.
#include <algorithm>
#include <cstdint>
#if defined(__x86_64__)
#include <immintrin.h>
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif

#include "ops/cpu_kernels.h"
#include "ops/vecn.h"

// Contraction is off in this file: GCC fused `acc + x * w` into one FMA in some of tile's
// instantiations and not in others (seen on Zen 3 with -march=native), so an output's bits
// depended on how many rows its tile had. The accumulation's FMA is explicit (fma_n) instead.
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace k25::cpu {

namespace {

// c + a * b with one rounding where the target has a fused multiply-add, two otherwise; the
// same instruction in every instantiation either way.
inline vn fma_n(vn a, vn b, vn c) {
#if defined(__AVX512F__)
  return reinterpret_cast<vn>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b),
                                              reinterpret_cast<__m512>(c)));
#elif defined(__FMA__) && defined(__AVX__)
  return reinterpret_cast<vn>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b),
                                              reinterpret_cast<__m256>(c)));
#elif defined(__ARM_NEON)
  return reinterpret_cast<vn>(vfmaq_f32(reinterpret_cast<float32x4_t>(c), reinterpret_cast<float32x4_t>(a),
                                        reinterpret_cast<float32x4_t>(b)));
#else
  return a * b + c;
#endif
}

constexpr int kRows = 4;  // rows of x in a register tile
constexpr int kCols = 2;  // weight rows in a register tile (8 accumulators, 6 loads a step)
// Weight prefetch distance in floats: 4 KB ahead of the loads (1-4 rows: ~1.6-2.9x the
// bandwidth without it on an AVX2 host; 8 KB and more ahead lose it again).
constexpr int64_t kPrefetch = 1024;

// Keeps v in a vector register: GCC would otherwise fold its load into each FMA that uses it
// (a load per use; a 256-bit load is two uops on Zen 1).
inline void in_register(vn& v) {
#if defined(__x86_64__)
  asm("" : "+x"(v));
#elif defined(__aarch64__)
  asm("" : "+w"(v));
#else
  (void)v;
#endif
}

// Outputs of rows [0, R) of x and weight rows [n, n + C).
template <int R, int C>
inline void tile(const float* x, int64_t x_stride, const float* w, const float* b, float* y, int64_t y_stride,
                 int64_t n, int64_t K) {
  vn acc[R][C];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) acc[r][c] = vn{};
  }
  const float* wr[C];
  for (int c = 0; c < C; ++c) wr[c] = w + (n + c) * K;
  const int64_t kv = K / kLanes * kLanes;
  for (int64_t k = 0; k < kv; k += kLanes) {
    vn wv[C];
    for (int c = 0; c < C; ++c) {
      wv[c] = loadn(wr[c] + k);
      __builtin_prefetch(wr[c] + k + kPrefetch);
    }
    for (int r = 0; r < R; ++r) {
      vn xv = loadn(x + r * x_stride + k);
      in_register(xv);
      for (int c = 0; c < C; ++c) acc[r][c] = fma_n(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      float s = fold_lanes<false>(acc[r][c]);
      for (int64_t k = kv; k < K; ++k) s += x[r * x_stride + k] * wr[c][k];
      y[r * y_stride + n + c] = b ? s + b[n + c] : s;
    }
  }
}

// Weight rows [n, n + C) against every row of x, kRows rows at a time: the weight rows are
// read from memory once and stay in L1 for the later row tiles.
template <int C>
void cols_tile(const float* x, int64_t x_stride, const float* w, const float* b, float* y, int64_t y_stride,
               int64_t M, int64_t n, int64_t K) {
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) tile<kRows, C>(x + m * x_stride, x_stride, w, b, y + m * y_stride, y_stride, n, K);
  const float* xm = x + m * x_stride;
  float* ym = y + m * y_stride;
  switch (M - m) {
    case 1: tile<1, C>(xm, x_stride, w, b, ym, y_stride, n, K); break;
    case 2: tile<2, C>(xm, x_stride, w, b, ym, y_stride, n, K); break;
    case 3: tile<3, C>(xm, x_stride, w, b, ym, y_stride, n, K); break;
    default: break;
  }
}

}  // namespace

void linear_few_rows(const float* x, int64_t x_stride, const float* w, const float* b, float* y,
                     int64_t y_stride, int64_t M, int64_t n0, int64_t n1, int64_t K) {
  int64_t n = n0;
  for (; n + kCols <= n1; n += kCols) cols_tile<kCols>(x, x_stride, w, b, y, y_stride, M, n, K);
  for (; n < n1; ++n) cols_tile<1>(x, x_stride, w, b, y, y_stride, M, n, K);
}

}  // namespace k25::cpu
