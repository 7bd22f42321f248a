// The scheduler: pure policy. Decides which sequences run in a step and how many tokens
// each computes, under one token budget; allocates their KV blocks; preempts when blocks
// run out. It never touches tensors or tiers: with config.swap_preempted it lists in the
// plan which blocks of a preempted sequence the engine should swap out (to L2/L3), and
// which readmitted sequences need their parked blocks fetched; the engine moves them.
//
// Order: priority class (gold, silver, bronze), then arrival. Running sequences are
// served first (decodes and unfinished prompt chunks), then waiting ones are admitted.
// A waiting sequence of a higher class may preempt running sequences of a strictly
// lower class when it cannot otherwise be admitted; a running sequence that needs a
// block preempts the lowest-ranked running sequences (possibly itself). A sequence whose
// swapped blocks are being fetched (SwapState::kIn) is neither scheduled nor preempted.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "k25/config.h"
#include "engine/sequence.h"
#include "kv/block_pool.h"
#include "kv/tiers/predictor.h"

namespace k25 {

struct ScheduledSeq {
  Sequence* seq;
  int32_t num_new_tokens;  // tokens computed this step, starting at seq->num_computed
  bool emits;              // this step computes the last known token: sample the next
};

// Blocks of a sequence preempted by swap: its first `num_tokens` tokens' KV. The blocks
// are back in the pool already; the engine copies them out before the step reuses them.
struct SwapOut {
  Sequence* seq;
  std::vector<int32_t> blocks;
  int32_t num_tokens;
};

struct StepPlan {
  std::vector<ScheduledSeq> seqs;
  std::vector<SwapOut> swap_outs;
  // Readmitted with blocks for their parked KV, or admitted with blocks for cached prefix
  // blocks that L2/L3 hold (Sequence::tier_prefix_hashes): to fetch.
  std::vector<Sequence*> swap_ins;
  // Prefix caching with tiers: cached blocks that this plan's allocations evicted from L1
  // (their bytes intact until the step writes them), for the engine to copy down.
  std::vector<BlockPool::Evicted> prefix_spills;
  // Cold blocks: computed blocks of a sequence that would otherwise have to preempt itself,
  // released from L1 in this plan; the engine copies them to L2 before the step reuses them
  // (Sequence::cold_keys gets their keys). And cold copies of preempted sequences, to free.
  struct ColdDemote {
    Sequence* seq;
    int32_t index;  // in the sequence's block table
    int32_t block;  // the L1 block it leaves
  };
  std::vector<ColdDemote> cold_demotes;
  std::vector<uint64_t> cold_freed;
  // Cold blocks the predictor brings back (Scheduler::set_predictor): each gets `block`,
  // allocated here; the engine copies it there after this plan's copies out, without
  // waiting, and puts it in the block table once the copy has landed (until then the
  // sequence reads it in L2). An exchange's colder block is in cold_demotes.
  struct Promotion {
    Sequence* seq;
    int32_t index;  // in the sequence's block table (a cold entry)
    int32_t block;  // the L1 block it comes back to
  };
  std::vector<Promotion> promotions;
  std::vector<int64_t> preempted;  // ids preempted while planning this step
  std::vector<std::vector<int32_t>> preempted_blocks;  // the blocks each one gave back
  int32_t num_tokens = 0;
  bool empty() const { return seqs.empty(); }
};

class Scheduler {
 public:
  Scheduler(const EngineConfig& config, BlockPool* pool);

  // Takes ownership; the sequence waits until schedule() admits it.
  void add(std::unique_ptr<Sequence> seq);
  // Plans one step and allocates the blocks it needs.
  StepPlan schedule();
  // Marks the planned tokens computed. Call after the step ran.
  void complete_step(const StepPlan& plan);
  // Frees the sequence's blocks and removes it from the queues. The sequence object
  // stays alive until release() so that its final output can be built.
  void finish(Sequence* seq, FinishReason reason);
  std::unique_ptr<Sequence> release(int64_t id);

  // True when the next schedule() runs every running sequence as a one-token step and
  // preempts or admits nobody: nothing waits, nothing swaps, each running sequence has
  // exactly one token to compute, all fit the token budget, their new blocks are free.
  bool decode_step_fits() const;

  // Prefix caching counters: prompt tokens looked up at admission, those found (in L1 or
  // the tiers), and those found in the tiers.
  int64_t prefix_query_tokens() const { return prefix_query_tokens_; }
  int64_t prefix_hit_tokens() const { return prefix_hit_tokens_; }
  int64_t prefix_tier_hit_tokens() const { return prefix_tier_hit_tokens_; }

  // Prefix caching with tiers: how many consecutive full blocks of `tokens`, from block
  // `first` (the chain hash before it: `parent`) up to block `max_blocks`, the lower tiers
  // hold ready to fetch; their chain hashes go to `hashes`. Set by the engine.
  using TierPrefixLookup = std::function<int32_t(const int32_t* tokens, int32_t first, int32_t max_blocks,
                                                 int32_t block_size, uint64_t parent, std::vector<uint64_t>* hashes)>;
  void set_tier_prefix_lookup(TierPrefixLookup f) { tier_lookup_ = std::move(f); }
  // Prefix caching: registers the sequence's newly full, computed blocks whose tokens are
  // all known (a pending token waits for a later call).
  void cache_full_blocks(Sequence* seq);

