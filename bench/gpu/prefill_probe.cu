// Times the paged prefill attention kernel alone, without torch: a causal prefill of one
// sequence (GQA 32/8, head_dim 128, bf16, pages of 16 in shuffled order, the planner's work
// list) through k25::cuda::prefill_attention, checked against a float32 CUDA-core
// reference of the same function. Built on the CPU box with nvcc and carried, so kernel
// variants can be compared in one GPU call without building the extension:
//
//   bash bench/gpu/build_probe.sh [name:"-DFLAGS"] ...   # here: probe/prefill_probe_<name>
//   probe/prefill_probe_<name> [L] [iters]               # there (bench/gpu/probe_run.sh)
//
// Prints one line: variant, length, median and best ms, TFLOP/s (median), relative error.
// Exits 2 when the error is above 1e-2 (ablation builds compute something else on purpose).
#include "k25_cuda.h"
#include "ops/attention_plan.h"
#include "probe_common.cuh"

#ifndef K25_PROBE_VARIANT
#define K25_PROBE_VARIANT "base"
#endif

namespace {

using namespace probe;

__global__ void reference(const __nv_bfloat16* q, int64_t q_stride, const __nv_bfloat16* pool, const int* table,
                          int L, float scale, float* out) {
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  if (warp >= L * kHq) return;
  const int pos = warp / kHq, h = warp % kHq;
  reference_row(q + pos * q_stride + h * kD, pool, table, pos + 1, h / (kHq / kHkv), scale,
                out + (static_cast<int64_t>(pos) * kHq + h) * kD);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace k25;
  const int L = argc > 1 ? std::atoi(argv[1]) : 16384;
  const int iters = argc > 2 ? std::atoi(argv[2]) : 10;
  const int qkv_cols = (kHq + 2 * kHkv) * kD;
  Pool pool({L}, L);

  const int qs[2] = {0, L}, cl[1] = {L};
  AttentionPlanParams pp;
  pp.num_kv_heads = kHkv;
  pp.group = kHq / kHkv;
  pp.max_rows = cuda::kPrefillRows;
  pp.wave = 264;
  const AttentionPlan plan = plan_attention(qs, cl, 1, pp);

  __nv_bfloat16 *d_qkv, *d_out;
  cuda::AttnWork* d_work;
  float* d_ref;
  const size_t out_elems = static_cast<size_t>(L) * kHq * kD;
  CHECK(cudaMalloc(&d_qkv, static_cast<int64_t>(L) * qkv_cols * 2));
  CHECK(cudaMalloc(&d_out, out_elems * 2));
  CHECK(cudaMalloc(&d_ref, out_elems * 4));
  CHECK(cudaMalloc(&d_work, plan.work.size() * sizeof(cuda::AttnWork)));
  fill_random<<<1024, 256>>>(d_qkv, static_cast<int64_t>(L) * qkv_cols, 1);
  CHECK(cudaMemcpy(d_work, plan.work.data(), plan.work.size() * sizeof(cuda::AttnWork), cudaMemcpyHostToDevice));

  const cuda::KVCache kv = pool.cache();
  cuda::AttnBatch b = pool.batch({L});
  b.work = d_work;
  b.num_work = static_cast<int>(plan.work.size());
  const float scale = 1.0f / std::sqrt(static_cast<float>(kD));
  auto run = [&] {
    cuda::prefill_attention(cuda::DType::kBF16, d_qkv, qkv_cols, d_out, kv, 0, b, kHq, scale, 0, 0, b.num_work,
                            nullptr);
  };

  CHECK(cudaMemset(d_out, 0xFF, out_elems * 2));  // NaN: every element must be written
  run();
  CHECK(cudaGetLastError());
  reference<<<(L * kHq * 32 + 255) / 256, 256>>>(d_qkv, qkv_cols, pool.data, pool.d_table, L, scale, d_ref);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  const double rel = rel_err(d_out, d_ref, out_elems);

  double med = 0, best = 0;
  time_calls(run, iters, 1, &med, &best);
  const double flops = 2.0 * kHq * kD * static_cast<double>(L) * L;  // QK and PV over the causal half
  std::printf("%-24s L=%d items=%zu  %.3f ms (min %.3f)  %.1f TFLOP/s  rel_err %.2e\n", K25_PROBE_VARIANT, L,
              plan.work.size(), med, best, flops / (med * 1e-3) / 1e12, rel);
  return rel < 1e-2 ? 0 : 2;
}
