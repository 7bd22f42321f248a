// k25::Engine — the engine loop on its own thread.
//
// add_request() validates and queues a request and returns its id; the engine thread
// schedules, runs the model, samples and emits incremental RequestOutputs, which callers
// collect with wait_outputs(). Thread-safe: any thread may add, abort or wait.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "k25/config.h"
#include "k25/predictor_stats.h"
#include "k25/sampling.h"

namespace k25 {

class ModelExecutor;
class Scheduler;
class BlockPool;
class KVSwap;
class BlockPredictor;
struct BatchMeta;
struct BlockReads;
struct Sequence;
struct StepPlan;
struct ScheduledSeq;
struct SampleResult;
struct TierStats;

struct TokenLogprobOut {
  int32_t token;
  float logprob;
  std::vector<std::pair<int32_t, float>> top;
};

struct RequestOutput {
  int64_t id = 0;
  std::vector<int32_t> new_token_ids;
  std::vector<TokenLogprobOut> new_logprobs;  // one per new token when logprobs were asked
  bool finished = false;
  std::string finish_reason;  // "stop", "length", "abort", "error" once finished
  std::string stop_string;    // the stop string that ended it, if any
  std::string error;
  int32_t num_prompt_tokens = 0;
  int32_t num_output_tokens = 0;
  int32_t num_preemptions = 0;
  // Timing so far (cumulative): queue wait before the first step, prefill chunks and the
  // time of the steps that ran them.
  double queue_time_s = 0;
  int32_t prefill_chunks = 0;
  double prefill_time_s = 0;
  std::vector<float> prompt_logits;  // [num_prompt_tokens, vocab] when asked, at finish
};

// KV blocks taken from a request before it finished (for [KV_CACHE] logs).
struct KVEvent {
  int64_t request_id = 0;
  std::vector<int32_t> blocks;
  // "preempt_recompute" | "preempt_swap" | "abort" | "error", or a tier fault that cost
  // a swapped sequence its parked KV ("checksum_mismatch", "short_read", "no_space", ...)
  std::string reason;
};

// Dynamic sparsity of one layer since the engine started (decode selections only).
struct LayerSparsityStats {
  int64_t blocks_total = 0;    // blocks of the selections, one count per KV head
  int64_t blocks_skipped = 0;
  int64_t selections = 0;      // (sequence, KV head, step) selections
  int64_t reused_selections = 0;  // of the same, those carried over from an earlier step (not counted in selections)
  double entropy_bits = 0;     // summed entropy of the estimated attention mass over blocks
  std::vector<int32_t> top_blocks;  // best-scoring physical blocks of the latest selection
};

struct EngineStats {
  int64_t steps = 0;
  int64_t pipelined_steps = 0;  // launched before the previous step's samples were known
  int64_t lane_steps = 0;       // of steps, those of the L3 lane (sequences with cold blocks in L3)
  int64_t lane_deferred_aborts = 0;  // aborts that came during their request's lane step (applied at its end)
  // Lane steps whose reads started after the others' step: their plan's demotes were still
  // writing the pages they read back (an L3 page write holds no step).
  int64_t lane_deferred_starts = 0;
  // Halves (K or V of one layer of one block) of cold blocks in L3 that lane steps read, and
  // those they left unread because the selection skipped the block (ColdReadPlan).
  int64_t l3_halves_read = 0;
  int64_t l3_halves_skipped = 0;
  int64_t l3_halves_late = 0;  // of those read, the ones read after their layer's selection (not ahead)
  int64_t prefill_tokens = 0;  // tokens computed for prompts (and recomputation)
  int64_t decode_tokens = 0;   // tokens computed one per sequence per step
  int64_t generated_tokens = 0;
  int64_t preemptions = 0;
  int64_t requests_added = 0;
  int64_t requests_finished = 0;
  int64_t requests_aborted = 0;
  int64_t requests_failed = 0;
  int32_t running = 0;
  int32_t waiting = 0;
  int32_t blocks_total = 0;
  int32_t blocks_used = 0;
  int32_t blocks_free = 0;
  int32_t block_size = 0;
  double busy_time_s = 0;  // time spent inside steps
  // The latest regular step (an L3 lane step, whose layers run between them, is not one).
  double last_step_s = 0;
  int32_t last_step_tokens = 0;
  std::vector<LayerSparsityStats> sparsity_layers;  // empty unless sparsity is on
  // Preemption by swap (cache_mode="hierarchical")
  int64_t swap_outs = 0;       // sequences whose KV was parked in L2/L3
  int64_t swap_ins = 0;        // sequences that got it back
  int64_t swap_fallbacks = 0;  // sequences that recomputed (part of) it: no room, or a fault
  int64_t swap_declined = 0;   // preemptions that recomputed: estimated cheaper than swapping
  double recompute_s_per_token = 0;  // the estimate behind that choice (0: not measured yet)
  double swap_s_per_block = -1;      // mean offload + fetch latency per block (< 0: not yet)
  // Prefix caching (enable_prefix_caching): tokens of admitted requests looked up, those
  // found cached (not computed), and blocks registered in the cache now.
  int64_t prefix_cache_queries = 0;
  int64_t prefix_cache_hits = 0;
  int32_t prefix_cached_blocks = 0;
  // With tiers: hits fetched from L2/L3 (tokens), cached blocks copied down from L1, and
  // cached copies the tiers hold now.
  int64_t prefix_cache_tier_hits = 0;
  int64_t prefix_spilled_blocks = 0;
  int32_t prefix_tier_blocks = 0;
  // A sequence longer than L1 (cache_mode="hierarchical", CPU): blocks of running sequences
  // that live in L2 now, and blocks moved there so far.
  int32_t cold_blocks = 0;
  int64_t cold_demotes = 0;
  // On CUDA, cold entries that dense steps gathered into device memory a layer ahead instead of
  // reading them over the bus, summed over steps (docs/offload.md "Cold blocks on CUDA").
  int64_t cold_gathered = 0;
  // Cold blocks whose copy back to L1 landed in the block table (a request may end before
  // one of its promotions lands: <= predictor.promotions).
  int64_t cold_promotions = 0;
  // Its predictor (docs/offload.md "The predictor"): hits and misses, promotions.
  PredictorCounters predictor;
};

struct RequestSpec {
  std::vector<int32_t> prompt;
  SamplingParams params;
  Priority priority = Priority::kSilver;
  bool want_prompt_logits = false;
  int32_t single_token_from = -1;  // see Sequence::single_token_from
};

class Engine {
 public:
  // token_bytes[i]: the UTF-8 bytes token i adds to the text (for stop strings; may be
  // empty when the model has no tokenizer). eos_token_ids end generation unless ignore_eos.
  Engine(const EngineConfig& config, std::unique_ptr<ModelExecutor> executor,
         std::vector<std::string> token_bytes, std::vector<int32_t> eos_token_ids);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Validates and queues; throws k25::Error (kInvalidArgument, kResourceExhausted).
  int64_t add_request(RequestSpec spec);
  // Validates every request, then queues them all at once (ids in order): the engine sees
  // them together, so they are scheduled the same way on every run (an offline batch is
  // reproducible). One invalid request queues none of them.
  std::vector<int64_t> add_requests(std::vector<RequestSpec> specs);
  // Ends a request early (finish_reason "abort"); unknown or finished ids are ignored.
  void abort(int64_t id);
  // Blocks until at least one output is ready or the timeout passes.
  std::vector<RequestOutput> wait_outputs(double timeout_s);
  EngineStats stats() const;
  // KV evictions since the last call (bounded: the oldest are dropped past 4096).
  std::vector<KVEvent> drain_kv_events();
  const EngineConfig& config() const { return config_; }
  // Tier counters (cache_mode="hierarchical"); false when the engine has no tiers.
  bool tier_stats(TierStats* out) const;
  // Tests: flips a byte on disk in each of the next n pages written to L3 (see
  // TierManager). Throws kInvalidArgument without an L3 tier.
  void corrupt_next_l3_writes_for_test(int32_t n);
  // Tests: each layer of a lane step's L3 reads takes at least this long (a slow disk).
  // Throws kInvalidArgument without cold blocks in L3.
  void delay_l3_reads_for_test(double seconds);
  // Tests: each cold page written to L3 counts as written this long after its demote
  // started (a slow disk's writes). Throws kInvalidArgument without cold blocks in L3.
  void delay_l3_writes_for_test(double seconds);
  // Tests: each copy into L1 begun from now on (a swap-in's or prefix fetch's blocks, a
  // promotion) calls back no earlier than this long after it began (a slow bus). Throws
  // kInvalidArgument without tiers.
  void delay_tier_copies_in_for_test(double seconds);
  // Tests: the tiers' release of the next request to finish throws (an engine bug's stand-in).
  void fail_next_kv_release_for_test();
  // Tests: the swap-or-recompute choice sees this cost per block instead of the measured one.
  void set_swap_cost_for_test(double s_per_block);
  // Aborts what is left and stops the engine thread. Idempotent.
  void shutdown();

