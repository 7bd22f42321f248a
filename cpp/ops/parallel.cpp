#include "ops/parallel.h"

#include <ATen/Parallel.h>

namespace k25 {

void parallel_for(int64_t begin, int64_t end, int64_t grain,
                  const std::function<void(int64_t, int64_t)>& fn) {
  at::parallel_for(begin, end, grain, fn);
}

int num_threads() { return at::get_num_threads(); }

void set_num_threads(int n) {
  if (n > 0) at::set_num_threads(n);
}

}  // namespace k25
