#include "kv/tiers/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#elif defined(__aarch64__) && defined(__ARM_FEATURE_CRC32)
#include <arm_acle.h>
#endif

namespace k25 {

namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

// table[k][b]: CRC of byte b followed by k zero bytes, so that eight bytes are folded
// with eight independent lookups (slicing by 8) instead of eight dependent ones.
struct Tables {
  std::array<std::array<uint32_t, 256>, 8> t{};
  constexpr Tables() {
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t c = b;
      for (int i = 0; i < 8; ++i) c = (c >> 1) ^ ((c & 1u) ? kPoly : 0u);
      t[0][b] = c;
    }
    for (uint32_t b = 0; b < 256; ++b) {
      for (int k = 1; k < 8; ++k) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFFu];
    }
  }
};
constexpr Tables kTables;

uint32_t crc32c_table(const uint8_t* p, size_t n, uint32_t c) {
  const auto& t = kTables.t;
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);  // little-endian hosts only (x86-64, aarch64)
    w ^= c;
    c = t[7][w & 0xFF] ^ t[6][(w >> 8) & 0xFF] ^ t[5][(w >> 16) & 0xFF] ^ t[4][(w >> 24) & 0xFF] ^
        t[3][(w >> 32) & 0xFF] ^ t[2][(w >> 40) & 0xFF] ^ t[1][(w >> 48) & 0xFF] ^ t[0][w >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) c = (c >> 8) ^ t[0][(c ^ *p++) & 0xFFu];
  return c;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(const uint8_t* p, size_t n, uint32_t c) {
  uint64_t c64 = c;
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c64 = _mm_crc32_u64(c64, w);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c64);
  while (n--) c32 = _mm_crc32_u8(c32, *p++);
  return c32;
}

bool have_sse42() {
  static const bool yes = __builtin_cpu_supports("sse4.2");
  return yes;
}
#elif defined(__aarch64__) && defined(__ARM_FEATURE_CRC32)
uint32_t crc32c_arm(const uint8_t* p, size_t n, uint32_t c) {
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c = __crc32cd(c, w);
    p += 8;
    n -= 8;
  }
  while (n--) c = __crc32cb(c, *p++);
  return c;
}
#endif

}  // namespace

uint32_t crc32c(const void* data, size_t len, uint32_t crc) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
#if defined(__x86_64__)
  c = have_sse42() ? crc32c_sse42(p, len, c) : crc32c_table(p, len, c);
#elif defined(__aarch64__) && defined(__ARM_FEATURE_CRC32)
  c = crc32c_arm(p, len, c);
#else
  c = crc32c_table(p, len, c);
#endif
  return ~c;
}

uint32_t crc32c_portable(const void* data, size_t len, uint32_t crc) {
  return ~crc32c_table(static_cast<const uint8_t*>(data), len, ~crc);
}

}  // namespace k25
