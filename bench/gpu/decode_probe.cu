// Times the paged decode attention kernel alone, without torch: B sequences of L keys (GQA
// 32/8, head_dim 128, bf16, pages of 16 in shuffled order), one query token each, in the
// CUDA-graph form the engine's decode steps use (splits derived on the device, merged inside
// the kernel), checked against a float32 CUDA-core reference. Built on the CPU box with
// nvcc and carried, like prefill_probe.cu:
//
//   bash bench/gpu/build_probe.sh [name:"-DFLAGS"] ...   # here: probe/decode_probe_<name>
//   probe/decode_probe_<name> B L [rounds [tables]]      # there (bench/gpu/probe_run.sh)
//
// -DK25_PROBE_TAIL_N=N [-DK25_PROBE_TAIL_PCT=P]: an explicit work list with a static tail of N
// short ranges a (sequence, KV head) over its last 100 - P percent of keys (below; RESULTS,
// 2026-12-07 session 45).
//
// Prints one line: variant, batch, length, splits, median and best us a call (rounds of 20
// back-to-back calls), KV bytes read per second (median), relative error. Exits 2 when the
// error is above 1e-2.
#include "k25_cuda.h"
#include "probe_common.cuh"

#ifndef K25_PROBE_VARIANT
#define K25_PROBE_VARIANT "base"
#endif

namespace {

using namespace probe;

__global__ void reference(const __nv_bfloat16* q, int64_t q_stride, const __nv_bfloat16* pool, const int* tables,
                          int max_blocks, int B, int L, float scale, float* out) {
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  if (warp >= B * kHq) return;
  const int s = warp / kHq, h = warp % kHq;
  reference_row(q + s * q_stride + h * kD, pool, tables + static_cast<int64_t>(s) * max_blocks, L,
                h / (kHq / kHkv), scale, out + (static_cast<int64_t>(s) * kHq + h) * kD);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace k25;
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s B L [rounds]\n", argv[0]);
    return 1;
  }
  const int B = std::atoi(argv[1]), L = std::atoi(argv[2]);
  const int rounds = argc > 3 ? std::atoi(argv[3]) : 7;
  // Tables: 0 the sequence's block table for every KV head (dense); 1 per-head tables
  // (AttnBatch::head_tables, as a sparse step reads) all equal to it; 2 per-head tables, each
  // head its sequence's blocks in its own shuffled order, so the heads of a sequence no longer
  // read the same block at the same time (a sparse step's access pattern at every key; the
  // output is the same up to rounding: attention does not depend on the keys' order).
  const int table_mode = argc > 4 ? std::atoi(argv[4]) : 0;
  const int group = kHq / kHkv, qkv_cols = (kHq + 2 * kHkv) * kD;
  Pool pool(std::vector<int>(B, L), 7 * B + L);

  // The engine's split rule for the graph form (cuda_glue::decode_splits_for): one wave.
  const int wave = cuda::decode_attention_wave(cuda::DType::kBF16, kD, group);
#ifndef K25_PROBE_WAVE_DIV
#define K25_PROBE_WAVE_DIV 1  // 2: one CTA an SM instead of the wave's two (half the partials to merge)
#endif
  const int splits = std::max(1, std::min(64, wave / K25_PROBE_WAVE_DIV / std::max(1, B * kHkv)));
  // The engine's tail rule (cuda_glue::decode_tail_for); -DK25_PROBE_NO_TAIL: none.
#ifdef K25_PROBE_NO_TAIL
  const int tail = 0;
#else
  const int tail = splits >= 2 && B >= 2 && 4 * B * kHkv * splits >= 3 * wave
                       ? std::max(2, std::min(64, wave / std::max(1, B * kHkv)))
                       : 0;
#endif

  __nv_bfloat16 *d_q, *d_out;
  int* d_counters;
  float *d_partials, *d_ref;
  const size_t out_elems = static_cast<size_t>(B) * kHq * kD;
  CHECK(cudaMalloc(&d_q, static_cast<int64_t>(B) * qkv_cols * 2));
  CHECK(cudaMalloc(&d_out, out_elems * 2));
  CHECK(cudaMalloc(&d_ref, out_elems * 4));
  CHECK(cudaMalloc(&d_counters, static_cast<size_t>(B) * kHkv * sizeof(int)));
  CHECK(cudaMalloc(&d_partials, static_cast<size_t>(B) * kHkv * (splits + tail) * group * (kD + cuda::kPartialPad) * 4));
  CHECK(cudaMemset(d_counters, 0, static_cast<size_t>(B) * kHkv * sizeof(int)));  // zero at rest
  fill_random<<<1024, 256>>>(d_q, static_cast<int64_t>(B) * qkv_cols, 3);

