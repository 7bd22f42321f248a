// KVSwap: preemption by swap for the engine (cache_mode="hierarchical").
//
// The scheduler decides (StepPlan::swap_outs, swap_ins); KVSwap moves the blocks through
// the TierManager and keeps each sequence's swap fields in step with what completed:
//   - swap-out: each computed block of a preempted sequence is demoted (L2, or L3 when L2
//     is full). The blocks are back in the pool already and this step may hand them to
//     others, so start() waits until their bytes are copied out (a memcpy on the CPU; an
//     L3 write goes on in the background). Blocks the tiers have no room for, and every
//     block after them, are recomputed instead.
//   - swap-in: a readmitted sequence got fresh blocks; start() fetches its keys into them
//     and the sequence is skipped until apply_completions() sees all of them land, then
//     its num_computed comes back. A failed fetch (checksum, short read, ...) is logged
//     as a KV event with the fault as reason; the sequence recomputes from that block on.
//   - cold blocks (a sequence longer than L1): blocks the plan released from a running
//     sequence are copied to L2 before the step reuses them; the sequence keeps their keys
//     and the attention reads them in L2 (cold_l2_data) until the sequence ends or is
//     preempted. Where the executor can read them layer by layer (the CPU backend,
//     cold_l3_slices), a cold block goes to L3 when L2 is full; start() waits until its page
//     is written, and each of its steps (the engine's L3 lane) reads their layers back while it
//     runs (read_cold_l3). A page that cannot be written or read back intact makes its
//     sequence recompute (the engine drops that step's result for it).
//   - promotions (the predictor's, StepPlan::promotions): cold blocks copied back into the
//     L1 blocks the plan gave them (TierManager::copy_up, after the plan's copies out: an
//     exchange's colder block leaves first). Nothing waits: until the copy lands the
//     sequence goes on reading the block in L2, which the copy keeps; apply_completions()
//     then puts the L1 block in the block table and frees the L2 copy, between steps.
//     Their summaries are rebuilt like a swap-in's (take_landed).
//   - prefix spill (with enable_prefix_caching): a cached block that the plan evicted from
//     L1 is demoted too (start() waits for its copy as for a swap-out) and indexed by its
//     chain hash; the scheduler finds such blocks past a prompt's L1 hits through
//     lookup_prefix() and admits the sequence as a swap-in of them (the index's keys
//     become the sequence's swap keys: a tier copy is used once, then the fetched block is
//     cached in L1 again). When the tiers are full, the oldest indexed copies make room.
// Completions arrive on tier threads; they are queued and applied on the engine thread,
// which `wake` rouses (no polling).
#pragma once

#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/executor.h"
#include "engine/scheduler.h"
#include "kv/block_pool.h"
#include "kv/tiers/tier_manager.h"

namespace k25 {

struct SwapCounters {
  int64_t swap_outs = 0;       // sequences whose KV went (at least partly) to the tiers
  int64_t swap_ins = 0;        // sequences that got their KV back
  int64_t swap_fallbacks = 0;  // sequences that recomputed some of it (no room, a fault)
  int64_t swap_declined = 0;   // preemptions that recomputed because that was estimated cheaper
  int64_t prefix_spills = 0;   // cached prefix blocks copied down from L1
  int64_t prefix_fetches = 0;  // of those, blocks fetched back for a later request
  int64_t prefix_dropped = 0;  // indexed copies freed to make room (or lost to a fault)
  int64_t cold_demotes = 0;    // blocks of running sequences moved to L2 (a sequence longer than L1)
  int64_t cold_promotions = 0; // cold blocks fetched back to L1 (the predictor's)
};

// One step's reads of cold blocks in L3, layer by layer (BatchMeta::cold_layers): each
// layer's slice of every such block is read into one of a ring of buffers while the layers
// before run. The reads of the first layers start at construction; asking for layer l
// waits for its reads and starts those of the layers up to l + depth - 1. Staged (CUDA):
// two buffers (the executor's ColdStage); else four.
class ColdL3Reads : public ColdLayerSource {
 public:
  struct Entry {
    int32_t list_index;  // in BatchMeta::cold_blocks
    uint64_t key;
    std::string lost;    // not empty: the copy is gone already (why), nothing to read
  };
  // stage: null, or where the staging buffers come from (ColdStage; then every entry of
  // `list`, L2 ones copied by the host, goes through them: layer_region).
  // test_delay_s: tests hold each layer's reads this long (a slow disk's stand-in).
  // plan: which halves are read ahead (ColdReadPlan; halves: the tiers' slices are two per
  // layer, num_layers of them each).
  ColdL3Reads(TierManager* tiers, std::vector<const void*> list, std::vector<Entry> entries, int32_t num_layers,
              const std::function<ColdStage(int64_t bytes)>& stage = {}, double test_delay_s = 0,
              ColdReadPlan plan = {});
  ~ColdL3Reads() override;  // waits for the reads in flight
  ColdL3Reads(const ColdL3Reads&) = delete;
  ColdL3Reads& operator=(const ColdL3Reads&) = delete;
  const void* const* layer(int32_t layer) override;
  Region layer_region(int32_t layer) override;
  bool selective() const override { return sel_; }
  // The halves of the entries in `need` that `layer` has not read yet (its attention's).
  bool need(int32_t layer, const std::vector<uint8_t>& need) override;
  // Whether asking for `layer` now would not wait: its reads have all completed.
  bool layer_ready(int32_t layer);
  // Waits for the reads in flight. The entries whose bytes could not be had (index into
  // the entries, and why: the fault's evict_reason); the step read zeros in their place.
  std::vector<std::pair<size_t, std::string>> finish();
  // Selective: of the layers issued, how many halves (K and V of a layer of an entry; a
  // whole slice read counts as both) there were and how many were read.
  int64_t halves_total() const { return halves_total_; }
  // Selective: the layers whose attention read entry e (need), [layer].
  std::vector<uint8_t> kept_layers(size_t e) const {
    return std::vector<uint8_t>(kept_.begin() + static_cast<std::ptrdiff_t>(e * num_layers_),
                                kept_.begin() + static_cast<std::ptrdiff_t>((e + 1) * num_layers_));
  }
  int64_t halves_read() const { return halves_read_; }
  int64_t halves_late() const { return halves_late_; }  // of those, read after their layer's selection
  // Halves the selection skipped: neither read nor of an entry that could not be read.
  int64_t halves_skipped() const { return halves_total_ - halves_read_ - halves_unreadable_; }

