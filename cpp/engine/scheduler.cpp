#include "engine/scheduler.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "k25/status.h"

namespace k25 {

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::kNone: return "";
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kAbort: return "abort";
    case FinishReason::kError: return "error";
  }
  return "";
}

Scheduler::Scheduler(const EngineConfig& config, BlockPool* pool) : config_(config), pool_(pool) {
  if (config_.max_num_batched_tokens <= 0 || config_.prefill_chunk_size <= 0 ||
      config_.max_batch_size <= 0 || config_.block_size <= 0) {
    fail(ErrorCode::kInvalidArgument, "scheduler limits must be positive");
  }
}

void Scheduler::add(std::unique_ptr<Sequence> seq) {
  Sequence* s = seq.get();
  if (seqs_.count(s->id)) fail(ErrorCode::kInternal, "duplicate sequence id");
  s->status = SeqStatus::kWaiting;
  seqs_.emplace(s->id, std::move(seq));
  waiting_.push_back(s);
}

Sequence* Scheduler::find(int64_t id) {
  auto it = seqs_.find(id);
  return it == seqs_.end() ? nullptr : it->second.get();
}

// The L1 blocks a sequence holds: its resident ones and those its promotions are being
// copied into (allocated, still cold in its table until the copy lands).
int32_t Scheduler::l1_blocks_held(const Sequence& seq) const {
  int32_t n = static_cast<int32_t>(seq.block_table.size()) - seq.num_cold;
  for (uint8_t p : seq.promoting) n += p != 0;
  return n;
}

int32_t Scheduler::blocks_missing(const Sequence& seq, int32_t num_new_tokens) const {
  int32_t need = blocks_for_tokens(seq.num_computed + num_new_tokens, config_.block_size);
  return std::max<int32_t>(0, need - static_cast<int32_t>(seq.block_table.size()));
}

bool Scheduler::decode_step_fits() const {
  if (!waiting_.empty() || running_.empty()) return false;
  if (static_cast<int32_t>(running_.size()) > config_.max_num_batched_tokens) return false;
  int32_t missing = 0;
  for (const Sequence* s : running_) {
    if (s->swap != SwapState::kNone || s->in_lane || s->num_tokens() - s->num_computed != 1) return false;
    missing += blocks_missing(*s, 1);
  }
  if (missing <= pool_->num_free()) return true;
  // One block short: schedule() gives it to a sequence longer than L1 itself by moving one
  // of its own blocks to L2 (Phase 1), when that sequence is the lowest-ranked, i.e. the one
  // it would otherwise preempt, and every better one got its block first.
  if (!cold_room_ || missing != pool_->num_free() + 1) return false;
  std::vector<Sequence*> order = running_;  // as schedule() sorts them; pick_victim takes the last
  std::stable_sort(order.begin(), order.end(), ranks_before);
  const Sequence* last = order.back();
  return blocks_missing(*last, 1) == 1 && longer_than_l1(*last, 1) &&
         !cold_candidates(*last, 1).empty() && cold_room_(1) >= 1;
}

bool Scheduler::longer_than_l1(const Sequence& s, int32_t n) const {
  // Its blocks with this step's, or all its tokens' (a prompt longer than L1 that others share
  // L1 with would otherwise preempt itself at every chunk, and recompute, until they end).
  return l1_blocks_held(s) + blocks_missing(s, n) > pool_->num_total() ||
         blocks_for_tokens(s.num_tokens(), config_.block_size) > pool_->num_total();
}

bool Scheduler::grow(Sequence* seq, int32_t num_new_tokens) {
  int32_t missing = blocks_missing(*seq, num_new_tokens);
  if (missing > pool_->num_free()) return false;
  std::vector<int32_t> got = pool_->allocate(missing);
  seq->block_table.insert(seq->block_table.end(), got.begin(), got.end());
  return true;
}

