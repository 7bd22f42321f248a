#include "k25/engine.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>

#include "engine/executor.h"
#include "engine/kv_swap.h"
#include "engine/scheduler.h"
#include "engine/sequence.h"
#include "k25/status.h"
#include "kv/block_pool.h"
#include "kv/tiers/predictor.h"
#include "ops/kv_layout.h"

namespace k25 {

namespace {

double now_s() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double>(clock::now().time_since_epoch()).count();
}

}  // namespace

// What the engine keeps of a step between launching it and processing its samples: per
// scheduled sequence its id (a pipelined step's sequence may finish or be aborted before
// the step's results are collected), whether it emits, its sample and where the sampled
// token goes in its token list (-1: appended).
struct Engine::StepRecord {
  std::vector<int64_t> ids;
  std::vector<char> emits;
  std::vector<int> sample_of_seq;
  std::vector<int32_t> token_index;
  BatchMeta meta;    // a pipelined step's, kept for the predictor's reads at its collection
  int64_t plan = 0;  // and its plan's serial (BlockPredictor::begin_plan)
};

struct Engine::StepCounts {
  int64_t generated = 0, finished = 0, failed = 0;
};

// What the executor gets for a step of some scheduled sequences (build_inputs).
struct Engine::StepInputs {
  BatchMeta meta;
  std::vector<SampleRequest> samples;
  std::vector<LogitsCopy> copies;
  std::vector<std::vector<int32_t>> banned;  // samples point into it
  StepRecord rec;
  std::vector<Sequence*> seqs;
  std::vector<std::pair<int32_t, uint64_t>> cold_l3;    // (entry of meta.cold_blocks, key) in L3
  std::vector<std::pair<size_t, int32_t>> cold_l3_seq;  // its (sequence in seqs, block index)
  int64_t prefill_tokens = 0, decode_tokens = 0;
};

// The L3 lane (docs/offload.md): a step of the sequences with cold blocks in L3, whose
// forward runs a layer at a time as its reads come in, between the other sequences' steps.
// Members end in reverse order: the executor's step (it waits for the device), then the
// reads (they wait for the disk), then the inputs both refer to.
struct Engine::Lane {
  StepPlan plan;  // its sequences only
  StepInputs in;
  std::unique_ptr<ColdL3Reads> reads;
  std::unique_ptr<LayeredStep> step;
  std::vector<int64_t> aborted;  // aborts that came while it ran: they end with it
  double t0 = 0;                 // when it was planned
  double busy_s = 0;             // time in its layers
  int64_t plan_serial = 0;       // the plan it ran (BlockPredictor::begin_plan)
};

Engine::Engine(const EngineConfig& config, std::unique_ptr<ModelExecutor> executor,
               std::vector<std::string> token_bytes, std::vector<int32_t> eos_token_ids)
    : config_(config),
      executor_(std::move(executor)),
      token_bytes_(std::move(token_bytes)),
      eos_token_ids_(std::move(eos_token_ids)) {
  if (!executor_) fail(ErrorCode::kInvalidArgument, "engine needs a model executor");
  if (config_.max_seq_len <= 0) fail(ErrorCode::kInvalidArgument, "max_seq_len must be positive");
  vocab_size_ = executor_->vocab_size();
  // The pool's dtype is make_executor's choice; a config that names another one was not passed
  // there (a C++ host's mistake), so say so rather than run with a pool it did not ask for.
  const std::string& want = config_.kv_cache_dtype;
  if (!want.empty() && want != "auto" && !executor_->kv_dtype().empty() && executor_->kv_dtype() != want) {
    fail(ErrorCode::kInvalidArgument, "EngineConfig::kv_cache_dtype is '" + want + "' but the executor's KV pool is " +
                                          executor_->kv_dtype() + ": pass it to make_executor");
  }
  if (config_.max_seq_len > executor_->max_positions()) {
    fail(ErrorCode::kInvalidArgument, "max_seq_len " + std::to_string(config_.max_seq_len) +
                                          " exceeds the positions the model was loaded for (" +
                                          std::to_string(executor_->max_positions()) + ")");
  }
  if (!token_bytes_.empty() && static_cast<int32_t>(token_bytes_.size()) < vocab_size_) {
    // Padded model vocabularies have ids the tokenizer does not know; they add no text.
    token_bytes_.resize(vocab_size_);
  }
  pool_ = std::make_unique<BlockPool>(config_.num_kv_blocks);
  max_seq_blocks_ = config_.num_kv_blocks;
  scheduler_ = std::make_unique<Scheduler>(config_, pool_.get());
  stats_.blocks_total = pool_->num_total();
  stats_.blocks_free = pool_->num_total();
  stats_.block_size = config_.block_size;
  if (config_.swap_preempted) {
    last_tier_stats_ = std::make_shared<TierStats>();
    swap_ = std::make_unique<KVSwap>(
        config_, executor_->kv_host_base(), executor_->kv_block_bytes(), scheduler_.get(), pool_.get(),
        [this] {
          // Taking mu_ orders this wake-up after the loop's check of its predicate.
          { std::lock_guard<std::mutex> lk(mu_); }
          cv_.notify_all();
        },
        [this](int64_t id, const std::vector<int32_t>& blocks, const std::string& reason) {
          record_kv_event(id, blocks, reason.c_str(), true);
        },
        [this](TierConfig* tc) { return executor_->configure_tiers(tc); },
        executor_->cold_l3_slices());  // (used only if supports_cold_blocks(), known once the tiers exist)
    if (executor_->supports_cold_blocks()) {
      // A sequence longer than L1 keeps running with some of its blocks in L2 (use (a) of
      // the tiers, docs/offload.md).
      KVSwap* swap = swap_.get();
      scheduler_->set_cold_room([swap](int32_t want) { return swap->cold_room(want); });
      // Promotions copy up from L2 only: a cold block in L3 stays there.
      cold_l3_ = swap_->l3_cold();
      if (cold_l3_) scheduler_->set_cold_promotable([swap](uint64_t key) { return swap->cold_l2_data(key) != nullptr; });
      if (cold_l3_) {
        scheduler_->set_lane_cancel([this] { cancel_lane(); });
        // One lane step at a time: the others with L3 blocks wait for it unplanned.
        scheduler_->set_lane_held([this](const Sequence& s) { return lane_ && reads_l3(s); });
      }
      max_seq_blocks_ = swap_->max_sequence_blocks();
      PredictorConfig pc;
      pc.decay = config_.predictor_decay;
      pc.promote_heat = config_.predictor_promote_heat;
      pc.margin = config_.predictor_margin;
      pc.max_moves = config_.predictor_max_moves;
      pc.free_watermark = config_.predictor_free_watermark;
      pc.max_entropy = config_.predictor_max_entropy;
      predictor_ = std::make_unique<BlockPredictor>(pc);
      scheduler_->set_predictor(predictor_.get());
    }
    if (config_.enable_prefix_caching) {
      // Cached blocks evicted from L1 go down to L2/L3 and are found there (docs/offload.md).
      pool_->set_record_evictions(true);
      KVSwap* swap = swap_.get();
      scheduler_->set_tier_prefix_lookup([swap](const int32_t* tokens, int32_t first, int32_t max_blocks,
                                                int32_t block_size, uint64_t parent, std::vector<uint64_t>* hashes) {
        return swap->lookup_prefix(tokens, first, max_blocks, block_size, parent, hashes);
      });
    }
  }
  executor_->warm_up(config_.max_batch_size);
  // K25_L3_LANE=0: a lane step runs whole inside the step that plans it, so the others wait
  // for its disk reads (the behaviour before the lane; for measuring what the lane saves).
  const char* lane = std::getenv("K25_L3_LANE");
  lane_waits_ = lane && std::string(lane) == "0";
  // K25_L3_WRITE_WAIT=1: the step that plans a lane step waits for its demotes' page writes
  // (the behaviour before the lane's reads could start later; for measuring what that saves).
  const char* write_wait = std::getenv("K25_L3_WRITE_WAIT");
  lane_write_wait_ = write_wait && std::string(write_wait) == "1";
  const char* pipe = std::getenv("K25_ASYNC_SCHEDULING");
  pipeline_ = !(pipe && std::string(pipe) == "0");
  thread_ = std::thread([this] { loop(); });
}

