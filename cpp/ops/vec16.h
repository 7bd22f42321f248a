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

// exp of a float vector of any width V (VI: the int32 vector of the same width); the same
// algorithm as vexp. vexp16 below, and the CPU attention's native-width vectors, use it.
// kSummed: for x <= 0 (or -inf) whose exps are added to a sum that is at least 1 (a
// log-sum-exp relative to its maximum): no upper clamp, and x < -87 gives exp(-87) ~ 1e-38
// rather than 0, which leaves such a float sum unchanged; three operations fewer.
template <typename V, typename VI, bool kSummed = false>
inline V vexp_lanes(V x) {
  const V lo = V{} - 87.0f, hi = V{} + 88.0f;
  const auto under = x < lo;
  x = x < lo ? lo : x;
  if (!kSummed) x = x > hi ? hi : x;
  // Round to nearest by the 1.5 * 2^23 trick (|x * log2 e| < 2^22 here).
  const V n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  V r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const VI e = (__builtin_convertvector(n, VI) + 127) << 23;
  const V out = p * (V)e;  // same-size vector cast: reinterprets the bits
  if (kSummed) return out;
  return under ? V{} : out;
}

// exp of 16 floats.
inline v16 vexp16(v16 x) { return vexp_lanes<v16, v16i>(x); }

// 8 doubles as one vector, and exp of doubles (a vector of any width V, VL: the int64 vector
// of the same width) with an error of a few double ulps: Cody-Waite
// reduction to |r| <= log(2)/2, then the Taylor series to r^13 (truncation below 1e-17).
// Inputs below -708 flush to 0 (std::exp would give subnormals there).
typedef double v8d __attribute__((vector_size(64)));
typedef int64_t v8l __attribute__((vector_size(64)));

template <typename V, typename VL>
inline V vexp_d_lanes(V x) {
  const auto under = x < -708.0;
  x = x < -708.0 ? V{} - 708.0 : x;
  x = x > 709.0 ? V{} + 709.0 : x;
  // Round to nearest by the 1.5 * 2^52 trick (|x * log2 e| < 2^51 here): t holds the integer
  // n in its low mantissa bits, so n as an int64 is t's bits less the constant's (AVX2 has
  // no double-to-int64 conversion; GCC would convert lane by lane).
  const V magic = V{} + 6755399441055744.0;
  const V t = x * 1.4426950408889634074 + magic;
  const V n = t - magic;
  const V r = (x - n * 6.93147180369123816490e-01) - n * 1.90821492927058770002e-10;
  V p = V{} + 1.0 / 6227020800.0;  // 1/13!
  p = p * r + 1.0 / 479001600.0;
  p = p * r + 1.0 / 39916800.0;
  p = p * r + 1.0 / 3628800.0;
  p = p * r + 1.0 / 362880.0;
  p = p * r + 1.0 / 40320.0;
  p = p * r + 1.0 / 5040.0;
  p = p * r + 1.0 / 720.0;
  p = p * r + 1.0 / 120.0;
  p = p * r + 1.0 / 24.0;
  p = p * r + 1.0 / 6.0;
  p = p * r + 0.5;
  p = p * r + 1.0;
  p = p * r + 1.0;
  const VL e = (((VL)t - (VL)magic) + 1023) << 52;
  const V out = p * (V)e;
  return under ? V{} : out;
}

inline v8d vexp8d(v8d x) { return vexp_d_lanes<v8d, v8l>(x); }

// log of positive normal floats, a vector of any width V (VI: the int32 vector of the same
// width), with ~1 ulp error (the Cephes logf polynomial on a mantissa in [sqrt(1/2),
// sqrt(2))); NaN stays NaN; zeros, negatives, subnormals and infinities are not handled.
template <typename V, typename VI>
inline V vlog_lanes(V x) {
  const VI bits = (VI)x;
  VI e = ((bits >> 23) & 0xff) - 126;
  V m = (V)((bits & 0x807fffff) | 0x3f000000);  // x = m * 2^e, m in [0.5, 1)
  const auto small = m < 0.707106781186547524f;
  e = small ? e - 1 : e;
  m = small ? m + m - 1.0f : m - 1.0f;
  const V z = m * m;
  V y = V{} + 7.0376836292e-2f;
  y = y * m - 1.1514610310e-1f;
  y = y * m + 1.1676998740e-1f;
  y = y * m - 1.2420140846e-1f;
  y = y * m + 1.4249322787e-1f;
  y = y * m - 1.6668057665e-1f;
  y = y * m + 2.0000714765e-1f;
  y = y * m - 2.4999993993e-1f;
  y = y * m + 3.3333331174e-1f;
  y = y * m * z;
  const V fe = __builtin_convertvector(e, V);
  y += fe * -2.12194440e-4f;
  y -= 0.5f * z;
  const V r = m + y + fe * 0.693359375f;
  return x == x ? r : x;
}

inline v16 vlog16(v16 x) { return vlog_lanes<v16, v16i>(x); }

}  // namespace k25::cpu
