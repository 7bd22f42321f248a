// The seam between the tier mover and the primary (L1) KV pool: copies one whole block
// (all layers' K and V, contiguous in the pool's layout) between L1 and host memory.
//
// On the CPU the primary pool is host memory and a copy is a memcpy on a worker thread.
// On CUDA (cuda_glue::make_cuda_block_copier) a copy is a cudaMemcpyAsync on a copy stream
// into pinned L2 slots whose completion cudaLaunchHostFunc hands to a worker thread, so
// copies overlap the compute stream; the mover does not change.
#pragma once

#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>

#include "kv/tiers/task_runner.h"

namespace k25 {

class BlockCopier {
 public:
  using Done = std::function<void(bool ok)>;
  virtual ~BlockCopier() = default;
  virtual int64_t block_bytes() const = 0;
  virtual int32_t num_blocks() const = 0;
  // L1 block -> host memory at dst; done() runs once the bytes are there.
  virtual void copy_out(int32_t block, void* dst, Done done) = 0;
  // Host memory at src -> L1 block; done() runs once the block holds them.
  virtual void copy_in(const void* src, int32_t block, Done done) = 0;
  // Copies the calling thread starts between begin_batch() and end_batch() may share one
  // completion: their done() callbacks may run only after end_batch(), so a thread must not
  // wait for one of them inside its batch. Copies started by other threads meanwhile are
  // not in it. Batches do not nest. The default copies one by one.
  virtual void begin_batch() {}
  virtual void end_batch() {}
  // Makes the engine's compute stream wait, on the device, for every copy this copier has
  // queued so far, so that a step may run before their done() callbacks: true where it did
  // (CUDA), false where the caller must wait for done() (the CPU's copies run on threads).
  virtual bool order_compute_after_copies() { return false; }
};

// begin_batch() ... end_batch() for a scope (no-op for a null copier).
class CopyBatch {
 public:
  explicit CopyBatch(BlockCopier* c) : c_(c) {
    if (c_) c_->begin_batch();
  }
  ~CopyBatch() {
    // Also while an exception unwinds: the copies already queued must still report.
    try {
      close();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[KV_CACHE] closing a tier copy batch failed: %s\n", e.what());
    }
  }
  void close() {
    if (c_) c_->end_batch();
    c_ = nullptr;
  }
  CopyBatch(const CopyBatch&) = delete;
  CopyBatch& operator=(const CopyBatch&) = delete;

 private:
  BlockCopier* c_;
};

// L1 in host memory: base points at block 0; blocks are block_bytes apart.
class HostBlockCopier : public BlockCopier {
 public:
  HostBlockCopier(void* base, int64_t block_bytes, int32_t num_blocks, TaskRunner* runner);
  int64_t block_bytes() const override { return block_bytes_; }
  int32_t num_blocks() const override { return num_blocks_; }
  void copy_out(int32_t block, void* dst, Done done) override;
  void copy_in(const void* src, int32_t block, Done done) override;

 private:
  uint8_t* base_;
  int64_t block_bytes_;
  int32_t num_blocks_;
  TaskRunner* runner_;
};

}  // namespace k25