Engine::~Engine() {
  shutdown();
  lane_.reset();  // (the loop ends it) before swap_, whose tiers its reads use
}

void Engine::shutdown() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  // Concurrent callers all return after the thread has ended; only one joins it.
  std::lock_guard<std::mutex> join(join_mu_);
  if (thread_.joinable()) thread_.join();
  // Then the tiers: wait for transfers in flight, close (and remove) the L3 file. Their
  // last counters stay readable.
  std::unique_ptr<KVSwap> swap;
  {
    std::lock_guard<std::mutex> lk(mu_);
    swap = std::move(swap_);
  }
  if (swap) {
    // Outside mu_: draining runs callbacks that take it. The last counters include the
    // transfers that were still in flight.
    swap->tiers().drain();
    const TierStats last = swap->tier_stats();
    {
      std::lock_guard<std::mutex> lk(mu_);
      *last_tier_stats_ = last;
    }
    swap.reset();
  }
}

int64_t Engine::add_request(RequestSpec spec) {
  std::vector<RequestSpec> one;
  one.push_back(std::move(spec));
  return add_requests(std::move(one)).front();
}

std::vector<int64_t> Engine::add_requests(std::vector<RequestSpec> specs) {
  std::vector<std::unique_ptr<Sequence>> seqs;
  for (RequestSpec& spec : specs) seqs.push_back(make_sequence(std::move(spec)));
  std::vector<int64_t> ids;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_) fail(ErrorCode::kResourceExhausted, "the engine is shut down");
    for (std::unique_ptr<Sequence>& seq : seqs) {
      seq->id = next_id_++;
      seq->arrival = next_arrival_++;
      ids.push_back(seq->id);
      inbox_.push_back(std::move(seq));
      ++stats_.requests_added;
    }
  }
  cv_.notify_all();
  return ids;
}

std::unique_ptr<Sequence> Engine::make_sequence(RequestSpec spec) const {
  auto bad = [](const std::string& m) { fail(ErrorCode::kInvalidArgument, m); };
  const int64_t P = static_cast<int64_t>(spec.prompt.size());
  if (P == 0) bad("the prompt is empty");
  for (int32_t t : spec.prompt) {
    if (t < 0 || t >= vocab_size_) {
      bad("prompt token id " + std::to_string(t) + " is outside the vocabulary (size " +
          std::to_string(vocab_size_) + ")");
    }
  }
  SamplingParams& p = spec.params;
  validate_sampling_params(p, vocab_size_);
  if (!p.stop.empty() && token_bytes_.empty()) {
    bad("stop strings need a tokenizer; this model has none (use stop_token_ids)");
  }
  if (spec.want_prompt_logits && P * static_cast<int64_t>(vocab_size_) > (int64_t{1} << 31)) {
    bad("the prompt logits of " + std::to_string(P) + " tokens would take over 8 GB; score shorter pieces");
  }
  if (config_.decode_max_tokens > 0) p.max_new_tokens = std::min(p.max_new_tokens, config_.decode_max_tokens);
  const int64_t needed = P + (p.max_new_tokens > 0 ? 1 : 0);
  if (needed > config_.max_seq_len) {
    bad("the prompt has " + std::to_string(P) + " tokens; max_seq_len is " +
        std::to_string(config_.max_seq_len) + " and must hold the prompt plus one new token");
  }
  const int64_t max_total = std::min<int64_t>(P + p.max_new_tokens, config_.max_seq_len);
  const int32_t blocks = blocks_for_tokens(max_total, config_.block_size);
  if (blocks > max_seq_blocks_) {
    const std::string room = max_seq_blocks_ > config_.num_kv_blocks
                                 ? (cold_l3_ ? "the KV pool, L2 and L3 hold " : "the KV pool and L2 hold ") + std::to_string(max_seq_blocks_)
                                 : "the KV pool holds " + std::to_string(config_.num_kv_blocks);
    // With tiers on but an executor that cannot read cold blocks (the unfused path), more
    // L2 or L3 would not help: say what would.
    const bool tiers_without_cold = swap_ && !executor_->supports_cold_blocks();
    const std::string remedy = tiers_without_cold
                                   ? "raise kv_cache_bytes or lower max_new_tokens (a request longer than the KV "
                                     "pool runs with its older blocks in L2/L3 only on the fused path, "
                                     "enable_kernel_fusion=True)"
                                   : std::string("raise kv_cache_bytes (or l2_bytes") + (cold_l3_ ? " or l3_bytes" : "") +
                                         " with cache_mode='hierarchical') or lower max_new_tokens";
    fail(ErrorCode::kResourceExhausted,
         "the request needs up to " + std::to_string(max_total) + " tokens of KV (" + std::to_string(blocks) +
             " blocks) but " + room + " blocks of " + std::to_string(config_.block_size) + " tokens; " + remedy);
  }

  auto seq = std::make_unique<Sequence>();
  seq->tokens = std::move(spec.prompt);
  seq->num_prompt_tokens = static_cast<int32_t>(P);
  seq->max_total_tokens = static_cast<int32_t>(max_total);
  seq->priority = spec.priority;
  seq->params = std::move(p);
  seq->want_prompt_logits = spec.want_prompt_logits;
  seq->single_token_from = spec.single_token_from;
  if (seq->params.has_seed) {
    seq->seed = seq->params.seed;
  } else {
    std::random_device rd;
    seq->seed = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  }
  seq->arrival_time = now_s();
  return seq;
}

void Engine::abort(int64_t id) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    aborts_.push_back(id);
  }
  cv_.notify_all();
}

std::vector<RequestOutput> Engine::wait_outputs(double timeout_s) {
  std::unique_lock<std::mutex> lk(out_mu_);
  if (outbox_.empty() && timeout_s > 0) {
    // Clamped: a huge duration overflows the clock arithmetic and would not wait at all.
    const double t = std::min(timeout_s, 86400.0);
    out_cv_.wait_for(lk, std::chrono::duration<double>(t), [&] { return !outbox_.empty(); });
  }
  std::vector<RequestOutput> out(std::make_move_iterator(outbox_.begin()),
                                 std::make_move_iterator(outbox_.end()));
  outbox_.clear();
  return out;
}

EngineStats Engine::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  return stats_;
}

void Engine::emit(RequestOutput out) {
  {
    std::lock_guard<std::mutex> lk(out_mu_);
    outbox_.push_back(std::move(out));
  }
  out_cv_.notify_all();
}

bool Engine::tier_stats(TierStats* out) const {
  std::lock_guard<std::mutex> lk(mu_);
  if (swap_) *last_tier_stats_ = swap_->tier_stats();
  if (!last_tier_stats_) return false;
  *out = *last_tier_stats_;
  return true;
}

void Engine::set_swap_cost_for_test(double s_per_block) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!swap_) fail(ErrorCode::kInvalidArgument, "this engine has no tiers");
  swap_->set_swap_cost_for_test(s_per_block);
}

void Engine::corrupt_next_l3_writes_for_test(int32_t n) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!swap_ || !swap_->tiers().has_l3()) fail(ErrorCode::kInvalidArgument, "this engine has no L3 tier");
  swap_->tiers().corrupt_next_l3_writes_for_test(n);
}

void Engine::delay_l3_reads_for_test(double seconds) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!swap_ || !swap_->l3_cold()) fail(ErrorCode::kInvalidArgument, "this engine keeps no cold blocks in L3");
  swap_->set_l3_read_delay_for_test(seconds);
}

void Engine::delay_l3_writes_for_test(double seconds) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!swap_ || !swap_->l3_cold()) fail(ErrorCode::kInvalidArgument, "this engine keeps no cold blocks in L3");
  swap_->set_l3_write_delay_for_test(seconds);
}

