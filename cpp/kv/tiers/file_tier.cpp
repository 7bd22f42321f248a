#include "kv/tiers/file_tier.h"

#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "k25/status.h"
#include "kv/tiers/page_format.h"

namespace k25 {

namespace {

std::string errno_text(int e) { return std::string(std::strerror(e)) + " (errno " + std::to_string(e) + ")"; }

bool is_no_space(int e) { return e == ENOSPC || e == EFBIG || e == EDQUOT; }

}  // namespace

FileTier::FileTier(const FileTierOptions& o) : path_(o.path), page_bytes_(o.page_bytes) {
  if (path_.empty()) fail(ErrorCode::kInvalidArgument, "l3_path is empty");
  if (page_bytes_ <= 0 || page_bytes_ % kPageAlign != 0) {
    fail(ErrorCode::kInvalidArgument, "L3 page size must be a positive multiple of 4096");
  }
  num_pages_ = o.bytes / page_bytes_;
  if (num_pages_ < 1) {
    fail(ErrorCode::kInvalidArgument, "l3_bytes=" + std::to_string(o.bytes) + " holds no L3 page of " +
                                          std::to_string(page_bytes_) + " bytes (one KV block and its trailer)");
  }
  const int64_t used = num_pages_ * page_bytes_;

  struct stat st {};
  const bool existed = ::stat(path_.c_str(), &st) == 0;
  const bool block_dev = existed && S_ISBLK(st.st_mode);
  if (existed && !block_dev && !S_ISREG(st.st_mode)) {
    fail(ErrorCode::kInvalidArgument, "l3_path " + path_ + " is neither a regular file nor a block device");
  }
  const int flags = O_RDWR | O_CLOEXEC | (block_dev ? 0 : O_CREAT);
  fd_ = ::open(path_.c_str(), flags | O_DIRECT, 0600);
  direct_ = fd_ >= 0;
  if (fd_ < 0 && errno == EINVAL) {
    fd_ = ::open(path_.c_str(), flags, 0600);
    if (fd_ >= 0) {
      tier_log(o.log, "[KV_CACHE] l3_path=" + path_ +
                          " direct_io=off reason=o_direct_unsupported: the filesystem refuses O_DIRECT; "
                          "L3 uses buffered I/O (pages also pass through the page cache)");
    }
  }
  if (fd_ < 0) {
    fail(ErrorCode::kIOError, "cannot open l3_path " + path_ + ": " + errno_text(errno) +
                                  "; give a writable file path on an SSD (or a block device)");
  }
  created_ = !existed;
  auto bail = [&](ErrorCode code, const std::string& m) {
    ::close(fd_);
    fd_ = -1;
    if (created_) ::unlink(path_.c_str());
    fail(code, m);
  };
  if (block_dev) {
    uint64_t dev_bytes = 0;
    if (::ioctl(fd_, BLKGETSIZE64, &dev_bytes) != 0) bail(ErrorCode::kIOError, "l3_path " + path_ + ": " + errno_text(errno));
    if (dev_bytes < static_cast<uint64_t>(used)) {
      bail(ErrorCode::kResourceExhausted, "l3_path " + path_ + " holds " + std::to_string(dev_bytes) +
                                              " bytes, fewer than l3_bytes=" + std::to_string(o.bytes));
    }
  } else {
    // Reserve the space now: a full disk is found at start, not by a write mid-run.
    // fallocate(2), not posix_fallocate: glibc emulates the latter by writing a byte per
    // block, which O_DIRECT refuses and which would be slow for large files anyway.
    int r = ::fallocate(fd_, 0, 0, used) == 0 ? 0 : errno;
    if (r == EOPNOTSUPP) {
      r = ::ftruncate(fd_, used) == 0 ? 0 : errno;  // filesystem without fallocate: sparse
    }
    if (r != 0) {
      bail(is_no_space(r) ? ErrorCode::kResourceExhausted : ErrorCode::kIOError,
           "cannot reserve l3_bytes=" + std::to_string(used) + " at l3_path " + path_ + ": " + errno_text(r) +
               (is_no_space(r) ? "; free disk space or lower l3_bytes" : ""));
    }
  }

  std::string backend = o.runner ? "threads" : o.io_backend;
  if (backend != "auto" && backend != "io_uring" && backend != "threads") {
    bail(ErrorCode::kInvalidArgument, "io backend must be auto, io_uring or threads, not '" + backend + "'");
  }
  if (backend == "auto" || backend == "io_uring") {
    try {
      file_ = make_uring_file(fd_, o.queue_depth > 0 ? o.queue_depth : 32);
    } catch (const Error& e) {
      if (backend == "io_uring") bail(e.code(), e.what());
      if (uring_built()) {
        tier_log(o.log, std::string("[KV_CACHE] l3_path=") + path_ + " io_backend=threads reason=" + e.what());
      }
    }
  }
  if (!file_) {
    TaskRunner* runner = o.runner;
    if (!runner) {
      threads_ = std::make_unique<WorkerThreads>(o.io_threads > 0 ? o.io_threads : 2, "k25-l3-io");
      runner = threads_.get();
    }
    file_ = make_threaded_file(fd_, runner);
  }
}

FileTier::~FileTier() {
  file_.reset();
  threads_.reset();
  if (fd_ >= 0) ::close(fd_);
  if (created_) ::unlink(path_.c_str());
}

void FileTier::write_page(int64_t page, const void* buf, AsyncFile::Done done) {
  file_->write(page_offset(page), buf, static_cast<size_t>(page_bytes_), std::move(done));
}

void FileTier::read_page(int64_t page, void* buf, AsyncFile::Done done) {
  file_->read(page_offset(page), buf, static_cast<size_t>(page_bytes_), std::move(done));
}

void FileTier::read_range(int64_t page, int64_t offset, void* buf, int64_t bytes, AsyncFile::Done done) {
  if (offset < 0 || bytes <= 0 || offset + bytes > page_bytes_ || offset % 4096 != 0 || bytes % 4096 != 0) {
    fail(ErrorCode::kInternal, "L3: a page range must be whole 4096-byte units inside the page");
  }
  file_->read(page_offset(page) + offset, buf, static_cast<size_t>(bytes), std::move(done));
}

}  // namespace k25

namespace k25 {

void FileTier::corrupt_page_for_test(int64_t page) {
  const int fd = ::open(path_.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) fail(ErrorCode::kIOError, "corrupt_page_for_test: " + errno_text(errno));
  const int64_t off = page_offset(page) + 17;
  uint8_t b = 0;
  bool ok = ::pread(fd, &b, 1, off) == 1;
  b ^= 0x5A;
  ok = ok && ::pwrite(fd, &b, 1, off) == 1 && ::fsync(fd) == 0;
  ::close(fd);
  if (!ok) fail(ErrorCode::kIOError, "corrupt_page_for_test: could not rewrite the byte");
}

}  // namespace k25
