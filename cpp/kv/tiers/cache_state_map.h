// CacheStateMap: the one source of truth for where every offloaded KV block lives and
// which transfer it is in.
//
// An L1 block (a block id of the primary pool) that is in no transfer is simply resident:
// the block pool owns it. Moving a block out of L1 creates an entry with a fresh key
// (never reused; it also names the copy on disk). The caller owns the key until it calls
// free(key), exactly once, in any state. An entry is in exactly one state:
//
//   kDemoting  L1 -> L2 or L3 in flight; the L1 block is the source and must stay put
//              until release_l1() says its bytes are copied (the write to L3 may go on)
//   kInL2      held in an L2 slot
//   kSpilling  L2 -> L3 in flight; the L2 slot is the source
//   kInL3      held in an L3 page only
//   kFetching  L2 or L3 -> L1 in flight; the L1 block is the target and must not be read
//   kCopyingUp L2 -> L1 copy in flight that keeps the L2 copy: the L1 block is the target,
//              the slot stays the block's (it may be read meanwhile); ends back in kInL2
//   kResident  fetched back: the bytes are in L1 again, nothing is held below
//   kLost      a transfer failed and the copy is gone (the caller recomputes)
//
//   begin_demote ─► kDemoting ──ok──► kInL2 / kInL3      (failure: kLost)
//   begin_spill:     kInL2 ─► kSpilling ──ok──► kInL3    (failure: back to kInL2)
//   begin_fetch:     kInL2 / kInL3 ─► kFetching ──ok──► kResident  (failure: kLost)
//   begin_copy_up:   kInL2 ─► kCopyingUp ──(ok or not)──► kInL2
//   free:            settled states: gone now; in flight: gone when the transfer ends
//
// Keeping kResident and kLost until free() makes ownership race-free: a completion never
// removes a key its owner may still name.
//
// begin_* run on the caller's thread and reserve what the transfer needs (an L2 slot, an
// L3 page); finish() runs from the transfer's completion callback and is the only way out
// of an in-flight state. free() of a settled entry releases it at once; free() during a
// transfer marks the entry, and the completion releases it. An illegal transition (an
// unknown key, a block already moving, a fetch of a block in flight) is a kInternal error.
//
// L2 slots are shared between residents and staging: a transfer to or from L3 that does
// not end in L2 borrows a slot as its I/O buffer. `staging` slots are kept out of the
// residents' reach so that L3 traffic always gets buffers back as its transfers finish.
// A transfer that finds no free slot is still begun (its l2_slot is -1: waiting for a
// buffer); assign_staging() hands it one once a completion has returned a slot.
//
// Thread-safe: one mutex; every method is short and never blocks on I/O.
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

namespace k25 {

enum class BlockState : uint8_t { kDemoting, kInL2, kSpilling, kInL3, kFetching, kResident, kLost, kCopyingUp };
enum class Tier : uint8_t { kL1 = 1, kL2 = 2, kL3 = 3 };
const char* block_state_name(BlockState s);

struct TierEntry {
  BlockState state = BlockState::kInL2;
  Tier via = Tier::kL2;    // kDemoting: the target tier; kFetching: the source tier
  int32_t l1_block = -1;   // source (kDemoting) or target (kFetching); -1 otherwise
  int32_t l2_slot = -1;    // residence (kInL2, kSpilling, L2 moves) or staging buffer
  int64_t l3_page = -1;    // residence (kInL3) or target (kSpilling, L3 demotes)
  bool free_requested = false;
};

// What a begin_* reserved: enough for the mover to run the transfer.
struct TierMove {
  uint64_t key = 0;
  Tier via = Tier::kL2;
  int32_t l1_block = -1;
  int32_t l2_slot = -1;
  int64_t l3_page = -1;
};

// What finish() did.
struct TierFinish {
  BlockState from = BlockState::kDemoting;  // the in-flight state that ended
  Tier via = Tier::kL2;
  int32_t l1_block = -1;
  bool cancelled = false;  // freed during the transfer; the entry is gone
};

struct TierCounts {
  int32_t demoting = 0, in_l2 = 0, spilling = 0, in_l3 = 0, fetching = 0, resident = 0, lost = 0, copying_up = 0;
  int32_t l2_slots_used = 0, l2_residents = 0;
  int64_t l3_pages_used = 0;
  int32_t in_flight() const { return demoting + spilling + fetching + copying_up; }
};

class CacheStateMap {
 public:
  CacheStateMap(int32_t num_l1_blocks, int32_t num_l2_slots, int32_t l2_staging_slots, int64_t num_l3_pages);

