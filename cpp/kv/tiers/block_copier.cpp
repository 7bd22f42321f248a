#include "kv/tiers/block_copier.h"

#include <cstring>

#include "k25/status.h"

namespace k25 {

HostBlockCopier::HostBlockCopier(void* base, int64_t block_bytes, int32_t num_blocks, TaskRunner* runner)
    : base_(static_cast<uint8_t*>(base)), block_bytes_(block_bytes), num_blocks_(num_blocks), runner_(runner) {
  if (!base_ || block_bytes_ <= 0 || num_blocks_ <= 0 || !runner_) {
    fail(ErrorCode::kInvalidArgument, "HostBlockCopier: bad arguments");
  }
}

void HostBlockCopier::copy_out(int32_t block, void* dst, Done done) {
  const uint8_t* src = base_ + static_cast<int64_t>(block) * block_bytes_;
  runner_->post([src, dst, n = block_bytes_, done = std::move(done)] {
    std::memcpy(dst, src, static_cast<size_t>(n));
    done(true);
  });
}

void HostBlockCopier::copy_in(const void* src, int32_t block, Done done) {
  uint8_t* dst = base_ + static_cast<int64_t>(block) * block_bytes_;
  runner_->post([src, dst, n = block_bytes_, done = std::move(done)] {
    std::memcpy(dst, src, static_cast<size_t>(n));
    done(true);
  });
}

}  // namespace k25
