// Float vectors of the machine's own width for the CPU kernels' hot loops (cpu_kernels.cpp's
// attention, cpu_linear.cpp's few-rows GEMM): vn is 8 floats with AVX2, 16 with AVX-512, 4
// with NEON. GCC keeps a vector wider than the target's registers (vec16.h's v16 on AVX2) in
// memory inside such loops, moving its halves through general registers (5-8 GFLOP/s on an
// AVX2 host), so these loops use vn; lane for lane the arithmetic is the same.
#pragma once

#include <cstdint>

namespace k25::cpu {

#if defined(__AVX512F__)
typedef float vn __attribute__((vector_size(64)));
#elif defined(__ARM_NEON)
typedef float vn __attribute__((vector_size(16)));
#else
typedef float vn __attribute__((vector_size(32)));
#endif
typedef float vnu __attribute__((vector_size(sizeof(vn)), aligned(4)));  // unaligned access
typedef int32_t vni __attribute__((vector_size(sizeof(vn))));
constexpr int kLanes = static_cast<int>(sizeof(vn) / sizeof(float));

inline vn loadn(const float* p) { return *reinterpret_cast<const vnu*>(p); }
inline void storen(float* p, vn x) { *reinterpret_cast<vnu*>(p) = x; }

// Max or sum of v's lanes: halves folded lane for lane (i with i ^ stride).
template <bool kMax>
inline float fold_lanes(vn v) {
  for (int stride = kLanes / 2; stride > 0; stride /= 2) {
    vni mask;
    for (int i = 0; i < kLanes; ++i) mask[i] = i ^ stride;
    const vn y = __builtin_shuffle(v, mask);
    v = kMax ? (v > y ? v : y) : v + y;
  }
  return v[0];
}

}  // namespace k25::cpu