  // L1 -> L2 when a resident slot is free, else L1 -> L3 (through a staging slot, maybe
  // still to come) when allow_l3 and a page is free. nullopt when neither has room.
  std::optional<TierMove> begin_demote(int32_t l1_block, bool allow_l3);
  // kInL2 -> kSpilling; nullopt when L3 has no free page.
  std::optional<TierMove> begin_spill(uint64_t key);
  // kInL2 / kInL3 -> kFetching into l1_block (from L3: a staging slot, maybe still to come).
  TierMove begin_fetch(uint64_t key, int32_t l1_block);
  // kInL2 -> kCopyingUp into l1_block; the L2 slot stays held (and readable).
  TierMove begin_copy_up(uint64_t key, int32_t l1_block);
  // A demote's L1 source has been copied out: the block may be reused while the rest of
  // the transfer (an L3 write) goes on.
  void release_l1(uint64_t key);
  // Gives a staging slot to an L3 transfer that is waiting for one; nullopt while no slot
  // is free.
  std::optional<int32_t> assign_staging(uint64_t key);
  // Ends the transfer `key` is in; ok says whether it succeeded.
  TierFinish finish(uint64_t key, bool ok);
  // Releases a settled entry (true) or marks an in-flight one for release at its
  // completion (false). Exactly once per key.
  bool free(uint64_t key);

  std::optional<TierEntry> entry(uint64_t key) const;
  // The key whose transfer uses this L1 block, if any.
  std::optional<uint64_t> l1_user(int32_t l1_block) const;
  std::vector<uint64_t> keys() const;
  TierCounts counts() const;
  // Oldest settled L2 residents first (spill candidates), at most n.
  std::vector<uint64_t> oldest_in_l2(size_t n) const;

  int32_t num_l1_blocks() const { return static_cast<int32_t>(l1_user_.size()); }
  int32_t num_l2_slots() const { return static_cast<int32_t>(l2_owner_.size()); }
  int32_t l2_capacity() const { return num_l2_slots() - staging_; }  // resident slots
  // Resident slots a demote to L2 could take now.
  int32_t l2_room() const;
  int64_t num_l3_pages() const { return static_cast<int64_t>(l3_owner_.size()); }
  // Free L3 pages now.
  int64_t l3_room() const;

  // Throws kInternal unless every slot, page and L1 block is used by exactly the entries
  // that say so, the free lists hold the rest, and every entry's fields fit its state.
  void check_invariants() const;

 private:
  TierEntry& get(uint64_t key, const char* what);
  int32_t take_slot();
  int64_t take_page();
  void put_slot(int32_t s);
  void put_page(int64_t p);
  void release(TierEntry& e);  // returns every slot, page and L1 pin the entry holds
  void settle(TierEntry& e, BlockState s);
  static bool holds_resident_slot(const TierEntry& e);
  void check_invariants_locked() const;

  mutable std::mutex mu_;
  int32_t staging_;
  uint64_t next_key_ = 1;
  std::unordered_map<uint64_t, TierEntry> entries_;
  std::vector<uint64_t> l1_user_;   // key using each L1 block, 0: none
  std::vector<uint64_t> l2_owner_;  // key holding each slot, 0: free
  std::vector<uint64_t> l3_owner_;  // key holding each page, 0: free
  std::vector<int32_t> free_slots_;
  std::vector<int64_t> free_pages_;
  int32_t residents_ = 0;  // slots held as residence (see holds_resident_slot)
};

}  // namespace k25
