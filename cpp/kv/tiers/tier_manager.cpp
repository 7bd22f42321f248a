#include "kv/tiers/tier_manager.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "kv/tiers/crc32c.h"
#include "kv/tiers/page_format.h"

namespace k25 {

namespace {

int32_t l2_slots_for(const TierConfig& c) {
  if (c.block_bytes <= 0) fail(ErrorCode::kInvalidArgument, "tiers: block_bytes must be positive");
  if (c.l2_bytes < 0 || c.l3_bytes < 0) fail(ErrorCode::kInvalidArgument, "tiers: l2_bytes and l3_bytes must not be negative");
  const int64_t page = page_bytes_for(c.block_bytes);
  const int64_t slots = c.l2_bytes / page;
  if (slots < 1) {
    fail(ErrorCode::kInvalidArgument,
         "l2_bytes=" + std::to_string(c.l2_bytes) + " holds no L2 slot; one slot (a KV block of " +
             std::to_string(c.block_bytes) + " bytes and its page trailer) takes " + std::to_string(page) +
             " bytes" + (c.l3_path.empty() ? "" : ", and L3 transfers go through L2 slots"));
  }
  if (slots > (int64_t{1} << 30)) fail(ErrorCode::kInvalidArgument, "l2_bytes is too large");
  return static_cast<int32_t>(slots);
}

int32_t staging_for(const TierConfig& c, int32_t slots) {
  if (c.l3_path.empty()) return 0;
  if (c.l2_staging_slots < 1) fail(ErrorCode::kInvalidArgument, "tiers: L3 needs at least one L2 staging slot");
  return std::min(c.l2_staging_slots, slots);
}

int64_t checked_slices(const TierConfig& c) {
  if (c.l3_slices < 0 || (c.l3_slices > 0 && c.block_bytes % c.l3_slices != 0)) {
    fail(ErrorCode::kInvalidArgument, "tiers: l3_slices must divide block_bytes");
  }
  return c.l3_slices;
}

std::unique_ptr<TaskRunner> make_copy_runner(const TierConfig& c) {
  if (c.manual) return std::make_unique<ManualRunner>();
  return std::make_unique<WorkerThreads>(std::max(1, c.copy_threads), "k25-kv-copy");
}

std::unique_ptr<FileTier> make_l3(const TierConfig& c, int64_t page_bytes, TaskRunner* manual, const TierLog& log) {
  if (c.l3_path.empty()) {
    if (c.l3_bytes != 0) fail(ErrorCode::kInvalidArgument, "l3_bytes is set but l3_path is not");
    return nullptr;
  }
  FileTierOptions o;
  o.path = c.l3_path;
  o.bytes = c.l3_bytes;
  o.page_bytes = page_bytes;
  o.io_backend = c.io_backend;
  o.io_threads = c.io_threads;
  o.queue_depth = c.io_queue_depth;
  o.runner = manual;
  o.log = log;
  return std::make_unique<FileTier>(o);
}

TierFault read_fault(const IoOutcome& o, int64_t len) {
  if (o.bytes == len) return TierFault::kNone;
  if (o.err != 0 && o.bytes == 0) return TierFault::kIOError;
  return TierFault::kShortRead;  // end of file inside the page, or an error after part of it
}

TierFault write_fault(const IoOutcome& o, int64_t len) {
  if (o.err == ENOSPC || o.err == EFBIG || o.err == EDQUOT) return TierFault::kNoSpace;
  if (o.err != 0) return TierFault::kIOError;
  return o.bytes == len ? TierFault::kNone : TierFault::kShortWrite;
}

std::string io_detail(const IoOutcome& o, int64_t len) {
  std::string s = std::to_string(o.bytes) + " of " + std::to_string(len) + " bytes";
  if (o.err) s += ", " + std::string(std::strerror(o.err));
  return s;
}

const char* tier_name(Tier t) { return t == Tier::kL1 ? "L1" : t == Tier::kL2 ? "L2" : "L3"; }

}  // namespace

const char* tier_op_name(TierOp op) {
  switch (op) {
    case TierOp::kDemote: return "demote";
    case TierOp::kSpill: return "spill";
    case TierOp::kFetch: return "fetch";
    case TierOp::kCopyUp: return "copy_up";
    case TierOp::kRead: return "read";
  }
  return "unknown";
}

TierManager::TierManager(const TierConfig& config, int32_t num_l1_blocks, void* l1_base, TierLog log)
    : config_(config),
      log_(std::move(log)),
      page_bytes_(page_bytes_for(std::max<int64_t>(config.block_bytes, 1))),
      copy_runner_(make_copy_runner(config)),
      manual_(config.manual ? static_cast<ManualRunner*>(copy_runner_.get()) : nullptr),
      l2_(std::make_unique<HostTier>(l2_slots_for(config), page_bytes_,
                                     config.l2_allocator.allocate ? config.l2_allocator : mmap_allocator())),
      l3_(make_l3(config, page_bytes_, manual_, log_)),
      copier_(config.make_copier
                  ? config.make_copier(copy_runner_.get())
                  : std::make_unique<HostBlockCopier>(l1_base, config.block_bytes, num_l1_blocks, copy_runner_.get())),
      map_(num_l1_blocks, l2_->num_slots(), staging_for(config, l2_->num_slots()), l3_ ? l3_->num_pages() : 0) {
  checked_slices(config_);
}

TierManager::~TierManager() {
  // Shutdown waits for every transfer: workers still hold pointers into L1, L2 and the file.
  try {
    drain();
  } catch (const std::exception&) {
    // Manual mode reports a lost transfer from drain(); a destructor cannot throw it.
  }
}

void TierManager::begin_op() {
  std::lock_guard<std::mutex> lk(mu_);
  ++in_flight_;
}

int32_t TierManager::in_flight() const {
  std::lock_guard<std::mutex> lk(mu_);
  return in_flight_;
}

void TierManager::complete(const TierMove& mv, TierOp op, TierFault fault, const std::string& detail,
                           Clock::time_point t0, const TierCallback& done) {
  const bool ok = fault == TierFault::kNone;
  const TierFinish f = map_.finish(mv.key, ok);
  if (f.cancelled && config_.l3_slices > 0) {
    // Freed in flight: free() has run, and a write may have added slice checksums since.
    std::lock_guard<std::mutex> lk(mu_);
    slice_crcs_.erase(mv.key);
  }
  TierResult r;
  r.key = mv.key;
  r.op = op;
  r.tier = op == TierOp::kSpill ? Tier::kL3 : mv.via;
  r.l1_block = mv.l1_block;
  r.cancelled = f.cancelled;
  r.ok = ok && !f.cancelled;
  r.fault = f.cancelled ? TierFault::kCancelled : fault;
  if (!ok && !f.cancelled) {
    r.code = tier_fault_code(fault);
    r.message = std::string("KV ") + tier_op_name(op) + " of key " + std::to_string(mv.key) + " via " +
                tier_name(mv.via) + " failed: " + tier_fault_name(fault) + (detail.empty() ? "" : " (" + detail + ")");
  }
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  const int64_t block = config_.block_bytes;
  {
    std::lock_guard<std::mutex> lk(mu_);
    TierStats& s = stats_;
    if (f.cancelled) {
      ++s.cancelled;
    } else if (!ok) {
      ++s.faults[static_cast<int>(fault)];
    } else if (op == TierOp::kDemote) {
      ++s.offloads;
      if (mv.via == Tier::kL2) {
        ++s.offloads_to_l2;
        s.bytes_to_l2 += block;
      } else {
        ++s.offloads_to_l3;
        s.bytes_to_l3 += page_bytes_;
      }
      s.offload_latency.observe(secs);
    } else if (op == TierOp::kSpill) {
      ++s.spills;
      s.bytes_to_l3 += page_bytes_;
      s.spill_latency.observe(secs);
    } else {
      ++s.fetches;
      if (mv.via == Tier::kL2) {
        ++s.fetches_from_l2;
        s.bytes_from_l2 += block;
      } else {
        ++s.fetches_from_l3;
        s.bytes_from_l3 += page_bytes_;
      }
      s.fetch_latency.observe(secs);
    }
  }
  if (!r.ok && !r.cancelled) {
    tier_log(log_, "[KV_CACHE] key=" + std::to_string(mv.key) + " op=" + tier_op_name(op) + " tier=" +
                       tier_name(mv.via) + (mv.l1_block >= 0 ? " block_id=" + std::to_string(mv.l1_block) : "") +
                       (mv.l3_page >= 0 ? " l3_page=" + std::to_string(mv.l3_page) : "") +
                       " evict_reason=" + tier_fault_name(fault) + (detail.empty() ? "" : " detail=\"" + detail + "\""));
  }
  if (done) done(r);
  start_waiting();  // this transfer may have returned a slot that a waiting one needs
  // Last, and notified under the lock: once drain() sees zero, this thread touches the
  // manager no more (the destructor may run next).
  std::lock_guard<std::mutex> lk(mu_);
  --in_flight_;
  idle_cv_.notify_all();
}

void TierManager::write_to_l3(const TierMove& mv, TierOp op, Clock::time_point t0, TierCallback done) {
  uint8_t* slot = l2_->slot(mv.l2_slot);
  seal_page(slot, config_.block_bytes, mv.key);
  if (config_.l3_slices > 0) {
    // The bytes written, slice by slice (read_l3_slice checks one without the page's trailer).
    const int64_t n = l3_slice_bytes();
    std::vector<uint32_t> crcs(static_cast<size_t>(config_.l3_slices));
    for (int32_t i = 0; i < config_.l3_slices; ++i) crcs[i] = crc32c(slot + i * n, static_cast<size_t>(n));
    std::lock_guard<std::mutex> lk(mu_);
    slice_crcs_[mv.key] = std::move(crcs);
  }
  l3_->write_page(mv.l3_page, slot, [this, mv, op, t0, done = std::move(done)](IoOutcome o) {
    const TierFault fault = write_fault(o, page_bytes_);
    if (fault == TierFault::kNone) {
      bool corrupt = false;
      {
        std::lock_guard<std::mutex> lk(mu_);
        if (corrupt_next_ > 0) {
          --corrupt_next_;
          corrupt = true;
        }
      }
      if (corrupt) {
        try {
          l3_->corrupt_page_for_test(mv.l3_page);
        } catch (const std::exception& e) {
          tier_log(log_, std::string("[KV_CACHE] test corruption failed: ") + e.what());
        }
      }
    }
    complete(mv, op, fault, fault == TierFault::kNone ? "" : io_detail(o, page_bytes_), t0, done);
  });
}

void TierManager::start(const TierMove& mv, TierOp op, Clock::time_point t0, TierCallback done,
                        std::function<void(uint64_t)> copied) {
  uint8_t* slot = l2_->slot(mv.l2_slot);
  if (op == TierOp::kSpill) return write_to_l3(mv, op, t0, std::move(done));
  if (op == TierOp::kDemote) {
    copier_->copy_out(mv.l1_block, slot,
                      [this, mv, t0, done = std::move(done), copied = std::move(copied)](bool ok) mutable {
      if (!ok) return complete(mv, TierOp::kDemote, TierFault::kCopyFailed, "", t0, done);
      map_.release_l1(mv.key);
      if (copied) copied(mv.key);
      if (mv.via == Tier::kL2) return complete(mv, TierOp::kDemote, TierFault::kNone, "", t0, done);
      write_to_l3(mv, TierOp::kDemote, t0, std::move(done));
    });
    return;
  }
  auto copy_in = [this, slot, t0, op](const TierMove& m, TierCallback cb) {
    const double delay_s = copy_in_delay_s_.load();
    const Clock::time_point ready =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(delay_s));
    copier_->copy_in(slot, m.l1_block, [this, m, t0, op, delay_s, ready, cb = std::move(cb)](bool ok) {
      if (delay_s > 0) std::this_thread::sleep_until(ready);
      complete(m, op, ok ? TierFault::kNone : TierFault::kCopyFailed, "", t0, cb);
    });
  };
  if (mv.via == Tier::kL2) return copy_in(mv, std::move(done));
  l3_->read_page(mv.l3_page, slot, [this, mv, slot, t0, copy_in, done = std::move(done)](IoOutcome o) mutable {
    TierFault fault = read_fault(o, page_bytes_);
    std::string detail;
    if (fault != TierFault::kNone) {
      detail = io_detail(o, page_bytes_);
    } else {
      // Verified here, before a byte reaches L1: a bad page must never become KV.
      switch (check_page(slot, config_.block_bytes, mv.key)) {
        case PageCheck::kOk: break;
        case PageCheck::kChecksum: fault = TierFault::kChecksum; break;
        case PageCheck::kStale: fault = TierFault::kStale; break;
        case PageCheck::kBadTrailer: fault = TierFault::kBadTrailer; break;
      }
    }
    if (fault != TierFault::kNone) return complete(mv, TierOp::kFetch, fault, detail, t0, done);
    copy_in(mv, std::move(done));
  });
}