 private:
  void loop();
  void step();
  void emit(RequestOutput out);
  void gauges_locked();  // the gauges of stats_ from the scheduler and pool; mu_ held
  void refresh_gauges();
  void fail_all(const std::string& error);
  // Hands the KV that tier fetches brought back since the last call to the executor.
  void refresh_fetched_kv();
  void finish(Sequence* seq, int reason, const std::string& error, std::vector<RequestOutput>* outs);
  bool check_stop(Sequence* seq, int32_t token, std::string* matched);
  // Pipelined decode (async scheduling): see engine.cpp.
  bool can_pipeline() const;
  struct StepRecord;
  void collect_in_flight();
  void collect(std::unique_ptr<StepRecord> rec);
  struct StepCounts;
  void process_samples(const StepRecord& rec, const std::vector<Sequence*>& seqs,
                       const std::vector<SampleResult>& results, double t_done, std::vector<RequestOutput>* outs,
                       StepCounts* counts);
  void fail_step(const std::vector<Sequence*>& seqs, const std::string& error);
  struct StepInputs;
  void build_inputs(const std::vector<ScheduledSeq>& seqs, StepInputs* in);
  // The L3 lane (engine.cpp): sequences with cold blocks in L3 step there.
  struct Lane;
  bool reads_l3(const Sequence& s) const;  // some cold block of s is in L3
  // The lane step of `plan` (its sequences in the lane); its reads start now, or later
  // (advance_lane) when this step's demotes are still writing pages it reads. False: it
  // failed its sequences.
  bool start_lane(StepPlan plan, double t0);
  bool begin_lane_reads();  // the lane's reads and executor step; false: it failed them
  // Runs the lane step's layers whose reads are in (with `wait`, the next one in any case),
  // for up to budget_s (one layer at least); ends the step after its last layer.
  void advance_lane(bool wait, double budget_s = 1e30);
  void finish_lane();
  void cancel_lane();  // its tokens stay uncomputed (shutdown, an engine failure)
  // Ends the lane's executor step and reads (waiting for both); its sequences leave the lane.
  void stop_lane(Lane* lane);
  // stop_lane, then finishes the sequences aborted meanwhile and returns the others.
  std::vector<Sequence*> end_lane(Lane* lane);
  void add_counts_locked(const StepCounts& counts);  // with mu_ held: counters and gauges
  void tier_counters_locked();  // with mu_ held: stats_'s copies of the scheduler's and tiers' counters

