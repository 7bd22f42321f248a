#include "kv/tiers/cache_state_map.h"

#include <algorithm>
#include <string>

#include "k25/status.h"

namespace k25 {

namespace {

[[noreturn]] void internal(const std::string& m) { fail(ErrorCode::kInternal, "cache_state_map: " + m); }

}  // namespace

const char* block_state_name(BlockState s) {
  switch (s) {
    case BlockState::kDemoting: return "demoting";
    case BlockState::kInL2: return "in_l2";
    case BlockState::kSpilling: return "spilling";
    case BlockState::kInL3: return "in_l3";
    case BlockState::kFetching: return "fetching";
    case BlockState::kCopyingUp: return "copying_up";
    case BlockState::kResident: return "resident";
    case BlockState::kLost: return "lost";
  }
  return "unknown";
}

CacheStateMap::CacheStateMap(int32_t num_l1_blocks, int32_t num_l2_slots, int32_t l2_staging_slots,
                             int64_t num_l3_pages)
    : staging_(l2_staging_slots) {
  if (num_l1_blocks <= 0 || num_l2_slots < 0 || num_l3_pages < 0 || l2_staging_slots < 0 ||
      l2_staging_slots > num_l2_slots) {
    fail(ErrorCode::kInvalidArgument, "cache_state_map: bad sizes");
  }
  l1_user_.assign(num_l1_blocks, 0);
  l2_owner_.assign(num_l2_slots, 0);
  l3_owner_.assign(num_l3_pages, 0);
  // Handed out lowest first (popped from the back).
  for (int32_t s = num_l2_slots - 1; s >= 0; --s) free_slots_.push_back(s);
  for (int64_t p = num_l3_pages - 1; p >= 0; --p) free_pages_.push_back(p);
}

bool CacheStateMap::holds_resident_slot(const TierEntry& e) {
  switch (e.state) {
    case BlockState::kInL2:
    case BlockState::kSpilling:
    case BlockState::kCopyingUp: return true;
    case BlockState::kDemoting:
    case BlockState::kFetching: return e.via == Tier::kL2;
    case BlockState::kInL3:
    case BlockState::kResident:
    case BlockState::kLost: return false;
  }
  return false;
}

TierEntry& CacheStateMap::get(uint64_t key, const char* what) {
  auto it = entries_.find(key);
  if (it == entries_.end()) internal(std::string(what) + " of unknown key " + std::to_string(key));
  return it->second;
}

int32_t CacheStateMap::take_slot() {
  const int32_t s = free_slots_.back();
  free_slots_.pop_back();
  return s;
}

int64_t CacheStateMap::take_page() {
  const int64_t p = free_pages_.back();
  free_pages_.pop_back();
  return p;
}

void CacheStateMap::put_slot(int32_t s) {
  if (s < 0) return;
  l2_owner_[s] = 0;
  free_slots_.push_back(s);
}

void CacheStateMap::put_page(int64_t p) {
  if (p < 0) return;
  l3_owner_[p] = 0;
  free_pages_.push_back(p);
}

void CacheStateMap::release(TierEntry& e) {
  if (holds_resident_slot(e)) --residents_;
  put_slot(e.l2_slot);
  put_page(e.l3_page);
  if (e.l1_block >= 0) l1_user_[e.l1_block] = 0;
  e.l2_slot = e.l1_block = -1;
  e.l3_page = -1;
}

void CacheStateMap::settle(TierEntry& e, BlockState s) {
  release(e);
  e.state = s;
}

std::optional<TierMove> CacheStateMap::begin_demote(int32_t l1_block, bool allow_l3) {
  std::lock_guard<std::mutex> lk(mu_);
  if (l1_block < 0 || l1_block >= num_l1_blocks()) internal("demote of L1 block out of range");
  if (l1_user_[l1_block] != 0) {
    internal("demote of L1 block " + std::to_string(l1_block) + " while key " +
             std::to_string(l1_user_[l1_block]) + " moves it");
  }
  TierEntry e;
  e.state = BlockState::kDemoting;
  e.l1_block = l1_block;
  if (residents_ < l2_capacity() && !free_slots_.empty()) {
    e.via = Tier::kL2;
    e.l2_slot = take_slot();
    ++residents_;
  } else if (allow_l3 && !free_pages_.empty()) {
    e.via = Tier::kL3;
    e.l2_slot = free_slots_.empty() ? -1 : take_slot();  // staging, or wait for one
    e.l3_page = take_page();
  } else {
    return std::nullopt;
  }
  const uint64_t key = next_key_++;
  l1_user_[l1_block] = key;
  if (e.l2_slot >= 0) l2_owner_[e.l2_slot] = key;
  if (e.l3_page >= 0) l3_owner_[e.l3_page] = key;
  entries_.emplace(key, e);
  return TierMove{key, e.via, e.l1_block, e.l2_slot, e.l3_page};
}

int32_t CacheStateMap::l2_room() const {
  std::lock_guard<std::mutex> lk(mu_);
  return std::max(0, std::min(l2_capacity() - residents_, static_cast<int32_t>(free_slots_.size())));
}

int64_t CacheStateMap::l3_room() const {
  std::lock_guard<std::mutex> lk(mu_);
  return static_cast<int64_t>(free_pages_.size());
}

std::optional<TierMove> CacheStateMap::begin_spill(uint64_t key) {
  std::lock_guard<std::mutex> lk(mu_);
  TierEntry& e = get(key, "spill");
  if (e.state != BlockState::kInL2) internal(std::string("spill of a block that is ") + block_state_name(e.state));
  if (e.free_requested) internal("spill of a freed block");
  if (free_pages_.empty()) return std::nullopt;
  e.state = BlockState::kSpilling;
  e.via = Tier::kL3;
  e.l3_page = take_page();
  l3_owner_[e.l3_page] = key;
  return TierMove{key, e.via, -1, e.l2_slot, e.l3_page};
}

TierMove CacheStateMap::begin_fetch(uint64_t key, int32_t l1_block) {
  std::lock_guard<std::mutex> lk(mu_);
  TierEntry& e = get(key, "fetch");
  if (l1_block < 0 || l1_block >= num_l1_blocks()) internal("fetch into L1 block out of range");
  if (l1_user_[l1_block] != 0) {
    internal("fetch into L1 block " + std::to_string(l1_block) + " while key " +
             std::to_string(l1_user_[l1_block]) + " moves it");
  }
  if (e.state == BlockState::kInL2) {
    e.via = Tier::kL2;
  } else if (e.state == BlockState::kInL3) {
    e.via = Tier::kL3;
    if (!free_slots_.empty()) {
      e.l2_slot = take_slot();  // staging
      l2_owner_[e.l2_slot] = key;
    }
  } else {
    internal(std::string("fetch of a block that is ") + block_state_name(e.state));
  }
  e.state = BlockState::kFetching;
  e.l1_block = l1_block;
  l1_user_[l1_block] = key;
  return TierMove{key, e.via, e.l1_block, e.l2_slot, e.l3_page};
}

TierMove CacheStateMap::begin_copy_up(uint64_t key, int32_t l1_block) {
  std::lock_guard<std::mutex> lk(mu_);
  TierEntry& e = get(key, "copy up");
  if (l1_block < 0 || l1_block >= num_l1_blocks()) internal("copy up into L1 block out of range");
  if (l1_user_[l1_block] != 0) {
    internal("copy up into L1 block " + std::to_string(l1_block) + " while key " + std::to_string(l1_user_[l1_block]) +
             " moves it");
  }
  if (e.state != BlockState::kInL2) internal(std::string("copy up of a block that is ") + block_state_name(e.state));
  e.state = BlockState::kCopyingUp;
  e.l1_block = l1_block;
  l1_user_[l1_block] = key;
  return TierMove{key, Tier::kL2, e.l1_block, e.l2_slot, e.l3_page};
}

void CacheStateMap::release_l1(uint64_t key) {
  std::lock_guard<std::mutex> lk(mu_);
  TierEntry& e = get(key, "L1 release");
  if (e.state != BlockState::kDemoting || e.l1_block < 0) internal("L1 release of a block that is not being copied out");
  l1_user_[e.l1_block] = 0;
  e.l1_block = -1;
}

std::optional<int32_t> CacheStateMap::assign_staging(uint64_t key) {
  std::lock_guard<std::mutex> lk(mu_);
  TierEntry& e = get(key, "staging");
  if ((e.state != BlockState::kDemoting && e.state != BlockState::kFetching) || e.via != Tier::kL3 ||
      e.l2_slot >= 0) {
    internal("staging slot for a transfer that does not wait for one");
  }
  if (free_slots_.empty()) return std::nullopt;
  e.l2_slot = take_slot();
  l2_owner_[e.l2_slot] = key;
  return e.l2_slot;
}

TierFinish CacheStateMap::finish(uint64_t key, bool ok) {
  std::lock_guard<std::mutex> lk(mu_);
  TierEntry& e = get(key, "completion");
  TierFinish f;
  f.from = e.state;
  f.via = e.via;
  f.l1_block = e.l1_block;
  if (e.free_requested) {
    f.cancelled = true;
    release(e);
    entries_.erase(key);
    return f;
  }
  switch (e.state) {
    case BlockState::kDemoting:
      if (e.l1_block >= 0) l1_user_[e.l1_block] = 0;
      e.l1_block = -1;
      if (!ok) {
        settle(e, BlockState::kLost);
      } else if (e.via == Tier::kL2) {
        e.state = BlockState::kInL2;
      } else {
        put_slot(e.l2_slot);  // the staging buffer
        e.l2_slot = -1;
        e.state = BlockState::kInL3;
      }
      break;
    case BlockState::kSpilling:
      if (ok) {
        --residents_;
        put_slot(e.l2_slot);
        e.l2_slot = -1;
        e.state = BlockState::kInL3;
      } else {
        put_page(e.l3_page);  // the L2 copy is still good
        e.l3_page = -1;
        e.via = Tier::kL2;
        e.state = BlockState::kInL2;
      }
      break;
    case BlockState::kFetching:
      // Back in L1, or lost: either way nothing below L1 is held any more.
      settle(e, ok ? BlockState::kResident : BlockState::kLost);
      break;
    case BlockState::kCopyingUp:
      // The L2 copy is intact whether or not the copy into L1 worked.
      l1_user_[e.l1_block] = 0;
      e.l1_block = -1;
      e.state = BlockState::kInL2;
      break;
    case BlockState::kInL2:
    case BlockState::kInL3:
    case BlockState::kResident:
    case BlockState::kLost:
      internal(std::string("completion for a block that is ") + block_state_name(e.state) + " (no transfer)");
  }
  return f;
}

bool CacheStateMap::free(uint64_t key) {
  std::lock_guard<std::mutex> lk(mu_);
  TierEntry& e = get(key, "free");
  if (e.free_requested) internal("double free of key " + std::to_string(key));
  if (e.state != BlockState::kDemoting && e.state != BlockState::kSpilling && e.state != BlockState::kFetching &&
      e.state != BlockState::kCopyingUp) {
    release(e);
    entries_.erase(key);
    return true;
  }
  e.free_requested = true;
  return false;
}

std::optional<TierEntry> CacheStateMap::entry(uint64_t key) const {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = entries_.find(key);
  if (it == entries_.end()) return std::nullopt;
  return it->second;
}

std::optional<uint64_t> CacheStateMap::l1_user(int32_t l1_block) const {
  std::lock_guard<std::mutex> lk(mu_);
  if (l1_block < 0 || l1_block >= num_l1_blocks() || l1_user_[l1_block] == 0) return std::nullopt;
  return l1_user_[l1_block];
}

std::vector<uint64_t> CacheStateMap::keys() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<uint64_t> out;
  out.reserve(entries_.size());
  for (const auto& [k, e] : entries_) out.push_back(k);
  std::sort(out.begin(), out.end());
  return out;
}