void Engine::delay_tier_copies_in_for_test(double seconds) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!swap_) fail(ErrorCode::kInvalidArgument, "this engine has no tiers");
  swap_->tiers().delay_copies_in_for_test(seconds);
}

void Engine::fail_next_kv_release_for_test() {
  std::lock_guard<std::mutex> lk(mu_);
  if (!swap_) fail(ErrorCode::kInvalidArgument, "this engine has no tiers");
  swap_->fail_next_finish_for_test();
}

void Engine::record_kv_event(int64_t id, const std::vector<int32_t>& blocks, const char* reason, bool always) {
  if (blocks.empty() && !always) return;
  std::lock_guard<std::mutex> lk(mu_);
  kv_events_.push_back(KVEvent{id, blocks, reason});
  while (kv_events_.size() > 4096) kv_events_.pop_front();
}

std::vector<KVEvent> Engine::drain_kv_events() {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<KVEvent> out(std::make_move_iterator(kv_events_.begin()), std::make_move_iterator(kv_events_.end()));
  kv_events_.clear();
  return out;
}

void Engine::finish(Sequence* seq, int reason, const std::string& error,
                    std::vector<RequestOutput>* outs) {
  const FinishReason r = static_cast<FinishReason>(reason);
  if (r == FinishReason::kAbort || r == FinishReason::kError) {
    record_kv_event(seq->id, seq->block_table, r == FinishReason::kAbort ? "abort" : "error");
  }
  // A token still being sampled by a step in flight is not part of the output.
  while (!seq->tokens.empty() && seq->tokens.back() == kPendingToken) seq->tokens.pop_back();
  // Letting go of the request's KV (tier copies, blocks) must cost neither the request its
  // output nor the engine its thread: a failure there is an engine bug, logged as
  // "[KV_CACHE] ... evict_reason=release_error" and recorded as a KV event, and the request
  // ends as it would have.
  auto release = [&](const char* what, const std::function<void()>& f) {
    try {
      f();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[KV_CACHE] request=%lld op=release_%s evict_reason=release_error error=\"%s\"\n",
                   static_cast<long long>(seq->id), what, e.what());
      record_kv_event(seq->id, {}, "release_error", true);
    }
  };
  release("tiers", [&] {
    if (swap_) swap_->on_finish(seq);
  });
  if (predictor_) predictor_->forget(seq->id);
  release("blocks", [&] { scheduler_->finish(seq, r); });
  RequestOutput o;
  o.id = seq->id;
  o.finished = true;
  o.finish_reason = finish_reason_name(seq->finish_reason);
  o.error = error;
  o.num_prompt_tokens = seq->num_prompt_tokens;
  o.num_output_tokens = seq->num_output_tokens();
  o.num_preemptions = seq->num_preemptions;
  o.queue_time_s = seq->first_scheduled_time >= 0 ? seq->first_scheduled_time - seq->arrival_time : 0.0;
  o.prefill_chunks = seq->prefill_chunks;
  o.prefill_time_s = seq->prefill_time_s;
  if (seq->want_prompt_logits) o.prompt_logits = std::move(seq->prompt_logits);
  outs->push_back(std::move(o));
}

bool Engine::check_stop(Sequence* seq, int32_t token, std::string* matched) {
  const SamplingParams& p = seq->params;
  const bool may_stop = seq->num_output_tokens() > p.min_new_tokens ||
                        (p.min_new_tokens == 0);
  if (may_stop) {
    if (!p.ignore_eos &&
        std::find(eos_token_ids_.begin(), eos_token_ids_.end(), token) != eos_token_ids_.end()) {
      return true;
    }
    if (std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), token) != p.stop_token_ids.end()) {
      return true;
    }
  }
  if (!p.stop.empty()) {
    const std::string& piece = token_bytes_[token];
    // Like EOS, stop strings cannot end a request before min_new_tokens (vLLM's rule);
    // the bytes still enter the tail so that a later match can span them.
    std::string& tail = seq->output_bytes_tail;
    tail += piece;
    size_t longest = 0;
    for (const std::string& s : p.stop) longest = std::max(longest, s.size());
    // Only matches that end inside the new bytes are new.
    for (size_t i = 0; may_stop && i < p.stop.size(); ++i) {
      const std::string& s = p.stop[i];
      size_t from = tail.size() > piece.size() + s.size() - 1 ? tail.size() - piece.size() - s.size() + 1 : 0;
      if (tail.find(s, from) != std::string::npos) {
        *matched = s;
        return true;
      }
    }
    if (tail.size() > 2 * longest + 256) tail.erase(0, tail.size() - longest);
  }
  return false;
}

void Engine::loop() {
  executor_->prepare_thread();
  while (true) {
    std::deque<std::unique_ptr<Sequence>> adds;
    std::vector<int64_t> aborts;
    bool stopping;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] {
        // A step that could run nothing until a tier transfer lands sleeps until one does.
        const bool blocked = waiting_for_tiers_ && !swap_->has_completions();
        // Idle with completions to apply (a finished request's promotions): they give
        // blocks back.
        const bool tidy = swap_ && !scheduler_->has_unfinished() && swap_->has_completions();
        return stop_ || !inbox_.empty() || !aborts_.empty() || (scheduler_->has_unfinished() && !blocked) || tidy;
      });
      // Batching window: an idle engine that just got work waits a moment for more
      // arrivals, so that a burst starts in one step instead of one request at a time.
      if (config_.batching_window_ms > 0 && !inbox_.empty() && !stop_ && !scheduler_->has_unfinished()) {
        const auto deadline = std::chrono::steady_clock::now() +
                              std::chrono::duration<double, std::milli>(config_.batching_window_ms);
        while (!stop_ && cv_.wait_until(lk, deadline) != std::cv_status::timeout) {
        }
      }
      adds.swap(inbox_);
      aborts.swap(aborts_);
      stopping = stop_;
    }
    std::vector<RequestOutput> outs;
    for (auto& s : adds) scheduler_->add(std::move(s));
    if (stopping && in_flight_) collect_in_flight();  // its tokens are delivered, then the rest aborts
    if (stopping) cancel_lane();
    if (stopping) {
      // Nothing new starts; whatever is left ends as aborted.
      std::vector<Sequence*> left(scheduler_->running());
      left.insert(left.end(), scheduler_->waiting().begin(), scheduler_->waiting().end());
      for (Sequence* s : left) finish(s, static_cast<int>(FinishReason::kAbort), "", &outs);
    }
    for (int64_t id : aborts) {
      Sequence* s = scheduler_->find(id);
      if (s && s->in_lane) {  // its lane step is reading its blocks: it ends with that step
        if (std::find(lane_->aborted.begin(), lane_->aborted.end(), id) != lane_->aborted.end()) continue;
        lane_->aborted.push_back(id);
        std::lock_guard<std::mutex> lk(mu_);
        ++stats_.lane_deferred_aborts;
        continue;
      }
      if (s && s->status != SeqStatus::kFinished) finish(s, static_cast<int>(FinishReason::kAbort), "", &outs);
    }
    for (RequestOutput& o : outs) {
      scheduler_->release(o.id);
      std::lock_guard<std::mutex> lk(mu_);
      ++stats_.requests_aborted;
    }
    // Aborts free blocks outside a successful step: refresh the gauges before anyone is
    // told, and again after the step (whose failure paths also free blocks).
    refresh_gauges();
    for (RequestOutput& o : outs) emit(std::move(o));
    if (stopping) break;
    if (swap_ && !scheduler_->has_unfinished()) {
      try {
        swap_->apply_completions();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "[KV_CACHE] applying tier completions failed: %s\n", e.what());
      }
      refresh_gauges();
    }
    if (scheduler_->has_unfinished()) {
      try {
        step();
      } catch (const std::exception& e) {
        // Outside the model call (which step() handles itself) a failure means the
        // engine's own state is in doubt: end every request with the error, stay up.
        fail_all(std::string("engine step failed: ") + e.what());
      }
      refresh_gauges();
    }
  }
}

