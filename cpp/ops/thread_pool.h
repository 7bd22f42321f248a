// A small fork-join thread pool that owns the engine's CPU parallelism.
//
// Why not OpenMP: libgomp stops spinning between parallel regions as soon as a process
// has more OpenMP threads than cores (any other thread of the host application that
// ever ran an OpenMP region counts), and then every region pays a futex wake-up (~80 us
// on the VMs measured). A decode step runs ~150 short regions back to back, so that
// doubled its time. This pool spins for a short while after each job, then sleeps; its
// behaviour does not depend on what else the process does.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace k25 {

class ThreadPool {
 public:
  // `size` participants: the calling thread plus size - 1 workers. `on_worker_start`
  // runs once on each worker (e.g. to make a BLAS library single-threaded there).
  // Throws kResourceExhausted when the OS refuses a thread.
  explicit ThreadPool(int size, std::function<void()> on_worker_start = {});
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs task(i) for i in [0, n), n <= size(): task 0 on the caller, the others on
  // workers; returns when all are done and rethrows the first exception. Calls from
  // inside a task run every task inline. Concurrent callers take turns.
  void run(int n, const std::function<void(int)>& task);

  // How long an idle worker spins before it sleeps.
  static constexpr int64_t kSpinNanos = 200'000;

 private:
  void worker_loop(int id, std::function<void()> on_start);
  void stop_workers();

  std::vector<std::thread> workers_;
  std::mutex submit_mu_;
  std::mutex sleep_mu_;
  std::condition_variable sleep_cv_;
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
  const std::function<void(int)>* task_ = nullptr;
  int n_ = 0;
  std::mutex err_mu_;
  std::exception_ptr error_;
};

}  // namespace k25
