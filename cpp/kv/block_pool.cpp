#include "kv/block_pool.h"

#include <string>

#include "k25/status.h"

namespace k25 {

BlockPool::BlockPool(int32_t num_blocks) {
  if (num_blocks <= 0) fail(ErrorCode::kInvalidArgument, "KV pool needs at least one block");
  refcount_.assign(num_blocks, 0);
  for (int32_t i = 0; i < num_blocks; ++i) free_.push_back(i);
}

std::vector<int32_t> BlockPool::allocate(int32_t n) {
  if (n < 0 || n > num_free()) {
    fail(ErrorCode::kResourceExhausted, "KV pool: asked for " + std::to_string(n) +
                                            " blocks, " + std::to_string(num_free()) + " free");
  }
  std::vector<int32_t> out;
  out.reserve(n);
  for (int32_t i = 0; i < n; ++i) {
    int32_t b = free_.front();
    free_.pop_front();
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
  if (--refcount_[block] == 0) free_.push_back(block);
}

void BlockPool::release_all(std::vector<int32_t>& blocks) {
  for (int32_t b : blocks) decref(b);
  blocks.clear();
}

int32_t BlockPool::refcount(int32_t block) const {
  check_id(block);
  return refcount_[block];
}

void BlockPool::check_invariants() const {
  std::vector<char> in_free(refcount_.size(), 0);
  for (int32_t b : free_) {
    check_id(b);
    if (in_free[b]) fail(ErrorCode::kInternal, "KV pool: block listed free twice");
    in_free[b] = 1;
    if (refcount_[b] != 0) fail(ErrorCode::kInternal, "KV pool: free block with references");
  }
  for (size_t b = 0; b < refcount_.size(); ++b) {
    if (refcount_[b] < 0) fail(ErrorCode::kInternal, "KV pool: negative refcount");
    if (refcount_[b] == 0 && !in_free[b]) {
      fail(ErrorCode::kInternal, "KV pool: block " + std::to_string(b) + " leaked");
    }
  }
}

}  // namespace k25
