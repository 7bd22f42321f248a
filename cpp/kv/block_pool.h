// The block pool: the single owner of KV block ids and their reference counts.
//
// A block id names the same slots in every layer of the KV storage (which the executor
// owns). A block is free when no sequence holds a reference; reference counts > 1 are how
// sequences share blocks (prefix caching).
//
// Prefix cache: a full block whose KV is computed can be registered under the hash of its
// token prefix (the chain hash of every block up to and including it). It stays findable
// after its last reference goes: free blocks keep their cached content until they are
// handed out again, oldest-freed first (an LRU order: allocate() takes the block that has
// been free longest, and only then forgets what it held). match_prefix() finds the cached
// blocks of a token list's leading full blocks; acquire() takes a reference to one, taking
// it off the free list when it was free. A lookup compares the block's tokens and its
// parent's chain hash too, so a hash collision of one block cannot hand out another
// block's KV (two whole prefixes with equal 64-bit chain hashes still could).
#pragma once

#include <algorithm>
#include <cstdint>
#include <unordered_map>
#include <vector>

namespace k25 {

// Chain hash of a block: of the previous block's chain hash (0 for the first block) and
// the block's token ids.
uint64_t block_chain_hash(uint64_t parent, const int32_t* tokens, int32_t n);

// A cached block is the one asked for when its stored parent hash and tokens are too.
inline bool same_block(uint64_t stored_parent, const std::vector<int32_t>& stored_tokens, uint64_t parent,
                       const int32_t* tokens, int32_t n) {
  return stored_parent == parent && stored_tokens.size() == static_cast<size_t>(n) &&
         std::equal(stored_tokens.begin(), stored_tokens.end(), tokens);
}

// Walks the full blocks of `tokens` from block `first` (chain hash before it: `parent`) up
// to block `max_blocks` while found(hash, parent, block tokens) accepts them; returns how
// many were, their chain hashes appended to `hashes` (if given).
template <typename Found>
int32_t match_chain(const int32_t* tokens, int32_t first, int32_t max_blocks, int32_t block_size, uint64_t parent,
                    Found&& found, std::vector<uint64_t>* hashes) {
  int32_t n = 0;
  for (int32_t i = first; i < max_blocks; ++i) {
    const int32_t* t = tokens + static_cast<int64_t>(i) * block_size;
    const uint64_t h = block_chain_hash(parent, t, block_size);
    if (!found(h, parent, t)) break;
    if (hashes) hashes->push_back(h);
    parent = h;
    ++n;
  }
  return n;
}

class BlockPool {
 public:
  explicit BlockPool(int32_t num_blocks);

  int32_t num_total() const { return static_cast<int32_t>(refcount_.size()); }
  int32_t num_free() const { return num_free_; }
  int32_t num_used() const { return num_total() - num_free(); }
  int32_t num_cached() const { return static_cast<int32_t>(by_hash_.size()); }  // registered blocks

  // Takes n blocks (refcount 1 each) or throws kResourceExhausted, taking none. A block
  // that held cached content forgets it.
  std::vector<int32_t> allocate(int32_t n);
  void incref(int32_t block);
  // Drops one reference; the block is free again when none remain (its cached content,
  // if any, stays findable until the block is allocated again).
  void decref(int32_t block);
  void release_all(std::vector<int32_t>& blocks);  // decref each, then clear
  int32_t refcount(int32_t block) const;

  // Registers a held block (refcount > 0) as the cached content `hash` (its chain hash;
  // parent: the previous block's chain hash, 0 for the first) holding `tokens[0, n)`. No-op
  // when that hash is already cached (another block computed the same prefix) or the
  // block is already registered. Returns whether it was registered.
  bool register_block(int32_t block, uint64_t hash, uint64_t parent, const int32_t* tokens, int32_t n);
  // Leading full blocks of tokens[0, max_blocks * block_size) found in the cache, in order
  // (stops at the first miss); hashes receives their chain hashes. Takes no reference.
  std::vector<int32_t> match_prefix(const int32_t* tokens, int32_t max_blocks, int32_t block_size,
                                    std::vector<uint64_t>* hashes) const;
  // Takes a reference to a block found by match_prefix (refcount 0 or more).
  void acquire(int32_t block);

  // Cached content that allocate() evicted since the last take_evictions(), when
  // record_evictions is on (the block's bytes are intact until the caller writes them:
  // the engine may copy them out to a lower tier first).
  struct Evicted {
    int32_t block;
    uint64_t hash, parent;
    std::vector<int32_t> tokens;
  };
  void set_record_evictions(bool on) { record_evictions_ = on; }
  std::vector<Evicted> take_evictions();

  // Throws kInternal if the free list, the reference counts and the cache disagree.
  void check_invariants() const;

 private:
  void check_id(int32_t block) const;
  void push_free(int32_t block);   // at the tail (most recently freed)
  void unlink_free(int32_t block);
  void forget(int32_t block);      // drop its cached content

  struct Cached {
    uint64_t hash = 0, parent = 0;
    std::vector<int32_t> tokens;
    bool valid = false;
  };

  std::vector<int32_t> refcount_;
  // Free blocks as a doubly linked list (oldest at the head): O(1) removal of a free block
  // that a prefix hit takes back.
  std::vector<int32_t> next_, prev_;
  int32_t head_ = -1, tail_ = -1, num_free_ = 0;
  std::vector<Cached> cached_;
  std::unordered_map<uint64_t, int32_t> by_hash_;
  bool record_evictions_ = false;
  std::vector<Evicted> evicted_;
};

// Number of blocks that hold `num_tokens` tokens.
inline int32_t blocks_for_tokens(int64_t num_tokens, int32_t block_size) {
  return static_cast<int32_t>((num_tokens + block_size - 1) / block_size);
}

}  // namespace k25
