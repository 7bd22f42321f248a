// Element-type helpers shared by the kernels.
#pragma once

#include <cfloat>
#include <climits>
#include <utility>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "k25_cuda.h"

namespace k25::cuda {

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_f(float x);
template <>
__device__ __forceinline__ float from_f<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

template <typename T>
constexpr __host__ __device__ DType dtype_of();
template <>
constexpr __host__ __device__ DType dtype_of<float>() { return DType::kF32; }
template <>
constexpr __host__ __device__ DType dtype_of<__half>() { return DType::kF16; }
template <>
constexpr __host__ __device__ DType dtype_of<__nv_bfloat16>() { return DType::kBF16; }

// Rounds a float to the element type and back: the value PyTorch would hold in T.
template <typename T>
__device__ __forceinline__ float round_to(float x) { return to_f(from_f<T>(x)); }

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The block table of (sequence, KV head): its own with dynamic sparsity (head_tables),
// else the sequence's.
__device__ __forceinline__ const int* table_of(const AttnBatch& batch, int seq, int kv_head, int num_kv_heads) {
  return batch.head_tables != nullptr
             ? batch.head_tables + (static_cast<int64_t>(seq) * num_kv_heads + kv_head) * batch.max_blocks
             : batch.block_tables + static_cast<int64_t>(seq) * batch.max_blocks;
}

// Device-derived decode splits (AttnBatch::decode_splits = S_max > 0, one query token per
// sequence): the launch has num_seqs * S_max CTAs per KV head, num_seqs * num_kv_heads *
// S_max in all, shared out over the batch's sequences by their keys. With T = num_seqs * S_max
// CTAs a KV head and N the batch's keys (a sequence's span: its keys, or its window's), every
// sequence's ranges are at most c keys long, S_s = ceil(n_s / c) of them (at least 1, at most
// one per min_split_keys keys and kMaxFusedSplits), for a c near the smallest whose counts fit
// T: first ceil(N / T), then twice c scaled by how far the counts overshoot, and at last
// ceil(N / (T - num_seqs)), which always fits (the counts exceed n_s / c by under 1 each).
// Equal spans get S_max each (ceil(N / T) = ceil(n / S_max)), and a long row beside short ones
// gets the CTAs the short rows do not need: its ranges are about N / T keys long rather than
// n_s / S_max.
// Items: with one sequence, equal spans (up to 32 sequences, a warp's vote) or S_max = 1,
// (sequence, KV head, range) in that order, S_max items per (sequence, KV head) of which the
// first S_s work; otherwise KV head h owns items h B S_max + [0, B S_max) (B = num_seqs),
// sequence s of them [first_s, first_s + S_s), first_s the counts of the sequences before it
// (head-major: on an H100 the long row's CTAs then share SMs with the short rows', 1x128K +
// 7x4K 6% faster than in sequence order). A (sequence, KV head)'s partial slots are its
// items, contiguous; items past every sequence's have no work.
__device__ __forceinline__ int derived_span(const AttnBatch& batch, int seq, int window) {
  const int ctx = batch.context_lens[seq];
  return window > 0 ? min(ctx, window) : ctx;
}
__device__ __forceinline__ int derived_cap(int span, const AttnBatch& batch) {
  const int k = batch.min_split_keys;
  return min(max(1, (span + k - 1) / k), kMaxFusedSplits);
}
// S_s of a span with ranges of at most c keys.
__device__ __forceinline__ int derived_count(int span, int c, const AttnBatch& batch) {
  return min(max(1, (span + c - 1) / c), derived_cap(span, batch));
}
// Tail ranges (AttnBatch::decode_tail = N >= 2): a (sequence, KV head) whose keys take two or
// more ranges gives its last tenth of them to shorter ranges (N with equal lengths; by keys,
// like the long ones, otherwise), whose items follow every long range's in the grid, so they
// start as the first wave's CTAs finish and even out its end (bench/RESULTS.md, 2026-12-07).
// Only where the ranges average kTailMinRangeKeys keys or more (span / n_long, before the tail
// is taken): over shorter ones the extra CTAs and partials cost more than the end gains (B8 @
// 1K lost 27%, one 32K row beside seven 2K ones 1.4%). The tail keys of a span of n_long ranges:
constexpr int kTailMinRangeKeys = 4096;
__device__ __forceinline__ int derived_tail_keys(int span, int n_long) {
  return n_long >= 2 && span / n_long >= kTailMinRangeKeys ? span / 10 : 0;
}
// One derived item: seq < 0 when it has no work. count ranges, long_count over the span's first
// span - tail keys and the rest over its tail keys; split: this item's (< long_count: a long
// one); first: the partial slot of range 0 (a (sequence, KV head)'s slots are contiguous).
struct DerivedItem {
  int seq = -1, kv_head = 0, split = 0, count = 0, first = 0, long_count = 0, tail = 0;
};
// want_seq < 0: item `item` (of H KV heads); else (want_seq, want_head)'s counts and first
// slot (split 0). Called by whole warps (it shuffles over the sequences, 32 at a time);
// every lane gets the same answer. Items [0, H B S) are the long ranges as described above;
// with tails, items H B S + [0, H B N) the tail ranges, shared out the same way over the
// tail keys (in order, or by keys, KV head h's at h B N + ...), and a (sequence, KV head)'s
// S + N slots (in order) or its ranges' slots (by keys: KV head h's from h B (S + N), each
// sequence's long then tail ranges after the sequences before it) are contiguous.
__device__ __forceinline__ DerivedItem derived_item(const AttnBatch& batch, int window, int H, int item, int want_seq,
                                                    int want_head) {
  const int B = batch.num_seqs, S = batch.decode_splits, N = batch.tail_items();
  const int long_items = H * B * S;
  const bool tail_item = want_seq < 0 && item >= long_items;
  DerivedItem d;
  if (tail_item && N == 0) return d;  // (a grid past the long items without tails: no work)
  // Equal spans: (sequence, KV head, range) order, S long and N tail items per (sequence, KV
  // head), count long and nt tail ranges each.
  auto in_order = [&](int count, int span) {
    const int tail = N > 0 ? derived_tail_keys(span, count) : 0;
    const int nt = tail > 0 ? min(min(N, derived_cap(tail, batch)), kMaxFusedSplits - count) : 0;
    if (want_seq >= 0) {
      d.seq = want_seq;
      d.kv_head = want_head;
    } else if (!tail_item) {
      d.seq = item / (H * S);
      d.kv_head = item / S - d.seq * H;
      d.split = item % S;
      if (d.split >= count) d.seq = -1;
    } else {
      const int t = item - long_items;
      d.seq = t / (H * N);
      d.kv_head = t / N - d.seq * H;
      d.split = count + t % N;
      if (t % N >= nt) d.seq = -1;
    }
    d.count = count + nt;
    d.long_count = count;
    d.tail = nt > 0 ? tail : 0;
    d.first = (d.seq * H + d.kv_head) * (S + N);
    return d;
  };
  if (S == 1) return in_order(1, 0);
  if (B == 1) {
    const int span0 = derived_span(batch, 0, window);
    return in_order(min(S, derived_cap(span0, batch)), span0);
  }
  constexpr unsigned kAll = 0xffffffffu;
  const int lane = threadIdx.x % 32;
  int span = lane < B ? derived_span(batch, lane, window) : 0;  // the first 32 rows' stay in registers
  if (B <= 32) {
    const int span0 = __shfl_sync(kAll, span, 0);
    if (__all_sync(kAll, lane >= B || span == span0)) return in_order(min(S, derived_cap(span0, batch)), span0);
  }
  // Shares by keys, head-major: c keys at most a long range, ct a tail range.
  const int per_head = B * S, per_head_t = B * N;
  const int head = want_seq >= 0 ? want_head : tail_item ? (item - long_items) / per_head_t : item / per_head;
  const int j = tail_item ? item - long_items - head * per_head_t : item - head * per_head;
  auto sum_rows = [&](auto value) {  // sum over the rows of value(span, row)
    long long t = lane < B ? value(span) : 0;
    for (int s = lane + 32; s < B; s += 32) t += value(derived_span(batch, s, window));
    for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(kAll, t, o);
    return t;
  };
  auto range_keys = [](long long keys, long long ranges) {
    return static_cast<int>(min((keys + ranges - 1) / ranges, static_cast<long long>(INT_MAX)));
  };
  // The range length whose counts (count(span, c) for each row, over its keys(span)) fit
  // `ranges`: first ceil(total / ranges), then twice scaled by the overshoot, then the length
  // that always fits (each of the `rows` that take ranges counts less than one over n / c).
  auto fit = [&](auto keys, auto count, long long ranges, long long rows) {
    const long long total = sum_rows([&](int sp) { return static_cast<long long>(keys(sp)); });
    int c = max(1, range_keys(total, ranges));
    for (int tries = 0;; ++tries) {
      const long long t = sum_rows([&](int sp) { return static_cast<long long>(count(sp, c)); });
      if (t <= ranges) break;
      c = tries < 2 ? range_keys(static_cast<long long>(c) * t, ranges)
                    : max(c, range_keys(total, max(1LL, ranges - rows)));
      if (tries >= 2) break;
    }
    return c;
  };
  // (Every row takes a long range, an empty one too; only rows with tail keys take tail ranges.)
  const int c = fit([](int sp) { return sp; }, [&](int sp, int cc) { return derived_count(sp, cc, batch); }, per_head, B);
  // A row's tail keys (of its span and n long ranges) and tail ranges of at most cc keys (a merge
  // takes at most kMaxFusedSplits ranges: a row with that many long ones has no tail).
  auto tail_of = [&](int sp, int n) { return N > 0 ? derived_tail_keys(sp, n) : 0; };
  auto tail_ranges = [&](int t, int n, int cc) {
    return t > 0 ? min(derived_count(t, cc, batch), kMaxFusedSplits - n) : 0;
  };
  auto tail_keys = [&](int sp) { return tail_of(sp, derived_count(sp, c, batch)); };
  auto tail_count = [&](int sp, int cc) {
    const int n = derived_count(sp, c, batch);
    return tail_ranges(tail_of(sp, n), n, cc);
  };
  // Rows with tail keys: none (short or one-range rows only) leaves the tail items no work.
  const long long tail_rows = N > 0 ? sum_rows([&](int sp) { return tail_keys(sp) > 0 ? 1LL : 0LL; }) : 0;
  if (tail_item && tail_rows == 0) return d;
  const int ct = tail_rows > 0 ? fit(tail_keys, tail_count, per_head_t, tail_rows) : 1;
  int base = 0, base_t = 0;
  for (int s0 = 0; s0 < B; s0 += 32) {
    const int s = s0 + lane;
    if (s0 > 0) span = s < B ? derived_span(batch, s, window) : 0;
    const int n = s < B ? derived_count(span, c, batch) : 0;
    const int tk = s < B ? tail_of(span, n) : 0;
    const int nt = tail_ranges(tk, n, ct);
    int incl = n, incl_t = nt;
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(kAll, incl, o), vt = __shfl_up_sync(kAll, incl_t, o);
      if (lane >= o) {
        incl += v;
        incl_t += vt;
      }
    }
    const int excl = base + incl - n, excl_t = base_t + incl_t - nt;
    const bool mine = want_seq >= 0 ? s == want_seq
                      : tail_item   ? j >= excl_t && j < excl_t + nt
                                    : j >= excl && j < excl + n;
    const unsigned hit = __ballot_sync(kAll, s < B && mine);
    if (hit != 0) {
      const int src = __ffs(hit) - 1;
      const int first = __shfl_sync(kAll, excl, src), first_t = __shfl_sync(kAll, excl_t, src);
      d.seq = s0 + src;
      d.kv_head = head;
      d.long_count = __shfl_sync(kAll, n, src);
      d.count = d.long_count + __shfl_sync(kAll, nt, src);
      d.tail = d.count > d.long_count ? __shfl_sync(kAll, tk, src) : 0;
      d.first = head * (per_head + per_head_t) + first + first_t;
      d.split = want_seq >= 0 ? 0 : tail_item ? d.long_count + j - first_t : j - first;
      return d;
    }
    base += __shfl_sync(kAll, incl, 31);
    base_t += __shfl_sync(kAll, incl_t, 31);
  }
  return d;
}

