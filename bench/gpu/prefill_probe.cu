// Times the paged prefill attention kernel alone, without torch: a causal prefill of one
// sequence (GQA 32/8, head_dim 128, bf16, pages of 16 in shuffled order, the planner's work
// list) through k25::cuda::prefill_attention, checked against a float32 CUDA-core
// reference of the same function. Built on the CPU box with nvcc and carried, so kernel
// variants can be compared in one GPU call without building the extension:
//
//   bash bench/gpu/build_probe.sh            # here: one binary per variant, in probe/
//   probe/prefill_probe_<variant> [L] [iters]   # there
//
// Prints one line: variant, TFLOP/s (median of iters launches), relative error.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#include "k25_cuda.h"
#include "ops/attention_plan.h"

#ifndef K25_PROBE_VARIANT
#define K25_PROBE_VARIANT "base"
#endif

namespace {

constexpr int kHq = 32, kHkv = 8, kD = 128, kPage = 16;

#define CHECK(x)                                                                             \
  do {                                                                                       \
    cudaError_t e_ = (x);                                                                    \
    if (e_ != cudaSuccess) {                                                                 \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)

__global__ void fill_random(__nv_bfloat16* x, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint64_t z = (static_cast<uint64_t>(i) + seed) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    // Roughly normal: sum of four uniforms, centred, unit variance.
    float u = 0.0f;
    for (int k = 0; k < 4; ++k) u += static_cast<float>((z >> (16 * k)) & 0xFFFF) / 65535.0f;
    x[i] = __float2bfloat16_rn((u - 2.0f) * 1.7320508f);
  }
}

// One warp per (query token, head): keys 0..pos, float32, two passes (max, then sums).
__global__ void reference(const __nv_bfloat16* q, int64_t q_stride, const __nv_bfloat16* cache, const int* table,
                          int L, float scale, float* out) {
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
  if (warp >= L * kHq) return;
  const int pos = warp / kHq, h = warp % kHq, kvh = h / (kHq / kHkv);
  float qv[4];
  for (int i = 0; i < 4; ++i) qv[i] = __bfloat162float(q[pos * q_stride + h * kD + lane * 4 + i]);
  auto row = [&](int key, int kv) {  // [blocks][1 layer][K, V][kv heads][page][D]
    const int64_t blk = table[key / kPage];
    return cache + (((blk * 2 + kv) * kHkv + kvh) * kPage + key % kPage) * kD + lane * 4;
  };
  float mx = -INFINITY;
  for (int k = 0; k <= pos; ++k) {
    const __nv_bfloat16* kr = row(k, 0);
    float s = 0.0f;
    for (int i = 0; i < 4; ++i) s += qv[i] * __bfloat162float(kr[i]);
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    mx = fmaxf(mx, s * scale);
  }
  float acc[4] = {0, 0, 0, 0}, sum = 0.0f;
  for (int k = 0; k <= pos; ++k) {
    const __nv_bfloat16* kr = row(k, 0);
    float s = 0.0f;
    for (int i = 0; i < 4; ++i) s += qv[i] * __bfloat162float(kr[i]);
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    const float p = expf(s * scale - mx);
    sum += p;
    const __nv_bfloat16* vr = row(k, 1);
    for (int i = 0; i < 4; ++i) acc[i] += p * __bfloat162float(vr[i]);
  }
  for (int i = 0; i < 4; ++i) out[(static_cast<int64_t>(pos) * kHq + h) * kD + lane * 4 + i] = acc[i] / sum;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace k25;
  const int L = argc > 1 ? std::atoi(argv[1]) : 16384;
  const int iters = argc > 2 ? std::atoi(argv[2]) : 10;
  const int pages = (L + kPage - 1) / kPage;
  const int qkv_cols = (kHq + 2 * kHkv) * kD;

  std::vector<int> table(pages);
  std::iota(table.begin(), table.end(), 0);
  std::mt19937 rng(L);
  std::shuffle(table.begin(), table.end(), rng);

  const int qs[2] = {0, L}, cl[1] = {L};
  AttentionPlanParams pp;
  pp.num_kv_heads = kHkv;
  pp.group = kHq / kHkv;
  pp.max_rows = cuda::kPrefillRows;
  pp.wave = 264;
  const AttentionPlan plan = plan_attention(qs, cl, 1, pp);

  __nv_bfloat16 *d_qkv, *d_cache, *d_out;
  int *d_qs, *d_cl, *d_table;
  cuda::AttnWork* d_work;
  float* d_ref;
  const int64_t cache_elems = static_cast<int64_t>(pages) * 2 * kHkv * kPage * kD;
  CHECK(cudaMalloc(&d_qkv, static_cast<int64_t>(L) * qkv_cols * 2));
  CHECK(cudaMalloc(&d_cache, cache_elems * 2));
  CHECK(cudaMalloc(&d_out, static_cast<int64_t>(L) * kHq * kD * 2));
  CHECK(cudaMalloc(&d_ref, static_cast<int64_t>(L) * kHq * kD * 4));
  CHECK(cudaMalloc(&d_qs, sizeof(qs)));
  CHECK(cudaMalloc(&d_cl, sizeof(cl)));
  CHECK(cudaMalloc(&d_table, pages * sizeof(int)));
  CHECK(cudaMalloc(&d_work, plan.work.size() * sizeof(cuda::AttnWork)));
  fill_random<<<1024, 256>>>(d_qkv, static_cast<int64_t>(L) * qkv_cols, 1);
  fill_random<<<1024, 256>>>(d_cache, cache_elems, 2);
  CHECK(cudaMemcpy(d_qs, qs, sizeof(qs), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_cl, cl, sizeof(cl), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_table, table.data(), pages * sizeof(int), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_work, plan.work.data(), plan.work.size() * sizeof(cuda::AttnWork), cudaMemcpyHostToDevice));

  cuda::KVCache kv;
  kv.data = d_cache;
  kv.num_layers = 1;
  kv.num_kv_heads = kHkv;
  kv.head_dim = kD;
  kv.block_size = kPage;
  cuda::AttnBatch b{};
  b.query_start = d_qs;
  b.context_lens = d_cl;
  b.block_tables = d_table;
  b.max_blocks = pages;
  b.work = d_work;
  b.num_work = static_cast<int>(plan.work.size());
  const float scale = 1.0f / std::sqrt(static_cast<float>(kD));
  auto run = [&] {
    cuda::prefill_attention(cuda::DType::kBF16, d_qkv, qkv_cols, d_out, kv, 0, b, kHq, scale, 0, 0, b.num_work,
                            nullptr);
  };

  CHECK(cudaMemset(d_out, 0xFF, static_cast<int64_t>(L) * kHq * kD * 2));  // NaN: every element must be written
  run();
  CHECK(cudaGetLastError());
  reference<<<(L * kHq * 32 + 255) / 256, 256>>>(d_qkv, qkv_cols, d_cache, d_table, L, scale, d_ref);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  std::vector<__nv_bfloat16> out(static_cast<size_t>(L) * kHq * kD);
  std::vector<float> ref(out.size());
  CHECK(cudaMemcpy(out.data(), d_out, out.size() * 2, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(ref.data(), d_ref, ref.size() * 4, cudaMemcpyDeviceToHost));
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < out.size(); ++i) {
    const double d = static_cast<double>(__bfloat162float(out[i])) - ref[i];
    num += d * d;
    den += static_cast<double>(ref[i]) * ref[i];
  }
  const double rel = std::isfinite(num) ? std::sqrt(num / den) : INFINITY;

  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  for (int i = 0; i < 2; ++i) run();
  std::vector<float> ms;
  for (int i = 0; i < iters; ++i) {
    CHECK(cudaEventRecord(e0));
    run();
    CHECK(cudaEventRecord(e1));
    CHECK(cudaEventSynchronize(e1));
    float t = 0.0f;
    CHECK(cudaEventElapsedTime(&t, e0, e1));
    ms.push_back(t);
  }
  CHECK(cudaGetLastError());
  std::sort(ms.begin(), ms.end());
  const double flops = 2.0 * kHq * kD * static_cast<double>(L) * L;  // QK and PV over the causal half
  const double med = ms[ms.size() / 2];
  std::printf("%-24s L=%d items=%zu  %.3f ms (min %.3f)  %.1f TFLOP/s  rel_err %.2e\n", K25_PROBE_VARIANT, L,
              plan.work.size(), med, ms.front(), flops / (med * 1e-3) / 1e12, rel);
  return rel < 1e-2 ? 0 : 2;
}
