#include "kv/tiers/page_format.h"

#include <cstddef>
#include <cstring>

#include "kv/tiers/crc32c.h"

namespace k25 {

namespace {

uint32_t trailer_crc(const PageTrailer& t) { return crc32c(&t, offsetof(PageTrailer, trailer_crc)); }

}  // namespace

void seal_page(void* page, int64_t block_bytes, uint64_t key) {
  auto* bytes = static_cast<uint8_t*>(page);
  PageTrailer t{};
  t.magic = kPageMagic;
  t.version = kPageVersion;
  t.key = key;
  t.block_bytes = static_cast<uint64_t>(block_bytes);
  t.data_crc = crc32c(bytes, static_cast<size_t>(block_bytes));
  t.trailer_crc = trailer_crc(t);
  std::memcpy(bytes + block_bytes, &t, sizeof t);
  // The padding goes to disk too; zero it so a page's bytes depend only on its content.
  const int64_t end = page_bytes_for(block_bytes);
  const int64_t tail = block_bytes + static_cast<int64_t>(sizeof t);
  std::memset(bytes + tail, 0, static_cast<size_t>(end - tail));
}

const char* page_check_name(PageCheck c) {
  switch (c) {
    case PageCheck::kOk: return "ok";
    case PageCheck::kBadTrailer: return "bad_trailer";
    case PageCheck::kStale: return "stale_page";
    case PageCheck::kChecksum: return "checksum_mismatch";
  }
  return "unknown";
}

PageCheck check_page(const void* page, int64_t block_bytes, uint64_t key) {
  const auto* bytes = static_cast<const uint8_t*>(page);
  PageTrailer t;
  std::memcpy(&t, bytes + block_bytes, sizeof t);
  if (t.magic != kPageMagic || t.version != kPageVersion || t.trailer_crc != trailer_crc(t) ||
      t.block_bytes != static_cast<uint64_t>(block_bytes)) {
    return PageCheck::kBadTrailer;
  }
  if (t.key != key) return PageCheck::kStale;
  if (crc32c(bytes, static_cast<size_t>(block_bytes)) != t.data_crc) return PageCheck::kChecksum;
  return PageCheck::kOk;
}

}  // namespace k25
