#include "engine/kv_swap.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <unordered_set>

#include "k25/status.h"

namespace k25 {

namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void ewma(double* avg, double x) { *avg = *avg > 0 ? 0.8 * *avg + 0.2 * x : x; }

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
               BlockPool* pool, std::function<void()> wake, EventSink events,
               const std::function<bool(TierConfig*)>& configure, int32_t l3_slices)
    : config_(config), scheduler_(scheduler), pool_(pool), wake_(std::move(wake)), events_(std::move(events)) {
  TierConfig tc = tier_config(config, block_bytes);
  if (!l1_base && !(configure && configure(&tc))) {
    fail(ErrorCode::kUnsupported, "cache_mode='hierarchical' needs the KV pool in host memory or a device copy "
                                  "path; this executor has neither");
  }
  // Cold blocks in L3: each page also gets a checksum per layer, so that a step can read and
  // check one layer of it.
  if (l3_slices > 0 && !tc.l3_path.empty() && block_bytes % l3_slices == 0) l3_slices_ = tc.l3_slices = l3_slices;
  tiers_ = std::make_unique<TierManager>(tc, config.num_kv_blocks, l1_base);
}

ColdL3Reads::ColdL3Reads(TierManager* tiers, std::vector<const void*> list, std::vector<Entry> entries,
                         int32_t num_layers, const std::function<ColdStage(int64_t bytes)>& stage,
                         double test_delay_s, ColdReadPlan plan)
    : tiers_(tiers),
      list_(std::move(list)),
      entries_(std::move(entries)),
      num_layers_(num_layers),
      slice_bytes_(tiers->l3_slice_bytes()),
      plan_(std::move(plan)),
      test_delay_s_(test_delay_s),
      failed_(entries_.size()) {
  if (slice_bytes_ <= 0 || num_layers_ <= 0) fail(ErrorCode::kInternal, "cold L3 reads without slices");
  constexpr int64_t kAlign = 4096;
  sel_ = plan_.selective || plan_.halves;
  if (sel_ && (plan_.whole.size() != list_.size() || plan_.layers.size() != static_cast<size_t>(num_layers_) ||
               !(plan_.ahead.empty() || plan_.ahead.size() == list_.size() * static_cast<size_t>(num_layers_)) ||
               (plan_.keys_ahead && !plan_.halves))) {
    fail(ErrorCode::kInternal, "cold L3 reads: a read plan of another step");
  }
  if (plan_.halves) {
    // A layer's two halves read into one room, K then V as in a block: each half is whole
    // 4096-byte units (TorchExecutor::cold_read_plan offers halves only then).
    if (slice_bytes_ % kAlign != 0 || stage) fail(ErrorCode::kInternal, "cold L3 reads: halves must be aligned, unstaged");
    layer_bytes_ = 2 * slice_bytes_;
    stride_ = layer_bytes_;
  } else {
    layer_bytes_ = slice_bytes_;
    // Room for the widest aligned span of a slice (TierManager::l3_slice_span).
    stride_ = (slice_bytes_ + kAlign - 1) / kAlign * kAlign + kAlign;
  }
  // Staged: a slot per entry of the whole list (position j), else per L3 entry.
  const size_t slots = stage ? list_.size() : entries_.size();
  const size_t bytes = static_cast<size_t>(std::max<int64_t>(1, static_cast<int64_t>(slots)) * stride_);
  // Unstaged, four buffers: a lane step (engine.cpp) runs a layer when its reads are in,
  // between whole steps of the other sequences, and reads run three layers ahead of it.
  depth_ = stage ? 2 : 4;
  buf_.assign(static_cast<size_t>(depth_), nullptr);
  buf_layer_.assign(static_cast<size_t>(depth_), -1);
  pending_.assign(static_cast<size_t>(depth_), 0);
  ready_at_.assign(static_cast<size_t>(depth_), std::chrono::steady_clock::time_point{});
  if (stage) {
    stage_ = stage(static_cast<int64_t>(bytes));
    if (!stage_.host[0] || !stage_.host[1] || !stage_.device[0] || !stage_.device[1]) {
      fail(ErrorCode::kResourceExhausted, "no staging memory for cold blocks in L3");
    }
    staged_ = true;
    std::vector<bool> in_l3(list_.size(), false);
    for (const Entry& en : entries_) in_l3[static_cast<size_t>(en.list_index)] = true;
    for (size_t j = 0; j < list_.size(); ++j) {
      if (in_l3[j]) continue;
      if (!list_[j]) fail(ErrorCode::kInternal, "a staged cold entry without its bytes");
      staged_l2_.push_back(j);
    }
    buf_[0] = stage_.host[0];
    buf_[1] = stage_.host[1];
  } else {
    for (uint8_t*& b : buf_) b = static_cast<uint8_t*>(std::aligned_alloc(kAlign, bytes));
  }
  if (sel_) have_.assign(static_cast<size_t>(depth_) * entries_.size(), 0);
  if (sel_) kept_.assign(entries_.size() * static_cast<size_t>(num_layers_), 0);
  zeros_ = static_cast<uint8_t*>(std::calloc(1, static_cast<size_t>(layer_bytes_)));
  const bool all = std::all_of(buf_.begin(), buf_.end(), [](uint8_t* b) { return b != nullptr; });
  if (!all || !zeros_) {
    if (!staged_) {
      for (uint8_t* b : buf_) std::free(b);
    }
    std::free(zeros_);
    fail(ErrorCode::kResourceExhausted, "no memory for cold L3 read buffers");
  }
  for (size_t e = 0; e < entries_.size(); ++e) failed_[e] = entries_[e].lost;
  try {
    for (int32_t l = 0; l < std::min<int32_t>(depth_, num_layers_); ++l) issue(l);
  } catch (...) {
    for (int b = 0; b < depth_; ++b) wait_idle(b);
    if (!staged_) {
      for (uint8_t* bp : buf_) std::free(bp);
    }
    std::free(zeros_);
    throw;
  }
}

