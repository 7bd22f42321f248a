// Float vectors of the machine's own width for the CPU kernels' hot loops (cpu_kernels.cpp's
// attention, cpu_linear.cpp's few-rows GEMM): vn is 8 floats with AVX2, 16 with AVX-512, 4
// with NEON. GCC keeps a vector wider than the target's registers (vec16.h's v16 on AVX2) in
// memory inside such loops, moving its halves through general registers (5-8 GFLOP/s on an
// AVX2 host), so these loops use vn; lane for lane the arithmetic is the same.
#pragma once

#include <cstdint>
#include <cstring>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif

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

// bfloat16 KV (kv_layout.h KVElem::kBF16) as 16-bit words: a float's upper half. A vector of
// them widens by a zero extension and a shift (exact), so kernels templated on the element
// type read either pool with loadn and as_float.
typedef uint16_t vnh __attribute__((vector_size(sizeof(vn) / 2), aligned(2)));
typedef uint32_t vnw32 __attribute__((vector_size(sizeof(vn))));
inline vn loadn(const uint16_t* p) {
  // One widening load and a shift: GCC's generic conversion of the 16-bit vector takes the
  // halves apart (two narrow widenings, a byte shift and an insert on AVX2).
#if defined(__AVX512F__)
  return reinterpret_cast<vn>(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
#elif defined(__AVX2__)
  return reinterpret_cast<vn>(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
#elif defined(__ARM_NEON)
  const uint32x4_t w = vshll_n_u16(vld1_u16(p), 16);
  vn f;
  std::memcpy(&f, &w, sizeof(f));  // NEON and GCC vector types convert only through memory rules
  return f;
#else
  vnh h;
  std::memcpy(&h, p, sizeof(h));
  const vnw32 w = __builtin_convertvector(h, vnw32) << 16;
  vn f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
#endif
}
inline float as_float(float x) { return x; }
inline float as_float(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &w, 4);
  return f;
}
// Round to nearest-even, as torch's float -> bfloat16 (every NaN becomes its one quiet NaN).
inline uint16_t to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline void store_elem(float* p, float x) { *p = x; }
inline void store_elem(uint16_t* p, float x) { *p = to_bf16(x); }

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
