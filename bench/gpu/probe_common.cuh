// Shared pieces of the torch-free kernel probes (prefill_probe.cu, decode_probe.cu): error
// checks, random fill, a paged pool of shuffled pages in k25's layout, the relative error.
#pragma once

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

#define CHECK(x)                                                                             \
  do {                                                                                       \
    cudaError_t e_ = (x);                                                                    \
    if (e_ != cudaSuccess) {                                                                 \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)

namespace probe {

#ifndef K25_PROBE_SHUFFLE_SPAN
// Pages are shuffled within consecutive groups of this many (0: across the whole pool; 1: in
// order): how far apart a sequence's consecutive pages lie, e.g. within 2 MB (TLB reach).
#define K25_PROBE_SHUFFLE_SPAN 0
#endif
#ifndef K25_PROBE_PAGE
#define K25_PROBE_PAGE 16  // tokens per page (block_size); -DK25_PROBE_PAGE=32 builds another
#endif
#ifndef K25_PROBE_LAYERS
// Layers per pool block (the probe reads layer 0). The engine's pool holds every layer of a block
// together (32 for the 8B shape: a page of one layer every 2 MB), the benches' pools one.
#define K25_PROBE_LAYERS 1
#endif
constexpr int kHq = 32, kHkv = 8, kD = 128, kPage = K25_PROBE_PAGE;  // Llama-3.1-8B attention
constexpr int kLayers = K25_PROBE_LAYERS;

// Roughly normal values (sum of four uniforms, unit variance) from a counter hash: never zeros.
__global__ void fill_random(__nv_bfloat16* x, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint64_t z = (static_cast<uint64_t>(i) + seed) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    float u = 0.0f;
    for (int k = 0; k < 4; ++k) u += static_cast<float>((z >> (16 * k)) & 0xFFFF) / 65535.0f;
    x[i] = __float2bfloat16_rn((u - 2.0f) * 1.7320508f);
  }
}

// A pool [pages][kLayers][K, V][kHkv][kPage][kD] with every sequence's pages in shuffled
// order, and its block table [seqs][max_blocks] (-1 past a sequence's pages).
struct Pool {
  __nv_bfloat16* data = nullptr;
  int* d_table = nullptr;
  std::vector<int> table;
  int pages = 0, max_blocks = 0;
  Pool(const std::vector<int>& seq_lens, uint64_t seed) : lens(seq_lens) {
    for (int n : lens) max_blocks = std::max(max_blocks, (n + kPage - 1) / kPage);
    for (int n : lens) pages += (n + kPage - 1) / kPage;
    std::vector<int> perm(pages);
    std::iota(perm.begin(), perm.end(), 0);
    std::mt19937 rng(static_cast<uint32_t>(seed));
    const int span = K25_PROBE_SHUFFLE_SPAN > 0 ? K25_PROBE_SHUFFLE_SPAN : pages;
    for (int g = 0; g < pages; g += span) std::shuffle(perm.begin() + g, perm.begin() + std::min(pages, g + span), rng);
    table.assign(static_cast<size_t>(lens.size()) * max_blocks, -1);
    int at = 0;
    for (size_t s = 0; s < lens.size(); ++s) {
      for (int b = 0; b < (lens[s] + kPage - 1) / kPage; ++b) table[s * max_blocks + b] = perm[at++];
    }
    const int64_t elems = elements();
    CHECK(cudaMalloc(&data, elems * 2));
    fill_random<<<1024, 256>>>(data, elems, seed);
    CHECK(cudaMalloc(&d_table, table.size() * sizeof(int)));
    CHECK(cudaMemcpy(d_table, table.data(), table.size() * sizeof(int), cudaMemcpyHostToDevice));
  }
  int64_t elements() const { return static_cast<int64_t>(pages) * kLayers * 2 * kHkv * kPage * kD; }
  k25::cuda::KVCache cache() const {
    k25::cuda::KVCache kv;
    kv.data = data;
    kv.num_layers = kLayers;
    kv.num_kv_heads = kHkv;
    kv.head_dim = kD;
    kv.block_size = kPage;
    return kv;
  }
  // A batch over the pool's sequences with q_lens[s] query tokens each (the last of its
  // context): query_start, context_lens and the block table set, the rest for the caller.
  k25::cuda::AttnBatch batch(const std::vector<int>& q_lens) {
    std::vector<int> qs(1, 0);
    for (int n : q_lens) qs.push_back(qs.back() + n);
    CHECK(cudaMalloc(&d_query_start, qs.size() * sizeof(int)));
    CHECK(cudaMalloc(&d_context_lens, lens.size() * sizeof(int)));
    CHECK(cudaMemcpy(d_query_start, qs.data(), qs.size() * sizeof(int), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(d_context_lens, lens.data(), lens.size() * sizeof(int), cudaMemcpyHostToDevice));
    k25::cuda::AttnBatch b{};
    b.query_start = d_query_start;
    b.context_lens = d_context_lens;
    b.block_tables = d_table;
    b.max_blocks = max_blocks;
    return b;
  }
  std::vector<int> lens;
  int *d_query_start = nullptr, *d_context_lens = nullptr;
};

// Row `key` of K (kv 0) or V (kv 1) of KV head h in the pool, for a sequence's table.
__device__ __forceinline__ const __nv_bfloat16* pool_row(const __nv_bfloat16* pool, const int* table, int key,
                                                         int kv, int h) {
  const int64_t blk = table[key / kPage];
#ifdef K25_PROBE_KV_ADJ  // with variants/decode_kv_adjacent.patch: a head's K and V pages side by side
  return pool + (((blk * kLayers * kHkv + h) * 2 + kv) * kPage + key % kPage) * kD;
#else
  return pool + (((blk * kLayers * 2 + kv) * kHkv + h) * kPage + key % kPage) * kD;
#endif
}

// One warp per (query row, head): softmax(q K^T * scale) V over keys [0, n) in float32, two
// passes (max, then sums); lane i holds dims 4i..4i+3.
__device__ __forceinline__ void reference_row(const __nv_bfloat16* qrow, const __nv_bfloat16* pool, const int* table,
                                              int n, int h_kv, float scale, float* out_row) {
  const int lane = threadIdx.x % 32;
  float qv[4];
  for (int i = 0; i < 4; ++i) qv[i] = __bfloat162float(qrow[lane * 4 + i]);
  auto dot = [&](int k) {
    const __nv_bfloat16* kr = pool_row(pool, table, k, 0, h_kv) + lane * 4;
    float s = 0.0f;
    for (int i = 0; i < 4; ++i) s += qv[i] * __bfloat162float(kr[i]);
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    return s * scale;
  };
  float mx = -INFINITY;
  for (int k = 0; k < n; ++k) mx = fmaxf(mx, dot(k));
  float acc[4] = {0, 0, 0, 0}, sum = 0.0f;
  for (int k = 0; k < n; ++k) {
    const float p = expf(dot(k) - mx);
    sum += p;
    const __nv_bfloat16* vr = pool_row(pool, table, k, 1, h_kv) + lane * 4;
    for (int i = 0; i < 4; ++i) acc[i] += p * __bfloat162float(vr[i]);
  }
  for (int i = 0; i < 4; ++i) out_row[lane * 4 + i] = acc[i] / sum;
}

// ||out - ref|| / ||ref|| over n elements (out on the device in bf16, ref in float32);
// infinity when out holds a NaN or an Inf (e.g. an element never written: the probes
// poison the output first).
inline double rel_err(const __nv_bfloat16* d_out, const float* d_ref, size_t n) {
  std::vector<__nv_bfloat16> out(n);
  std::vector<float> ref(n);
  CHECK(cudaMemcpy(out.data(), d_out, n * 2, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(ref.data(), d_ref, n * 4, cudaMemcpyDeviceToHost));
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(__bfloat162float(out[i])) - ref[i];
    num += d * d;
    den += static_cast<double>(ref[i]) * ref[i];
  }
  return std::isfinite(num) ? std::sqrt(num / den) : INFINITY;
}

// Median and best of `rounds` timings of fn (each `per_round` back-to-back calls between
// two events on `stream`, so launch gaps overlap as in a graph or a stream of layers), in ms
// per call.
template <typename F>
void time_calls(F fn, int rounds, int per_round, double* median, double* best, cudaStream_t stream = nullptr) {
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  for (int i = 0; i < 2; ++i) fn();
  std::vector<float> ms;
  for (int r = 0; r < rounds; ++r) {
    CHECK(cudaEventRecord(e0, stream));
    for (int i = 0; i < per_round; ++i) fn();
    CHECK(cudaEventRecord(e1, stream));
    CHECK(cudaEventSynchronize(e1));
    float t = 0.0f;
    CHECK(cudaEventElapsedTime(&t, e0, e1));
    ms.push_back(t / per_round);
  }
  CHECK(cudaGetLastError());
  std::sort(ms.begin(), ms.end());
  *median = ms[ms.size() / 2];
  *best = ms.front();
}

}  // namespace probe