void Engine::observe_reads(const BatchMeta& meta, const std::vector<Sequence*>& seqs) {
  BlockReads reads;
  if (executor_->block_reads(meta, &reads)) observe_reads(meta, seqs, reads, plan_serial_);
}

// seqs[i] null: the sequence finished or was aborted since its (pipelined) step was launched.
// step: the plan the step ran (BlockPredictor::begin_plan).
void Engine::observe_reads(const BatchMeta& meta, const std::vector<Sequence*>& seqs, const BlockReads& reads,
                           int64_t step) {
  std::vector<uint8_t> cold;
  for (size_t i = 0; i < seqs.size() && i < reads.reads.size(); ++i) {
    const std::vector<int32_t>& r = reads.reads[i];
    if (r.empty() || seqs[i] == nullptr) continue;  // a prompt chunk: it reads every block and predicts nothing
    const int32_t* row = meta.block_tables.data() + static_cast<std::ptrdiff_t>(i) * meta.max_blocks_per_seq;
    cold.assign(r.size(), 0);
    for (size_t b = 0; b < r.size(); ++b) {
      if (row[b] > cold_block_id(0)) continue;
      // A cold block's entry: its bytes in L2, or null (in L3, read back for the step).
      const size_t j = static_cast<size_t>(cold_block_index(row[b]));
      cold[b] = j < meta.cold_blocks.size() && meta.cold_blocks[j] != nullptr ? BlockPredictor::kReadFromL2
                                                                              : BlockPredictor::kReadFromL3;
    }
    predictor_->observe(seqs[i]->id, r.data(), cold.data(), static_cast<int32_t>(r.size()), reads.passes,
                        reads.sparse[i] != 0, step);
  }
}

void Engine::refresh_fetched_kv() {
  const std::vector<KVSwap::Landed> landed = swap_->take_landed();
  if (landed.empty()) return;
  BatchMeta runs;
  runs.query_start.push_back(0);
  for (const KVSwap::Landed& l : landed) {
    runs.max_blocks_per_seq = std::max<int32_t>(runs.max_blocks_per_seq, static_cast<int32_t>(l.seq->block_table.size()));
  }
  runs.block_tables.assign(static_cast<size_t>(runs.max_blocks_per_seq) * landed.size(), -1);
  for (size_t i = 0; i < landed.size(); ++i) {
    const KVSwap::Landed& l = landed[i];
    runs.query_start.push_back(runs.query_start.back() + (l.end_token - l.first_token));
    runs.context_lens.push_back(l.end_token);
    std::copy(l.seq->block_table.begin(), l.seq->block_table.end(),
              runs.block_tables.begin() + static_cast<std::ptrdiff_t>(i) * runs.max_blocks_per_seq);
  }
  executor_->refresh_fetched_kv(runs);
}

void Engine::fail_all(const std::string& error) {
  cancel_lane();
  if (in_flight_) {
    // Wait for the launched steps (they write the pool; a failure between a launch and the
    // previous step's collection leaves two), drop their results.
    in_flight_.reset();
    std::vector<SampleResult> ignored;
    for (int i = 0; i < 2; ++i) {
      try {
        executor_->collect_async(&ignored);
      } catch (const std::exception&) {
        break;  // none left
      }
    }
  }
  std::vector<Sequence*> left(scheduler_->running());
  left.insert(left.end(), scheduler_->waiting().begin(), scheduler_->waiting().end());
  std::vector<RequestOutput> outs;
  for (Sequence* s : left) finish(s, static_cast<int>(FinishReason::kError), error, &outs);
  for (RequestOutput& o : outs) scheduler_->release(o.id);
  {
    std::lock_guard<std::mutex> lk(mu_);
    stats_.requests_failed += static_cast<int64_t>(outs.size());
  }
  for (RequestOutput& o : outs) emit(std::move(o));
}

void Engine::refresh_gauges() {
  std::lock_guard<std::mutex> lk(mu_);
  gauges_locked();
}

void Engine::gauges_locked() {
  stats_.running = scheduler_->num_running();
  stats_.waiting = scheduler_->num_waiting();
  stats_.blocks_used = pool_->num_used();
  stats_.blocks_free = pool_->num_free();
  stats_.prefix_cache_queries = scheduler_->prefix_query_tokens();
  stats_.prefix_cache_hits = scheduler_->prefix_hit_tokens();
  stats_.prefix_cache_tier_hits = scheduler_->prefix_tier_hit_tokens();
  stats_.prefix_cached_blocks = pool_->num_cached();
}

// Pipelined decode (vLLM's "async scheduling", SGLang's overlap scheduler): while step N
// runs on the device, the engine plans and launches step N+1, whose rows take step N's
// sampled ids on the device (BatchMeta::prev_rows; the token list holds kPendingToken
// until then), and only then waits for step N's ids and processes them. The host's work
// between two steps (planning, staging, the graph launch) overlaps the device's instead of
// leaving it idle. Only steps that cannot change the plan by what they sample are
// pipelined: every running sequence decodes one token (greedy or sampled, with or without
// logprobs) without penalties (they read the token history), with no waiting sequence, no
// swap, no preemption (its next block is free, or it is longer than L1 and demotes one of
// its own blocks for it: decode_step_fits), no bans (min_new_tokens met), no scoring,
// and its pending token is not its last allowed one. A sequence that
// stops on a sampled token (EOS, stop string) has had one more step launched for it; that
// step's row is discarded and the blocks it wrote are freed with the rest (the device
// runs steps in order, so a later step that reuses them runs after it).
bool Engine::can_pipeline() const {
  if (!pipeline_ || !executor_->supports_async()) return false;
  // A lane step (cold blocks in L3) runs eagerly, a layer at a time, between whole steps.
  if (cold_l3_ && swap_->l3_cold_in_use(scheduler_->running())) return false;
  const std::vector<Sequence*>& run = scheduler_->running();
  if (static_cast<int32_t>(run.size()) > executor_->max_async_batch()) return false;
  // Its cold blocks (one more each if it demotes one for its next token) within what a launched
  // step reads of them.
  int64_t cold = 0;
  for (const Sequence* s : run) cold += s->num_cold + 1;
  if (cold > executor_->max_async_cold_blocks()) return false;
  for (const Sequence* s : run) {
    const SamplingParams& p = s->params;
    // Penalties read the token history, which the step in flight extends.
    if (reads_token_history(p) || s->want_prompt_logits || s->single_token_from >= 0) return false;
    if (p.min_new_tokens > 0 && s->num_output_tokens() <= p.min_new_tokens) return false;
    if (s->num_output_tokens() >= p.max_new_tokens || s->num_tokens() >= s->max_total_tokens) return false;
  }
  return scheduler_->decode_step_fits();  // last: it may make L2 room (ColdRoom evicts prefix copies)
}

void Engine::fail_step(const std::vector<Sequence*>& seqs, const std::string& error) {
  std::vector<RequestOutput> outs;
  for (Sequence* s : seqs) {
    if (s && s->status != SeqStatus::kFinished) finish(s, static_cast<int>(FinishReason::kError), error, &outs);
  }
  for (RequestOutput& o : outs) scheduler_->release(o.id);
  {
    std::lock_guard<std::mutex> lk(mu_);
    stats_.requests_failed += static_cast<int64_t>(outs.size());
  }
  for (RequestOutput& o : outs) emit(std::move(o));
}

// Waits for a launched step (the oldest in flight) and processes its samples (sequences
// finished or aborted since its launch are skipped).
void Engine::collect_in_flight() { collect(std::move(in_flight_)); }