  const cuda::KVCache kv = pool.cache();
  cuda::AttnBatch b = pool.batch(std::vector<int>(B, 1));
  b.partials = d_partials;
  b.decode_splits = splits;
  b.decode_tail = tail;
  b.num_seqs = B;
  b.split_counters = splits > 1 ? d_counters : nullptr;
  int* d_head_tables = nullptr;
  if (table_mode > 0) {
    std::vector<int> ht(static_cast<size_t>(B) * kHkv * pool.max_blocks, -1);
    std::mt19937 rng(11u * B + L);
    for (int s = 0; s < B; ++s) {
      const int nb = (L + kPage - 1) / kPage;
      for (int h = 0; h < kHkv; ++h) {
        int* row = ht.data() + (static_cast<size_t>(s) * kHkv + h) * pool.max_blocks;
        std::copy(pool.table.begin() + static_cast<size_t>(s) * pool.max_blocks,
                  pool.table.begin() + static_cast<size_t>(s) * pool.max_blocks + nb, row);
        if (table_mode == 2) std::shuffle(row, row + nb, rng);  // L % kPage == 0 in the cases run
      }
    }
    CHECK(cudaMalloc(&d_head_tables, ht.size() * sizeof(int)));
    CHECK(cudaMemcpy(d_head_tables, ht.data(), ht.size() * sizeof(int), cudaMemcpyHostToDevice));
    b.head_tables = d_head_tables;
  }
  int used = std::max(1, std::min(splits, (L + b.min_split_keys - 1) / b.min_split_keys));  // derived_count at equal spans
#ifdef K25_PROBE_SPLIT_TARGET  // with variants/decode_split_target.patch
  b.split_target_keys = K25_PROBE_SPLIT_TARGET;
  used = std::min(used, std::max((splits + 1) / 2, (L + K25_PROBE_SPLIT_TARGET - 1) / K25_PROBE_SPLIT_TARGET));
#endif
  const float scale = 1.0f / std::sqrt(static_cast<float>(kD));
  int items = B * kHkv * (splits + tail);
#ifdef K25_PROBE_TAIL_N
  // An explicit work list (AttnBatch::work, merged in the kernel) instead of device-derived
  // splits: each (sequence, KV head) keeps the derived rule's `used` ranges over the first
  // K25_PROBE_TAIL_PCT percent of its keys and K25_PROBE_TAIL_N more, shorter ones over the
  // rest; every pair's long ranges come first in the grid, so the short ones start as the wave's
  // first CTAs finish (a static, deterministic tail; TAIL_N 0 and PCT 100: the derived rule's
  // ranges as a list).
  {
#ifndef K25_PROBE_TAIL_PCT
#define K25_PROBE_TAIL_PCT 100
#endif
    const int pairs = B * kHkv, n_long = used, n_short = K25_PROBE_TAIL_N, count = n_long + n_short;
    const int long_keys = n_short > 0 ? static_cast<int>(static_cast<int64_t>(L) * K25_PROBE_TAIL_PCT / 100) : L;
    std::vector<cuda::AttnWork> work;
    std::vector<int> merges;
    for (int pass = 0; pass < 2; ++pass) {
      for (int s = 0; s < B; ++s) {  // (sequence, KV head) order, as the derived rule's equal spans
        for (int h = 0; h < kHkv; ++h) {
          const int pair = s * kHkv + h;
          const int n = pass == 0 ? n_long : n_short;
          const int begin = pass == 0 ? 0 : long_keys, span = pass == 0 ? long_keys : L - long_keys;
          for (int i = 0; i < n; ++i) {
            cuda::AttnWork w{};
            w.seq = s;
            w.kv_head = h;
            w.q_begin = 0;
            w.q_end = 1;
            w.key_begin = begin + static_cast<int>(static_cast<int64_t>(span) * i / n);
            w.key_end = begin + static_cast<int>(static_cast<int64_t>(span) * (i + 1) / n);
            w.partial = count > 1 ? pair * count + (pass == 0 ? i : n_long + i) : -1;
            w.merge = count > 1 ? pair : -1;
            work.push_back(w);
          }
          if (pass == 0 && count > 1) merges.insert(merges.end(), {s, h, pair * count, count});
        }
      }
    }
    items = static_cast<int>(work.size());
    cuda::AttnWork* d_work;
    int* d_merge = nullptr;
    CHECK(cudaMalloc(&d_work, work.size() * sizeof(cuda::AttnWork)));
    CHECK(cudaMemcpy(d_work, work.data(), work.size() * sizeof(cuda::AttnWork), cudaMemcpyHostToDevice));
    if (count > 1) {
      CHECK(cudaFree(d_partials));
      CHECK(cudaMalloc(&d_partials, static_cast<size_t>(pairs) * count * group * (kD + cuda::kPartialPad) * 4));
      CHECK(cudaMalloc(&d_merge, merges.size() * sizeof(int)));
      CHECK(cudaMemcpy(d_merge, merges.data(), merges.size() * sizeof(int), cudaMemcpyHostToDevice));
    }
    b.partials = d_partials;
    b.decode_splits = 0;
    b.work = d_work;
    b.num_work = b.num_decode_work = items;
    b.merge = d_merge;
    b.num_merges = b.num_decode_merges = count > 1 ? pairs : 0;
    b.split_counters = count > 1 ? d_counters : nullptr;
    used = count;
  }
#endif
  // K25_PROBE_STREAM=1: the calls on a stream of their own (non-blocking) instead of the legacy
  // default stream, as the engine's steps run.
  cudaStream_t stream = nullptr;
  const char* own = std::getenv("K25_PROBE_STREAM");
  if (own != nullptr && std::atoi(own) == 1) CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // K25_PROBE_CHAIN=1: each call is RoPE and the cache write of each row's token (the engine's
  // kernel, identity tables, key L - 1) and then the attention, as a decode step runs them: the
  // attention's work before its pdl_wait overlaps RoPE only, not the previous attention's tail
  // as back-to-back calls let it. K25_PROBE_CHAIN=2: RoPE alone (its time, to subtract).
  const char* chain_env = std::getenv("K25_PROBE_CHAIN");
  const int chain = chain_env != nullptr ? std::atoi(chain_env) : 0;
  int32_t* d_pos = nullptr;
  int64_t* d_slots = nullptr;
  float *d_cos = nullptr, *d_sin = nullptr;
  if (chain > 0) {
    std::vector<int32_t> pos(B, L - 1);
    std::vector<int64_t> slots(B);
    for (int s = 0; s < B; ++s) {
      slots[s] = static_cast<int64_t>(pool.table[static_cast<size_t>(s) * pool.max_blocks + (L - 1) / kPage]) * kPage +
                 (L - 1) % kPage;
    }
    std::vector<float> ones(static_cast<size_t>(L) * kD / 2, 1.0f), zeros(static_cast<size_t>(L) * kD / 2, 0.0f);
    CHECK(cudaMalloc(&d_pos, B * sizeof(int32_t)));
    CHECK(cudaMalloc(&d_slots, B * sizeof(int64_t)));
    CHECK(cudaMalloc(&d_cos, ones.size() * sizeof(float)));
    CHECK(cudaMalloc(&d_sin, zeros.size() * sizeof(float)));
    CHECK(cudaMemcpy(d_pos, pos.data(), B * sizeof(int32_t), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(d_slots, slots.data(), B * sizeof(int64_t), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(d_cos, ones.data(), ones.size() * sizeof(float), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(d_sin, zeros.data(), zeros.size() * sizeof(float), cudaMemcpyHostToDevice));
  }
  auto run = [&] {
    if (chain > 0) {
      cuda::rope_write_kv(cuda::DType::kBF16, d_q, qkv_cols, d_pos, d_slots, B, kHq, d_cos, d_sin, kv, 0, stream);
    }
    if (chain != 2) {
      cuda::decode_attention(cuda::DType::kBF16, d_q, qkv_cols, d_out, kv, 0, b, kHq, scale, 0, items, stream);
    }
  };

  CHECK(cudaMemset(d_out, 0xFF, out_elems * 2));  // NaN: every element must be written
  CHECK(cudaDeviceSynchronize());                  // (run() may be on a non-blocking stream)
  run();
  CHECK(cudaGetLastError());
  CHECK(cudaStreamSynchronize(stream));  // the reference reads what RoPE wrote in chain mode
  reference<<<(B * kHq * 32 + 255) / 256, 256>>>(d_q, qkv_cols, pool.data, pool.d_table, pool.max_blocks, B, L,
                                                 scale, d_ref);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  const double rel = rel_err(d_out, d_ref, out_elems);

  double med = 0, best = 0;
  time_calls(run, rounds, 20, &med, &best, stream);
  const double bytes = static_cast<double>(B) * L * kHkv * kD * 2 * 2;  // K and V, bf16
  std::printf("%-24s B=%d L=%d splits=%d/%d+%d tables=%d chain=%d  %.1f us (min %.1f)  %.2f TB/s  rel_err %.2e\n",
              K25_PROBE_VARIANT, B, L, used, splits, tail, table_mode, chain, med * 1e3, best * 1e3,
              bytes / (med * 1e-3) / 1e12, rel);
  return rel < 1e-2 ? 0 : 2;
}