// The merge that a decode CTA's partial takes part in when the decode kernel does it
// itself (AttnBatch::split_counters): its counter, first partial slot and slot count;
// counter < 0 when merge_kernel does it (or there is no partial).
struct SplitMerge {
  int counter = -1, first = 0, count = 0;
};

// Work item `item` of a batch: from the list, or for a decode-only batch with device-derived
// splits, (sequence, KV head, key range) from the index and context_lens (derived_item).
// partial == kNoWork: an unused item (the CTA has nothing to do). merge (may be null): the
// split merge the item's partial takes part in (SplitMerge). Called by every thread of a CTA
// (derived splits shuffle within each warp).
constexpr int kNoWork = -2;
__device__ __forceinline__ AttnWork attn_work(const AttnBatch& batch, int num_kv_heads, int window, int item,
                                              SplitMerge* merge = nullptr) {
  if (batch.decode_splits <= 0) {
    const AttnWork w = batch.work[item];
    if (merge != nullptr && batch.split_counters != nullptr && w.partial >= 0 && w.merge >= 0) {
      const int* mg = batch.merge + 4 * w.merge;
      merge->counter = w.merge;
      merge->first = mg[2];
      merge->count = mg[3];
    }
    return w;
  }
  AttnWork w;
  w.q_begin = 0;
  w.q_end = 1;
  w.merge = -1;
  const DerivedItem d = derived_item(batch, window, num_kv_heads, item, -1, 0);
  if (d.seq < 0) {
    w.seq = w.kv_head = 0;
    w.key_begin = w.key_end = 0;
    w.partial = kNoWork;
    return w;
  }
  w.seq = d.seq;
  w.kv_head = d.kv_head;
  const int64_t span = derived_span(batch, w.seq, window);
  const int first = batch.context_lens[w.seq] - static_cast<int>(span);
  // Long ranges over the span's first span - tail keys, tail ranges over the rest (without a
  // tail: count ranges over the whole span).
  const int64_t long_span = span - d.tail;
  if (d.split < d.long_count) {
    w.key_begin = first + static_cast<int>(long_span * d.split / d.long_count);
    w.key_end = first + static_cast<int>(long_span * (d.split + 1) / d.long_count);
  } else {
    const int k = d.split - d.long_count, nt = d.count - d.long_count;
    w.key_begin = first + static_cast<int>(long_span + static_cast<int64_t>(d.tail) * k / nt);
    w.key_end = first + static_cast<int>(long_span + static_cast<int64_t>(d.tail) * (k + 1) / nt);
  }
  w.partial = d.count > 1 ? d.first + d.split : -1;
  if (merge != nullptr && batch.split_counters != nullptr && w.partial >= 0) {
    merge->counter = w.seq * num_kv_heads + w.kv_head;
    merge->first = d.first;
    merge->count = d.count;
  }
  return w;
}