// Called after every completion (which may have returned a slot) and after a new
// transfer was queued: hands free slots to waiting L3 transfers in arrival order.
void TierManager::start_waiting() {
  while (true) {
    Waiting w;
    {
      std::lock_guard<std::mutex> lk(wait_mu_);
      if (waiting_.empty()) return;
      const std::optional<TierEntry> e = map_.entry(waiting_.front().mv.key);
      if (e && e->free_requested) {
        w = std::move(waiting_.front());  // freed while it waited: nothing to move
        waiting_.pop_front();
      } else {
        const std::optional<int32_t> slot = map_.assign_staging(waiting_.front().mv.key);
        if (!slot) return;
        w = std::move(waiting_.front());
        waiting_.pop_front();
        w.mv.l2_slot = *slot;
      }
    }
    if (w.mv.l2_slot < 0) {
      complete(w.mv, w.op, TierFault::kNone, "", w.t0, w.done);  // reports it cancelled
    } else {
      start(w.mv, w.op, w.t0, std::move(w.done), std::move(w.copied));
    }
  }
}

uint64_t TierManager::demote(int32_t l1_block, TierCallback done, std::function<void(uint64_t)> copied,
                             bool allow_l3) {
  const auto t0 = Clock::now();
  const std::optional<TierMove> mv = map_.begin_demote(l1_block, allow_l3 && l3_ != nullptr);
  if (!mv) {
    std::lock_guard<std::mutex> lk(mu_);
    ++stats_.refused;
    return 0;
  }
  begin_op();
  if (mv->l2_slot < 0) {
    {
      std::lock_guard<std::mutex> lk(wait_mu_);
      waiting_.push_back({*mv, TierOp::kDemote, t0, std::move(done), std::move(copied)});
    }
    start_waiting();  // a slot may have come back since begin_demote looked
  } else {
    start(*mv, TierOp::kDemote, t0, std::move(done), std::move(copied));
  }
  return mv->key;
}