TierCounts CacheStateMap::counts() const {
  std::lock_guard<std::mutex> lk(mu_);
  TierCounts c;
  for (const auto& [k, e] : entries_) {
    switch (e.state) {
      case BlockState::kDemoting: ++c.demoting; break;
      case BlockState::kInL2: ++c.in_l2; break;
      case BlockState::kSpilling: ++c.spilling; break;
      case BlockState::kInL3: ++c.in_l3; break;
      case BlockState::kFetching: ++c.fetching; break;
      case BlockState::kResident: ++c.resident; break;
      case BlockState::kLost: ++c.lost; break;
      case BlockState::kCopyingUp: ++c.copying_up; break;
    }
  }
  c.l2_slots_used = num_l2_slots() - static_cast<int32_t>(free_slots_.size());
  c.l2_residents = residents_;
  c.l3_pages_used = num_l3_pages() - static_cast<int64_t>(free_pages_.size());
  return c;
}

std::vector<uint64_t> CacheStateMap::oldest_in_l2(size_t n) const {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<uint64_t> out;
  for (const auto& [k, e] : entries_) {
    if (e.state == BlockState::kInL2 && !e.free_requested) out.push_back(k);
  }
  std::sort(out.begin(), out.end());  // keys grow with time
  if (out.size() > n) out.resize(n);
  return out;
}