// The first element of block `id` (KVCache: a pool block, or a cold block's L2 slot).
template <typename T>
__device__ __forceinline__ const T* block_start(const KVCache& kv, int id, int64_t block_elems) {
  return is_cold_block(id) ? static_cast<const T*>(kv.cold_data) + cold_slot_of(id) * kv.cold_block_elems
                           : static_cast<const T*>(kv.data) + id * block_elems;
}
// Kernels that name a key row by a 32-bit row index (rows of head_dim elements from the
// pool's start) mark a cold block's rows, counted from the L2 pool's start, with this bit;
// the ATen glue (cuda_glue::paged_attention) checks that both pools have fewer than 2^31 rows.
constexpr uint32_t kColdRow = 0x80000000u;

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, bypassing L1; pred false zero-fills the destination (src is
// not read but must still be a valid address).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool pred) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(pred ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Floats of shared memory that merge_in_cta needs.
constexpr int kFusedMergeFloats = 2 * kDecodeMaxGroup * kMaxFusedSplits + kDecodeMaxGroup;

// merge_in_cta's accumulation over nk staged slots: runs [0, U) of this thread, each the
// next partial's 4 elements at staged + slot * slot_floats + off[j], times the slot's weight
// wt[wrow[j] + slot] where its sum lsum[wrow[j] + slot] is positive and the run is live.
template <int U, int N>
__device__ __forceinline__ void accumulate_runs(float4 (&acc)[N], const int (&off)[N], const int (&wrow)[N],
                                                const bool (&live)[N], const float* staged, const float* wt,
                                                const float* lsum, int slot_floats, int nk) {
  static_assert(U <= N, "runs held");
  const float* sk = staged;
#pragma unroll 4
  for (int k = 0; k < nk; ++k, sk += slot_floats) {
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const float4 v = *reinterpret_cast<const float4*>(sk + off[j]);
      const float f = wt[wrow[j] + k];
      const bool use = live[j] && lsum[wrow[j] + k] > 0.0f;
      acc[j].x = use ? fmaf(v.x, f, acc[j].x) : acc[j].x;
      acc[j].y = use ? fmaf(v.y, f, acc[j].y) : acc[j].y;
      acc[j].z = use ? fmaf(v.z, f, acc[j].z) : acc[j].z;
      acc[j].w = use ? fmaf(v.w, f, acc[j].w) : acc[j].w;
    }
  }
}

