// Asynchronous positional reads and writes on one file descriptor, completed through
// callbacks: io_uring (liburing) when built in and the kernel allows it, otherwise a few
// threads running pread/pwrite.
//
// A callback gets what happened, not a judgement: bytes transferred and errno (0 when
// none). Short transfers are the caller's to classify.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "kv/tiers/task_runner.h"

namespace k25 {

struct IoOutcome {
  int64_t bytes = 0;  // transferred before the end or the error
  int err = 0;        // errno of a failure, 0 when none
};

class AsyncFile {
 public:
  using Done = std::function<void(IoOutcome)>;
  virtual ~AsyncFile() = default;  // the caller waits for its transfers first
  virtual void read(int64_t offset, void* buf, size_t len, Done done) = 0;
  virtual void write(int64_t offset, const void* buf, size_t len, Done done) = 0;
  virtual const char* name() const = 0;
};

// pread/pwrite run as tasks of `runner` (not owned).
std::unique_ptr<AsyncFile> make_threaded_file(int fd, TaskRunner* runner);

// True when this build has io_uring support (liburing found at build time).
bool uring_built();
// Throws kUnsupported when io_uring is not built in or the kernel refuses a ring (old
// kernel, seccomp, kernel.io_uring_disabled).
std::unique_ptr<AsyncFile> make_uring_file(int fd, int queue_depth);
// Tests: while on, every io_uring submission is refused with EAGAIN (as a kernel short of
// memory refuses it), process-wide.
void refuse_uring_submits_for_test(bool on);

}  // namespace k25