void Scheduler::cache_full_blocks(Sequence* seq) {
  if (!config_.enable_prefix_caching) return;
  const int32_t bs = config_.block_size;
  const int32_t full = std::min<int32_t>(seq->num_computed / bs, static_cast<int32_t>(seq->block_table.size()));
  while (seq->num_cache_checked < full) {
    const int32_t i = seq->num_cache_checked;
    const int32_t* t = seq->tokens.data() + static_cast<int64_t>(i) * bs;
    if (std::find(t, t + bs, kPendingToken) != t + bs) return;  // its last token is still being sampled
    const uint64_t parent = i == 0 ? 0 : seq->block_hashes[i - 1];
    if (static_cast<int32_t>(seq->block_hashes.size()) == i) seq->block_hashes.push_back(block_chain_hash(parent, t, bs));
    if (seq->block_table[i] >= 0) pool_->register_block(seq->block_table[i], seq->block_hashes[i], parent, t, bs);
    ++seq->num_cache_checked;
  }
}

void Scheduler::release_blocks(Sequence* seq, bool cache) {
  if (cache) cache_full_blocks(seq);
  // Cold entries hold no L1 block (their tier keys are the engine's to free).
  seq->block_table.erase(std::remove(seq->block_table.begin(), seq->block_table.end(), kColdBlock),
                         seq->block_table.end());
  pool_->release_all(seq->block_table);
  seq->num_cache_checked = 0;
  seq->cold_keys.clear();
  seq->cold_summaries.clear();
  seq->l3_kept.clear();
  seq->promoting.clear();  // their copies end as cancelled (the keys are freed); KVSwap returns the blocks
  seq->num_cold = 0;
}

std::vector<int32_t> Scheduler::cold_candidates(const Sequence& seq, int32_t limit) const {
  // Never the first block (attention sinks; what sparsity always reads). The block this
  // step writes into is never full and computed, so never a candidate. (A pipelined step in
  // flight may still be writing the last token of a block counted full here: its demote's
  // copy runs on the device after that step.)
  std::vector<int32_t> out;
  const int32_t full = std::min<int32_t>(seq.num_computed / config_.block_size,
                                         static_cast<int32_t>(seq.block_table.size()));
  for (int32_t i = 1; i < full && (predictor_ || static_cast<int32_t>(out.size()) < limit); ++i) {
    const int32_t b = seq.block_table[i];
    if (b >= 0 && pool_->refcount(b) == 1) out.push_back(i);
  }
  if (predictor_) {
    predictor_->order_for_demotion(seq.id, &out);
    if (static_cast<int32_t>(out.size()) > limit) out.resize(limit);
  }
  return out;
}

void Scheduler::demote_position(Sequence* seq, int32_t i, StepPlan* plan) {
  if (seq->cold_keys.size() < seq->block_table.size()) seq->cold_keys.resize(seq->block_table.size(), 0);
  plan->cold_demotes.push_back({seq, i, seq->block_table[i]});
  pool_->decref(seq->block_table[i]);  // free now; its bytes are copied out before the step
  seq->block_table[i] = kColdBlock;
  ++seq->num_cold;
}

bool Scheduler::make_cold(Sequence* seq, int32_t need, StepPlan* plan) {
  if (!cold_room_ || need <= 0) return false;
  const std::vector<int32_t> picks = cold_candidates(*seq, need);
  if (static_cast<int32_t>(picks.size()) < need) return false;
  const int32_t want = static_cast<int32_t>(plan->cold_demotes.size()) + need;
  if (cold_room_(want) < want) return false;
  for (int32_t i : picks) demote_position(seq, i, plan);
  return true;
}