// Called by every thread of a decode CTA (uniformly: it has barriers) after the CTA wrote
// its partial of merge `s` (rows [0, rows) of group, at stride D + kPartialPad): counts the
// CTA on the merge's counter and, in the CTA that counts last, merges the merge's partials
// into out_heads (the output row of the sequence's token at its KV head's first query head)
// and sets the counter back to 0. The arithmetic and its order are merge_kernel's (per
// row: max over the partials with a positive sum, weights __expf(m_k - m), the sum and
// each output element accumulated by fmaf in slot order, skipping empty partials, times
// 1 / sum), so the output is bit-identical to the two-kernel path. scratch: kScratchBytes
// of shared memory that the CTA no longer uses (at least the kFusedMergeFloats weights and
// sums and one partial); s.count <= kMaxFusedSplits.
//
// The merging CTA is the kernel's tail: every other CTA has finished. So the partials come
// into shared memory in as few round trips as possible: whole partials, as many as fit
// after the weights, with 16-byte cp.async (L2 only: other SMs wrote them), the first batch
// issued together with the loads of every partial's max and sum.
template <typename T, int D, int kThreads, int kScratchBytes>
__device__ __forceinline__ void merge_in_cta(const AttnBatch& batch, const SplitMerge& s, int group, int rows,
                                             T* out_heads, float* scratch) {
  __shared__ int last;
  __threadfence();  // this thread's partial writes, visible device-wide before the count
  __syncthreads();
  if (threadIdx.x == 0) {
    const int prev = atomicAdd(batch.split_counters + s.counter, 1);
    last = prev == s.count - 1;
    // Every split has counted: nobody else touches the counter in this launch.
    if (last) batch.split_counters[s.counter] = 0;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();  // the other CTAs' partials (fenced before their counts) are read after ours

  constexpr int kW = kThreads / 32, kStride = D + kPartialPad;
  static_assert(kStride % 4 == 0, "partial rows of whole 16-byte pieces");
  constexpr int kHead = (kFusedMergeFloats + 3) / 4 * 4;  // weights and sums; then the partials, 16-byte aligned
  static_assert(kScratchBytes / 4 >= kHead + kDecodeMaxGroup * kStride, "one partial fits the scratch");
  const int count = s.count, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* lsum = scratch;                                    // [kDecodeMaxGroup][kMaxFusedSplits]
  float* wt = scratch + kDecodeMaxGroup * kMaxFusedSplits;  // maxima, then weights
  float* inv = wt + kDecodeMaxGroup * kMaxFusedSplits;      // [kDecodeMaxGroup]
  float* staged = scratch + kHead;                          // [per_batch][group][kStride]
  const int per_batch = (kScratchBytes / 4 - kHead) / (group * kStride);
  const float* base = batch.partials + static_cast<int64_t>(s.first) * group * kStride;
  auto stage = [&](int k0) {
    const int pieces = min(per_batch, count - k0) * group * kStride / 4;
    const float* src = base + static_cast<int64_t>(k0) * group * kStride;
    const uint32_t dst = smem_u32(staged);
    for (int c = threadIdx.x; c < pieces; c += kThreads) cp_async16(dst + 16 * c, src + 4 * c, true);
    cp_async_commit();
  };
  stage(0);
  // Every partial's max and sum (L2 reads, __ldcg); rows start at 16-byte offsets, so
  // (max, sum) loads as a float2. Four per thread in flight before any is stored.
  for (int i0 = threadIdx.x; i0 < rows * count; i0 += 4 * kThreads) {
    float2 ml[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int i = i0 + u * kThreads;
      ml[u] = i < rows * count
                  ? __ldcg(reinterpret_cast<const float2*>(
                        base + (static_cast<int64_t>(i % count) * group + i / count) * kStride + D))
                  : make_float2(0.0f, 0.0f);
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int i = i0 + u * kThreads;
      if (i < rows * count) {
        wt[(i / count) * kMaxFusedSplits + i % count] = ml[u].x;
        lsum[(i / count) * kMaxFusedSplits + i % count] = ml[u].y;
      }
    }
  }
  __syncthreads();
  // A warp per row: the max (order-free), the weights, then the sum in slot order.
  for (int r = warp; r < rows; r += kW) {
    float* wr = wt + r * kMaxFusedSplits;
    const float* lr = lsum + r * kMaxFusedSplits;
    float m = -FLT_MAX;
    for (int k = lane; k < count; k += 32) {
      if (lr[k] > 0.0f) m = fmaxf(m, wr[k]);
    }
    m = warp_max(m);
    for (int k = lane; k < count; k += 32) wr[k] = lr[k] > 0.0f ? __expf(wr[k] - m) : 0.0f;
    __syncwarp();
    if (lane == 0) {
      float l = 0.0f;
      for (int k = 0; k < count; ++k) {
        if (lr[k] > 0.0f) l = fmaf(lr[k], wr[k], l);
      }
      inv[r] = l > 0.0f ? 1.0f / l : 0.0f;
    }
  }
  // Each output element: its partials in slot order, batch after batch from shared memory.
  // A thread holds runs of 4 elements of one row (float4: one shared-memory load a slot, its
  // offset computed once); with 4 warps a CTA, one a scheduler, the loop was issue- and
  // latency-bound (3.8 us at 33 slots with float2 pairs and per-slot address arithmetic,
  // per-CTA stamps, bench/gpu/NOTES.md). Nothing in the loop branches: a run past the rows
  // loads a valid address and is masked like an empty partial, and the run count is a
  // template argument (accumulate_runs), so the slots' loads pipeline across iterations
  // (with a branch per run, each slot's loads waited in series: 2.0 us at 33 slots).
  static_assert(D % 4 == 0 && kStride % 4 == 0, "float4 runs");
  constexpr int kPer = (kDecodeMaxGroup * D / 4 + kThreads - 1) / kThreads;
  const int n = rows * D / 4;  // runs
  float4 acc[kPer];
  int off[kPer], wrow[kPer];
  bool live[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    acc[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const int e = 4 * (threadIdx.x + j * kThreads);
    live[j] = e < 4 * n;
    const int r = live[j] ? e / D : 0;
    off[j] = live[j] ? r * kStride + e % D : 0;
    wrow[j] = r * kMaxFusedSplits;
  }
  const int slot_floats = group * kStride;
  for (int k0 = 0; k0 < count; k0 += per_batch) {
    if (k0 > 0) {
      __syncthreads();  // the previous batch is consumed
      stage(k0);
    }
    cp_async_wait<0>();
    __syncthreads();  // every thread's pieces (and, the first time, the weights above)
    const int nk = min(per_batch, count - k0);
    if (kPer == 1 || n <= kThreads) {
      accumulate_runs<1>(acc, off, wrow, live, staged, wt + k0, lsum + k0, slot_floats, nk);
    } else {
      accumulate_runs<kPer>(acc, off, wrow, live, staged, wt + k0, lsum + k0, slot_floats, nk);
    }
  }
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int e = 4 * (threadIdx.x + j * kThreads);
    if (e < 4 * n) {
      const float iv = inv[e / D];
      out_heads[e] = from_f<T>(acc[j].x * iv);
      out_heads[e + 1] = from_f<T>(acc[j].y * iv);
      out_heads[e + 2] = from_f<T>(acc[j].z * iv);
      out_heads[e + 3] = from_f<T>(acc[j].w * iv);
    }
  }
}

// Calls f.template operator()<T>() with T matching the runtime dtype.
#define K25_DISPATCH_DTYPE(dtype, ...)                      \
  switch (dtype) {                                          \
    case DType::kF32: { using T = float; __VA_ARGS__; break; }          \
    case DType::kF16: { using T = __half; __VA_ARGS__; break; }         \
    case DType::kBF16: { using T = __nv_bfloat16; __VA_ARGS__; break; } \
  }

// Programmatic dependent launch (compute capability 9.0): a kernel launched with
// launch_pdl may start while the kernel before it in the stream is still running, once
// every CTA of that one has called pdl_trigger() (or exited). Until its own pdl_wait()
// returns, which is when the kernels before it have completed and their writes are
// visible, it may only read what no earlier kernel writes (weights) and write nothing.
// So a decode step's chain of small kernels overlaps each launch's ramp (and a GEMV's
// first weight loads) with the previous kernel's tail. Both are no-ops before sm_90 and
// for kernels launched without the attribute.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether the environment variable `name` is set to "0" (the kernels' A/B switches, read
// where they are used).
bool env_is_zero(const char* name);

// The current device's compute capability major (looked up once per device; 0 on error).
int device_compute_major();

// Whether launch_pdl sets the attribute: the current device has compute capability 9.0
// or later and the environment variable K25_PDL is not "0" (read at every launch, so A/B
// runs need no rebuild; CUDA graphs keep what was set when they were captured).
bool pdl_enabled();

// kernel<<<grid, block, smem, stream>>>(args...) with programmatic stream serialization
// when pdl_enabled(), and with cluster_x > 0 as thread-block clusters of cluster_x CTAs
// along x (sm_90). Only for kernels that call pdl_wait() before touching anything an
// earlier kernel writes or reads.
template <typename... Params, typename... Args>
void launch_pdl_clusters(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                         unsigned cluster_x, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (cluster_x > 0) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster_x;
    attr[n].val.clusterDim.y = 1;
    attr[n].val.clusterDim.z = 1;
    ++n;
  }
  if (pdl_enabled()) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  // An error stays in cudaGetLastError() for the glue's check.
  (void)cudaLaunchKernelEx(&cfg, kernel, static_cast<Params>(args)...);
}
template <typename... Params, typename... Args>
void launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                Args&&... args) {
  launch_pdl_clusters(kernel, grid, block, smem, stream, 0u, std::forward<Args>(args)...);
}

}  // namespace k25::cuda
