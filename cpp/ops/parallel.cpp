#include "ops/parallel.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <thread>

#include "ops/thread_pool.h"

namespace k25 {

namespace {

thread_local ThreadPool* t_pool = nullptr;

std::mutex g_default_mu;
std::shared_ptr<ThreadPool> g_default_pool;
int g_default_size = 0;

// A snapshot: set_num_threads() may replace the default pool while a caller still runs
// on the old one, which then lives until that caller is done.
std::shared_ptr<ThreadPool> default_pool() {
  std::lock_guard<std::mutex> lk(g_default_mu);
  if (!g_default_pool) {
    int n = g_default_size > 0 ? g_default_size : static_cast<int>(std::thread::hardware_concurrency());
    g_default_pool = std::make_shared<ThreadPool>(std::max(1, n));
  }
  return g_default_pool;
}

// The calling thread's pool: its bound one, else the default (kept alive through `held`).
ThreadPool* current_pool(std::shared_ptr<ThreadPool>& held) {
  if (t_pool) return t_pool;
  held = default_pool();
  return held.get();
}

}  // namespace

void parallel_for(int64_t begin, int64_t end, int64_t grain,
                  const std::function<void(int64_t, int64_t)>& fn) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  std::shared_ptr<ThreadPool> held;
  ThreadPool* pool = current_pool(held);
  const int64_t chunks = std::min<int64_t>(pool->size(), (n + grain - 1) / grain);
  if (chunks <= 1) {
    fn(begin, end);
    return;
  }
  pool->run(static_cast<int>(chunks), [&](int i) {
    const int64_t b = begin + n * i / chunks;
    const int64_t e = begin + n * (i + 1) / chunks;
    if (b < e) fn(b, e);
  });
}

void parallel_for_dynamic(int64_t begin, int64_t end, const std::function<void(int64_t, int64_t)>& fn) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  std::shared_ptr<ThreadPool> held;
  ThreadPool* pool = current_pool(held);
  const int workers = static_cast<int>(std::min<int64_t>(pool->size(), n));
  if (workers <= 1) {
    fn(begin, end);
    return;
  }
  std::atomic<int64_t> next{begin};
  pool->run(workers, [&](int) {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < end;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      fn(i, i + 1);
    }
  });
}

int num_threads() { return t_pool ? t_pool->size() : default_pool()->size(); }

void set_num_threads(int n) {
  std::lock_guard<std::mutex> lk(g_default_mu);
  g_default_size = std::max(1, n);
  g_default_pool.reset();  // rebuilt at the next use
}

void set_thread_pool(ThreadPool* pool) { t_pool = pool; }

ScopedPool::ScopedPool(ThreadPool* pool) : previous_(t_pool) { t_pool = pool; }
ScopedPool::~ScopedPool() { t_pool = previous_; }

}  // namespace k25
