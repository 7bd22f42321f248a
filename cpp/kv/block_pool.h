// The block pool: the single owner of KV block ids and their reference counts.
//
// A block id names the same slots in every layer of the KV storage (which the executor
// owns). Blocks are handed out from a FIFO free list; a block returns to it when its
// reference count drops to zero. Reference counts > 1 are how sequences share blocks.
#pragma once

#include <cstdint>
#include <deque>
#include <vector>

namespace k25 {

class BlockPool {
 public:
  explicit BlockPool(int32_t num_blocks);

  int32_t num_total() const { return static_cast<int32_t>(refcount_.size()); }
  int32_t num_free() const { return static_cast<int32_t>(free_.size()); }
  int32_t num_used() const { return num_total() - num_free(); }

  // Takes n blocks (refcount 1 each) or throws kResourceExhausted, taking none.
  std::vector<int32_t> allocate(int32_t n);
  void incref(int32_t block);
  // Drops one reference; the block is free again when none remain.
  void decref(int32_t block);
  void release_all(std::vector<int32_t>& blocks);  // decref each, then clear
  int32_t refcount(int32_t block) const;

  // Throws kInternal if the free list and the reference counts disagree.
  void check_invariants() const;

 private:
  void check_id(int32_t block) const;

  std::vector<int32_t> refcount_;
  std::deque<int32_t> free_;
};

// Number of blocks that hold `num_tokens` tokens.
inline int32_t blocks_for_tokens(int64_t num_tokens, int32_t block_size) {
  return static_cast<int32_t>((num_tokens + block_size - 1) / block_size);
}

}  // namespace k25