 private:
  void issue(int32_t layer);
  // Starts the reads of entry e's parts `want` of `layer` (kKeys | kValues; whole slices
  // without halves) into buffer b that it has not had; false when it started none.
  static constexpr uint8_t kKeys = 1, kValues = 2, kWhole = 3;
  bool read(int b, int32_t layer, size_t e, uint8_t want);
  void wait_idle(int b);   // buffer b's reads have ended
  void wait_ready(int b);  // and its layer counts as read (test_delay_s)
  // Waits for `layer`'s reads (issuing them first if need be), then starts the next layers'.
  int ready(int32_t layer);
  uint8_t* slot(int b, size_t e) const;

  TierManager* tiers_;
  std::vector<const void*> list_;
  std::vector<Entry> entries_;
  int32_t num_layers_;
  int64_t slice_bytes_, stride_;  // stride_: one entry's room in a buffer
  ColdReadPlan plan_;
  bool sel_ = false;              // selective (plan_): what a layer's attention needs is read after its selection
  int64_t layer_bytes_ = 0;       // one layer of a block: a slice, or two halves
  std::vector<uint8_t> have_;     // selective: [buffer][entry] the parts read (or being read)
  int64_t halves_total_ = 0, halves_read_ = 0, halves_late_ = 0;
  int64_t halves_unreadable_ = 0;  // of an entry lost or failed already (not read, not skipped)
  std::vector<uint8_t> kept_;     // selective: [entry][layer], set by need
  int depth_ = 2;                 // buffers in the ring
  std::vector<uint8_t*> buf_;
  ColdStage stage_;               // staged: buf_ are its host buffers (not owned)
  bool staged_ = false;
  std::vector<size_t> staged_l2_;  // staged: the entries of list_ in L2 (copied by the host)
  uint8_t* zeros_ = nullptr;      // a slice of zeros, for entries without bytes
  std::vector<int32_t> buf_layer_;
  double test_delay_s_ = 0;
  std::vector<std::chrono::steady_clock::time_point> ready_at_;  // test_delay_s: a layer's reads count from then
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<int32_t> pending_;
  std::vector<std::string> failed_;  // per entry: the first fault, or empty
};

class KVSwap {
 public:
  using EventSink = std::function<void(int64_t seq_id, const std::vector<int32_t>& blocks, const std::string& reason)>;

  // l1_base: the pool in host memory, or null with `configure` supplying the L2 allocator
  // and the copier (ModelExecutor::configure_tiers, CUDA).
  // l3_slices: the executor's cold_l3_slices() (0: cold blocks stay in L2).
  KVSwap(const EngineConfig& config, void* l1_base, int64_t block_bytes, Scheduler* scheduler, BlockPool* pool,
         std::function<void()> wake, EventSink events, const std::function<bool(TierConfig*)>& configure = {},
         int32_t l3_slices = 0);
  ~KVSwap();  // waits for transfers in flight

