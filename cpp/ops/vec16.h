// 16-float vectors and a vectorisable exp for the CPU kernels (attention, selection).
//
// GCC vector extensions: one v16 is one AVX-512 register, two AVX2 registers or four NEON
// registers, so the same source serves x86-64 and ARM; nothing here names an instruction.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace k25::cpu {

// exp(x) in float with ~1 ulp error, written so the compiler vectorises loops over it
// (std::exp is not vectorised without -ffast-math). Inputs below -87 flush to 0.
inline float vexp(float x) {
  const float lo = -87.0f, hi = 88.0f;
  const bool under = x < lo;
  x = std::min(std::max(x, lo), hi);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return under ? 0.0f : p * scale;
}

// 16 floats as one vector (GCC/Clang vector extensions: AVX-512, 2x AVX2 or 4x NEON).
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));  // unaligned access

inline v16 load16(const float* p) { return *reinterpret_cast<const v16u*>(p); }

// exp of 16 floats; the same algorithm as vexp.
inline v16 vexp16(v16 x) {
  const v16 lo = v16{} - 87.0f, hi = v16{} + 88.0f;
  const auto under = x < lo;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  // Round to nearest by the 1.5 * 2^23 trick (|x * log2 e| < 2^22 here).
  const v16 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  v16 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  v16 p = v16{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const v16i e = (__builtin_convertvector(n, v16i) + 127) << 23;
  const v16 out = p * (v16)e;  // same-size vector cast: reinterprets the bits
  return under ? v16{} : out;
}

// Horizontal max and sum as log-depth shuffle trees (a scalar loop costs ~4x more).
inline float hmax16(v16 x) {
  const v16i s8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
  const v16i s4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
  const v16i s2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
  const v16i s1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
  v16 y = __builtin_shuffle(x, s8);
  x = x > y ? x : y;
  y = __builtin_shuffle(x, s4);
  x = x > y ? x : y;
  y = __builtin_shuffle(x, s2);
  x = x > y ? x : y;
  y = __builtin_shuffle(x, s1);
  x = x > y ? x : y;
  return x[0];
}

inline float hsum16(v16 x) {
  const v16i s8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
  const v16i s4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
  const v16i s2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
  const v16i s1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
  x += __builtin_shuffle(x, s8);
  x += __builtin_shuffle(x, s4);
  x += __builtin_shuffle(x, s2);
  x += __builtin_shuffle(x, s1);
  return x[0];
}

}  // namespace k25::cpu
