#include <unistd.h>

#include <cerrno>

#include "kv/tiers/async_file.h"

namespace k25 {

namespace {

class ThreadedFile : public AsyncFile {
 public:
  ThreadedFile(int fd, TaskRunner* runner) : fd_(fd), runner_(runner) {}

  void read(int64_t offset, void* buf, size_t len, Done done) override {
    runner_->post([fd = fd_, offset, buf, len, done = std::move(done)] {
      IoOutcome out;
      auto* p = static_cast<uint8_t*>(buf);
      while (static_cast<size_t>(out.bytes) < len) {
        const ssize_t r = ::pread(fd, p + out.bytes, len - out.bytes, offset + out.bytes);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
          out.err = errno;
          break;
        }
        if (r == 0) break;  // end of file
        out.bytes += r;
      }
      done(out);
    });
  }

  void write(int64_t offset, const void* buf, size_t len, Done done) override {
    runner_->post([fd = fd_, offset, buf, len, done = std::move(done)] {
      IoOutcome out;
      const auto* p = static_cast<const uint8_t*>(buf);
      while (static_cast<size_t>(out.bytes) < len) {
        const ssize_t r = ::pwrite(fd, p + out.bytes, len - out.bytes, offset + out.bytes);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
          out.err = r < 0 ? errno : EIO;
          break;
        }
        out.bytes += r;
      }
      done(out);
    });
  }

  const char* name() const override { return "threads"; }

 private:
  int fd_;
  TaskRunner* runner_;
};

}  // namespace

std::unique_ptr<AsyncFile> make_threaded_file(int fd, TaskRunner* runner) {
  return std::make_unique<ThreadedFile>(fd, runner);
}

}  // namespace k25
