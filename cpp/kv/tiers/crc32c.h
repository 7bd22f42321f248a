// CRC32C (Castagnoli polynomial, reflected 0x82F63B78), the checksum of L3 pages.
//
// Why CRC32C: x86-64 (SSE4.2) and ARMv8 (CRC extension) compute it in hardware at several
// GB/s, so checking a whole KV block on every read from disk costs little next to the
// read itself. Builds without those instructions use a table-driven version.
#pragma once

#include <cstddef>
#include <cstdint>

namespace k25 {

// CRC32C of `len` bytes, continuing from `crc` (0 to start; pass a previous result to
// extend it over more bytes).
uint32_t crc32c(const void* data, size_t len, uint32_t crc = 0);
// The same function without the hardware instructions (tests compare the two).
uint32_t crc32c_portable(const void* data, size_t len, uint32_t crc = 0);

}  // namespace k25