void Engine::collect(std::unique_ptr<StepRecord> rec) {
  std::vector<Sequence*> seqs;
  for (int64_t id : rec->ids) {
    Sequence* s = scheduler_->find(id);
    seqs.push_back(s && s->status != SeqStatus::kFinished ? s : nullptr);
  }
  std::vector<SampleResult> results;
  try {
    executor_->collect_async(&results);
    if (results.size() != static_cast<size_t>(std::count_if(rec->sample_of_seq.begin(), rec->sample_of_seq.end(),
                                                            [](int i) { return i >= 0; }))) {
      fail(ErrorCode::kInternal, "executor returned wrong result count");
    }
  } catch (const std::exception& e) {
    return fail_step(seqs, std::string("model step failed: ") + e.what());
  }
  if (predictor_) {
    // Before the samples, which may finish a sequence (and end its predictor state).
    BlockReads reads;
    if (executor_->collected_block_reads(&reads)) observe_reads(rec->meta, seqs, reads, rec->plan);
  }
  std::vector<RequestOutput> outs;
  StepCounts counts;
  process_samples(*rec, seqs, results, now_s(), &outs, &counts);
  {
    std::lock_guard<std::mutex> lk(mu_);
    add_counts_locked(counts);
    // The collected step's selection statistics have landed with its outputs (CUDA: the
    // copy of the device's sums precedes the step's ids on its stream).
    stats_.sparsity_layers = executor_->sparsity_stats();
    if (predictor_) stats_.predictor = predictor_->counters();  // with the reads observed above
  }
  for (RequestOutput& o : outs) emit(std::move(o));
}

void Engine::add_counts_locked(const StepCounts& counts) {
  stats_.generated_tokens += counts.generated;
  stats_.requests_finished += counts.finished;
  stats_.requests_failed += counts.failed;
  gauges_locked();
}

// The executor's inputs for a step of `seqs_in` (all of a plan's, or the lane's).
void Engine::build_inputs(const std::vector<ScheduledSeq>& seqs_in, StepInputs* in) {
  const int32_t bs = config_.block_size;
  BatchMeta& meta = in->meta;
  meta.query_start.push_back(0);
  int32_t max_blocks = 0;
  for (const ScheduledSeq& s : seqs_in) {
    max_blocks = std::max<int32_t>(max_blocks, static_cast<int32_t>(s.seq->block_table.size()));
  }
  meta.max_blocks_per_seq = max_blocks;
  meta.block_tables.assign(static_cast<size_t>(max_blocks) * seqs_in.size(), -1);

  std::vector<SampleRequest>& samples = in->samples;
  std::vector<LogitsCopy>& copies = in->copies;
  std::vector<std::vector<int32_t>>& banned = in->banned;
  banned.assign(seqs_in.size(), {});  // samples point into it: sized once
  StepRecord& rec = in->rec;
  rec.sample_of_seq.assign(seqs_in.size(), -1);
  rec.token_index.assign(seqs_in.size(), -1);
  std::vector<Sequence*>& seqs = in->seqs;
  auto& cold_l3 = in->cold_l3;
  auto& cold_l3_seq = in->cold_l3_seq;
  int64_t& prefill_tokens = in->prefill_tokens;
  int64_t& decode_tokens = in->decode_tokens;
  for (size_t i = 0; i < seqs_in.size(); ++i) {
    const ScheduledSeq& s = seqs_in[i];
    Sequence* seq = s.seq;
    seqs.push_back(seq);
    rec.ids.push_back(seq->id);
    rec.emits.push_back(s.emits);
    if (seq->want_prompt_logits && seq->prompt_logits.empty()) {
      seq->prompt_logits.assign(static_cast<size_t>(seq->num_prompt_tokens) * vocab_size_, 0.0f);
    }
    for (int32_t j = 0; j < s.num_new_tokens; ++j) {
      const int32_t pos = seq->num_computed + j;
      const int32_t row = meta.num_tokens();
      if (seq->tokens[pos] == kPendingToken) {
        // Sampled by the step in flight: the device hands the id over.
        meta.prev_rows.resize(row, -1);
        meta.prev_rows.push_back(seq->pending_row);
        meta.token_ids.push_back(0);
      } else {
        meta.token_ids.push_back(seq->tokens[pos]);
      }
      meta.positions.push_back(pos);
      const int32_t block = seq->block_table[pos / bs];
      if (block < 0) fail(ErrorCode::kInternal, "a step writes into a cold block");
      meta.slot_mapping.push_back(static_cast<int64_t>(block) * bs + pos % bs);
      const bool last = j == s.num_new_tokens - 1;
      const bool prompt_row = seq->want_prompt_logits && pos < seq->num_prompt_tokens;
      if (prompt_row || (last && s.emits)) {
        const int32_t lr = static_cast<int32_t>(meta.logits_rows.size());
        meta.logits_rows.push_back(row);
        if (prompt_row) {
          copies.push_back({lr, seq->prompt_logits.data() + static_cast<size_t>(pos) * vocab_size_});
        }
        if (last && s.emits && seq->params.max_new_tokens > seq->num_output_tokens()) {
          SampleRequest r;
          r.logits_row = lr;
          r.input.params = &seq->params;
          r.input.tokens = &seq->tokens;
          r.input.num_prompt_tokens = seq->num_prompt_tokens;
          r.input.seed = seq->seed;
          if (seq->num_output_tokens() < seq->params.min_new_tokens) {
            if (!seq->params.ignore_eos) banned[i] = eos_token_ids_;
            banned[i].insert(banned[i].end(), seq->params.stop_token_ids.begin(),
                             seq->params.stop_token_ids.end());
            r.input.banned = &banned[i];
          }
          rec.sample_of_seq[i] = static_cast<int>(samples.size());
          samples.push_back(r);
        }
      }
    }
    meta.query_start.push_back(meta.num_tokens());
    meta.context_lens.push_back(seq->num_computed + s.num_new_tokens);
    meta.seq_ids.push_back(seq->id);
    std::copy(seq->block_table.begin(), seq->block_table.end(),
              meta.block_tables.begin() + static_cast<std::ptrdiff_t>(i) * max_blocks);
    if (seq->num_cold > 0) {
      // Cold blocks are read where they lie in L2: entry j of meta.cold_blocks; those in L3
      // layer by layer while the step runs (cold_l3 below).
      int32_t* row = meta.block_tables.data() + static_cast<std::ptrdiff_t>(i) * max_blocks;
      for (size_t b = 0; b < seq->block_table.size(); ++b) {
        if (row[b] != kColdBlock) continue;
        const int32_t j = static_cast<int32_t>(meta.cold_blocks.size());
        row[b] = cold_block_id(j);
        const uint64_t key = seq->cold_keys.at(b);
        const void* data = swap_->cold_l2_data(key);
        if (!data && !cold_l3_) fail(ErrorCode::kInternal, "cold block " + std::to_string(key) + " is not in L2");
        if (!data) {
          cold_l3.emplace_back(j, key);
          cold_l3_seq.emplace_back(i, static_cast<int32_t>(b));
        }
        meta.cold_blocks.push_back(data);
        // (null where the executor keeps none on the host: on CUDA, those of L2 blocks)
        const bool sums = b < seq->cold_summaries.size() && !seq->cold_summaries[b].empty();
        meta.cold_summaries.push_back(sums ? seq->cold_summaries[b].data() : nullptr);
      }
    }
    meta.max_query_len = std::max(meta.max_query_len, s.num_new_tokens);
    meta.max_context_len = std::max(meta.max_context_len, seq->num_computed + s.num_new_tokens);
    if (seq->num_computed + s.num_new_tokens < seq->num_tokens() || s.num_new_tokens > 1) {
      prefill_tokens += s.num_new_tokens;
    } else {
      decode_tokens += s.num_new_tokens;
    }
  }
  if (!meta.prev_rows.empty()) meta.prev_rows.resize(meta.num_tokens(), -1);
}

// Steps a request may lose to its cold blocks in L3 (each one recomputes it) before it fails.
constexpr int32_t kMaxColdTierFaults = 3;