const uint8_t* TierManager::l2_data(uint64_t key, bool in_flight) const {
  const std::optional<TierEntry> e = map_.entry(key);
  const bool landing = in_flight && e && e->state == BlockState::kDemoting && e->via == Tier::kL2 && e->l2_slot >= 0;
  if (!e || (e->state != BlockState::kInL2 && e->state != BlockState::kCopyingUp && !landing)) return nullptr;
  return l2_->slot(e->l2_slot);
}

bool TierManager::spill(uint64_t key, TierCallback done) {
  const auto t0 = Clock::now();
  if (!l3_) fail(ErrorCode::kInternal, "spill without an L3 tier");
  const std::optional<TierMove> mv = map_.begin_spill(key);
  if (!mv) {
    std::lock_guard<std::mutex> lk(mu_);
    ++stats_.refused;
    return false;
  }
  begin_op();
  start(*mv, TierOp::kSpill, t0, std::move(done));
  return true;
}

void TierManager::fetch(uint64_t key, int32_t l1_block, TierCallback done) {
  const auto t0 = Clock::now();
  const TierMove mv = map_.begin_fetch(key, l1_block);
  begin_op();
  if (mv.l2_slot < 0) {
    {
      std::lock_guard<std::mutex> lk(wait_mu_);
      waiting_.push_back({mv, TierOp::kFetch, t0, std::move(done), {}});
    }
    start_waiting();
  } else {
    start(mv, TierOp::kFetch, t0, std::move(done));
  }
}

