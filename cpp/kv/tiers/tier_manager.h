// TierManager: the asynchronous mover of KV blocks between L1 (the primary pool), L2
// (host memory) and L3 (a file on an SSD).
//
//   demote(l1_block)      L1 -> L2, or straight to L3 through a staging slot when L2 is full
//   spill(key)            L2 -> L3
//   fetch(key, l1_block)  L2 or L3 -> L1 (an L3 page is checked before it reaches L1)
//   copy_up(key, l1_block) L2 -> L1, keeping the L2 copy (readable meanwhile; freed by free())
//   free(key)             forget an offloaded copy (now, or when its transfer ends)
//
// Every call returns at once. A transfer to or from L3 needs an L2 slot as its I/O buffer;
// when none is free it waits in a FIFO that completions (which return slots) restart. The work runs on copy threads (memcpy on the CPU; a CUDA
// copy stream later, see block_copier.h) and on the I/O backend (io_uring or pread/pwrite
// threads); the last completion of a transfer flips the block's state in the
// CacheStateMap and then calls the caller's callback, on that worker thread. (A transfer
// freed while it waited for a slot ends without moving anything, on whichever thread
// reaches it in the queue, which may be the caller's inside demote() or fetch(): callers
// must not hold a lock their callback takes while calling in.) Nothing
// waits by polling: drain() sleeps on a condition variable until the transfers in flight
// have called back, and the destructor drains.
//
// A failed transfer never throws: its callback gets a TierResult naming the fault
// (checksum, stale page, short read, no space, I/O error) and its k25 error code; the
// fault is counted and logged as "[KV_CACHE] ... evict_reason=<fault>". A failed fetch
// or demote loses the copy (state kLost: the caller recomputes those tokens); a failed
// spill leaves the block in L2. The caller owns each key from demote() until free(),
// which it calls exactly once, in any state. Calls that break the state machine (unknown
// key, a block that is already moving) throw kInternal.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "kv/tiers/block_copier.h"
#include "kv/tiers/cache_state_map.h"
#include "kv/tiers/file_tier.h"
#include "kv/tiers/host_tier.h"
#include "kv/tiers/task_runner.h"
#include "kv/tiers/tier_log.h"
#include "kv/tiers/tier_stats.h"

namespace k25 {

struct TierConfig {
  int64_t block_bytes = 0;      // one L1 block: all layers' K and V
  int64_t l2_bytes = 0;         // L2 host pool; whole slots of page_bytes_for(block_bytes)
  int32_t l2_staging_slots = 2; // of those, kept for L3 traffic (only when L3 is on)
  std::string l3_path;          // empty: no L3
  int64_t l3_bytes = 0;
  std::string io_backend = "auto";  // auto | io_uring | threads
  int32_t io_threads = 2;
  int32_t io_queue_depth = 32;
  int32_t copy_threads = 1;     // L1 <-> L2 memcpy threads (CPU)
  bool manual = false;          // tests: transfers wait for run_pending()
  // > 0: every page written to L3 also gets a CRC32C of each of this many equal slices of
  // its block bytes (kept in host memory by key), so that read_l3_slice() can read and check
  // one slice (one layer's K and V: cold blocks in L3) without the whole page.
  int32_t l3_slices = 0;
  // Where L1 is not host memory (CUDA): L2's memory (pinned) and the L1 <-> L2 copier (a
  // copy stream), made by the executor that owns L1. Unset: mmap'd L2 and memcpy from the
  // l1_base given to TierManager.
  HostAllocator l2_allocator;
  std::function<std::unique_ptr<BlockCopier>(TaskRunner* completions)> make_copier;
};

enum class TierOp : uint8_t { kDemote, kSpill, kFetch, kCopyUp, kRead };
const char* tier_op_name(TierOp op);

struct TierResult {
  uint64_t key = 0;
  TierOp op = TierOp::kDemote;
  Tier tier = Tier::kL2;   // demote: where the block went; spill: L3; fetch: where it came from
  int32_t l1_block = -1;   // demote: the source; fetch: the target
  bool ok = false;
  bool cancelled = false;  // freed in flight: neither a success nor a fault
  TierFault fault = TierFault::kNone;
  ErrorCode code = ErrorCode::kInternal;  // when a fault: how it surfaces as a k25 error
  std::string message;
};
using TierCallback = std::function<void(const TierResult&)>;

class TierManager {
 public:
  // l1_base: the primary pool in host memory (block b at l1_base + b * block_bytes).
  // Throws k25::Error for a bad config, memory that cannot be had, an L3 path that cannot
  // be opened or reserved.
  TierManager(const TierConfig& config, int32_t num_l1_blocks, void* l1_base, TierLog log = {});
  ~TierManager();
  TierManager(const TierManager&) = delete;
  TierManager& operator=(const TierManager&) = delete;

