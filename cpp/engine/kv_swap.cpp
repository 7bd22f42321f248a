#include "engine/kv_swap.h"

#include <algorithm>
#include <atomic>

#include "k25/status.h"

namespace k25 {

namespace {

TierConfig tier_config(const EngineConfig& c, int64_t block_bytes) {
  TierConfig t;
  t.block_bytes = block_bytes;
  t.l2_bytes = c.l2_bytes;
  t.l3_path = c.l3_path;
  t.l3_bytes = c.l3_path.empty() ? 0 : c.l3_bytes;
  return t;
}

}  // namespace

KVSwap::KVSwap(const EngineConfig& config, void* l1_base, int64_t block_bytes, Scheduler* scheduler,
               BlockPool* pool, std::function<void()> wake, EventSink events)
    : config_(config), scheduler_(scheduler), pool_(pool), wake_(std::move(wake)), events_(std::move(events)) {
  if (!l1_base) {
    fail(ErrorCode::kUnsupported, "cache_mode='hierarchical' needs the KV pool in host memory (the CPU backend); "
                                  "the CUDA copy path is not built yet");
  }
  tiers_ = std::make_unique<TierManager>(tier_config(config, block_bytes), config.num_kv_blocks, l1_base);
}

KVSwap::~KVSwap() { tiers_.reset(); }

bool KVSwap::has_completions() const {
  std::lock_guard<std::mutex> lk(mu_);
  return !done_.empty();
}

void KVSwap::start(const StepPlan& plan) {
  auto on_done = [this](const TierResult& r) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      done_.push_back(r);
    }
    wake_();
  };
  const int32_t bs = config_.block_size;
  for (const SwapOut& so : plan.swap_outs) {
    Sequence* s = so.seq;
    s->swap_keys.clear();
    s->swap_out_pending = 0;
    for (size_t i = 0; i < so.blocks.size(); ++i) {
      // The step may reuse the block as soon as its bytes are copied out: `copied`, or
      // `done` when no copy happened. Whichever comes first counts.
      auto counted = std::make_shared<std::atomic<bool>>(false);
      auto copied = [this, counted](uint64_t) {
        if (counted->exchange(true)) return;
        std::lock_guard<std::mutex> lk(mu_);
        --copies_pending_;
        copied_cv_.notify_all();
      };
      {
        std::lock_guard<std::mutex> lk(mu_);
        ++copies_pending_;
      }
      const uint64_t key = tiers_->demote(so.blocks[i],
                                          [on_done, copied](const TierResult& r) {
                                            copied(r.key);
                                            on_done(r);
                                          },
                                          copied);
      if (key == 0) {  // neither L2 nor L3 has room: the rest is recomputed
        copied(0);
        break;
      }
      s->swap_keys.push_back(key);
      keys_[key] = KeyInfo{s->id, static_cast<int32_t>(i), true, false};
      ++s->swap_out_pending;
    }
    const int32_t kept = std::min<int32_t>(so.num_tokens, static_cast<int32_t>(s->swap_keys.size()) * bs);
    if (kept == 0) {
      s->swap = SwapState::kNone;
      s->swap_tokens = 0;
      ++counters_.swap_fallbacks;
      events_(s->id, so.blocks, "preempt_recompute");
    } else {
      s->swap_tokens = kept;
      ++counters_.swap_outs;
      if (kept < so.num_tokens) ++counters_.swap_fallbacks;
      events_(s->id, so.blocks, "preempt_swap");
    }
  }
  if (!plan.swap_outs.empty()) {
    std::unique_lock<std::mutex> lk(mu_);
    copied_cv_.wait(lk, [&] { return copies_pending_ == 0; });
  }
  // Fetches after the copies: a block freed by a swap-out may be a fetch's target now.
  for (Sequence* s : plan.swap_ins) {
    s->swap_in_pending = 0;
    s->swap_in_bad_block = -1;
    for (size_t i = 0; i < s->swap_keys.size(); ++i) {
      const uint64_t key = s->swap_keys[i];
      keys_.at(key).pending = true;
      ++s->swap_in_pending;
      tiers_->fetch(key, s->block_table[i], on_done);
    }
  }
}

void KVSwap::drop_key(uint64_t key) {
  tiers_->free(key);
  KeyInfo& k = keys_.at(key);
  if (k.pending) {
    k.freed = true;
  } else {
    keys_.erase(key);
  }
}

// Keeps blocks [0, index) of a swapped-out sequence; the rest will be recomputed.
void KVSwap::truncate(Sequence* s, int32_t index) {
  if (index >= static_cast<int32_t>(s->swap_keys.size())) return;
  for (size_t j = index; j < s->swap_keys.size(); ++j) drop_key(s->swap_keys[j]);
  s->swap_keys.resize(index);
  s->swap_tokens = std::min(s->swap_tokens, index * config_.block_size);
  ++counters_.swap_fallbacks;
  if (s->swap_tokens == 0) {
    s->swap = SwapState::kNone;  // nothing left to fetch: a plain recompute
    s->swap_keys.clear();
  }
}

void KVSwap::finish_swap_in(Sequence* s) {
  int32_t tokens = s->swap_tokens;
  if (s->swap_in_bad_block >= 0) {
    tokens = std::min(tokens, s->swap_in_bad_block * config_.block_size);
    ++counters_.swap_fallbacks;
  }
  for (uint64_t key : s->swap_keys) drop_key(key);
  s->swap_keys.clear();
  s->num_computed = tokens;
  s->swap = SwapState::kNone;
  s->swap_tokens = 0;
  s->swap_in_bad_block = -1;
  ++counters_.swap_ins;
}

void KVSwap::apply_completions() {
  std::vector<TierResult> done;
  {
    std::lock_guard<std::mutex> lk(mu_);
    done.swap(done_);
  }
  for (const TierResult& r : done) {
    auto it = keys_.find(r.key);
    if (it == keys_.end()) fail(ErrorCode::kInternal, "swap: completion for an unknown key");
    KeyInfo k = it->second;
    it->second.pending = false;
    if (k.freed) keys_.erase(it);
    Sequence* s = scheduler_->find(k.seq);
    const bool gone = s == nullptr || s->status == SeqStatus::kFinished;
    if (r.op == TierOp::kFetch && gone) {
      auto o = orphans_.find(k.seq);
      if (o != orphans_.end() && --o->second.pending == 0) {
        pool_->release_all(o->second.blocks);
        orphans_.erase(o);
      }
      continue;
    }
    if (gone) continue;
    if (r.op == TierOp::kDemote) {
      --s->swap_out_pending;
      if (!r.ok && !k.freed) {
        events_(s->id, {}, tier_fault_name(r.fault));
        truncate(s, k.index);
      }
    } else if (r.op == TierOp::kFetch) {
      --s->swap_in_pending;
      if (!r.ok) {
        events_(s->id, {s->block_table[k.index]}, tier_fault_name(r.fault));
        s->swap_in_bad_block =
            s->swap_in_bad_block < 0 ? k.index : std::min(s->swap_in_bad_block, k.index);
      }
      if (s->swap_in_pending == 0) finish_swap_in(s);
    }
  }
}

void KVSwap::on_finish(Sequence* s) {
  for (uint64_t key : s->swap_keys) drop_key(key);
  if (s->swap == SwapState::kIn && s->swap_in_pending > 0) {
    orphans_[s->id] = Orphan{std::move(s->block_table), s->swap_in_pending};
    s->block_table.clear();
  }
  s->swap_keys.clear();
  s->swap = SwapState::kNone;
}

}  // namespace k25