void Scheduler::plan_promotions(StepPlan* plan) {
  if (!predictor_ || !cold_room_) return;
  for (const ScheduledSeq& ss : plan->seqs) {
    Sequence* s = ss.seq;
    if (s->num_cold == 0) continue;
    std::vector<int32_t> cold;
    for (int32_t i = 0; i < static_cast<int32_t>(s->block_table.size()); ++i) {
      if (s->block_table[i] != kColdBlock) continue;
      if (i < static_cast<int32_t>(s->promoting.size()) && s->promoting[i]) continue;  // on its way already
      if (cold_promotable_ && !cold_promotable_(s->cold_keys.at(static_cast<size_t>(i)))) continue;
      // Not a block this plan demoted: its copy is not even out yet.
      const bool just_demoted = std::any_of(plan->cold_demotes.begin(), plan->cold_demotes.end(),
                                            [&](const StepPlan::ColdDemote& d) { return d.seq == s && d.index == i; });
      if (!just_demoted) cold.push_back(i);
    }
    // Memory pressure: free blocks go to promotions only above the watermark, and only
    // while nobody waits for them.
    const int32_t free_blocks =
        waiting_.empty() ? predictor_->free_blocks_above_watermark(pool_->num_free(), pool_->num_total()) : 0;
    const std::vector<int32_t> resident = cold_candidates(*s, INT32_MAX);
    for (const BlockPredictor::Move& m : predictor_->decide(s->id, cold, resident, free_blocks)) {
      if (m.demote >= 0) {
        const int32_t want = static_cast<int32_t>(plan->cold_demotes.size()) + 1;
        if (cold_room_(want) < want) break;  // no L2 slot for the colder block
        demote_position(s, m.demote, plan);
      }
      if (pool_->num_free() == 0) break;  // unreachable: an exchange just freed one
      plan->promotions.push_back({s, m.promote, pool_->allocate(1).front()});
      predictor_->moved(s->id, m);
    }
  }
}

bool Scheduler::prefix_eligible(const Sequence& seq) const {
  // Prompt logits need every prompt position computed; scoring computes its tail token by
  // token: neither starts from cached KV.
  return config_.enable_prefix_caching && !seq.want_prompt_logits && seq.single_token_from < 0 &&
         seq.num_computed == 0 && seq.swap == SwapState::kNone;
}

std::vector<int32_t> Scheduler::cached_prefix(Sequence* seq) const {
  if (!prefix_eligible(*seq)) return {};
  const int32_t bs = config_.block_size;
  const int32_t max_blocks = (seq->num_tokens() - 1) / bs;
  std::vector<uint64_t> hashes;
  std::vector<int32_t> hit = pool_->match_prefix(seq->tokens.data(), max_blocks, bs, &hashes);
  // Remember the chain (it depends on the tokens only).
  for (size_t i = seq->block_hashes.size(); i < hashes.size(); ++i) seq->block_hashes.push_back(hashes[i]);
  return hit;
}

void Scheduler::preempt(Sequence* seq, StepPlan* plan) {
  // Recompute: drop the KV, keep the tokens (prompt and what was generated so far). With
  // swap the computed blocks' KV goes to L2/L3 first (the engine falls back to recompute
  // when the tiers have no room).
  auto it = std::find(running_.begin(), running_.end(), seq);
  if (it == running_.end()) fail(ErrorCode::kInternal, "preempting a sequence that is not running");
  if (seq->swap != SwapState::kNone) fail(ErrorCode::kInternal, "preempting a sequence that is swapping");
  if (seq->in_lane) {
    // Its lane step is reading its blocks: the engine ends that step first (it is dropped).
    if (!lane_cancel_) fail(ErrorCode::kInternal, "preempting a sequence in the L3 lane without a way to end its step");
    lane_cancel_();
    if (seq->in_lane) fail(ErrorCode::kInternal, "the L3 lane's step did not end");
  }
  running_.erase(it);
  plan->preempted.push_back(seq->id);
  plan->preempted_blocks.push_back(seq->block_table);
  if (seq->num_cold > 0) {
    // A sequence with cold blocks recomputes (its KV did not fit L1 in the first place).
    for (uint64_t k : seq->cold_keys) {
      if (k != 0) plan->cold_freed.push_back(k);
    }
  }
  if (config_.swap_preempted && seq->num_computed > 0 && seq->num_cold == 0) {
    const int32_t n = blocks_for_tokens(seq->num_computed, config_.block_size);
    plan->swap_outs.push_back({seq, std::vector<int32_t>(seq->block_table.begin(), seq->block_table.begin() + n),
                               seq->num_computed});
    seq->swap = SwapState::kOut;
    seq->swap_tokens = seq->num_computed;
  }
  // A swapped-out sequence's blocks are not offered to the cache: they are being copied
  // out, and a cached free block could be evicted (copied out again) in this same plan.
  release_blocks(seq, seq->swap != SwapState::kOut);
  seq->num_computed = 0;
  seq->status = SeqStatus::kWaiting;
  ++seq->num_preemptions;
  ++num_preemptions_;
  waiting_.push_back(seq);
}