  // Starts moving l1_block out of L1. The block must keep its bytes (stay allocated and
  // unwritten) until `copied` runs, or `done` if that comes first (no copy happened: it
  // failed, or the key was freed before the copy started): from then on only the host
  // copy is used. Returns the copy's key, or 0 when neither L2 nor L3 has room
  // (nothing started; no callback). allow_l3 = false: L2 or nothing.
  uint64_t demote(int32_t l1_block, TierCallback done, std::function<void(uint64_t key)> copied = {},
                  bool allow_l3 = true);
  // Starts writing an L2 block to L3; false when L3 has no free page.
  bool spill(uint64_t key, TierCallback done);
  // Starts copying the block back into l1_block (allocated by the caller, not read until
  // `done` runs with ok).
  void fetch(uint64_t key, int32_t l1_block, TierCallback done);
  // Starts copying a block in L2 into l1_block (allocated by the caller, not read until
  // `done` runs with ok) while the L2 copy stays, readable through l2_data(); afterwards the
  // block is in L2 as before (counted as a fetch from L2).
  void copy_up(uint64_t key, int32_t l1_block, TierCallback done);
  // Where slice `slice` of a page lies for read_l3_slice: the aligned span of the page that
  // is read (offset in the page, bytes) and where the slice's bytes start in that span.
  struct SliceSpan {
    int64_t offset = 0, bytes = 0, data_offset = 0;
  };
  SliceSpan l3_slice_span(int32_t slice) const;
  int64_t l3_slice_bytes() const { return config_.l3_slices > 0 ? config_.block_bytes / config_.l3_slices : 0; }
  // Reads slice `slice` of a block settled in L3 (state unchanged: the page stays where it
  // is) into `buf` (4096-aligned, l3_slice_span(slice).bytes long) and checks it against the
  // slice's CRC32C: a short read or a mismatch is a fault, counted and logged like a fetch's
  // (op=read). The caller must not free the key before `done` runs. Needs l3_slices > 0.
  void read_l3_slice(uint64_t key, int32_t slice, void* buf, TierCallback done);
  // Slices [slice, slice + count) in one read (buf: the span from the first's to the last's,
  // l3_slice_span(slice).data_offset before the first), each checked against its CRC32C.
  void read_l3_slices(uint64_t key, int32_t slice, int32_t count, void* buf, TierCallback done);
  // Forgets the copy: at once when settled, at the end of its transfer when in flight.
  void free(uint64_t key);
  // Waits until no transfer is in flight (manual mode: runs them all).
  void drain();

  // Manual mode only.
  size_t num_pending() const;
  bool run_pending(size_t index);

  const CacheStateMap& map() const { return map_; }
  // The bytes of a block settled in L2 or being copied up from it (laid out as in L1), or
  // nullptr when it is neither.
  // in_flight: also while the block's copy down to its L2 slot is in flight (a reader that the
  // device orders after that copy, BlockCopier::order_compute_after_copies).
  const uint8_t* l2_data(uint64_t key, bool in_flight = false) const;
  int32_t l2_room() const { return map_.l2_room(); }
  TierStats stats() const;
  int32_t in_flight() const;
  // The L1 <-> L2 copier, for a CopyBatch around a run of demotes or fetches (block_copier.h).
  BlockCopier* copier() { return copier_.get(); }
  int64_t block_bytes() const { return config_.block_bytes; }
  int64_t page_bytes() const { return page_bytes_; }
  bool has_l3() const { return l3_ != nullptr; }
  const FileTier* l3() const { return l3_.get(); }
  // Byte offset in the L3 file of a block that is in L3 (-1 otherwise), for tests and tools.
  int64_t l3_offset(uint64_t key) const;
  // Tests: the next n pages written to L3 get one byte flipped on disk right after the
  // write succeeds (so their fetch must fail its checksum).
  void corrupt_next_l3_writes_for_test(int32_t n);
  // Tests: a copy into L1 (fetch, copy-up) begun from now on calls back no earlier than
  // `seconds` after it began (a slow bus's stand-in: its worker sleeps until then).
  void delay_copies_in_for_test(double seconds) { copy_in_delay_s_.store(seconds); }

 private:
  using Clock = std::chrono::steady_clock;
  void begin_op();
  void complete(const TierMove& mv, TierOp op, TierFault fault, const std::string& detail, Clock::time_point t0,
                const TierCallback& done);
  void write_to_l3(const TierMove& mv, TierOp op, Clock::time_point t0, TierCallback done);
  // Runs a transfer that has all it needs (an L3 one: its staging slot).
  void start(const TierMove& mv, TierOp op, Clock::time_point t0, TierCallback done,
             std::function<void(uint64_t)> copied = {});
  void start_waiting();

  struct Waiting {
    TierMove mv;
    TierOp op;
    Clock::time_point t0;
    TierCallback done;
    std::function<void(uint64_t)> copied;
  };

  TierConfig config_;
  TierLog log_;
  int64_t page_bytes_;
  std::unique_ptr<TaskRunner> copy_runner_;  // first in, last out: outlives every user
  ManualRunner* manual_ = nullptr;           // copy_runner_ in manual mode
  std::unique_ptr<HostTier> l2_;
  std::unique_ptr<FileTier> l3_;
  std::unique_ptr<BlockCopier> copier_;
  CacheStateMap map_;

  mutable std::mutex mu_;  // in_flight_, stats_
  std::condition_variable idle_cv_;
  int32_t in_flight_ = 0;
  TierStats stats_;
  int32_t corrupt_next_ = 0;  // tests
  std::atomic<double> copy_in_delay_s_{0};  // tests
  std::unordered_map<uint64_t, std::vector<uint32_t>> slice_crcs_;  // l3_slices > 0: by key (mu_)
  std::mutex wait_mu_;
  std::deque<Waiting> waiting_;  // L3 transfers without a staging slot yet, oldest first
};

}  // namespace k25
