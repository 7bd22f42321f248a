#include "kv/tiers/task_runner.h"

#include <pthread.h>

#include <string>
#include <system_error>

#include "k25/status.h"

namespace k25 {

WorkerThreads::WorkerThreads(int num_threads, const char* name) {
  try {
    for (int i = 0; i < num_threads; ++i) {
      threads_.emplace_back([this] { loop(); });
      pthread_setname_np(threads_.back().native_handle(), name);  // shows in top/gdb
    }
  } catch (const std::system_error& e) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : threads_) t.join();
    fail(ErrorCode::kResourceExhausted, std::string("cannot start tier worker threads: ") + e.what());
  }
}

WorkerThreads::~WorkerThreads() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void WorkerThreads::post(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    queue_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void WorkerThreads::loop() {
  while (true) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and nothing left to run
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

void ManualRunner::post(std::function<void()> task) {
  std::lock_guard<std::mutex> lk(mu_);
  queue_.push_back(std::move(task));
}

size_t ManualRunner::pending() const {
  std::lock_guard<std::mutex> lk(mu_);
  return queue_.size();
}

bool ManualRunner::run(size_t index) {
  std::function<void()> task;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (index >= queue_.size()) return false;
    task = std::move(queue_[index]);
    queue_.erase(queue_.begin() + static_cast<std::ptrdiff_t>(index));
  }
  task();
  return true;
}

}  // namespace k25
