#include "kv/block_pool.h"

#include <algorithm>
#include <string>

#include "k25/status.h"

namespace k25 {

namespace {

uint64_t mix(uint64_t x) {  // splitmix64's finaliser
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

}  // namespace

uint64_t block_chain_hash(uint64_t parent, const int32_t* tokens, int32_t n) {
  uint64_t h = mix(parent ^ 0x6b32355f70726678ULL);
  for (int32_t i = 0; i < n; ++i) h = mix(h + static_cast<uint32_t>(tokens[i]) + 0x9e3779b97f4a7c15ULL);
  return mix(h ^ static_cast<uint64_t>(n));
}

BlockPool::BlockPool(int32_t num_blocks) {
  if (num_blocks <= 0) fail(ErrorCode::kInvalidArgument, "KV pool needs at least one block");
  refcount_.assign(num_blocks, 0);
  next_.assign(num_blocks, -1);
  prev_.assign(num_blocks, -1);
  cached_.resize(num_blocks);
  for (int32_t i = 0; i < num_blocks; ++i) push_free(i);
}

void BlockPool::push_free(int32_t b) {
  prev_[b] = tail_;
  next_[b] = -1;
  if (tail_ >= 0) {
    next_[tail_] = b;
  } else {
    head_ = b;
  }
  tail_ = b;
  ++num_free_;
}

void BlockPool::unlink_free(int32_t b) {
  if (prev_[b] >= 0) {
    next_[prev_[b]] = next_[b];
  } else {
    head_ = next_[b];
  }
  if (next_[b] >= 0) {
    prev_[next_[b]] = prev_[b];
  } else {
    tail_ = prev_[b];
  }
  prev_[b] = next_[b] = -1;
  --num_free_;
}

void BlockPool::forget(int32_t b) {
  Cached& c = cached_[b];
  if (!c.valid) return;
  auto it = by_hash_.find(c.hash);
  if (it != by_hash_.end() && it->second == b) by_hash_.erase(it);
  if (record_evictions_) evicted_.push_back(Evicted{b, c.hash, c.parent, std::move(c.tokens)});
  c = Cached();
}

std::vector<BlockPool::Evicted> BlockPool::take_evictions() {
  std::vector<Evicted> out;
  out.swap(evicted_);
  return out;
}

std::vector<int32_t> BlockPool::allocate(int32_t n) {
  if (n < 0 || n > num_free()) {
    fail(ErrorCode::kResourceExhausted, "KV pool: asked for " + std::to_string(n) +
                                            " blocks, " + std::to_string(num_free()) + " free");
  }
  std::vector<int32_t> out;
  out.reserve(n);
  for (int32_t i = 0; i < n; ++i) {
    const int32_t b = head_;
    unlink_free(b);
    forget(b);  // its old content is about to be overwritten
    refcount_[b] = 1;
    out.push_back(b);
  }
  return out;
}

void BlockPool::check_id(int32_t block) const {
  if (block < 0 || block >= num_total()) {
    fail(ErrorCode::kInternal, "KV pool: block id " + std::to_string(block) + " out of range");
  }
}

void BlockPool::incref(int32_t block) {
  check_id(block);
  if (refcount_[block] <= 0) {
    fail(ErrorCode::kInternal, "KV pool: incref of free block " + std::to_string(block));
  }
  ++refcount_[block];
}

void BlockPool::decref(int32_t block) {
  check_id(block);
  if (refcount_[block] <= 0) {
    fail(ErrorCode::kInternal, "KV pool: double free of block " + std::to_string(block));
  }
  if (--refcount_[block] == 0) push_free(block);
}

void BlockPool::release_all(std::vector<int32_t>& blocks) {
  // The last block first: a sequence's tail is the least likely to be shared, so it is
  // the first of its blocks to be handed out again.
  for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) decref(*it);
  blocks.clear();
}

int32_t BlockPool::refcount(int32_t block) const {
  check_id(block);
  return refcount_[block];
}

bool BlockPool::register_block(int32_t block, uint64_t hash, uint64_t parent, const int32_t* tokens, int32_t n) {
  check_id(block);
  if (refcount_[block] <= 0) fail(ErrorCode::kInternal, "KV pool: registering a free block");
  if (cached_[block].valid || by_hash_.count(hash)) return false;
  Cached& c = cached_[block];
  c.hash = hash;
  c.parent = parent;
  c.tokens.assign(tokens, tokens + n);
  c.valid = true;
  by_hash_.emplace(hash, block);
  return true;
}

std::vector<int32_t> BlockPool::match_prefix(const int32_t* tokens, int32_t max_blocks, int32_t block_size,
                                             std::vector<uint64_t>* hashes) const {
  std::vector<int32_t> out;
  match_chain(
      tokens, 0, max_blocks, block_size, 0,
      [&](uint64_t h, uint64_t parent, const int32_t* t) {
        auto it = by_hash_.find(h);
        if (it == by_hash_.end()) return false;
        const Cached& c = cached_[it->second];
        if (!c.valid || !same_block(c.parent, c.tokens, parent, t, block_size)) return false;
        out.push_back(it->second);
        return true;
      },
      hashes);
  return out;
}

void BlockPool::acquire(int32_t block) {
  check_id(block);
  if (refcount_[block] == 0) unlink_free(block);
  ++refcount_[block];
}

void BlockPool::check_invariants() const {
  std::vector<char> in_free(refcount_.size(), 0);
  int32_t n = 0, last = -1;
  for (int32_t b = head_; b >= 0; b = next_[b]) {
    check_id(b);
    if (in_free[b]) fail(ErrorCode::kInternal, "KV pool: block listed free twice");
    if (prev_[b] != last) fail(ErrorCode::kInternal, "KV pool: free list links disagree");
    in_free[b] = 1;
    if (refcount_[b] != 0) fail(ErrorCode::kInternal, "KV pool: free block with references");
    last = b;
    if (++n > num_total()) fail(ErrorCode::kInternal, "KV pool: free list has a cycle");
  }
  if (last != tail_ || n != num_free_) fail(ErrorCode::kInternal, "KV pool: free list count or tail wrong");
  for (size_t b = 0; b < refcount_.size(); ++b) {
    if (refcount_[b] < 0) fail(ErrorCode::kInternal, "KV pool: negative refcount");
    if (refcount_[b] == 0 && !in_free[b]) {
      fail(ErrorCode::kInternal, "KV pool: block " + std::to_string(b) + " leaked");
    }
  }
  size_t valid = 0;
  for (size_t b = 0; b < cached_.size(); ++b) {
    if (!cached_[b].valid) continue;
    ++valid;
    auto it = by_hash_.find(cached_[b].hash);
    if (it == by_hash_.end() || it->second != static_cast<int32_t>(b)) {
      fail(ErrorCode::kInternal, "KV pool: cached block " + std::to_string(b) + " not findable by its hash");
    }
  }
  if (valid != by_hash_.size()) fail(ErrorCode::kInternal, "KV pool: cache map has stale entries");
}

}  // namespace k25