ColdL3Reads::~ColdL3Reads() {
  for (int b = 0; b < depth_; ++b) wait_idle(b);
  if (!staged_) {
    for (uint8_t* b : buf_) std::free(b);
  }
  std::free(zeros_);
}

uint8_t* ColdL3Reads::slot(int b, size_t e) const {
  const size_t at = staged_ ? static_cast<size_t>(entries_[e].list_index) : e;
  return buf_[b] + static_cast<int64_t>(at) * stride_;
}

void ColdL3Reads::wait_idle(int b) {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return pending_[b] == 0; });
}

void ColdL3Reads::wait_ready(int b) {
  wait_idle(b);
  if (test_delay_s_ > 0) std::this_thread::sleep_until(ready_at_[b]);
}

bool ColdL3Reads::layer_ready(int32_t layer) {
  if (layer < 0 || layer >= num_layers_) return false;
  const int b = layer % depth_;
  std::lock_guard<std::mutex> lk(mu_);
  return buf_layer_[b] == layer && pending_[b] == 0 && std::chrono::steady_clock::now() >= ready_at_[b];
}

void ColdL3Reads::issue(int32_t layer) {
  const int b = layer % depth_;
  wait_idle(b);  // its last layer's reads (done already: that layer was asked for)
  {
    std::lock_guard<std::mutex> lk(mu_);
    buf_layer_[b] = layer;
    ready_at_[b] = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                           std::chrono::duration<double>(test_delay_s_));
    // The layer's reads count as one more until they are all issued, so that a fast
    // completion does not make the layer look ready half-issued.
    ++pending_[b];
  }
  auto issued = [this, b] {
    std::lock_guard<std::mutex> lk(mu_);
    --pending_[b];
    cv_.notify_all();
  };
  if (sel_) halves_total_ += 2 * static_cast<int64_t>(entries_.size());
  if (sel_) std::fill(have_.begin() + static_cast<std::ptrdiff_t>(b * entries_.size()),
                              have_.begin() + static_cast<std::ptrdiff_t>((b + 1) * entries_.size()), 0);
  // Staged, the L2 entries: their layer slice copied by the host, where an L3 read would put it.
  if (!staged_l2_.empty()) {
    const TierManager::SliceSpan sp = tiers_->l3_slice_span(layer);
    for (size_t j : staged_l2_) {
      std::memcpy(buf_[b] + static_cast<int64_t>(j) * stride_ + sp.data_offset,
                  static_cast<const uint8_t*>(list_[j]) + static_cast<int64_t>(layer) * slice_bytes_,
                  static_cast<size_t>(slice_bytes_));
    }
  }
  // Ahead: whole layers, or with a selection to come what it reads (ColdReadPlan).
  const bool selects = sel_ && plan_.layers[static_cast<size_t>(layer)];
  try {
    for (size_t e = 0; e < entries_.size(); ++e) {
      const size_t j = static_cast<size_t>(entries_[e].list_index);
      const bool whole = !selects || plan_.whole[j] ||
                         (!plan_.ahead.empty() && plan_.ahead[j * static_cast<size_t>(num_layers_) + layer]);
      read(b, layer, e, whole ? kWhole : plan_.keys_ahead ? kKeys : 0);
    }
  } catch (...) {
    issued();
    throw;
  }
  issued();
}