void Engine::step() {
  const double t0 = now_s();
  waiting_for_tiers_ = false;
  const bool pipelined = can_pipeline();
  if (in_flight_ && !pipelined) {
    collect_in_flight();
    if (!scheduler_->has_unfinished()) return;
  }
  if (swap_) {
    swap_->apply_completions();
    refresh_fetched_kv();
  }
  if (predictor_) predictor_->begin_plan(++plan_serial_);
  StepPlan plan = scheduler_->schedule();
  for (size_t i = 0; i < plan.preempted.size(); ++i) {
    const bool swapped = std::any_of(plan.swap_outs.begin(), plan.swap_outs.end(),
                                     [&](const SwapOut& so) { return so.seq->id == plan.preempted[i]; });
    if (!swapped) record_kv_event(plan.preempted[i], plan.preempted_blocks[i], "preempt_recompute");
  }
  // A demoted block's summaries kept on the host with its sequence (none: the executor keeps none).
  auto keep_host_summaries = [](const StepPlan::ColdDemote& d, std::vector<float> sums) {
    if (sums.empty()) return;
    if (d.seq->cold_summaries.size() < d.seq->block_table.size()) d.seq->cold_summaries.resize(d.seq->block_table.size());
    d.seq->cold_summaries[static_cast<size_t>(d.index)] = std::move(sums);
  };
  for (const StepPlan::ColdDemote& d : plan.cold_demotes) {
    // Before this step's writes reset the L1 block's summaries for its new content.
    keep_host_summaries(d, executor_->block_summaries(d.block));
  }
  if (swap_) swap_->start(plan);  // records preempt_swap (or preempt_recompute) itself
  if (swap_) {
    // Device-side summaries of the blocks that just went cold (their L2 slots are known now).
    for (const StepPlan::ColdDemote& d : plan.cold_demotes) {
      const uint64_t key = d.seq->cold_keys.at(static_cast<size_t>(d.index));
      const void* data = key != 0 ? swap_->cold_l2_data(key) : nullptr;
      if (data) {
        executor_->keep_cold_summaries(d.block, data);
      } else if (key != 0 && cold_l3_) {
        // In L3 (no slot for device rows): a host copy, for the staged steps that read it.
        keep_host_summaries(d, executor_->cold_l3_summaries(d.block));
      }
    }
  }
  for (const ScheduledSeq& s : plan.seqs) {
    if (s.seq->first_scheduled_time < 0) s.seq->first_scheduled_time = t0;
  }
  // Sequences with cold blocks in L3 step in the lane, a layer at a time between the others'
  // steps, so that the disk does not hold the others up; while a lane step runs, another
  // such sequence is skipped (it keeps what this plan gave it).
  double lane_wait_s = 0;
  if (cold_l3_) {
    StepPlan lane_plan;
    std::vector<ScheduledSeq> rest;
    for (const ScheduledSeq& s : plan.seqs) {
      if (!reads_l3(*s.seq)) {
        rest.push_back(s);
        continue;
      }
      plan.num_tokens -= s.num_new_tokens;
      if (!lane_) lane_plan.seqs.push_back(s);
    }
    plan.seqs = std::move(rest);
    // A lane that could not start failed its own requests; the plan's others run next loop
    // (with an empty plan here, the code below would take a waiting request for unschedulable).
    if (!lane_plan.seqs.empty() && !start_lane(std::move(lane_plan), t0)) return;
    if (lane_waits_ && lane_) {
      // K25_L3_LANE=0: the others wait for the lane step (finish_lane counts its busy time).
      const double tw = now_s();
      while (lane_) advance_lane(true);
      if (plan.empty()) return;
      lane_wait_s = now_s() - tw;
    }
  }
  std::vector<RequestOutput> outs;
  if (plan.empty() && lane_) {
    // Nothing else to run: the lane's next layer, waiting for its reads if need be.
    return advance_lane(true);
  }
  if (plan.empty() && swap_ && (swap_->in_flight() > 0 || swap_->has_completions())) {
    waiting_for_tiers_ = true;  // every sequence that could run waits for a transfer
    return;
  }
  if (plan.empty()) {
    // Unreachable when admission checks hold (an idle pool fits any admitted request);
    // fail the head of the queue rather than spin.
    if (scheduler_->num_running() == 0 && scheduler_->num_waiting() > 0) {
      Sequence* s = scheduler_->waiting().front();
      finish(s, static_cast<int>(FinishReason::kError), "request could not be scheduled", &outs);
      scheduler_->release(s->id);
      std::lock_guard<std::mutex> lk(mu_);
      ++stats_.requests_failed;
    }
    for (RequestOutput& o : outs) emit(std::move(o));
    return;
  }

  StepInputs inputs;
  build_inputs(plan.seqs, &inputs);
  BatchMeta& meta = inputs.meta;
  std::vector<SampleRequest>& samples = inputs.samples;
  std::vector<LogitsCopy>& copies = inputs.copies;
  StepRecord& rec = inputs.rec;
  std::vector<Sequence*>& seqs = inputs.seqs;
  const int64_t prefill_tokens = inputs.prefill_tokens, decode_tokens = inputs.decode_tokens;
  if (!inputs.cold_l3.empty()) fail(ErrorCode::kInternal, "a whole step with cold blocks in L3 (they run in the lane)");

  StepCounts counts;
  std::unique_ptr<StepRecord> previous;  // pipelined: the step to collect while this one runs
  if (pipelined) {
    try {
      executor_->launch_async(meta, samples);
    } catch (const std::exception& e) {
      // Nothing was launched: the step in flight (if any) is collected, then this one fails.
      if (in_flight_) collect_in_flight();
      return fail_step(seqs, std::string("model step failed: ") + e.what());
    }
    scheduler_->complete_step(plan);
    for (size_t i = 0; i < seqs.size(); ++i) {
      if (rec.sample_of_seq[i] < 0) continue;
      seqs[i]->tokens.push_back(kPendingToken);
      seqs[i]->pending_row = samples[rec.sample_of_seq[i]].logits_row;
      rec.token_index[i] = seqs[i]->num_tokens() - 1;
    }
    if (predictor_) {
      rec.meta = std::move(meta);  // its block tables tell cold reads from resident ones
      rec.plan = plan_serial_;
    }
    previous = std::move(in_flight_);
    in_flight_ = std::make_unique<StepRecord>(std::move(rec));
  } else {
    std::vector<SampleResult> results;
    const double t_exec = now_s();
    try {
      executor_->execute(meta, samples, &results, copies);
      if (results.size() != samples.size()) fail(ErrorCode::kInternal, "executor returned wrong result count");
    } catch (const std::exception& e) {
      // The step's sequences fail; the engine and every other request carry on.
      return fail_step(seqs, std::string("model step failed: ") + e.what());
    }
    const double t_done = now_s();
    if (predictor_) observe_reads(meta, seqs);
    // What recomputing costs, for the swap-or-recompute choice (prompt steps).
    if (swap_ && prefill_tokens > 0) swap_->observe_compute(prefill_tokens + decode_tokens, t_done - t_exec);
    for (const ScheduledSeq& s : plan.seqs) {
      if (s.seq->num_computed < s.seq->num_prompt_tokens) {  // this step computed prompt tokens
        ++s.seq->prefill_chunks;
        s.seq->prefill_time_s += t_done - t0;
      }
    }
    scheduler_->complete_step(plan);
    process_samples(rec, seqs, results, t_done, &outs, &counts);
  }
  const double t1 = now_s();
  {
    std::lock_guard<std::mutex> lk(mu_);
    ++stats_.steps;
    if (pipelined) ++stats_.pipelined_steps;
    stats_.prefill_tokens += prefill_tokens;
    stats_.decode_tokens += decode_tokens;
    add_counts_locked(counts);
    stats_.busy_time_s += t1 - t0 - lane_wait_s;
    stats_.last_step_s = t1 - t0 - lane_wait_s;
    stats_.last_step_tokens = plan.num_tokens;
    stats_.sparsity_layers = executor_->sparsity_stats();
    tier_counters_locked();
  }
  for (RequestOutput& o : outs) emit(std::move(o));
  if (previous) {
    // After this step's counters: whoever sees the previous step's outputs sees them too.
    collect(std::move(previous));
    std::lock_guard<std::mutex> lk(mu_);
    stats_.busy_time_s += now_s() - t1;
  }
  // The lane layers whose reads came in while this step ran, for at most as long as the step
  // took (one layer at least): the others' steps then take at most about twice their time.
  advance_lane(false, now_s() - t0);
}

