// A parallel-for over an index range that runs on torch's intra-op thread pool.
//
// Kernels in cpp/ops/ are plain C++ on raw pointers; they parallelise through this seam so
// that the process has one OpenMP runtime (torch's) and one thread count.
#pragma once

#include <cstdint>
#include <functional>

namespace k25 {

// Calls fn(begin_chunk, end_chunk) over [begin, end) in chunks of at least `grain` indices.
void parallel_for(int64_t begin, int64_t end, int64_t grain,
                  const std::function<void(int64_t, int64_t)>& fn);

// Number of threads parallel_for uses from the calling thread.
int num_threads();
// Sets the intra-op thread count for the calling thread (OpenMP ICVs are per thread).
void set_num_threads(int n);

}  // namespace k25
