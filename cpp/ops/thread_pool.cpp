#include "ops/thread_pool.h"

#include <chrono>
#include <string>
#include <system_error>

#include "k25/status.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define K25_CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define K25_CPU_RELAX() asm volatile("yield" ::: "memory")
#else
#define K25_CPU_RELAX() std::this_thread::yield()
#endif

namespace k25 {

namespace {

thread_local bool t_inside_pool_task = false;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

ThreadPool::ThreadPool(int size, std::function<void()> on_worker_start) {
  if (size < 1) size = 1;
  workers_.reserve(size - 1);
  try {
    for (int i = 1; i < size; ++i) {
      workers_.emplace_back([this, i, on_worker_start] { worker_loop(i, on_worker_start); });
    }
  } catch (const std::system_error& e) {
    stop_workers();  // joinable threads must not be destroyed
    fail(ErrorCode::kResourceExhausted, std::string("cannot start worker threads: ") + e.what());
  }
}

ThreadPool::~ThreadPool() {
  std::lock_guard<std::mutex> submit(submit_mu_);  // a run in progress finishes first
  stop_workers();
}

void ThreadPool::stop_workers() {
  {
    std::lock_guard<std::mutex> lk(sleep_mu_);
    stop_.store(true);
  }
  sleep_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
  workers_.clear();
}

void ThreadPool::worker_loop(int id, std::function<void()> on_start) {
  if (on_start) on_start();
  t_inside_pool_task = true;  // nested parallel work inside a task runs inline
  uint64_t seen = 0;
  while (true) {
    // Wait for a new job: spin briefly (jobs come back to back within a step), then sleep.
    const int64_t spin_until = now_ns() + kSpinNanos;
    int polls = 0;
    while (epoch_.load() == seen && !stop_.load()) {
      K25_CPU_RELAX();
      if (++polls % 256 == 0 && now_ns() > spin_until) {
        std::unique_lock<std::mutex> lk(sleep_mu_);
        sleepers_.fetch_add(1);
        sleep_cv_.wait(lk, [&] { return epoch_.load() != seen || stop_.load(); });
        sleepers_.fetch_sub(1);
      }
    }
    if (stop_.load()) return;
    seen = epoch_.load();
    if (id < n_) {
      try {
        (*task_)(id);
      } catch (...) {
        std::lock_guard<std::mutex> lk(err_mu_);
        if (!error_) error_ = std::current_exception();
      }
    }
    pending_.fetch_sub(1);
  }
}

void ThreadPool::run(int n, const std::function<void(int)>& task) {
  if (n <= 0) return;
  if (n == 1 || workers_.empty() || t_inside_pool_task) {
    for (int i = 0; i < n; ++i) task(i);
    return;
  }
  std::lock_guard<std::mutex> submit(submit_mu_);
  task_ = &task;
  n_ = n;
  error_ = nullptr;
  pending_.store(static_cast<int>(workers_.size()));
  epoch_.fetch_add(1);  // publishes task_ and n_ (seq_cst)
  if (sleepers_.load() > 0) {
    std::lock_guard<std::mutex> lk(sleep_mu_);
    sleep_cv_.notify_all();
  }
  std::exception_ptr own;
  t_inside_pool_task = true;
  try {
    task(0);
  } catch (...) {
    own = std::current_exception();
  }
  t_inside_pool_task = false;
  while (pending_.load() > 0) K25_CPU_RELAX();
  if (own) std::rethrow_exception(own);
  if (error_) std::rethrow_exception(error_);
}

}  // namespace k25
