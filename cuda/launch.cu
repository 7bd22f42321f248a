// Launch settings shared by the kernels (see launch_pdl in common.cuh).
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "common.cuh"

namespace k25::cuda {

bool env_is_zero(const char* name) {
  const char* env = std::getenv(name);
  return env && std::strcmp(env, "0") == 0;
}

int device_compute_major() {
  // Compute capability major + 1 per device, looked up once (0: not yet).
  constexpr int kMaxDevices = 64;
  static std::atomic<int> major[kMaxDevices] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) return 0;
  int m = major[dev].load(std::memory_order_relaxed);
  if (m == 0) {
    int cc = 0;
    if (cudaDeviceGetAttribute(&cc, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) return 0;
    m = cc + 1;
    major[dev].store(m, std::memory_order_relaxed);
  }
  return m - 1;
}

bool pdl_enabled() { return !env_is_zero("K25_PDL") && device_compute_major() >= 9; }

}  // namespace k25::cuda