void CacheStateMap::check_invariants() const {
  std::lock_guard<std::mutex> lk(mu_);
  check_invariants_locked();
}

void CacheStateMap::check_invariants_locked() const {
  std::vector<uint64_t> l1(l1_user_.size(), 0), l2(l2_owner_.size(), 0), l3(l3_owner_.size(), 0);
  int32_t residents = 0;
  auto claim = [](std::vector<uint64_t>& v, int64_t i, uint64_t key, const char* what) {
    if (i < 0 || i >= static_cast<int64_t>(v.size())) internal(std::string(what) + " index out of range");
    if (v[i] != 0) internal(std::string(what) + " " + std::to_string(i) + " held by two keys");
    v[i] = key;
  };
  for (const auto& [key, e] : entries_) {
    if (key == 0 || key >= next_key_) internal("key out of range");
    // A demote holds its L1 source until the bytes are copied out (release_l1).
    const bool l1_used = e.state == BlockState::kFetching || e.state == BlockState::kCopyingUp ||
                         (e.state == BlockState::kDemoting && e.l1_block >= 0);
    // An L3 transfer may still wait for its staging slot; everything else in L2 has one.
    const bool slot_optional = (e.state == BlockState::kDemoting || e.state == BlockState::kFetching) &&
                               e.via == Tier::kL3;
    const bool slot_used = e.state == BlockState::kInL2 || e.state == BlockState::kSpilling ||
                           e.state == BlockState::kCopyingUp ||
                           ((e.state == BlockState::kDemoting || e.state == BlockState::kFetching) &&
                            e.via == Tier::kL2);
    const bool page_used = e.state == BlockState::kInL3 || e.state == BlockState::kSpilling ||
                           ((e.state == BlockState::kDemoting || e.state == BlockState::kFetching) && e.via == Tier::kL3);
    if (l1_used != (e.l1_block >= 0)) internal(std::string("L1 block field wrong for a block ") + block_state_name(e.state));
    if (!slot_optional && slot_used != (e.l2_slot >= 0)) {
      internal(std::string("L2 slot field wrong for a block ") + block_state_name(e.state));
    }
    if (page_used != (e.l3_page >= 0)) internal(std::string("L3 page field wrong for a block ") + block_state_name(e.state));
    if (e.free_requested && e.state != BlockState::kDemoting && e.state != BlockState::kSpilling &&
        e.state != BlockState::kFetching && e.state != BlockState::kCopyingUp) {
      internal("settled entry marked freed");
    }
    if (l1_used) claim(l1, e.l1_block, key, "L1 block");
    if (e.l2_slot >= 0) claim(l2, e.l2_slot, key, "L2 slot");
    if (page_used) claim(l3, e.l3_page, key, "L3 page");
    if (holds_resident_slot(e)) ++residents;
  }
  if (l1 != l1_user_) internal("L1 users disagree with the entries");
  if (l2 != l2_owner_) internal("L2 owners disagree with the entries");
  if (l3 != l3_owner_) internal("L3 owners disagree with the entries");
  if (residents != residents_ || residents_ > l2_capacity()) internal("L2 resident count wrong");
  auto check_free = [](const auto& free_list, const std::vector<uint64_t>& owner, const char* what) {
    std::vector<char> seen(owner.size(), 0);
    for (auto i : free_list) {
      if (i < 0 || static_cast<size_t>(i) >= owner.size() || seen[i] || owner[i] != 0) {
        internal(std::string("free list of ") + what + " wrong");
      }
      seen[i] = 1;
    }
    size_t used = 0;
    for (uint64_t o : owner) used += o != 0;
    if (used + free_list.size() != owner.size()) internal(std::string(what) + " leaked");
  };
  check_free(free_slots_, l2_owner_, "L2 slots");
  check_free(free_pages_, l3_owner_, "L3 pages");
}

}  // namespace k25