  // Cold blocks (a sequence longer than L1): set by the engine when the tiers and the
  // executor support them. Returns how many L2 slots cold blocks may take now, making room
  // for up to `want` if it can (by dropping cached prefix copies).
  using ColdRoom = std::function<int32_t(int32_t want)>;
  void set_cold_room(ColdRoom f) { cold_room_ = std::move(f); }
  bool cold_blocks_enabled() const { return static_cast<bool>(cold_room_); }
  // Whether a cold block (by tier key) may be promoted; unset: every one.
  void set_cold_promotable(std::function<bool(uint64_t key)> f) { cold_promotable_ = std::move(f); }
  // Sequences in the engine's L3 lane (Sequence::in_lane) are skipped while their lane step
  // runs, but stay victims as any other: preempting one first calls this, which ends (drops)
  // the lane step.
  void set_lane_cancel(std::function<void()> cancel) { lane_cancel_ = std::move(cancel); }
  // Running sequences for which `held` is true are not scheduled this step (the engine: ones
  // with cold blocks in L3 while the lane runs another's step); they stay victims too.
  void set_lane_held(std::function<bool(const Sequence&)> held) { lane_held_ = std::move(held); }
  // Outside a plan: a running sequence drops its KV and waits to recompute it, as a
  // preemption by recompute does (a cold block in L3 it could not read back). Its blocks
  // (for the KV event) and its cold copies' keys (for the engine to free) are returned.
  void recompute(Sequence* seq, std::vector<int32_t>* blocks, std::vector<uint64_t>* cold_keys);
  // With cold blocks: the predictor that orders demotions and decides promotions (owned by
  // the engine; null: oldest first, no promotions).
  void set_predictor(BlockPredictor* p) { predictor_ = p; }

  Sequence* find(int64_t id);
  bool has_unfinished() const { return !running_.empty() || !waiting_.empty(); }
  int32_t num_running() const { return static_cast<int32_t>(running_.size()); }
  int32_t num_waiting() const { return static_cast<int32_t>(waiting_.size()); }
  int64_t num_preemptions() const { return num_preemptions_; }
  const EngineConfig& config() const { return config_; }
  const std::vector<Sequence*>& running() const { return running_; }
  const std::vector<Sequence*>& waiting() const { return waiting_; }

  // Throws kInternal when block ownership is inconsistent (for tests and debug builds).
  void check_invariants() const;

 private:
  void preempt(Sequence* seq, StepPlan* plan);
  // Cold blocks: the sequence's computed full blocks it could move to L2 (resident, not its
  // first block, not shared), in the predictor's demotion order (else oldest first), at
  // most `limit`.
  std::vector<int32_t> cold_candidates(const Sequence& seq, int32_t limit) const;
  // Moves `need` of them to L2 in this plan; false (nothing changed) when it cannot.
  bool make_cold(Sequence* seq, int32_t need, StepPlan* plan);
  void demote_position(Sequence* seq, int32_t index, StepPlan* plan);
  // The predictor's promotions for the sequences of this plan (after everything else).
  void plan_promotions(StepPlan* plan);
  // The lowest-ranked running sequence that may be preempted (not swapping in).
  Sequence* pick_victim() const;
  int32_t blocks_missing(const Sequence& seq, int32_t num_new_tokens) const;
  int32_t l1_blocks_held(const Sequence& seq) const;
  // Whether s cannot fit L1 alone, with n more tokens (then it goes cold rather than preempt
  // itself).
  bool longer_than_l1(const Sequence& s, int32_t n) const;
  bool grow(Sequence* seq, int32_t num_new_tokens);
  // Frees a sequence's blocks (with cache: registering what it computed first).
  void release_blocks(Sequence* seq, bool cache);
  // The cached blocks a waiting sequence (nothing computed) can start from: at most all
  // but the block of its last token, which must be computed to sample from it.
  std::vector<int32_t> cached_prefix(Sequence* seq) const;
  bool prefix_eligible(const Sequence& seq) const;
  void sort_queues();

  EngineConfig config_;
  BlockPool* pool_;
  std::map<int64_t, std::unique_ptr<Sequence>> seqs_;
  std::vector<Sequence*> running_;
  std::vector<Sequence*> waiting_;
  int64_t num_preemptions_ = 0;
  int64_t prefix_query_tokens_ = 0, prefix_hit_tokens_ = 0, prefix_tier_hit_tokens_ = 0;
  TierPrefixLookup tier_lookup_;
  ColdRoom cold_room_;
  std::function<bool(uint64_t)> cold_promotable_;
  std::function<void()> lane_cancel_;
  std::function<bool(const Sequence&)> lane_held_;
  // Not scheduled this step: fetches to land, its lane step to end, or held for the lane.
  bool skipped(const Sequence& s) const {
    return s.swap == SwapState::kIn || s.in_lane || (lane_held_ && lane_held_(s));
  }
  BlockPredictor* predictor_ = nullptr;
};

// True when a ranks before b (higher priority class, then earlier arrival).
inline bool ranks_before(const Sequence* a, const Sequence* b) {
  if (a->priority != b->priority) return a->priority < b->priority;
  return a->arrival < b->arrival;
}

}  // namespace k25
