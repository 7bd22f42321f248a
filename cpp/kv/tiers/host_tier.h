// L2: a host-memory pool of fixed-size slots, each holding one KV block (all layers' K
// and V) laid out as an L3 page (page_format.h), so a slot goes to disk as it is.
//
// The memory comes from a HostAllocator. The default maps anonymous memory (page-aligned,
// so slots can be O_DIRECT buffers, and untouched slots cost nothing). On CUDA the
// executor's allocator hands out pinned memory (cudaHostAlloc) so that the copy stream
// can DMA into slots (TierConfig::l2_allocator).
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace k25 {

struct HostAllocator {
  std::function<void*(size_t bytes)> allocate;  // nullptr when refused; 4096-aligned
  std::function<void(void* p, size_t bytes)> release;
  std::string kind;  // "mmap", "pinned", ...
};

// Anonymous private mapping.
HostAllocator mmap_allocator();

class HostTier {
 public:
  // Throws kResourceExhausted when the memory cannot be had.
  HostTier(int32_t num_slots, int64_t slot_bytes, HostAllocator alloc = mmap_allocator());
  ~HostTier();
  HostTier(const HostTier&) = delete;
  HostTier& operator=(const HostTier&) = delete;

  int32_t num_slots() const { return num_slots_; }
  int64_t slot_bytes() const { return slot_bytes_; }
  const std::string& kind() const { return alloc_.kind; }
  uint8_t* slot(int32_t s) const { return base_ + static_cast<int64_t>(s) * slot_bytes_; }

 private:
  int32_t num_slots_;
  int64_t slot_bytes_;
  HostAllocator alloc_;
  uint8_t* base_ = nullptr;
};

}  // namespace k25
