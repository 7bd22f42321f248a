// parallel_for over an index range, on a k25::ThreadPool.
//
// The engine thread binds its executor's pool with ScopedPool; any other caller (the
// kernel tests, a C++ host calling kernels directly) gets a process-wide default pool
// sized by set_num_threads() (default: the hardware concurrency).
#pragma once

#include <cstdint>
#include <functional>

namespace k25 {

class ThreadPool;

// Calls fn(b, e) over [begin, end) split into at most pool-size chunks of >= grain.
void parallel_for(int64_t begin, int64_t end, int64_t grain,
                  const std::function<void(int64_t, int64_t)>& fn);

// Calls fn(i, i + 1) for every i in [begin, end), the pool's threads each claiming the
// next unclaimed index from a shared counter (with one participant, fn(begin, end) once):
// for items of uneven or unpredictable cost (memory-bound work whose speed differs between
// threads), where parallel_for's fixed equal chunks leave a thread idle while the other
// finishes.
void parallel_for_dynamic(int64_t begin, int64_t end, const std::function<void(int64_t, int64_t)>& fn);

// Participants of the pool parallel_for uses from the calling thread.
int num_threads();
// Resizes the default pool (threads without a bound pool use it).
void set_num_threads(int n);

// Makes `pool` the one parallel_for uses on the calling thread (nullptr: the default).
void set_thread_pool(ThreadPool* pool);

// Makes `pool` the one parallel_for uses on this thread while in scope.
class ScopedPool {
 public:
  explicit ScopedPool(ThreadPool* pool);
  ~ScopedPool();

 private:
  ThreadPool* previous_;
};

}  // namespace k25
