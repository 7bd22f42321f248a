// Scalar conversions between float32 and the 16-bit float formats found in model files.
//
// Plain integer arithmetic rather than F16C/_Float16 so that results are identical on every
// machine and build flag set (numpy, which the tests compare against, does the same), and
// so the loops that call them stay auto-vectorizable.
#pragma once

#include <cstdint>
#include <cstring>

namespace k25 {

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Exact for every input: normals, subnormals, +-0, +-inf; NaN payloads are kept as they are
// (a signalling NaN stays signalling, as numpy does).
inline float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  uint32_t bits;
  if (em >= 0x7c00u) {
    bits = 0x7f800000u | (em << 13);
  } else if (em >= 0x0400u) {
    // Rebias the exponent from 15 to 127; the mantissa just widens.
    bits = (em << 13) + ((127u - 15u) << 23);
  } else {
    // Subnormal or zero: em units of 2^-24, exactly representable as a float32 normal.
    bits = f32_bits(float(em) * 0x1p-24f);
  }
  return f32_from_bits(bits | sign);
}

// Round to nearest, ties to even; overflow gives inf; NaN stays NaN (quieted, top payload
// bits kept), as the hardware conversion instructions do.
inline uint16_t fp32_to_fp16(float f) {
  const uint32_t x = f32_bits(f);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) {
    if (ax == 0x7f800000u) return uint16_t(sign | 0x7c00u);
    return uint16_t(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
  }
  const int e = int(ax >> 23) - 127;
  if (e > 15) return uint16_t(sign | 0x7c00u);
  if (e >= -14) {
    uint32_t h = (uint32_t(e + 15) << 10) | ((ax >> 13) & 0x3ffu);
    const uint32_t rem = ax & 0x1fffu;
    // A carry out of the mantissa correctly bumps the exponent (and 65520+ becomes inf).
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
    return uint16_t(sign | h);
  }
  if (e < -25) return sign;  // below half the smallest subnormal: rounds to zero
  // Result is a half subnormal in units of 2^-24: value = m * 2^(e-23) = (m >> s) units.
  const uint32_t m = (ax & 0x7fffffu) | 0x800000u;
  const int s = -(e + 1);  // 14..24
  uint32_t h = m >> s;
  const uint32_t rem = m & ((1u << s) - 1u);
  const uint32_t half = 1u << (s - 1);
  if (rem > half || (rem == half && (h & 1u))) ++h;  // may round up into the first normal
  return uint16_t(sign | h);
}

inline float bf16_to_fp32(uint16_t h) { return f32_from_bits(uint32_t(h) << 16); }

// Round to nearest, ties to even; NaN is quieted and keeps its top payload bits (as ggml).
inline uint16_t fp32_to_bf16(float f) {
  const uint32_t x = f32_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x40u);
  return uint16_t((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

}  // namespace k25
