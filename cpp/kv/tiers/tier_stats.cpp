#include "kv/tiers/tier_stats.h"

namespace k25 {

void LatencyHistogram::observe(double seconds) {
  size_t i = 0;
  while (i < kBounds.size() && seconds > kBounds[i]) ++i;
  ++counts[i];
  ++count;
  sum += seconds;
}

const char* tier_fault_name(TierFault f) {
  switch (f) {
    case TierFault::kNone: return "none";
    case TierFault::kCancelled: return "cancelled";
    case TierFault::kChecksum: return "checksum_mismatch";
    case TierFault::kBadTrailer: return "bad_trailer";
    case TierFault::kStale: return "stale_page";
    case TierFault::kShortRead: return "short_read";
    case TierFault::kShortWrite: return "short_write";
    case TierFault::kNoSpace: return "no_space";
    case TierFault::kIOError: return "io_error";
    case TierFault::kCopyFailed: return "copy_failed";
  }
  return "unknown";
}

ErrorCode tier_fault_code(TierFault f) {
  switch (f) {
    case TierFault::kChecksum:
    case TierFault::kBadTrailer:
    case TierFault::kStale:
    case TierFault::kShortRead: return ErrorCode::kCorruptFile;
    case TierFault::kNoSpace: return ErrorCode::kResourceExhausted;
    case TierFault::kShortWrite:
    case TierFault::kIOError: return ErrorCode::kIOError;
    case TierFault::kNone:
    case TierFault::kCancelled:
    case TierFault::kCopyFailed: return ErrorCode::kInternal;
  }
  return ErrorCode::kInternal;
}

int64_t TierStats::failures() const {
  int64_t n = 0;
  for (int i = 2; i < kNumTierFaults; ++i) n += faults[i];
  return n;
}

}  // namespace k25
