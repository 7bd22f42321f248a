// io_uring backend. Compiled only when CMake found liburing (K25_HAVE_LIBURING).
#include "kv/tiers/async_file.h"
#include "k25/status.h"

#ifdef K25_HAVE_LIBURING
#include <liburing.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>
#endif

namespace k25 {

#ifndef K25_HAVE_LIBURING

bool uring_built() { return false; }

void refuse_uring_submits_for_test(bool) {}

std::unique_ptr<AsyncFile> make_uring_file(int, int) {
  fail(ErrorCode::kUnsupported, "this build of k25 has no io_uring support (liburing-dev was not installed)");
}

#else

bool uring_built() { return true; }

namespace {

std::atomic<bool> g_refuse_submits{false};

// user_data of an entry whose operation was failed before the kernel took it (see
// push_locked): its completion only gives back its place.
constexpr uint64_t kOrphaned = 1;

// One ring; submissions from any thread under a mutex, completions reaped by one thread
// that sleeps in io_uring_wait_cqe (no polling). At most queue_depth operations are in
// the kernel; the rest wait in a backlog that completions drain.
class UringFile : public AsyncFile {
 public:
  UringFile(int fd, int queue_depth) : fd_(fd), depth_(queue_depth) {
    const int r = io_uring_queue_init(static_cast<unsigned>(queue_depth), &ring_, 0);
    if (r < 0) {
      fail(ErrorCode::kUnsupported, std::string("io_uring is not available: ") + std::strerror(-r));
    }
    reaper_ = std::thread([this] { reap(); });
  }

  ~UringFile() override {
    {
      // A NOP with user_data 0 wakes the reaper and tells it to stop. The mover drains
      // before destroying the file, so nothing else is in flight.
      std::lock_guard<std::mutex> lk(mu_);
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      if (sqe) {
        io_uring_prep_nop(sqe);
        io_uring_sqe_set_data64(sqe, 0);
        io_uring_submit(&ring_);
      }
    }
    reaper_.join();
    io_uring_queue_exit(&ring_);
  }

  void read(int64_t offset, void* buf, size_t len, Done done) override {
    submit(new Op{false, offset, buf, len, std::move(done)});
  }
  void write(int64_t offset, const void* buf, size_t len, Done done) override {
    submit(new Op{true, offset, const_cast<void*>(buf), len, std::move(done)});
  }
  const char* name() const override { return "io_uring"; }

 private:
  struct Op {
    bool write;
    int64_t offset;
    void* buf;
    size_t len;
    Done done;
    int err = 0;  // why a refused operation failed
  };

  void submit(Op* op) {
    std::vector<Op*> refused;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (in_kernel_ >= depth_) {
        backlog_.push_back(op);
        return;
      }
      push_locked(op, &refused);
    }
    fail_refused(refused);
  }

  int submit_ring() {
    if (g_refuse_submits.load(std::memory_order_relaxed)) return -EAGAIN;
    return io_uring_submit(&ring_);
  }

  // Under mu_. An operation the kernel keeps refusing goes to *refused, to be failed by the
  // caller once mu_ is released (its callback may submit again).
  void push_locked(Op* op, std::vector<Op*>* refused) {
    const unsigned index = ring_.sq.sqe_tail;  // the entry io_uring_get_sqe hands out
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (!sqe) {  // cannot happen while in_kernel_ < depth_; keep the op rather than lose it
      backlog_.push_front(op);
      return;
    }
    if (op->write) {
      io_uring_prep_write(sqe, fd_, op->buf, static_cast<unsigned>(op->len), static_cast<uint64_t>(op->offset));
    } else {
      io_uring_prep_read(sqe, fd_, op->buf, static_cast<unsigned>(op->len), static_cast<uint64_t>(op->offset));
    }
    io_uring_sqe_set_data(sqe, op);
    ++in_kernel_;
    // With at most depth_ operations in a ring of depth_ entries the kernel refuses a
    // submission only transiently (EAGAIN: no memory for the request just now), so retry
    // a while. A refused entry stays in the ring, published: a later submission would
    // carry it in. The kernel takes entries only inside a submission, and every one runs
    // here under mu_, so an entry it has not taken yet is still ours to rewrite: one that
    // is refused throughout becomes a no-op (its completion, whenever a later submission
    // carries it in, only gives back its place) and its operation fails now with EAGAIN,
    // which the tier handles as a failed transfer. Without that, nothing would submit it
    // again until the next operation, and with none the transfer would never end.
    int r = 0;
    for (int tries = 0; tries < 1000; ++tries) {
      r = submit_ring();
      if (r >= 0 || (r != -EINTR && r != -EAGAIN && r != -EBUSY)) break;
      std::this_thread::yield();
    }
    if (r >= 0) return;
    const unsigned head = io_uring_smp_load_acquire(ring_.sq.khead);
    if (static_cast<int>(index - head) >= 0) {  // not taken by the kernel
      io_uring_prep_nop(sqe);
      io_uring_sqe_set_data64(sqe, kOrphaned);
      op->err = -r;
      refused->push_back(op);
    }
  }

  static void fail_refused(const std::vector<Op*>& refused) {
    for (Op* op : refused) {
      IoOutcome out;
      out.err = op->err;
      op->done(out);
      delete op;
    }
  }

  void reap() {
    while (true) {
      io_uring_cqe* cqe = nullptr;
      const int r = io_uring_wait_cqe(&ring_, &cqe);
      if (r == -EINTR) continue;
      if (r < 0) return;  // the ring is gone (only at teardown in practice)
      const uint64_t data = io_uring_cqe_get_data64(cqe);
      const int res = cqe->res;
      io_uring_cqe_seen(&ring_, cqe);
      if (data == 0) return;  // the shutdown NOP
      std::vector<Op*> refused;
      {
        std::lock_guard<std::mutex> lk(mu_);
        --in_kernel_;
        while (!backlog_.empty() && in_kernel_ < depth_) {
          Op* next = backlog_.front();
          backlog_.pop_front();
          push_locked(next, &refused);
        }
      }
      fail_refused(refused);
      if (data == kOrphaned) continue;
      Op* op = reinterpret_cast<Op*>(data);
      IoOutcome out;
      if (res < 0) {
        out.err = -res;
      } else {
        out.bytes = res;
      }
      op->done(out);
      delete op;
    }
  }

  int fd_;
  int depth_;
  io_uring ring_{};
  std::mutex mu_;
  std::deque<Op*> backlog_;
  int in_kernel_ = 0;
  std::thread reaper_;
};

}  // namespace

void refuse_uring_submits_for_test(bool on) { g_refuse_submits.store(on, std::memory_order_relaxed); }

std::unique_ptr<AsyncFile> make_uring_file(int fd, int queue_depth) {
  return std::make_unique<UringFile>(fd, queue_depth);
}

#endif

}  // namespace k25
