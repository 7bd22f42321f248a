// Float vectors of the machine's own width for the CPU kernels' hot loops (cpu_kernels.cpp's
// attention, cpu_linear.cpp's few-rows GEMM): vn is 8 floats with AVX2, 16 with AVX-512, 4
// with NEON. GCC keeps a vector wider than the target's registers (vec16.h's v16 on AVX2) in
// memory inside such loops, moving its halves through general registers (5-8 GFLOP/s on an
// AVX2 host), so these loops use vn; lane for lane the arithmetic is the same.
#pragma once

#include <cstdint>
#include <cstring>

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
// Doubles of the same width: kLanes / 2 lanes.
typedef double vnd __attribute__((vector_size(sizeof(vn))));
typedef int64_t vnl __attribute__((vector_size(sizeof(vn))));
constexpr int kLanesD = kLanes / 2;

inline vn loadn(const float* p) { return *reinterpret_cast<const vnu*>(p); }
inline void storen(float* p, vn x) { *reinterpret_cast<vnu*>(p) = x; }

// Max or sum of a float vector's lanes (any width): the upper half folded onto the lower,
// lane for lane, until two lanes are left. The halves are taken by memcpy, which compiles to
// register extracts with constant operands; a shuffle whose mask is filled in a loop was
// built lane by lane at run time and cost about a fifth of the selection's scoring.
template <bool kMax, typename V>
inline float fold_lanes(V v) {
  constexpr int n = static_cast<int>(sizeof(V) / sizeof(float));
  if constexpr (n == 2) {
    return kMax ? (v[0] > v[1] ? v[0] : v[1]) : v[0] + v[1];
  } else {
    typedef float H __attribute__((vector_size(sizeof(V) / 2)));
    H lo, hi;
    std::memcpy(&lo, &v, sizeof(H));
    std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(H), sizeof(H));
    return fold_lanes<kMax>(kMax ? (lo > hi ? lo : hi) : lo + hi);
  }
}

}  // namespace k25::cpu
