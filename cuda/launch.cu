// Launch settings shared by the kernels (see launch_pdl in common.cuh).
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "common.cuh"

namespace k25::cuda {

bool pdl_enabled() {
  const char* env = std::getenv("K25_PDL");
  if (env && std::strcmp(env, "0") == 0) return false;
  // Compute capability major + 1 per device, looked up once (0: not yet).
  constexpr int kMaxDevices = 64;
  static std::atomic<int> major[kMaxDevices] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) return false;
  int m = major[dev].load(std::memory_order_relaxed);
  if (m == 0) {
    int cc = 0;
    if (cudaDeviceGetAttribute(&cc, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) return false;
    m = cc + 1;
    major[dev].store(m, std::memory_order_relaxed);
  }
  return m - 1 >= 9;
}

}  // namespace k25::cuda
