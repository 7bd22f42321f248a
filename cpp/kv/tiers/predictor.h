// BlockPredictor: which cold blocks of a long sequence come back to L1, and which of its
// resident blocks leave first (issue #6, docs/offload.md "The predictor").
//
// Inputs, per step and sequence: how many of the step's attention passes (one per layer
// and KV head) read each block position (dynamic sparsity's selections, exported by the
// executor), recency (the step a block was last read) and memory pressure (the free L1
// blocks above a watermark). Each block position has a heat, an exponentially weighted
// mean of the fraction of passes that read it:
//
//   heat <- decay * heat + (1 - decay) * reads / passes      (new blocks start at 1)
//
// and each sequence an access entropy, the same mean of each step's normalized entropy of
// its reads over its blocks, counted above the floor every block got (passes that ran no
// selection read them all): p_b = (reads_b - floor) / sum; H = -sum p_b log p_b / log nb,
// 1 when every block is read alike, as dense attention reads them; 0 when one is:
//
//   entropy <- decay * entropy + (1 - decay) * H            (from the first step's H)
//
// Decisions:
//   - demotion order (L1 is short): coldest first, then least recently read, then oldest
//     position. Without sparsity every pass reads every block, so heat and recency tie
//     and the order is the oldest position first.
//   - promotions: a cold block with heat >= promote_heat comes back, hottest first, at
//     most max_moves per sequence and step: into a free L1 block while more than the
//     watermark's share of L1 is free, else in exchange for the coldest resident
//     candidate, only when that one is at least `margin` colder (so two blocks of similar
//     heat never swap back and forth), and only while the sequence's access entropy is at
//     most max_entropy: reads spread nearly evenly say little about which block the next
//     steps read, so heat differences there are noise that an exchange (two copies, one of
//     them out of L1) would chase. Promotions into free blocks cost L1 nothing and go on.
// Counted: reads served by L1 (hits) and by a lower tier (misses), promotions, exchanges,
// promoted blocks that the next observed step read, exchanges the entropy held back, and
// the mean access entropy of the observed steps.
//
// Plain C++, no locks: the engine thread owns it.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

#include "k25/predictor_stats.h"

namespace k25 {

struct PredictorConfig {
  double decay = 0.75;          // weight of a block's history in its heat, [0, 1)
  double promote_heat = 0.5;    // a cold block at least this hot is worth fetching back, (0, 1]
  double margin = 0.25;         // an exchange needs the resident block this much colder, [0, 1]
  int32_t max_moves = 2;        // promotions per sequence per step (bounds the copy traffic a step starts)
  double free_watermark = 0.1;  // share of L1 kept free: promotions take free blocks only above it
  double max_entropy = 0.95;    // no exchanges for a sequence whose access entropy is above this, [0, 1]
};

class BlockPredictor {
 public:
  // Throws kInvalidArgument for a value out of its range.
  explicit BlockPredictor(const PredictorConfig& config);

  // Where a block was read (observe's cold[b]).
  static constexpr uint8_t kReadFromL1 = 0, kReadFromL2 = 1, kReadFromL3 = 2;
  // One decode step of one sequence: reads[b] of `passes` attention passes read block
  // position b (b < num_blocks); cold[b] where that block was read (kReadFrom*). Heat
  // changes only when sparse is true (a dense pass reads everything and says nothing about
  // the next step); hits and misses are counted either way. step: the plan the step ran
  // (begin_plan); a pipelined step is observed after the next plan, whose promotions it
  // cannot have read, so those stay watched for the step they were planned with.
  void observe(int64_t seq, const int32_t* reads, const uint8_t* cold, int32_t num_blocks, int32_t passes,
               bool sparse, int64_t step = INT64_MAX);
  // The plan being made is step `step`'s: the moves it carries out are watched from that
  // step's reads on.
  void begin_plan(int64_t step) { plan_step_ = step; }
  // Sorts candidate positions into demotion order (coldest first).
  void order_for_demotion(int64_t seq, std::vector<int32_t>* positions) const;

  struct Move {
    int32_t promote;  // the cold position to fetch back
    int32_t demote;   // the resident position that leaves for it, or -1: a free block
  };
  // cold: positions the sequence holds outside L1; resident: positions it may demote;
  // free_blocks: L1 blocks free beyond the watermark (Scheduler computes it).
  // Not const: it counts the exchanges the access entropy held back.
  std::vector<Move> decide(int64_t seq, const std::vector<int32_t>& cold, const std::vector<int32_t>& resident,
                           int32_t free_blocks);
  // A decided move was carried out (counted; the promoted block is watched for a read).
  void moved(int64_t seq, const Move& m);
  void forget(int64_t seq);

  double heat(int64_t seq, int32_t pos) const;
  double entropy(int64_t seq) const;  // the sequence's access entropy; 1 before any sparse step
  int32_t free_blocks_above_watermark(int32_t free_blocks, int32_t total_blocks) const;
  const PredictorConfig& config() const { return config_; }
  const PredictorCounters& counters() const { return counters_; }

 private:
  struct SeqState {
    std::vector<float> heat;
    std::vector<int64_t> last_read;  // observation count at the last read, -1: never
    std::vector<std::pair<int32_t, int64_t>> watched;  // promoted positions not yet observed, and their plan
    int64_t observations = 0;
    double entropy = -1;  // the access entropy (mean of normalized H); < 0: none observed yet
  };
  bool colder(const SeqState* s, int32_t a, int32_t b) const;

  PredictorConfig config_;
  PredictorCounters counters_;
  int64_t plan_step_ = 0;  // begin_plan's
  std::unordered_map<int64_t, SeqState> seqs_;
};

}  // namespace k25
