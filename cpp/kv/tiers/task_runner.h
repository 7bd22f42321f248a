// Where the tier mover's blocking work runs: memcpy between L1 and host memory, and
// pread/pwrite when io_uring is not used.
//
// WorkerThreads is the real thing: a few threads sleeping on a condition variable until
// work arrives. ManualRunner holds every task until a test releases it, in the order the
// test chooses: the same code paths run, but the interleaving of completions is under the
// test's control (property tests of the state machine).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace k25 {

class TaskRunner {
 public:
  virtual ~TaskRunner() = default;
  // Runs `task` later, on some thread. Tasks must not throw.
  virtual void post(std::function<void()> task) = 0;
};

class WorkerThreads : public TaskRunner {
 public:
  // Throws kResourceExhausted when the OS refuses a thread.
  WorkerThreads(int num_threads, const char* name);
  // Runs what is queued, then joins.
  ~WorkerThreads() override;
  void post(std::function<void()> task) override;

 private:
  void loop();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

class ManualRunner : public TaskRunner {
 public:
  void post(std::function<void()> task) override;
  size_t pending() const;
  // Runs the task at `index` of the queue (arrival order) on this thread; false when
  // there is none. A task may post more.
  bool run(size_t index);

 private:
  mutable std::mutex mu_;
  std::deque<std::function<void()>> queue_;
};

}  // namespace k25