bool ColdL3Reads::read(int b, int32_t layer, size_t e, uint8_t want) {
  uint8_t missing = want;
  if (sel_) {
    uint8_t& have = have_[static_cast<size_t>(b) * entries_.size() + e];
    missing = want & static_cast<uint8_t>(~have);
    have |= missing;
  }
  bool started = false;
  // Both halves: one read of the two (a disk's cost is as much per read as per byte).
  const bool both = plan_.halves && missing == kWhole;
  const int parts = plan_.halves && !both ? 2 : 1;
  for (int part = 0; part < parts; ++part) {
    if (!(missing & (plan_.halves && !both ? 1 << part : kWhole))) continue;
    const int32_t slice = plan_.halves ? 2 * layer + part : layer;
    const int32_t count = both ? 2 : 1;
    const int64_t halves = plan_.halves ? count : 2;  // (a whole slice is both halves)
    TierManager::SliceSpan sp = tiers_->l3_slice_span(slice);
    if (both) sp.bytes *= 2;  // (halves are whole 4096-byte units)
    uint8_t* dst = slot(b, e) + part * slice_bytes_;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!failed_[e].empty()) {  // one bad slice spoils the block for this step
        if (staged_) std::memset(dst, 0, static_cast<size_t>(sp.bytes));
        if (sel_) halves_unreadable_ += halves;
        continue;
      }
      ++pending_[b];
    }
    try {
      tiers_->read_l3_slices(entries_[e].key, slice, count, dst, [this, e, dst, sp, b](const TierResult& r) {
        std::lock_guard<std::mutex> lk(mu_);
        if (!r.ok) {
          if (failed_[e].empty()) failed_[e] = tier_fault_name(r.fault);
          std::memset(dst, 0, static_cast<size_t>(sp.bytes));
        }
        --pending_[b];
        cv_.notify_all();
      });
    } catch (...) {
      std::lock_guard<std::mutex> lk(mu_);
      --pending_[b];
      throw;
    }
    started = true;
    if (sel_) halves_read_ += halves;
  }
  return started;
}

bool ColdL3Reads::need(int32_t layer, const std::vector<uint8_t>& need) {
  if (!sel_) return false;
  if (layer < 0 || layer >= num_layers_ || need.size() != list_.size()) fail(ErrorCode::kInternal, "cold L3 reads: bad need");
  const int b = layer % depth_;
  // After layer(layer), before the next one's: the buffer still holds this layer.
  if (buf_layer_[b] != layer) fail(ErrorCode::kInternal, "cold L3 reads: need for a layer not asked for");
  {
    std::lock_guard<std::mutex> lk(mu_);
    ++pending_[b];  // (as in issue)
  }
  bool started = false;
  try {
    for (size_t e = 0; e < entries_.size(); ++e) {
      if (!need[static_cast<size_t>(entries_[e].list_index)]) continue;
      kept_[e * static_cast<size_t>(num_layers_) + layer] = 1;
      const int64_t before = halves_read_;
      started = read(b, layer, e, kWhole) || started;
      halves_late_ += halves_read_ - before;
    }
  } catch (...) {
    std::lock_guard<std::mutex> lk(mu_);
    --pending_[b];
    cv_.notify_all();
    throw;
  }
  std::lock_guard<std::mutex> lk(mu_);
  if (started && test_delay_s_ > 0) {
    ready_at_[b] = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                          std::chrono::duration<double>(test_delay_s_));
  }
  --pending_[b];
  cv_.notify_all();
  return started;
}

int ColdL3Reads::ready(int32_t layer) {
  if (layer < 0 || layer >= num_layers_) fail(ErrorCode::kInternal, "cold L3 reads: no such layer");
  const int b = layer % depth_;
  if (buf_layer_[b] != layer) issue(layer);
  wait_ready(b);
  // The buffers of the layers before are free again (staged: the caller has seen the device
  // finish layer - 1), so the next layers' reads start.
  for (int32_t k = 1; k < depth_ && layer + k < num_layers_; ++k) {
    if (buf_layer_[(layer + k) % depth_] != layer + k) issue(layer + k);
  }
  return b;
}

ColdLayerSource::Region ColdL3Reads::layer_region(int32_t layer) {
  if (!staged_) fail(ErrorCode::kInternal, "cold L3 reads: layer_region without staging buffers");
  const int b = ready(layer);
  // Entry j's slice lies at buffer + j * stride_ + data_offset; the kernels add layer * slice.
  const int64_t shift = tiers_->l3_slice_span(layer).data_offset - static_cast<int64_t>(layer) * slice_bytes_;
  Region r;
  r.device = reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(stage_.device[b]) + static_cast<uintptr_t>(shift));
  r.stride = stride_;
  r.count = static_cast<int32_t>(list_.size());
  return r;
}

const void* const* ColdL3Reads::layer(int32_t layer) {
  if (staged_) fail(ErrorCode::kInternal, "cold L3 reads: staged reads are read through layer_region");
  const int b = ready(layer);
  // Each entry's pointer, placed so that the kernels' offset of this layer (KVLayout::
  // k_in_block) lands on the slice read for it (halves: on its K half, the V half after it).
  const int64_t back = static_cast<int64_t>(layer) * layer_bytes_;
  const int64_t data = plan_.halves ? 0 : tiers_->l3_slice_span(layer).data_offset;
  std::lock_guard<std::mutex> lk(mu_);
  for (size_t e = 0; e < entries_.size(); ++e) {
    const uint8_t* at = failed_[e].empty() ? slot(b, e) + data : zeros_;
    list_[static_cast<size_t>(entries_[e].list_index)] =
        reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(at) - static_cast<uintptr_t>(back));
  }
  return list_.data();
}