  // After schedule(), before the step runs.
  void start(const StepPlan& plan);
  // On the engine thread: applies the completions queued since the last call.
  void apply_completions();
  bool has_completions() const;  // engine thread: also promotions held for the lane that may land now
  int32_t in_flight() const { return tiers_->in_flight(); }
  // A sequence ends: its keys are freed; blocks that fetches still write into go back to
  // the pool when those fetches end (the sequence's block table is emptied).
  void on_finish(Sequence* seq);

  // Swap or recompute: a preempted sequence is swapped out only when moving its blocks
  // down and back is estimated to take less than computing its tokens again. Down: the
  // step's wait for its swap-outs' copies, per block; back: a swap-in's time from its
  // fetches' start to the last landing, per block (both exponentially weighted, so queueing
  // behind other transfers counts once, not per block); recompute: seconds per token of
  // recent prompt steps. Until all three are measured, it swaps.
  void observe_compute(int64_t tokens, double seconds);
  double recompute_s_per_token() const { return recompute_s_per_token_; }  // 0: not measured
  double swap_s_per_block() const;                                         // < 0: not measured
  void set_swap_cost_for_test(double s_per_block) { swap_cost_override_.store(s_per_block); }
  void fail_next_finish_for_test() { fail_next_finish_.store(true); }

  // Scheduler::TierPrefixLookup: consecutive cached blocks the tiers hold, settled.
  int32_t lookup_prefix(const int32_t* tokens, int32_t first, int32_t max_blocks, int32_t block_size,
                        uint64_t parent, std::vector<uint64_t>* hashes) const;
  int32_t num_prefix_blocks() const { return static_cast<int32_t>(prefix_.size()); }

  // Scheduler::ColdRoom: L2 slots (and with l3_cold(), L3 pages) free for cold blocks,
  // after dropping the oldest cached prefix copies while fewer than `want` are.
  int32_t cold_room(int32_t want);
  // Where a cold block's KV lies in L2 (the L1 block layout), or null when it is not in L2
  // (in L3, or lost).
  const void* cold_l2_data(uint64_t key) const;
  // Cold blocks may go to L3 (read layer by layer by read_cold_l3).
  bool l3_cold() const { return l3_slices_ > 0; }
  // The step's reads of its cold blocks in L3: entries (index in `list`, key). `list` is
  // BatchMeta::cold_blocks (the L3 entries null).
  // With `stage` (CUDA), every cold entry goes through its buffers (ColdL3Reads).
  std::unique_ptr<ColdL3Reads> read_cold_l3(const std::vector<const void*>& list,
                                            const std::vector<std::pair<int32_t, uint64_t>>& entries,
                                            const std::function<ColdStage(int64_t bytes)>& stage = {},
                                            ColdReadPlan plan = {});
  // Whether a step now could read (or, demoting, put) a cold block in L3: some running
  // sequence has one there, or L2 has fewer free slots than the step could demote.
  bool l3_cold_in_use(const std::vector<Sequence*>& running) const;
  // Tests: every layer of a step's L3 reads takes at least this long (ColdL3Reads).
  void set_l3_read_delay_for_test(double s) { l3_read_delay_s_.store(s); }
  // Whether no page write of these cold keys (a step's L3 entries) is still in flight; with
  // wait, waits until none is. A cold demote to L3 holds its step only until its L1 block is
  // copied out; the lane step that reads the page back starts its reads once this is true.
  // Moves the faults of the writes that ended into what read_cold_l3 reports as lost.
  bool cold_l3_written(const std::vector<std::pair<int32_t, uint64_t>>& entries, bool wait);
  // Tests: every cold page write to L3 counts as ending this long after its demote started
  // (a slow disk's stand-in for cold_l3_written).
  void set_l3_write_delay_for_test(double s) { l3_write_delay_s_.store(s); }
  // Frees cold copies the engine took from a sequence (Scheduler::recompute).
  void free_cold_keys(const std::vector<uint64_t>& keys);
  // The most blocks one sequence may have: L1's and L2's resident slots, and L3's pages
  // with l3_cold().
  int32_t max_sequence_blocks() const {
    const int64_t n = config_.num_kv_blocks + int64_t{tiers_->map().l2_capacity()} +
                      (l3_cold() ? tiers_->map().num_l3_pages() : 0);
    return static_cast<int32_t>(std::min<int64_t>(n, INT32_MAX));
  }

  // Sequences whose fetched KV landed since the last call: tokens [first_token, end_token)
  // of each are back in L1 (the engine rebuilds what derives from the keys, e.g. the
  // dynamic-sparsity block summaries, before the next step reads them).
  struct Landed {
    Sequence* seq;
    int32_t first_token, end_token;
  };
  std::vector<Landed> take_landed() {
    std::vector<Landed> out;
    out.swap(landed_);
    return out;
  }

