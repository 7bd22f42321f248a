// Counters of the tiered KV cache's block predictor (kv/tiers/predictor.h), as
// EngineStats::predictor reports them (docs/offload.md "The predictor").
#pragma once

#include <cstdint>

namespace k25 {

struct PredictorCounters {
  int64_t steps = 0;             // (sequence, decode step) observations with sparse reads
  int64_t reads_l1 = 0;          // decode steps' block reads by attention passes served from L1 (hits)
  int64_t reads_lower = 0;       // ... served from L2 or L3 (cold blocks: misses) = reads_l2 + reads_l3
  int64_t reads_l2 = 0;          // ... by a cold block in L2 (read in place)
  int64_t reads_l3 = 0;          // ... by a cold block in L3 (read back for the step)
  int64_t promotions = 0;        // cold blocks whose copy back to L1 started
  int64_t exchanges = 0;         // of those, with a colder resident block demoted for it
  int64_t promotions_read = 0;   // promoted blocks read by the step planned with them
  int64_t entropy_holds = 0;     // exchanges not made: the sequence's access entropy above predictor_max_entropy
  double entropy_sum = 0;        // the observed steps' access entropies (normalized), summed
  double mean_entropy() const { return steps > 0 ? entropy_sum / static_cast<double>(steps) : 0.0; }
  double hit_rate() const {
    const int64_t n = reads_l1 + reads_lower;
    return n > 0 ? static_cast<double>(reads_l1) / static_cast<double>(n) : 0.0;
  }
};

}  // namespace k25
