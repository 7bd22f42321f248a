// CPU kernels on raw float32 pointers. Each has a PyTorch reference in tests/python/
// test_cpu_kernels.py. They parallelise through k25::parallel_for.
#pragma once

#include <cstdint>

#include "ops/kv_layout.h"

namespace k25::cpu {

// The sequences of one step, as the attention kernels see them (see BatchMeta).
struct AttentionBatch {
  const int32_t* query_start = nullptr;   // [S + 1]
  const int32_t* context_lens = nullptr;  // [S]
  const int32_t* block_tables = nullptr;  // [S * max_blocks_per_seq]
  int32_t max_blocks_per_seq = 0;
  int32_t num_seqs = 0;
  // Dynamic sparsity (ops/block_sparsity.h): a sequence with sparse_seq[s] set reads KV
  // head h through head_tables[(s * num_kv_heads + h) * max_blocks_per_seq ...] instead
  // of its block table, and context_lens[s] is the kept keys' count.
  const int32_t* head_tables = nullptr;
  const uint8_t* sparse_seq = nullptr;
  // When set, paged_attention also writes each (row, query head)'s log-sum-exp of the
  // scaled scores here: [T][num_heads] (what compensation for skipped blocks needs).
  float* row_lse = nullptr;
  // Cold blocks (kv_layout.h): table entry cold_block_id(j) is read at cold_blocks[j]; with
  // dynamic sparsity its key summaries (one block of ops/block_sparsity.h's layout) at
  // cold_summaries[j].
  const void* const* cold_blocks = nullptr;   // elements of layout.elem
  const float* const* cold_summaries = nullptr;
};

// out[t] = rmsnorm(x[t]) * w over rows of n; x and out may alias.
void rms_norm(const float* x, int64_t x_stride, const float* w, float* out, int64_t out_stride,
              int64_t rows, int64_t n, float eps);
// h[t] += delta[t]; out[t] = rmsnorm(h[t]) * w   (residual add fused with the norm).
void add_rms_norm(float* h, const float* delta, const float* w, float* out, int64_t rows,
                  int64_t n, float eps);
// out[t, i] = silu(gu[t, i]) * gu[t, n + i]   (gate and up projections side by side).
void silu_mul(const float* gu, float* out, int64_t rows, int64_t n);

// Rotates q and k heads in place (rotate-half convention: pairs (i, i + d/2)).
// cos_sin: [max_pos, d/2] cos table followed by the [max_pos, d/2] sin table.
// qkv rows hold num_heads q heads, then num_kv_heads k heads, then the v heads.
void rope_inplace(float* qkv, int64_t row_stride, const int32_t* positions, int64_t rows,
                  int32_t num_heads, int32_t num_kv_heads, int32_t head_dim,
                  const float* cos_table, const float* sin_table);
// Writes the k and v heads of each qkv row into the paged cache at slot_mapping[t].
void write_kv(const float* qkv, int64_t row_stride, const int64_t* slot_mapping, int64_t rows,
              int32_t num_heads, void* kv, const KVLayout& layout, int32_t layer);
// RoPE on q (in place) and k, fused with the cache write of k (rotated) and v.
void rope_write_kv(float* qkv, int64_t row_stride, const int32_t* positions,
                   const int64_t* slot_mapping, int64_t rows, int32_t num_heads,
                   const float* cos_table, const float* sin_table, void* kv,
                   const KVLayout& layout, int32_t layer);

// y[m, n] = sum_k x[m, k] w[n, k] (+ b[n]) for rows m < M and columns n in [n0, n1), on the
// calling thread (cpu_linear.cpp): x rows at x_stride, w [N][K] contiguous, y rows at y_stride.
// For a few rows (decode steps), where BLAS is slow; each output is computed the same way
// whatever M is.
void linear_few_rows(const float* x, int64_t x_stride, const float* w, const float* b, float* y,
                     int64_t y_stride, int64_t M, int64_t n0, int64_t n1, int64_t K);
// Causal attention of each sequence's new tokens over its paged KV (prefill chunks and
// decodes mixed). q rows: [T][num_heads * head_dim] with stride q_stride; out: [T][num_heads
// * head_dim] contiguous. sliding_window > 0 limits each query to its last window keys.
void paged_attention(const float* q, int64_t q_stride, float* out, const void* kv,
                     const KVLayout& layout, int32_t layer, const AttentionBatch& batch,
                     int32_t num_heads, float scale, int32_t sliding_window);

}  // namespace k25::cpu