std::vector<std::pair<size_t, std::string>> ColdL3Reads::finish() {
  for (int b = 0; b < depth_; ++b) wait_idle(b);
  std::vector<std::pair<size_t, std::string>> out;
  std::lock_guard<std::mutex> lk(mu_);
  for (size_t e = 0; e < entries_.size(); ++e) {
    if (!failed_[e].empty()) out.emplace_back(e, failed_[e]);
  }
  return out;
}

bool KVSwap::l3_cold_in_use(const std::vector<Sequence*>& running) const {
  if (!l3_cold()) return false;
  // A step demotes at most one block of a sequence for its next token, plus one for each of
  // its exchanges (predictor_max_moves): while L2 has room for all of them, none goes to L3.
  const int64_t demotes = static_cast<int64_t>(running.size()) * (1 + std::max(0, config_.predictor_max_moves));
  if (tiers_->l2_room() < demotes) return true;
  for (const Sequence* s : running) {
    if (s->num_cold == 0) continue;
    for (uint64_t k : s->cold_keys) {
      if (k != 0 && !cold_l2_data(k)) return true;
    }
  }
  return false;
}

std::unique_ptr<ColdL3Reads> KVSwap::read_cold_l3(const std::vector<const void*>& list,
                                                  const std::vector<std::pair<int32_t, uint64_t>>& entries,
                                                  const std::function<ColdStage(int64_t bytes)>& stage,
                                                  ColdReadPlan plan) {
  if (!l3_cold()) fail(ErrorCode::kInternal, "cold blocks in L3 without L3 cold support");
  // Staged, the host copies the L2 entries: this step's demotes must have landed there.
  if (stage) settle_cold_demotes();
  // And the pages it reads back are written (the engine starts a lane step's reads when they are).
  cold_l3_written(entries, /*wait=*/true);
  std::vector<ColdL3Reads::Entry> es;
  for (const auto& [j, key] : entries) {
    auto it = cold_lost_.find(key);
    es.push_back({j, key, it == cold_lost_.end() ? std::string() : it->second});
  }
  const int32_t layers = plan.halves ? l3_slices_ / 2 : l3_slices_;
  return std::make_unique<ColdL3Reads>(tiers_.get(), list, std::move(es), layers, stage, l3_read_delay_s_.load(),
                                       std::move(plan));
}

void KVSwap::free_cold_key(uint64_t key) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    take_cold_lost_locked();
  }
  cold_lost_.erase(key);
  l3_write_ready_at_.erase(key);
  tiers_->free(key);
}

void KVSwap::free_cold_keys(const std::vector<uint64_t>& keys) {
  for (uint64_t k : keys) {
    if (k != 0) free_cold_key(k);
  }
}

KVSwap::~KVSwap() { tiers_.reset(); }

bool KVSwap::has_completions() const {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!done_.empty()) return true;
  }
  // Held promotions whose sequence has left the lane land at the next apply_completions
  // (held_ is the engine thread's, as are all callers).
  for (const TierResult& r : held_) {
    auto pr = promotions_.find(r.key);
    const Sequence* owner = pr != promotions_.end() ? scheduler_->find(pr->second.seq) : nullptr;
    if (!owner || !owner->in_lane) return true;
  }
  return false;
}

uint64_t KVSwap::demote_counted(int32_t block, const TierCallback& on_done) {
  // The step may reuse the block as soon as its bytes are copied out: `copied`, or `done`
  // when no copy happened. Whichever comes first counts; start() waits for all of them.
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
  uint64_t key;
  // Full tiers: the oldest indexed prefix copies make room (a swap-out or a newer prefix
  // block is worth more than the oldest cached one).
  while ((key = tiers_->demote(block,
                               [on_done, copied](const TierResult& r) {
                                 copied(r.key);
                                 on_done(r);
                               },
                               copied)) == 0 &&
         evict_oldest_prefix()) {
  }
  if (key == 0) copied(0);
  return key;
}

int32_t KVSwap::cold_room(int32_t want) {
  auto room = [&]() -> int64_t {
    int64_t n = tiers_->l2_room();
    if (l3_cold()) n += tiers_->map().l3_room();
    return n;
  };
  while (room() < want && evict_oldest_prefix()) {
  }
  return static_cast<int32_t>(std::min<int64_t>(room(), INT32_MAX));
}

const void* KVSwap::cold_l2_data(uint64_t key) const {
  // While this step's demotes are unsettled their slots are still landing, in device order
  // before the step's kernels (demote_cold).
  return tiers_->l2_data(key, /*in_flight=*/unsettled_ != nullptr);
}

