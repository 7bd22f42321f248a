#include "kv/tiers/host_tier.h"

#include <sys/mman.h>

#include "k25/status.h"

namespace k25 {

HostAllocator mmap_allocator() {
  HostAllocator a;
  a.allocate = [](size_t bytes) -> void* {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? nullptr : p;
  };
  a.release = [](void* p, size_t bytes) { ::munmap(p, bytes); };
  a.kind = "mmap";
  return a;
}

HostTier::HostTier(int32_t num_slots, int64_t slot_bytes, HostAllocator alloc)
    : num_slots_(num_slots), slot_bytes_(slot_bytes), alloc_(std::move(alloc)) {
  if (num_slots_ < 0 || slot_bytes_ <= 0 || slot_bytes_ % 4096 != 0) {
    fail(ErrorCode::kInvalidArgument, "L2 slots must be positive multiples of 4096 bytes");
  }
  if (num_slots_ == 0) return;
  const size_t bytes = static_cast<size_t>(num_slots_) * static_cast<size_t>(slot_bytes_);
  base_ = static_cast<uint8_t*>(alloc_.allocate(bytes));
  if (!base_) {
    fail(ErrorCode::kResourceExhausted, "cannot allocate l2_bytes=" + std::to_string(bytes) + " of " + alloc_.kind +
                                            " host memory for the L2 KV tier");
  }
}

HostTier::~HostTier() {
  if (base_) alloc_.release(base_, static_cast<size_t>(num_slots_) * static_cast<size_t>(slot_bytes_));
}

}  // namespace k25
