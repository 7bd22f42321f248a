// The format of one L3 page: a KV block's bytes followed by a trailer that says whose
// bytes they are and lets a reader prove they are intact.
//
//   [ block bytes (block_bytes) ][ PageTrailer (64 bytes) ][ zero padding to 4096 ]
//
// A page is a multiple of 4096 bytes so that it can be read and written with O_DIRECT;
// an L2 slot has the same size and alignment, so a slot is written to disk as it is and
// read back into a slot without a bounce buffer. The trailer sits after the data so that
// the data starts on the slot's (page-aligned) first byte.
//
// The key in the trailer is the offloaded copy's key, which is never reused: a page that
// still holds an older copy's bytes (a lost or misdirected write) reads as "stale", not
// as someone else's KV.
#pragma once

#include <cstdint>
#include <string>

namespace k25 {

constexpr int64_t kPageAlign = 4096;
constexpr uint64_t kPageMagic = 0x3147505F56584B32ull;  // "2KXV_PG1" read little-endian
constexpr uint32_t kPageVersion = 1;

struct PageTrailer {
  uint64_t magic;
  uint32_t version;
  uint32_t reserved;
  uint64_t key;          // the copy this page holds
  uint64_t block_bytes;  // size of the data before the trailer
  uint32_t data_crc;     // CRC32C of the data
  uint32_t reserved2;
  uint64_t reserved3[2];
  uint32_t pad;
  uint32_t trailer_crc;  // CRC32C of every byte of the trailer before this field
};
static_assert(sizeof(PageTrailer) == 64, "the trailer is part of the on-disk format");

// Bytes of one page (and one L2 slot) for blocks of `block_bytes`.
inline int64_t page_bytes_for(int64_t block_bytes) {
  const int64_t raw = block_bytes + static_cast<int64_t>(sizeof(PageTrailer));
  return (raw + kPageAlign - 1) / kPageAlign * kPageAlign;
}

// Writes the trailer for `key` after the block bytes at the start of `page`.
void seal_page(void* page, int64_t block_bytes, uint64_t key);

enum class PageCheck { kOk, kBadTrailer, kStale, kChecksum };
const char* page_check_name(PageCheck c);

// Checks a page read back for `key`: an intact trailer, the right key and size, and data
// whose checksum matches.
PageCheck check_page(const void* page, int64_t block_bytes, uint64_t key);

}  // namespace k25
