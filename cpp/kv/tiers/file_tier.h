// L3: KV pages in a file (or a whole block device) on an SSD, read and written with
// O_DIRECT so that offloaded KV does not fill the page cache (which would take the very
// host memory L2 is meant to have).
//
// The file is created if missing and its l3_bytes are reserved up front (fallocate), so
// a disk that cannot hold it is an error when the engine starts, not a surprise mid-run;
// a file this tier created is removed when it closes. Filesystems without O_DIRECT
// (tmpfs before Linux 6.6, some FUSE) fall back to buffered I/O with a logged warning.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "kv/tiers/async_file.h"
#include "kv/tiers/task_runner.h"
#include "kv/tiers/tier_log.h"

namespace k25 {

struct FileTierOptions {
  std::string path;
  int64_t bytes = 0;       // l3_bytes: whole pages of it are used
  int64_t page_bytes = 0;  // a multiple of 4096
  std::string io_backend = "auto";  // auto | io_uring | threads
  int32_t io_threads = 2;           // pread/pwrite threads (threads backend)
  int32_t queue_depth = 32;         // io_uring operations in the kernel at once
  TaskRunner* runner = nullptr;     // tests: run pread/pwrite here (forces threads)
  TierLog log;
};

class FileTier {
 public:
  // Throws k25::Error: kIOError (cannot open or reserve), kResourceExhausted (no room
  // for l3_bytes), kInvalidArgument (sizes), kUnsupported (io_uring asked for, absent).
  explicit FileTier(const FileTierOptions& opts);
  ~FileTier();  // the caller has waited for its transfers
  FileTier(const FileTier&) = delete;
  FileTier& operator=(const FileTier&) = delete;

  int64_t num_pages() const { return num_pages_; }
  int64_t page_bytes() const { return page_bytes_; }
  int64_t page_offset(int64_t page) const { return page * page_bytes_; }
  bool direct_io() const { return direct_; }
  const char* backend() const { return file_->name(); }
  const std::string& path() const { return path_; }

  // Tests: flips one byte of a page's data on disk, through the filesystem (a separate
  // buffered descriptor), as a failing disk or a stray write would.
  void corrupt_page_for_test(int64_t page);

  // One page from / to a page-aligned buffer of page_bytes().
  void write_page(int64_t page, const void* buf, AsyncFile::Done done);
  void read_page(int64_t page, void* buf, AsyncFile::Done done);
  // Part of a page: `bytes` from `offset` within it (both multiples of 4096) into an aligned buffer.
  void read_range(int64_t page, int64_t offset, void* buf, int64_t bytes, AsyncFile::Done done);

 private:
  std::string path_;
  int fd_ = -1;
  bool created_ = false;
  bool direct_ = false;
  int64_t page_bytes_ = 0;
  int64_t num_pages_ = 0;
  std::unique_ptr<WorkerThreads> threads_;  // before file_: outlives it
  std::unique_ptr<AsyncFile> file_;
};

}  // namespace k25