// Transfers a step waits for before it runs (cold demotes): step_copy() makes
// each one's callback before it starts; the callback counts it done.
struct KVSwap::StepCopies {
  std::atomic<int32_t> pending{0};
  std::atomic<bool> failed{false};
};

TierCallback KVSwap::step_copy(const std::shared_ptr<StepCopies>& c) {
  ++c->pending;
  return [this, c](const TierResult& r) {
    // Cancelled: the key was freed meanwhile (the request ended before a deferred demote's
    // callback ran), so nobody reads the block: not a failure.
    if (!r.ok && !r.cancelled) c->failed.store(true);
    std::lock_guard<std::mutex> lk(mu_);
    --c->pending;
    copied_cv_.notify_all();
  };
}

bool KVSwap::wait_step_copies(const StepCopies& c) {
  std::unique_lock<std::mutex> lk(mu_);
  copied_cv_.wait(lk, [&] { return c.pending.load() == 0; });
  return !c.failed.load();
}

void KVSwap::demote_cold(const StepPlan& plan) {
  for (uint64_t key : plan.cold_freed) free_cold_key(key);
  if (plan.cold_demotes.empty()) return;
  // Before anything else of this plan takes an L2 slot: the scheduler counted the room.
  auto copies = std::make_shared<StepCopies>();
  CopyBatch batch(tiers_->copier());
  const double write_delay_s = l3_write_delay_s_.load();
  for (const StepPlan::ColdDemote& d : plan.cold_demotes) {
    TierCallback done = step_copy(copies);
    std::function<void(uint64_t)> copied;
    if (l3_cold()) {
      // A demote to L3 counts for the step once its L1 block is copied out (into its staging
      // slot), which is what the step's writes to that block need; the page write goes on,
      // and only the lane step that reads the page back waits for it (cold_l3_written). A
      // demote to L2 counts at its end, when its slot is readable. Whichever comes first.
      auto counted = std::make_shared<std::atomic<bool>>(false);
      TierCallback count = std::move(done);
      copied = [this, count, counted](uint64_t key) {
        const std::optional<TierEntry> e = tiers_->map().entry(key);
        if (!e || e->via != Tier::kL3 || counted->exchange(true)) return;
        TierResult r;
        r.key = key;
        r.op = TierOp::kDemote;
        r.tier = Tier::kL3;
        r.ok = true;
        count(r);
      };
      // A page that could not be written (no space, I/O error) is not a failed step: the
      // sequence reads zeros for it and recomputes (the engine, ColdL3Reads).
      done = [this, count, counted](const TierResult& r) {
        TierResult settled = r;
        if (!r.ok && !r.cancelled && r.tier == Tier::kL3) {
          std::lock_guard<std::mutex> lk(mu_);
          cold_lost_new_.emplace_back(r.key, tier_fault_name(r.fault));
          settled.ok = true;
        }
        if (!counted->exchange(true)) return count(settled);
        std::lock_guard<std::mutex> lk(mu_);  // a lane waiting in cold_l3_written
        copied_cv_.notify_all();
      };
    }
    const uint64_t key = tiers_->demote(d.block, done, copied, /*allow_l3=*/l3_cold());
    if (key == 0) fail(ErrorCode::kInternal, "no tier room for a cold block although the plan counted one");
    d.seq->cold_keys.at(static_cast<size_t>(d.index)) = key;
    ++counters_.cold_demotes;
    if (write_delay_s > 0) {
      const std::optional<TierEntry> e = tiers_->map().entry(key);
      if (e && e->via == Tier::kL3) {
        l3_write_ready_at_[key] =
            std::chrono::steady_clock::now() +
            std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(write_delay_s));
      }
    }
  }
  batch.close();  // before waiting for its copies
  // The step reads them in L2 and may reuse their L1 blocks. On CUDA the compute stream waits
  // for the copies on the device, and only the next step's start() waits for their callbacks
  // (the blocks' state, which a fetch, promotion or demote of the same L1 block or key needs):
  // a host wait here would put the whole completion path (host function, worker thread,
  // wake-up) in front of this step. Elsewhere, wait until they are there.
  BlockCopier* copier = tiers_->copier();
  // A block that goes to L3 may still wait for a staging slot, so the device cannot order
  // the step after its copy out of L1: the host waits for that copy (not for the write).
  bool to_l3 = false;
  for (const StepPlan::ColdDemote& d : plan.cold_demotes) {
    const std::optional<TierEntry> e = tiers_->map().entry(d.seq->cold_keys.at(static_cast<size_t>(d.index)));
    to_l3 = to_l3 || (e && e->via == Tier::kL3);
  }
  if (copier != nullptr && copier->order_compute_after_copies() && !to_l3) {
    unsettled_ = copies;
    return;
  }
  // An L1 -> L2 copy is a memcpy (or a copy-stream transfer) that has no failure of its own.
  if (!wait_step_copies(*copies)) fail(ErrorCode::kInternal, "copying a cold block to L2 failed");
}