bool Engine::reads_l3(const Sequence& s) const {
  if (!cold_l3_ || s.num_cold == 0) return false;
  for (size_t b = 0; b < s.block_table.size(); ++b) {
    if (s.block_table[b] == kColdBlock && !swap_->cold_l2_data(s.cold_keys.at(b))) return true;
  }
  return false;
}

bool Engine::start_lane(StepPlan plan, double t0) {
  auto lane = std::make_unique<Lane>();
  lane->plan = std::move(plan);
  lane->t0 = t0;
  lane->plan_serial = plan_serial_;
  build_inputs(lane->plan.seqs, &lane->in);
  for (Sequence* s : lane->in.seqs) s->in_lane = true;
  lane_ = std::move(lane);
  // This plan's demotes to L3 may still be writing pages the step reads back: then its reads
  // start after the others' step, once the pages are written (advance_lane), so that the
  // others do not wait for the disk's writes either.
  if (!swap_->cold_l3_written(lane_->in.cold_l3, /*wait=*/lane_write_wait_)) {
    ++stats_.lane_deferred_starts;
    return true;
  }
  return begin_lane_reads();
}

bool Engine::begin_lane_reads() {
  Lane* lane = lane_.get();
  std::function<ColdStage(int64_t)> stage;
  if (executor_->stages_cold_blocks()) stage = [this](int64_t bytes) { return executor_->cold_stage(bytes); };
  try {
    // The reads of the first layers start here, while the others' step runs.
    ColdReadPlan reads_plan = executor_->cold_read_plan(lane->in.meta);
    if (reads_plan.selective) {
      // What the last lane step's attention read of each block is read whole ahead.
      const size_t L = reads_plan.layers.size();
      reads_plan.ahead.assign(lane->in.meta.cold_blocks.size() * L, 0);
      for (size_t e = 0; e < lane->in.cold_l3.size(); ++e) {
        const auto [i, b] = lane->in.cold_l3_seq[e];
        const Sequence* s = lane->in.seqs[i];
        if (static_cast<size_t>(b) >= s->l3_kept.size() || s->l3_kept[static_cast<size_t>(b)].size() != L) continue;
        std::copy(s->l3_kept[static_cast<size_t>(b)].begin(), s->l3_kept[static_cast<size_t>(b)].end(),
                  reads_plan.ahead.begin() +
                      static_cast<std::ptrdiff_t>(static_cast<size_t>(lane->in.cold_l3[e].first) * L));
      }
    }
    lane->reads =
        swap_->read_cold_l3(lane->in.meta.cold_blocks, lane->in.cold_l3, stage, std::move(reads_plan));
    lane->in.meta.cold_layers = lane->reads.get();
    lane->step = executor_->begin_layered(lane->in.meta, lane->in.samples);
  } catch (const std::exception& e) {  // e.g. no memory for the read buffers: these requests fail
    std::unique_ptr<Lane> failed = std::move(lane_);
    // Its reads end before failing frees the keys they read; aborts that came meanwhile end too.
    std::vector<Sequence*> seqs = end_lane(failed.get());
    fail_step(seqs, std::string("model step failed: ") + e.what());
    return false;
  }
  return true;
}

void Engine::advance_lane(bool wait, double budget_s) {
  if (!lane_) return;
  if (!lane_->reads) {  // its reads wait for its pages' writes (start_lane)
    if (!swap_->cold_l3_written(lane_->in.cold_l3, wait) || !begin_lane_reads()) return;
  }
  Lane& ln = *lane_;
  try {
    const double start = now_s();
    bool first = true;
    while (ln.step->next_layer() < ln.step->num_layers()) {
      if (!wait && !ln.reads->layer_ready(ln.step->next_layer())) return;
      if (!first && now_s() - start >= budget_s) return;  // the others' next step first
      const double t = now_s();
      ln.step->run_layer();
      ln.busy_s += now_s() - t;
      wait = false;
      first = false;
    }
  } catch (const std::exception& e) {
    std::unique_ptr<Lane> lane = std::move(lane_);
    std::vector<Sequence*> seqs = end_lane(lane.get());
    return fail_step(seqs, std::string("model step failed: ") + e.what());
  }
  finish_lane();
}

void Engine::stop_lane(Lane* lane) {
  lane->step.reset();   // waits for the device to finish its launched layers
  lane->reads.reset();  // waits for the reads in flight
  lane->in.meta.cold_layers = nullptr;
  for (Sequence* s : lane->in.seqs) s->in_lane = false;
}

std::vector<Sequence*> Engine::end_lane(Lane* lane) {
  stop_lane(lane);
  std::vector<RequestOutput> outs;
  std::vector<Sequence*> left;
  for (Sequence* s : lane->in.seqs) {
    const bool aborted = std::find(lane->aborted.begin(), lane->aborted.end(), s->id) != lane->aborted.end();
    if (!aborted) {
      left.push_back(s);
      continue;
    }
    finish(s, static_cast<int>(FinishReason::kAbort), "", &outs);
  }
  for (RequestOutput& o : outs) {
    scheduler_->release(o.id);
    std::lock_guard<std::mutex> lk(mu_);
    ++stats_.requests_aborted;
  }
  for (RequestOutput& o : outs) emit(std::move(o));
  return left;
}

void Engine::cancel_lane() {
  if (!lane_) return;
  std::unique_ptr<Lane> lane = std::move(lane_);
  // The step's tokens stay uncomputed: its sequences step again. Called from the scheduler
  // too (a preemption): nothing here may change its queues, so the aborts that came while
  // the step ran go back to the engine loop, which applies them with the next ones.
  stop_lane(lane.get());
  if (!lane->aborted.empty()) {
    std::lock_guard<std::mutex> lk(mu_);
    aborts_.insert(aborts_.end(), lane->aborted.begin(), lane->aborted.end());
  }
}