void TierManager::copy_up(uint64_t key, int32_t l1_block, TierCallback done) {
  const auto t0 = Clock::now();
  const TierMove mv = map_.begin_copy_up(key, l1_block);
  begin_op();
  start(mv, TierOp::kCopyUp, t0, std::move(done));
}

TierManager::SliceSpan TierManager::l3_slice_span(int32_t slice) const {
  const int64_t n = l3_slice_bytes();
  if (n <= 0 || slice < 0 || slice >= config_.l3_slices) fail(ErrorCode::kInternal, "tiers: no such L3 slice");
  // O_DIRECT wants offsets and sizes in whole 4096-byte units (the page is a multiple of them).
  constexpr int64_t kAlign = 4096;
  const int64_t begin = slice * n, end = begin + n;
  SliceSpan sp;
  sp.offset = begin / kAlign * kAlign;
  sp.bytes = (end + kAlign - 1) / kAlign * kAlign - sp.offset;
  sp.data_offset = begin - sp.offset;
  return sp;
}

void TierManager::read_l3_slice(uint64_t key, int32_t slice, void* buf, TierCallback done) {
  read_l3_slices(key, slice, 1, buf, std::move(done));
}

void TierManager::read_l3_slices(uint64_t key, int32_t slice, int32_t count, void* buf, TierCallback done) {
  if (count < 1 || slice + count > config_.l3_slices) fail(ErrorCode::kInternal, "tiers: no such L3 slices");
  SliceSpan sp = l3_slice_span(slice);
  if (count > 1) {
    const SliceSpan last = l3_slice_span(slice + count - 1);
    sp.bytes = last.offset + last.bytes - sp.offset;
  }
  const std::optional<TierEntry> e = map_.entry(key);
  if (!l3_ || !e || e->state != BlockState::kInL3 || e->l3_page < 0) {
    fail(ErrorCode::kInternal, "tiers: reading a slice of key " + std::to_string(key) + ", which is not settled in L3");
  }
  std::vector<uint32_t> want(static_cast<size_t>(count));
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = slice_crcs_.find(key);
    if (it == slice_crcs_.end()) fail(ErrorCode::kInternal, "tiers: no slice checksums for key " + std::to_string(key));
    std::copy(it->second.begin() + slice, it->second.begin() + slice + count, want.begin());
  }
  begin_op();
  const int64_t page = e->l3_page;
  l3_->read_range(page, sp.offset, buf, sp.bytes, [this, key, page, slice, count, sp, want = std::move(want), buf,
                                                   done = std::move(done)](IoOutcome o) {
    TierFault fault = read_fault(o, sp.bytes);
    std::string detail;
    const int64_t n = l3_slice_bytes();
    if (fault != TierFault::kNone) detail = io_detail(o, sp.bytes);
    for (int32_t i = 0; fault == TierFault::kNone && i < count; ++i) {
      if (crc32c(static_cast<const uint8_t*>(buf) + sp.data_offset + i * n, static_cast<size_t>(n)) != want[i]) {
        fault = TierFault::kChecksum;
        detail = "slice " + std::to_string(slice + i);
      }
    }
    TierResult r;
    r.key = key;
    r.op = TierOp::kRead;
    r.tier = Tier::kL3;
    r.ok = fault == TierFault::kNone;
    r.fault = fault;
    if (!r.ok) {
      r.code = tier_fault_code(fault);
      r.message = "KV read of slice " + std::to_string(slice) + " of key " + std::to_string(key) +
                  " in L3 failed: " + tier_fault_name(fault) + (detail.empty() ? "" : " (" + detail + ")");
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (r.ok) {
        stats_.l3_slice_reads += count;
        stats_.bytes_from_l3 += sp.bytes;
      } else {
        ++stats_.faults[static_cast<int>(fault)];
      }
    }
    if (!r.ok) {
      tier_log(log_, "[KV_CACHE] key=" + std::to_string(key) + " op=read tier=L3 l3_page=" + std::to_string(page) +
                         " slice=" + std::to_string(slice) + " evict_reason=" + tier_fault_name(fault) +
                         (detail.empty() ? "" : " detail=\"" + detail + "\""));
    }
    if (done) done(r);
    std::lock_guard<std::mutex> lk(mu_);
    --in_flight_;
    idle_cv_.notify_all();
  });
}