  EngineConfig config_;
  std::unique_ptr<ModelExecutor> executor_;
  std::vector<std::string> token_bytes_;
  std::vector<int32_t> eos_token_ids_;
  size_t max_stop_len_cap_ = 0;
  int32_t vocab_size_ = 0;
  int32_t max_seq_blocks_ = 0;  // most KV blocks one request may need (L1, plus L2 (and L3) with cold blocks)
  bool cold_l3_ = false;        // cold blocks may go to L3 (KVSwap::l3_cold, with cold blocks on)

  std::unique_ptr<BlockPool> pool_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<BlockPredictor> predictor_;  // with cold blocks; engine thread only
  // After a step ran: what its attention read, for the predictor.
  void observe_reads(const BatchMeta& meta, const std::vector<Sequence*>& seqs);
  void observe_reads(const BatchMeta& meta, const std::vector<Sequence*>& seqs, const BlockReads& reads,
                     int64_t step);
  int64_t plan_serial_ = 0;  // steps planned with a predictor (BlockPredictor::begin_plan)
  std::unique_ptr<Lane> lane_;  // the L3 lane's step, while one runs
  bool lane_waits_ = false;     // K25_L3_LANE=0: the step that plans a lane step runs it whole
  bool lane_write_wait_ = false;  // K25_L3_WRITE_WAIT=1: ... waits for its demotes' page writes

  mutable std::mutex mu_;  // guards inbox_, aborts_, stop_, stats_ snapshot
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Sequence>> inbox_;
  std::unique_ptr<Sequence> make_sequence(RequestSpec spec) const;  // validates
  std::vector<int64_t> aborts_;
  bool stop_ = false;
  int64_t next_id_ = 1;
  uint64_t next_arrival_ = 0;
  EngineStats stats_;

  std::deque<KVEvent> kv_events_;  // guarded by mu_
  void record_kv_event(int64_t id, const std::vector<int32_t>& blocks, const char* reason, bool always = false);

  std::mutex out_mu_;
  std::condition_variable out_cv_;
  std::deque<RequestOutput> outbox_;

  std::mutex join_mu_;
  std::thread thread_;

  // Engine thread: a launched step whose results are not collected yet (pipelined decode).
  std::unique_ptr<StepRecord> in_flight_;
  bool pipeline_ = true;  // K25_ASYNC_SCHEDULING=0 turns pipelined decode off
  // Engine thread: the last step could not run anything until a tier transfer completes.
  bool waiting_for_tiers_ = false;
  // Tier counters as last read (guarded by mu_), so that they outlive shutdown.
  std::shared_ptr<TierStats> last_tier_stats_;
  std::unique_ptr<KVSwap> swap_;  // last: destroyed first (it drains transfers into the pool)
};

}  // namespace k25