bool KVSwap::cold_l3_written(const std::vector<std::pair<int32_t, uint64_t>>& entries, bool wait) {
  for (const auto& [j, key] : entries) {
    auto it = l3_write_ready_at_.find(key);
    if (it == l3_write_ready_at_.end()) continue;
    if (std::chrono::steady_clock::now() < it->second) {
      if (!wait) return false;
      std::this_thread::sleep_until(it->second);
    }
    l3_write_ready_at_.erase(it);
  }
  // Under mu_. A write that fails settles its key as lost (TierManager::complete) just before
  // its callback records why, under mu_ (cold_lost_new_): in between, the key is neither
  // writing nor readable nor known lost, so it still counts as writing.
  auto writing = [&] {
    for (const auto& [j, key] : entries) {
      const std::optional<TierEntry> e = tiers_->map().entry(key);
      if (!e) continue;
      if (e->state == BlockState::kDemoting) return true;
      if (e->state == BlockState::kLost && cold_lost_.count(key) == 0 &&
          std::none_of(cold_lost_new_.begin(), cold_lost_new_.end(), [&](const auto& x) { return x.first == key; })) {
        return true;
      }
    }
    return false;
  };
  std::unique_lock<std::mutex> lk(mu_);
  if (wait) {
    copied_cv_.wait(lk, [&] { return !writing(); });  // each write's `done` notifies under mu_
  } else if (writing()) {
    return false;
  }
  take_cold_lost_locked();
  return true;
}

void KVSwap::take_cold_lost_locked() {
  for (auto& [key, why] : cold_lost_new_) cold_lost_[key] = std::move(why);
  cold_lost_new_.clear();
}

void KVSwap::settle_cold_demotes() {
  if (!unsettled_) return;
  const std::shared_ptr<StepCopies> c = std::move(unsettled_);
  unsettled_.reset();
  if (!wait_step_copies(*c)) fail(ErrorCode::kInternal, "copying a cold block to L2 failed");
}

void KVSwap::promote(const StepPlan& plan, const TierCallback& on_done) {
  for (const StepPlan::Promotion& p : plan.promotions) {
    const uint64_t key = p.seq->cold_keys.at(p.index);
    promotions_[key] = Promotion{p.seq->id, p.index, p.block};
    if (p.seq->promoting.size() < p.seq->block_table.size()) p.seq->promoting.resize(p.seq->block_table.size(), 0);
    p.seq->promoting[p.index] = 1;
    tiers_->copy_up(key, p.block, on_done);
  }
}

// A promotion's copy ended. The block goes into the block table only if the sequence still
// has that cold block (it may have finished or been preempted since: the key was freed and
// the copy reports itself cancelled); otherwise, or when the copy failed (the L2 copy is
// intact: the block simply stays cold), its L1 block goes back to the pool.
void KVSwap::finish_promotion(const TierResult& r, const Promotion& p) {
  Sequence* s = scheduler_->find(p.seq);
  const size_t i = static_cast<size_t>(p.index);
  const bool still_cold = s && s->status == SeqStatus::kRunning && i < s->cold_keys.size() &&
                          s->cold_keys[i] == r.key && s->block_table[i] == kColdBlock;
  if (still_cold && i < s->promoting.size()) s->promoting[i] = 0;
  if (!still_cold || !r.ok) {
    pool_->decref(p.block);
    return;
  }
  tiers_->free(r.key);
  s->cold_keys[i] = 0;
  if (i < s->cold_summaries.size()) s->cold_summaries[i].clear();
  s->block_table[i] = p.block;
  --s->num_cold;
  landed_.push_back({s, p.index * config_.block_size, (p.index + 1) * config_.block_size});
  ++counters_.cold_promotions;
}