  TierStats tier_stats() const { return tiers_->stats(); }
  TierManager& tiers() { return *tiers_; }
  SwapCounters counters() const { return counters_; }

 private:
  struct KeyInfo {
    int64_t seq;
    int32_t index;   // block index within the sequence's swapped prefix
    bool pending;    // a transfer of this key has not been applied yet
    bool freed;      // dropped while pending: its completion only settles bookkeeping
  };
  struct Orphan {     // blocks of a finished sequence that fetches still write into
    std::vector<int32_t> blocks;
    int32_t pending;
  };
  struct TierPrefix {  // a cached block's copy in L2/L3, owned by the index
    uint64_t key = 0, parent = 0;
    std::vector<int32_t> tokens;
    bool settled = false;  // its demote completed
    std::list<uint64_t>::iterator lru;
  };
  void drop_key(uint64_t key);
  uint64_t demote_counted(int32_t block, const TierCallback& on_done);
  void spill_prefixes(const StepPlan& plan, const TierCallback& on_done);
  struct StepCopies;
  TierCallback step_copy(const std::shared_ptr<StepCopies>& c);
  bool wait_step_copies(const StepCopies& c);  // false when one failed
  void demote_cold(const StepPlan& plan);
  void free_cold_key(uint64_t key);
  void take_cold_lost_locked();  // with mu_ held: cold_lost_new_ into cold_lost_
  // Waits for the callbacks of the cold demotes an earlier step left to the device's ordering
  // (demote_cold); fails the step if one of those copies failed.
  void settle_cold_demotes();
  struct Promotion {
    int64_t seq;
    int32_t index;  // in the sequence's block table
    int32_t block;  // the L1 block it is copied into
  };
  void promote(const StepPlan& plan, const TierCallback& on_done);
  void finish_promotion(const TierResult& r, const Promotion& p);
  void take_prefixes(Sequence* s);
  bool evict_oldest_prefix();
  void erase_prefix(uint64_t hash);
  void truncate(Sequence* s, int32_t index);
  void finish_swap_in(Sequence* s);

  EngineConfig config_;
  Scheduler* scheduler_;
  BlockPool* pool_;
  std::function<void()> wake_;
  EventSink events_;
  SwapCounters counters_;
  std::vector<Landed> landed_;
  std::unordered_map<uint64_t, KeyInfo> keys_;  // engine thread only
  std::unordered_map<int64_t, Orphan> orphans_;
  std::unordered_map<uint64_t, Promotion> promotions_;  // by tier key, while its copy runs
  std::unordered_map<uint64_t, TierPrefix> prefix_;  // by chain hash
  std::unordered_map<uint64_t, uint64_t> prefix_key_;  // tier key -> chain hash, while indexed
  std::list<uint64_t> prefix_lru_;                      // settled hashes, oldest first
  double recompute_s_per_token_ = 0;  // exponentially weighted, over prompt steps
  double copy_s_per_block_ = 0, fetch_s_per_block_ = 0;  // likewise (0: not measured)
  std::unordered_map<int64_t, std::pair<double, int32_t>> fetch_started_;  // seq -> (time, blocks)
  std::atomic<double> swap_cost_override_{-1.0};  // set from another thread (tests)
  std::atomic<bool> fail_next_finish_{false};     // tests

  mutable std::mutex mu_;  // done_, copies_pending_
  std::condition_variable copied_cv_;
  std::vector<TierResult> done_;
  int32_t copies_pending_ = 0;
  // The latest step's cold demotes whose copies the compute stream waits for on the device
  // and whose callbacks (the blocks' state) the next step's start() waits for; null: none.
  std::shared_ptr<StepCopies> unsettled_;

  std::atomic<double> l3_read_delay_s_{0};
  std::atomic<double> l3_write_delay_s_{0};
  // Tests (l3_write_delay_s_): when each cold page write to L3 counts as ended. Engine thread.
  std::unordered_map<uint64_t, std::chrono::steady_clock::time_point> l3_write_ready_at_;
  std::vector<TierResult> held_;  // promotions of sequences in the L3 lane (apply_completions)
  int32_t l3_slices_ = 0;  // > 0: cold blocks may go to L3 (one slice a layer)
  // Cold blocks whose copy to L3 failed (no space, I/O error): key -> evict_reason, until
  // the key is freed. cold_lost_new_ takes them from the tier threads (under mu_).
  std::unordered_map<uint64_t, std::string> cold_lost_;
  std::vector<std::pair<uint64_t, std::string>> cold_lost_new_;

  std::unique_ptr<TierManager> tiers_;  // last: destroyed (drained) first
};

}  // namespace k25