void Scheduler::recompute(Sequence* seq, std::vector<int32_t>* blocks, std::vector<uint64_t>* cold_keys) {
  // Only for a sequence with cold blocks, which preempt() never swaps out.
  if (seq->num_cold == 0) fail(ErrorCode::kInternal, "recompute() of a sequence without cold blocks");
  StepPlan plan;
  preempt(seq, &plan);
  *blocks = std::move(plan.preempted_blocks.front());
  *cold_keys = std::move(plan.cold_freed);
  sort_queues();
}

Sequence* Scheduler::pick_victim() const {
  for (auto it = running_.rbegin(); it != running_.rend(); ++it) {
    if ((*it)->swap != SwapState::kIn) return *it;
  }
  return nullptr;
}

void Scheduler::sort_queues() {
  std::stable_sort(running_.begin(), running_.end(), ranks_before);
  std::stable_sort(waiting_.begin(), waiting_.end(), ranks_before);
}

StepPlan Scheduler::schedule() {
  StepPlan plan;
  sort_queues();
  int32_t budget = config_.max_num_batched_tokens;
  const int32_t chunk = config_.prefill_chunk_size;

  // Phase 0: a waiting sequence of a higher class takes room from lower classes. It
  // must pass the same test as Phase 2's admission, after the blocks that the running
  // sequences are about to take in Phase 1, or it would be refused there again.
  const int32_t watermark_blocks =
      static_cast<int32_t>(std::ceil(config_.admission_watermark * pool_->num_total()));
  if (!waiting_.empty()) {
    Sequence* w = waiting_.front();
    const int32_t first = std::min({w->num_tokens() - w->num_computed, w->step_limit(chunk), budget});
    auto fits = [&] {
      int32_t reserved = 0, left = budget;
      for (Sequence* r : running_) {
        if (skipped(*r)) continue;  // not scheduled this step
        const int32_t n = std::min({r->num_tokens() - r->num_computed, r->step_limit(chunk), left});
        if (n <= 0) break;
        reserved += blocks_missing(*r, n);
        left -= n;
      }
      const int32_t watermark = running_.empty() ? 0 : watermark_blocks;
      return num_running() < config_.max_batch_size &&
             blocks_missing(*w, first) + watermark + reserved <= pool_->num_free();
    };
    bool preempted = false;
    Sequence* victim;
    while ((victim = pick_victim()) != nullptr && victim->priority > w->priority && !fits()) {
      preempt(victim, &plan);
      preempted = true;
    }
    if (preempted) std::stable_sort(waiting_.begin(), waiting_.end(), ranks_before);
  }

  // Phase 1: running sequences, best first; the worst make room when blocks run out.
  bool preempted_for_running = false;
  size_t i = 0;
  while (i < running_.size() && budget > 0) {
    Sequence* s = running_[i];
    if (skipped(*s)) {
      ++i;
      continue;
    }
    int32_t n = std::min({s->num_tokens() - s->num_computed, s->step_limit(chunk), budget});
    if (n <= 0) fail(ErrorCode::kInternal, "running sequence with nothing to compute");
    bool self_preempted = false;
    while (blocks_missing(*s, n) > pool_->num_free()) {
      Sequence* victim = pick_victim();  // never null: s itself qualifies
      if (victim == s && cold_room_ && longer_than_l1(*s, n)) {
        // Longer than L1 itself: rather than preempt itself, s moves some of its computed
        // blocks to L2 and goes on (a prompt chunk shrinks to what that can make room for).
        // A sequence that would fit L1 alone preempts itself as before (it is swapped out,
        // or recomputed, and readmitted when the others have made room).
        const int32_t short_by = blocks_missing(*s, n) - pool_->num_free();
        const int32_t can = static_cast<int32_t>(cold_candidates(*s, short_by).size());
        if (can < short_by && n > 1) {
          const int32_t blocks = static_cast<int32_t>(s->block_table.size()) + pool_->num_free() + can;
          const int32_t fit = blocks * config_.block_size - s->num_computed;
          if (fit > 0) n = std::min(n, fit);
        }
        const int32_t need = blocks_missing(*s, n) - pool_->num_free();
        if (need <= 0 || make_cold(s, need, &plan)) continue;  // the shorter chunk may fit as it is
      }
      preempt(victim, &plan);
      preempted_for_running = true;
      if (victim == s) {
        self_preempted = true;
        break;
      }
    }
    if (self_preempted) break;
    grow(s, n);
    plan.seqs.push_back({s, n, s->num_computed + n == s->num_tokens()});
    plan.num_tokens += n;
    budget -= n;
    ++i;
  }
  if (preempted_for_running) std::stable_sort(waiting_.begin(), waiting_.end(), ranks_before);

  // Phase 2: admit waiting sequences in order; stop at the first that does not fit, so a
  // long prompt is not starved by shorter ones behind it. No admissions in a step that
  // had to preempt for running sequences: the pool is already short.
  if (!preempted_for_running) {
    const int32_t watermark = running_.empty() ? 0 : watermark_blocks;
    size_t admitted = 0;
    while (admitted < waiting_.size() && budget > 0 && num_running() < config_.max_batch_size) {
      Sequence* s = waiting_[admitted];
      if (s->swap == SwapState::kOut) {
        // Parked KV: readmitted with blocks for it, once every block has landed in L2/L3
        // (keys are filled in after this plan, so a sequence preempted in this very step
        // waits too). It computes nothing until the engine's fetches complete.
        if (s->swap_keys.empty() || s->swap_out_pending > 0) break;
        const int32_t need = static_cast<int32_t>(s->swap_keys.size());
        if (need + watermark > pool_->num_free()) break;
        s->block_table = pool_->allocate(need);
        s->swap = SwapState::kIn;
        s->status = SeqStatus::kRunning;
        running_.push_back(s);
        plan.swap_ins.push_back(s);
        ++admitted;
        continue;
      }
      // Prefix caching: start after the cached blocks of its prompt (and of what it had
      // generated before a preemption). Blocks taken back from the free list count
      // against the room it needs.
      const bool eligible = prefix_eligible(*s);
      const std::vector<int32_t> hit = cached_prefix(s);
      int32_t taken_free = 0;
      for (int32_t b : hit) taken_free += pool_->refcount(b) == 0 ? 1 : 0;
      const int32_t bs = config_.block_size;
      if (eligible && tier_lookup_) {
        // Cached blocks past the L1 hits that L2/L3 hold: admitted with blocks for both,
        // it computes nothing until the engine's fetches land (as a swap-in).
        const int32_t nh = static_cast<int32_t>(hit.size());
        std::vector<uint64_t> hashes;
        const int32_t tier = tier_lookup_(s->tokens.data(), nh, (s->num_tokens() - 1) / bs, bs,
                                          nh == 0 ? 0 : s->block_hashes[nh - 1], &hashes);
        if (tier > 0) {
          if (tier + taken_free + watermark > pool_->num_free()) break;
          prefix_query_tokens_ += s->num_tokens();
          prefix_hit_tokens_ += static_cast<int64_t>(nh + tier) * bs;
          prefix_tier_hit_tokens_ += static_cast<int64_t>(tier) * bs;
          for (int32_t b : hit) pool_->acquire(b);
          s->block_table = hit;
          const std::vector<int32_t> got = pool_->allocate(tier);
          s->block_table.insert(s->block_table.end(), got.begin(), got.end());
          s->num_computed = nh * bs;
          s->num_cache_checked = nh;
          for (size_t j = s->block_hashes.size(); j < static_cast<size_t>(nh + tier); ++j) {
            s->block_hashes.push_back(hashes[j - nh]);
          }
          s->swap = SwapState::kIn;
          s->swap_tokens = (nh + tier) * bs;
          s->swap_first_block = nh;
          s->tier_prefix_hashes = std::move(hashes);
          s->prefix_fetch = true;
          s->status = SeqStatus::kRunning;
          running_.push_back(s);
          plan.swap_ins.push_back(s);
          ++admitted;
          continue;
        }
      }
      const int32_t start = static_cast<int32_t>(hit.size()) * bs;
      int32_t n = std::min({s->num_tokens() - start, s->step_limit(chunk), budget});
      const int32_t need = blocks_for_tokens(start + n, config_.block_size) - static_cast<int32_t>(hit.size());
      if (need + taken_free + watermark > pool_->num_free()) break;
      if (eligible) {
        prefix_query_tokens_ += s->num_tokens();
        prefix_hit_tokens_ += start;
      }
      for (int32_t b : hit) pool_->acquire(b);
      s->block_table = hit;
      s->num_computed = start;
      s->num_cache_checked = static_cast<int32_t>(hit.size());
      grow(s, n);
      s->status = SeqStatus::kRunning;
      running_.push_back(s);
      plan.seqs.push_back({s, n, s->num_computed + n == s->num_tokens()});
      plan.num_tokens += n;
      budget -= n;
      ++admitted;
    }
    waiting_.erase(waiting_.begin(), waiting_.begin() + static_cast<std::ptrdiff_t>(admitted));
  }
  plan_promotions(&plan);
  plan.prefix_spills = pool_->take_evictions();
  return plan;
}