void TierManager::free(uint64_t key) {
  if (config_.l3_slices > 0) {
    std::lock_guard<std::mutex> lk(mu_);
    slice_crcs_.erase(key);
  }
  map_.free(key);
}

void TierManager::drain() {
  if (manual_) {
    while (manual_->run(0)) {
    }
    if (in_flight() != 0) fail(ErrorCode::kInternal, "tiers: a transfer was lost (in flight with nothing queued)");
    return;
  }
  std::unique_lock<std::mutex> lk(mu_);
  idle_cv_.wait(lk, [&] { return in_flight_ == 0; });
}

size_t TierManager::num_pending() const { return manual_ ? manual_->pending() : 0; }

bool TierManager::run_pending(size_t index) {
  if (!manual_) fail(ErrorCode::kInternal, "run_pending needs a manual-mode TierManager");
  return manual_->run(index);
}

TierStats TierManager::stats() const {
  const TierCounts c = map_.counts();
  std::lock_guard<std::mutex> lk(mu_);
  TierStats s = stats_;
  s.l2_blocks = c.l2_residents;
  s.l3_blocks = c.l3_pages_used;
  return s;
}

void TierManager::corrupt_next_l3_writes_for_test(int32_t n) {
  std::lock_guard<std::mutex> lk(mu_);
  corrupt_next_ = n;
}

int64_t TierManager::l3_offset(uint64_t key) const {
  const std::optional<TierEntry> e = map_.entry(key);
  if (!l3_ || !e || e->l3_page < 0) return -1;
  return l3_->page_offset(e->l3_page);
}

}  // namespace k25