void KVSwap::start(const StepPlan& plan) {
  settle_cold_demotes();  // before any transfer of this plan (one may reuse their blocks or keys)
  demote_cold(plan);
  auto on_done = [this](const TierResult& r) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      done_.push_back(r);
    }
    wake_();
  };
  // Prefix fetches take their keys out of the index first: room made below for this
  // plan's copies may free the oldest indexed copies.
  for (Sequence* s : plan.swap_ins) {
    if (!s->tier_prefix_hashes.empty()) take_prefixes(s);
  }
  const int32_t bs = config_.block_size;
  const double per_block = swap_s_per_block();
  const double t_copy = now_seconds();
  CopyBatch batch(tiers_->copier());  // the copies out, closed before they are waited for
  for (const SwapOut& so : plan.swap_outs) {
    Sequence* s = so.seq;
    s->swap_keys.clear();
    s->swap_out_pending = 0;
    if (per_block >= 0 && recompute_s_per_token_ > 0 &&
        per_block * static_cast<double>(so.blocks.size()) >= recompute_s_per_token_ * so.num_tokens) {
      // Recomputing is estimated cheaper than a round trip through the tiers.
      s->swap = SwapState::kNone;
      s->swap_tokens = 0;
      ++counters_.swap_declined;
      events_(s->id, so.blocks, "preempt_recompute");
      continue;
    }
    for (size_t i = 0; i < so.blocks.size(); ++i) {
      const uint64_t key = demote_counted(so.blocks[i], on_done);
      if (key == 0) break;  // neither L2 nor L3 has room: the rest is recomputed
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
  int64_t swapped_blocks = 0;
  for (const SwapOut& so : plan.swap_outs) swapped_blocks += static_cast<int64_t>(so.seq->swap_keys.size());
  spill_prefixes(plan, on_done);
  batch.close();
  if (!plan.swap_outs.empty() || !plan.prefix_spills.empty()) {
    std::unique_lock<std::mutex> lk(mu_);
    copied_cv_.wait(lk, [&] { return copies_pending_ == 0; });
  }
  if (swapped_blocks > 0 && plan.prefix_spills.empty()) {
    ewma(&copy_s_per_block_, (now_seconds() - t_copy) / static_cast<double>(swapped_blocks));
  }
  // After every copy out: a promotion's block may be one this plan freed, even by one of its
  // own cold demotes (an exchange), whose state then must have settled (release_l1).
  if (!plan.promotions.empty() || !plan.swap_ins.empty()) settle_cold_demotes();
  CopyBatch copies_in(tiers_->copier());  // nothing below waits for them
  promote(plan, on_done);
  // Fetches after the copies: a block freed by a swap-out may be a fetch's target now.
  for (Sequence* s : plan.swap_ins) {
    if (s->swap != SwapState::kIn) continue;  // its prefix copies were all taken (above)
    s->swap_in_pending = 0;
    s->swap_in_bad_block = -1;
    fetch_started_[s->id] = {now_seconds(), static_cast<int32_t>(s->swap_keys.size())};
    for (size_t i = 0; i < s->swap_keys.size(); ++i) {
      const uint64_t key = s->swap_keys[i];
      keys_.at(key).pending = true;
      ++s->swap_in_pending;
      tiers_->fetch(key, s->block_table[s->swap_first_block + i], on_done);
    }
  }
}

void KVSwap::spill_prefixes(const StepPlan& plan, const TierCallback& on_done) {
  std::unordered_set<int32_t> moving;  // a block is copied out once per plan
  for (const SwapOut& so : plan.swap_outs) moving.insert(so.blocks.begin(), so.blocks.end());
  for (const StepPlan::ColdDemote& d : plan.cold_demotes) moving.insert(d.block);
  for (const BlockPool::Evicted& e : plan.prefix_spills) {
    if (prefix_.count(e.hash) || moving.count(e.block)) continue;
    const uint64_t key = demote_counted(e.block, on_done);
    if (key == 0) break;  // the tiers are full of transfers in flight
    TierPrefix& p = prefix_[e.hash];
    p.key = key;
    p.parent = e.parent;
    p.tokens = e.tokens;
    p.settled = false;
    p.lru = prefix_lru_.end();
    prefix_key_[key] = e.hash;
    moving.insert(e.block);
    ++counters_.prefix_spills;
  }
}

void KVSwap::observe_compute(int64_t tokens, double seconds) {
  if (tokens > 0 && seconds > 0) ewma(&recompute_s_per_token_, seconds / static_cast<double>(tokens));
}

double KVSwap::swap_s_per_block() const {
  const double forced = swap_cost_override_.load();
  if (forced >= 0) return forced;
  if (copy_s_per_block_ <= 0 || fetch_s_per_block_ <= 0) return -1;
  return copy_s_per_block_ + fetch_s_per_block_;
}

int32_t KVSwap::lookup_prefix(const int32_t* tokens, int32_t first, int32_t max_blocks, int32_t block_size,
                              uint64_t parent, std::vector<uint64_t>* hashes) const {
  return match_chain(
      tokens, first, max_blocks, block_size, parent,
      [&](uint64_t h, uint64_t p, const int32_t* t) {
        auto it = prefix_.find(h);
        return it != prefix_.end() && it->second.settled &&
               same_block(it->second.parent, it->second.tokens, p, t, block_size);
      },
      hashes);
}

void KVSwap::take_prefixes(Sequence* s) {
  s->swap_keys.clear();
  for (size_t i = 0; i < s->tier_prefix_hashes.size(); ++i) {
    auto it = prefix_.find(s->tier_prefix_hashes[i]);
    // Gone: another sequence admitted in this plan took that copy first (a copy is used
    // once). This one recomputes from that block on.
    if (it == prefix_.end() || !it->second.settled) break;
    const uint64_t key = it->second.key;
    prefix_lru_.erase(it->second.lru);
    prefix_key_.erase(key);
    prefix_.erase(it);
    s->swap_keys.push_back(key);
    keys_[key] = KeyInfo{s->id, static_cast<int32_t>(i), false, false};
    ++counters_.prefix_fetches;
  }
  s->tier_prefix_hashes.clear();
  s->swap_tokens = (s->swap_first_block + static_cast<int32_t>(s->swap_keys.size())) * config_.block_size;
  if (s->swap_keys.empty()) {  // nothing to fetch: it runs from its L1 hits next step
    s->swap = SwapState::kNone;
    s->swap_tokens = 0;
    s->swap_first_block = 0;
    s->prefix_fetch = false;
  }
}

void KVSwap::erase_prefix(uint64_t hash) {
  auto it = prefix_.find(hash);
  if (it == prefix_.end()) return;
  tiers_->free(it->second.key);
  prefix_key_.erase(it->second.key);
  if (it->second.settled) prefix_lru_.erase(it->second.lru);
  prefix_.erase(it);
}

bool KVSwap::evict_oldest_prefix() {
  if (prefix_lru_.empty()) return false;
  erase_prefix(prefix_lru_.front());
  ++counters_.prefix_dropped;
  return true;
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
  auto started = fetch_started_.find(s->id);
  if (started != fetch_started_.end()) {
    if (started->second.second > 0 && s->swap_in_bad_block < 0) {
      ewma(&fetch_s_per_block_, (now_seconds() - started->second.first) / started->second.second);
    }
    fetch_started_.erase(started);
  }
  int32_t tokens = s->swap_tokens;
  if (s->swap_in_bad_block >= 0) {
    tokens = std::min(tokens, (s->swap_first_block + s->swap_in_bad_block) * config_.block_size);
    ++counters_.swap_fallbacks;
  }
  for (uint64_t key : s->swap_keys) drop_key(key);
  s->swap_keys.clear();
  const int32_t first = s->swap_first_block * config_.block_size;
  if (tokens > first) landed_.push_back({s, first, tokens});
  s->num_computed = tokens;
  s->swap = SwapState::kNone;
  s->swap_tokens = 0;
  s->swap_first_block = 0;
  s->swap_in_bad_block = -1;
  if (!s->prefix_fetch) ++counters_.swap_ins;  // a preempted sequence's own KV came back
  s->prefix_fetch = false;
  scheduler_->cache_full_blocks(s);  // the fetched blocks are findable in L1 again
}

void KVSwap::apply_completions() {
  std::vector<TierResult> done;
  {
    std::lock_guard<std::mutex> lk(mu_);
    done.swap(done_);
  }
  // Promotions of a sequence in the engine's L3 lane land once its step is over: its step
  // reads the block's L2 copy, which landing frees.
  done.insert(done.begin(), held_.begin(), held_.end());
  held_.clear();
  for (const TierResult& r : done) {
    auto pr = promotions_.find(r.key);
    if (pr != promotions_.end()) {
      const Sequence* owner = scheduler_->find(pr->second.seq);
      if (owner && owner->in_lane) {
        held_.push_back(r);
        continue;
      }
      const Promotion p = pr->second;
      promotions_.erase(pr);
      finish_promotion(r, p);
      continue;
    }
    auto pk = prefix_key_.find(r.key);
    if (pk != prefix_key_.end()) {  // a cached prefix block's copy (only demotes: fetches take the key first)
      const uint64_t h = pk->second;
      if (r.op == TierOp::kDemote && r.ok) {
        TierPrefix& p = prefix_.at(h);
        p.settled = true;
        p.lru = prefix_lru_.insert(prefix_lru_.end(), h);
      } else {
        erase_prefix(h);
        ++counters_.prefix_dropped;
      }
      continue;
    }
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
        events_(s->id, {s->block_table[s->swap_first_block + k.index]}, tier_fault_name(r.fault));
        s->swap_in_bad_block =
            s->swap_in_bad_block < 0 ? k.index : std::min(s->swap_in_bad_block, k.index);
      }
      if (s->swap_in_pending == 0) finish_swap_in(s);
    }
  }
}

void KVSwap::on_finish(Sequence* s) {
  if (fail_next_finish_.exchange(false)) fail(ErrorCode::kInternal, "injected failure releasing a request's tier copies");
  fetch_started_.erase(s->id);
  for (uint64_t& key : s->cold_keys) {
    if (key != 0) free_cold_key(key);
    key = 0;  // the scheduler drops the entries when it releases the blocks
  }
  for (uint64_t key : s->swap_keys) drop_key(key);
  if (s->swap == SwapState::kIn && s->swap_in_pending > 0) {
    orphans_[s->id] = Orphan{std::move(s->block_table), s->swap_in_pending};
    s->block_table.clear();
  }
  s->swap_keys.clear();
  s->tier_prefix_hashes.clear();
  s->swap_first_block = 0;
  s->prefix_fetch = false;
  s->swap = SwapState::kNone;
}

}  // namespace k25