void Scheduler::complete_step(const StepPlan& plan) {
  for (const ScheduledSeq& s : plan.seqs) {
    if (s.seq->status != SeqStatus::kRunning) continue;
    s.seq->num_computed += s.num_new_tokens;
    cache_full_blocks(s.seq);
  }
}

void Scheduler::finish(Sequence* seq, FinishReason reason) {
  if (seq->status == SeqStatus::kFinished) return;
  auto drop = [seq](std::vector<Sequence*>& q) {
    auto it = std::find(q.begin(), q.end(), seq);
    if (it != q.end()) q.erase(it);
  };
  drop(running_);
  drop(waiting_);
  // Finished before its blocks go: should releasing them throw (a corrupt pool, an engine
  // bug), the sequence is still out of every queue and can be released.
  seq->status = SeqStatus::kFinished;
  seq->finish_reason = reason;
  // A failed step may have left its tokens' KV unwritten: nothing of it is cached.
  release_blocks(seq, reason != FinishReason::kError);
}

std::unique_ptr<Sequence> Scheduler::release(int64_t id) {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return nullptr;
  if (it->second->status != SeqStatus::kFinished) {
    fail(ErrorCode::kInternal, "releasing a sequence that is not finished");
  }
  std::unique_ptr<Sequence> out = std::move(it->second);
  seqs_.erase(it);
  return out;
}