void Engine::finish_lane() {
  std::unique_ptr<Lane> lane = std::move(lane_);
  StepInputs& in = lane->in;
  std::vector<SampleResult> results;
  const double t_exec = now_s();
  try {
    lane->step->finish(&results, in.copies);
    if (results.size() != in.samples.size()) fail(ErrorCode::kInternal, "executor returned wrong result count");
  } catch (const std::exception& e) {
    std::vector<Sequence*> seqs = end_lane(lane.get());
    return fail_step(seqs, std::string("model step failed: ") + e.what());
  }
  const double t_done = now_s();
  lane->busy_s += t_done - t_exec;
  BlockReads reads;  // (taken before stop_lane ends the executor's step)
  const bool have_reads = predictor_ && lane->step->block_reads(in.meta, &reads);
  // Cold blocks in L3 that could not be read back intact (or written: lost): the step read
  // zeros for them, so each such sequence drops this step's result and recomputes.
  std::vector<Sequence*>& seqs = in.seqs;
  std::vector<bool> spoiled(seqs.size(), false);
  std::vector<std::string> spoiled_why(seqs.size());
  const int64_t halves_read = lane->reads->halves_read();
  const int64_t halves_skipped = lane->reads->halves_skipped();
  const int64_t halves_late = lane->reads->halves_late();
  if (lane->reads->selective()) {
    for (size_t e = 0; e < in.cold_l3.size(); ++e) {
      const auto [i, b] = in.cold_l3_seq[e];
      Sequence* s = seqs[i];
      if (s->l3_kept.size() <= static_cast<size_t>(b)) s->l3_kept.resize(static_cast<size_t>(b) + 1);
      s->l3_kept[static_cast<size_t>(b)] = lane->reads->kept_layers(e);
    }
  }
  for (const auto& [e, why] : lane->reads->finish()) {
    const size_t i = in.cold_l3_seq[e].first;
    if (!spoiled[i]) spoiled_why[i] = why;
    spoiled[i] = true;
  }
  stop_lane(lane.get());
  for (const ScheduledSeq& s : lane->plan.seqs) {
    if (s.seq->num_computed < s.seq->num_prompt_tokens) {  // this step computed prompt tokens
      ++s.seq->prefill_chunks;
      s.seq->prefill_time_s += t_done - lane->t0;
    }
  }
  std::vector<RequestOutput> outs;
  StepCounts counts;
  int64_t aborted = 0;
  std::vector<int64_t> failed_ids;  // released after complete_step, which still walks the plan
  for (size_t i = 0; i < seqs.size(); ++i) {
    // Aborted while the step ran: it ends now, its result unused.
    if (std::find(lane->aborted.begin(), lane->aborted.end(), seqs[i]->id) != lane->aborted.end()) {
      finish(seqs[i], static_cast<int>(FinishReason::kAbort), "", &outs);
      failed_ids.push_back(seqs[i]->id);
      seqs[i] = nullptr;
      ++aborted;
    }
  }
  try {
    // Before complete_step: a spoiled step's blocks must not count as computed (nor be offered
    // to the prefix cache: their KV derives from the zeros read in place of the bad block).
    for (size_t i = 0; i < seqs.size(); ++i) {
      if (!spoiled[i] || !seqs[i]) continue;
      Sequence* seq = seqs[i];
      seqs[i] = nullptr;  // its sample (if any) is not used
      if (++seq->cold_tier_faults > kMaxColdTierFaults) {
        // A tier that keeps failing (a full or failing disk): the request ends with the
        // reason rather than recomputing for ever.
        record_kv_event(seq->id, seq->block_table, spoiled_why[i].c_str(), true);
        finish(seq, static_cast<int>(FinishReason::kError),
               "KV cache tier L3 failed " + std::to_string(seq->cold_tier_faults) + " times for this request (" +
                   spoiled_why[i] + ")", &outs);
        failed_ids.push_back(seq->id);
        ++counts.failed;
        continue;
      }
      std::vector<int32_t> blocks;
      std::vector<uint64_t> keys;
      scheduler_->recompute(seq, &blocks, &keys);
      swap_->free_cold_keys(keys);
      record_kv_event(seq->id, blocks, spoiled_why[i].c_str(), true);
    }
    // The predictor learns from the lane's selections as from any step's (seqs: null for the
    // ones above). Not observe_compute: the lane step's time includes its reads.
    if (have_reads) observe_reads(in.meta, seqs, reads, lane->plan_serial);
    scheduler_->complete_step(lane->plan);  // skips the sequences above (no longer running)
    for (int64_t id : failed_ids) scheduler_->release(id);
    process_samples(in.rec, seqs, results, t_done, &outs, &counts);
  } catch (...) {
    // The engine fails every request it still runs (loop()); the ones this step already ended
    // (aborted, failed) are no longer among them, so their outputs go out here.
    for (int64_t id : failed_ids) scheduler_->release(id);  // (a second release is a no-op)
    for (RequestOutput& o : outs) emit(std::move(o));
    throw;
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    ++stats_.steps;
    ++stats_.lane_steps;
    stats_.l3_halves_read += halves_read;
    stats_.l3_halves_skipped += halves_skipped;
    stats_.l3_halves_late += halves_late;
    stats_.requests_aborted += aborted;
    stats_.prefill_tokens += in.prefill_tokens;
    stats_.decode_tokens += in.decode_tokens;
    add_counts_locked(counts);
    stats_.busy_time_s += lane->busy_s;
    stats_.sparsity_layers = executor_->sparsity_stats();
    tier_counters_locked();
  }
  for (RequestOutput& o : outs) emit(std::move(o));
}

void Engine::tier_counters_locked() {
  stats_.preemptions = scheduler_->num_preemptions();
  if (!swap_) return;
  const SwapCounters c = swap_->counters();
  stats_.swap_outs = c.swap_outs;
  stats_.swap_ins = c.swap_ins;
  stats_.swap_fallbacks = c.swap_fallbacks;
  stats_.swap_declined = c.swap_declined;
  stats_.recompute_s_per_token = swap_->recompute_s_per_token();
  stats_.swap_s_per_block = swap_->swap_s_per_block();
  stats_.prefix_spilled_blocks = c.prefix_spills;
  stats_.prefix_tier_blocks = swap_->num_prefix_blocks();
  stats_.cold_demotes = c.cold_demotes;
  stats_.cold_gathered = executor_->cold_gathered();
  stats_.cold_promotions = c.cold_promotions;
  if (predictor_) stats_.predictor = predictor_->counters();
  int32_t cold = 0;
  for (const Sequence* r : scheduler_->running()) cold += r->num_cold;
  stats_.cold_blocks = cold;
}

// Appends (or, for a pipelined step, fills in) each emitting sequence's sampled token,
// checks stop conditions and builds the outputs. seqs[i]: the record's i-th sequence, or
// null when it finished since the step was launched.
void Engine::process_samples(const StepRecord& rec, const std::vector<Sequence*>& seqs,
                             const std::vector<SampleResult>& results, double t_done,
                             std::vector<RequestOutput>* outs_all, StepCounts* counts) {
  std::vector<RequestOutput>& outs = *outs_all;
  const size_t first_out = outs.size();
  for (size_t i = 0; i < seqs.size(); ++i) {
    Sequence* seq = seqs[i];
    if (!seq || !rec.emits[i]) continue;
    if (rec.sample_of_seq[i] < 0) {  // max_new_tokens reached already (e.g. scoring requests)
      finish(seq, static_cast<int>(FinishReason::kLength), "", &outs);
      continue;
    }
    const SampleResult& r = results[rec.sample_of_seq[i]];
    if (r.token < 0) {
      finish(seq, static_cast<int>(FinishReason::kError), "sampling failed: " + r.error, &outs);
      ++counts->failed;
      continue;
    }
    int32_t index = rec.token_index[i];
    if (index < 0) {
      seq->tokens.push_back(r.token);
      index = seq->num_tokens() - 1;
    } else {
      seq->tokens[index] = r.token;
    }
    // Counts up to this token (a pipelined sequence may already hold the next one pending).
    const int32_t num_output = index + 1 - seq->num_prompt_tokens;
    ++counts->generated;
    if (seq->first_token_time < 0) seq->first_token_time = t_done;
    RequestOutput o;
    o.id = seq->id;
    o.new_token_ids.push_back(r.token);
    if (seq->params.logprobs >= 0) {
      TokenLogprobOut lp{r.token, r.logprob, {}};
      for (const TokenLogprob& t : r.top) lp.top.emplace_back(t.token, t.logprob);
      o.new_logprobs.push_back(std::move(lp));
    }
    std::string matched;
    FinishReason reason = FinishReason::kNone;
    if (check_stop(seq, r.token, &matched)) {
      reason = FinishReason::kStop;
    } else if (num_output >= seq->params.max_new_tokens || index + 1 >= seq->max_total_tokens) {
      reason = FinishReason::kLength;
    }
    if (reason != FinishReason::kNone) {
      std::vector<RequestOutput> fin;
      finish(seq, static_cast<int>(reason), "", &fin);
      o.finished = true;
      o.finish_reason = fin[0].finish_reason;
      o.stop_string = matched;
      o.prompt_logits = std::move(fin[0].prompt_logits);
    }
    o.num_prompt_tokens = seq->num_prompt_tokens;
    o.num_output_tokens = num_output;
    o.num_preemptions = seq->num_preemptions;
    o.queue_time_s = seq->first_scheduled_time - seq->arrival_time;
    o.prefill_chunks = seq->prefill_chunks;
    o.prefill_time_s = seq->prefill_time_s;
    outs.push_back(std::move(o));
  }
  for (size_t k = first_out; k < outs.size(); ++k) {
    const RequestOutput& o = outs[k];
    if (o.finished) {
      scheduler_->release(o.id);
      if (o.finish_reason != "error") ++counts->finished;
    }
  }
}

}  // namespace k25
