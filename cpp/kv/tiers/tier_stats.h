// Counters of the tier mover: what moved, how much, how fast, and what went wrong.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "k25/status.h"

namespace k25 {

// Cumulative histogram of seconds with fixed buckets (Prometheus style: counts[i] is the
// number of samples <= kBounds[i]; the last count is +Inf).
struct LatencyHistogram {
  static constexpr std::array<double, 14> kBounds = {1e-5, 2.5e-5, 5e-5,   1e-4, 2.5e-4, 5e-4, 1e-3,
                                                     2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1,  1.0};
  std::array<int64_t, kBounds.size() + 1> counts{};  // per bucket, not cumulative
  int64_t count = 0;
  double sum = 0;
  void observe(double seconds);
};

// Why a transfer did not deliver its block. The names are the evict_reason of logs.
enum class TierFault : uint8_t {
  kNone,
  kCancelled,     // freed while in flight (not a failure)
  kChecksum,      // page data does not match its checksum
  kBadTrailer,    // page trailer unreadable (magic, version, size or its own checksum)
  kStale,         // page holds another copy than the one asked for
  kShortRead,     // the file ended inside the page (truncated)
  kShortWrite,
  kNoSpace,       // ENOSPC, EFBIG (file size limit), EDQUOT
  kIOError,       // any other errno
  kCopyFailed,    // the L1 <-> host copy failed
};
constexpr int kNumTierFaults = 10;
const char* tier_fault_name(TierFault f);
// The k25 error code a fault surfaces as.
ErrorCode tier_fault_code(TierFault f);

struct TierStats {
  int64_t offloads = 0;         // blocks that left L1 (completed demotes)
  int64_t offloads_to_l2 = 0;
  int64_t offloads_to_l3 = 0;   // straight to L3 because L2 was full
  int64_t spills = 0;           // L2 -> L3
  int64_t fetches = 0;          // blocks back in L1
  int64_t fetches_from_l2 = 0;  // hits in L2
  int64_t fetches_from_l3 = 0;  // hits in L3
  int64_t l3_slice_reads = 0;   // slices read in place from L3 pages (cold blocks in L3)
  int64_t cancelled = 0;        // transfers whose block was freed in flight
  int64_t refused = 0;          // demote/spill/fetch calls that found no room (nothing started)
  std::array<int64_t, kNumTierFaults> faults{};  // by TierFault
  int64_t bytes_to_l2 = 0, bytes_from_l2 = 0;    // block bytes copied between L1 and L2 slots
  int64_t bytes_to_l3 = 0, bytes_from_l3 = 0;    // page bytes written to / read from L3
  LatencyHistogram offload_latency;  // demote started -> block safe in L2/L3
  LatencyHistogram fetch_latency;    // fetch started -> block back in L1
  LatencyHistogram spill_latency;
  // Now: L2 slots and L3 pages held by copies (in flight included; staging slots not).
  int32_t l2_blocks = 0;
  int64_t l3_blocks = 0;

  int64_t failures() const;
};

}  // namespace k25