void Scheduler::check_invariants() const {
  pool_->check_invariants();
  std::vector<int32_t> owners(pool_->num_total(), 0);
  int64_t owned = 0;
  for (Sequence* s : running_) {
    if (s->status != SeqStatus::kRunning) fail(ErrorCode::kInternal, "running queue state");
    if (static_cast<int32_t>(s->block_table.size()) <
        blocks_for_tokens(s->num_computed, config_.block_size)) {
      fail(ErrorCode::kInternal, "sequence without blocks for its computed tokens");
    }
    int32_t cold = 0;
    for (size_t i = 0; i < s->block_table.size(); ++i) {
      const int32_t b = s->block_table[i];
      if (b == kColdBlock) {
        if (i >= s->cold_keys.size() || s->cold_keys[i] == 0) fail(ErrorCode::kInternal, "cold block without a key");
        ++cold;
        continue;
      }
      if (owners.at(b)++ == 0) ++owned;  // blocks, not references (prefix blocks are shared)
    }
    if (cold != s->num_cold) fail(ErrorCode::kInternal, "cold block count wrong");
  }
  for (Sequence* s : waiting_) {
    if (s->status != SeqStatus::kWaiting) fail(ErrorCode::kInternal, "waiting queue state");
    if (!s->block_table.empty() || s->num_computed != 0 || s->num_cold != 0) {
      fail(ErrorCode::kInternal, "waiting sequence holds KV blocks");
    }
  }
  for (int32_t b = 0; b < pool_->num_total(); ++b) {
    if (owners[b] != pool_->refcount(b)) {
      fail(ErrorCode::kInternal, "block " + std::to_string(b) + " has refcount " +
                                     std::to_string(pool_->refcount(b)) + " but " +
                                     std::to_string(owners[b]) + " owners");
    }
  }
  if (owned != pool_->num_used()) fail(ErrorCode::kInternal, "block accounting mismatch");
}

}  // namespace k25
