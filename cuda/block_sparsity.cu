// Dynamic block sparsity on the device (issue #5; docs/sparsity.md "CUDA").
//
// Per layer and decode step, four launches that need no host decision (CUDA graphs):
//   1. score_mma_kernel (4-bit-coded summaries of 16-bit KV; score_kernel for float32), a warp per (sequence,
//      KV head, run of blocks): per block and query head the Quest bound
//      sum_d max(q_d mn_d, q_d mx_d) and the centre estimate q·(mn + mx) / 2, scaled, from
//      the block's summary; the per-(sequence, query head) maxima by atomicMax.
//   2. bin_kernel (CTAs over (sequence, KV head, 256 blocks)): relative to each query
//      head's best and maxed over the group, a block's rank score and estimate; its mass
//      n exp(estimate) in fixed point (2^-40: sums are exact, so order-free); histograms of
//      the others' (neither sink nor recent) masses and counts over the quantised estimate,
//      and of their counts over the quantised score.
//   3. count_kernel (a CTA per sequence, a warp per KV head): a head's need is the mandatory
//      blocks plus the fewest others, best estimate first, whose mass reaches mass_target of
//      the total; whole quanta above the one where the target is crossed, and of that
//      quantum as many blocks as its mean mass says. The sequence keeps the largest need,
//      clamped so the skipped fraction lies in [min_ratio, max_ratio]; each head then takes
//      that many others by quantised score (the threshold quantum and how many of it).
//      Statistics.
//   4. table_kernel (a CTA per (sequence, KV head)): the kept blocks — mandatory, above the
//      threshold quantum, and of it the lowest-numbered — as a block table in position
//      order; a dense sequence gets its table copied. The histograms, sums and maxima back
//      to zero (many threads here; the count kernel's one CTA per sequence is the serial
//      part).
// On sm_90, 2 to 4 are one launch instead (choose_kernel, section "2-4 in one launch"): a CTA per
// (sequence, KV head), a cluster per sequence, histograms in shared memory.
// Quantised (1/32 nat) rather than sorted: the count and the ranking need only prefix sums
// of a histogram, so a head's selection is a few passes over its blocks, spread over CTAs,
// not a sort in one CTA (at batch 1 there are only num_kv_heads of those).
#include <cub/block/block_scan.cuh>

#include <cmath>
#include <type_traits>

#include "common.cuh"
#include "mma.cuh"

namespace k25::cuda {

namespace {

constexpr int kBins = kSparsityBins;
constexpr float kPerNat = static_cast<float>(kSparsityBinsPerNat);
constexpr double kMassUnit = 1099511627776.0;  // 2^40: fixed point of a block's mass

// The quantum of a relative estimate x <= 0 (best = the top bin); NaN and anything below
// the range go to bin 0.
__device__ __forceinline__ int quantum(float x) {
  const float d = -x * kPerNat;
  if (!(d < static_cast<float>(kBins - 1))) return 0;
  return kBins - 1 - max(0, static_cast<int>(d));
}

// Floats as unsigned integers in the same order (atomicMax on floats); 0 sorts below
// every float and is the "at rest" value.
__device__ __forceinline__ uint32_t order_bits(float x) {
  const uint32_t u = __float_as_uint(x + 0.0f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float from_order_bits(uint32_t u) {
  return __uint_as_float((u & 0x80000000u) ? (u & 0x7FFFFFFFu) : ~u);
}

// Row s's SparseSelect::reuse entry (-1 without reuse).
__device__ __forceinline__ int reuse_of(const SparseSelect& a, int s) { return a.reuse != nullptr ? a.reuse[s] : -1; }

// Blocks of sequence s that select (single-token step, more than min_context keys, not
// reusing a kept selection), else 0.
__device__ __forceinline__ int eligible_blocks(const SparseSelect& a, int s) {
  const int q_len = a.query_start[s + 1] - a.query_start[s];
  const int ctx = a.context_lens[s];
  const int r = reuse_of(a, s);
  return q_len == 1 && ctx > a.min_context && !(r >= 0 && (r & 1)) ? (ctx + a.block_size - 1) / a.block_size : 0;
}

// Mandatory blocks of nb: [0, ob) and [oe, nb).
__device__ __forceinline__ void others_range(const SparseSelect& a, int nb, int* ob, int* oe) {
  *ob = min(max(a.sink_blocks, 0), nb);
  *oe = max(*ob, nb - max(a.recent_blocks, 0));
}

// Summary rows, one per (block, layer, KV head) (k25_cuda.h, summary_row_bytes): float32 KV,
// 2D floats; 16-bit KV, 2D 4-bit codes and a float scale: a quarter of the bytes of 16-bit
// minima and maxima, which the selection reads in full every step.
template <typename T>
constexpr bool kCodedSummaries = !std::is_same_v<T, float>;

// Where the summary of (block, KV head) of this layer begins: a pool block's row of `summ`;
// a cold one's row past the pool's (L2 slot s), or of cold_summaries (the step's cold entry j).
// SummaryRows: the rows of one (layer, KV head) by block id, row(b) = base + b x stride, so a
// kernel that walks many blocks of one head pays the layout's products once.
struct SummaryRows {
  const uint8_t* hot;
  const uint8_t* cold;
  int64_t stride;
  __device__ __forceinline__ const uint8_t* operator()(int block) const {
    const bool c = is_cold_block(block);  // (selects, one product: no predicated second path)
    return (c ? cold : hot) + static_cast<int64_t>(c ? cold_slot_of(block) : block) * stride;
  }
};
template <typename T>
__device__ __forceinline__ SummaryRows summary_rows(const SparseSelect& a, const void* summ, int h, int D) {
  const int64_t bytes = summary_row_bytes(dtype_of<T>(), D, a.code_tiles);
  const int64_t stride = static_cast<int64_t>(a.num_layers) * a.num_kv_heads * bytes;
  const int64_t head = (static_cast<int64_t>(a.layer) * a.num_kv_heads + h) * bytes;
  const uint8_t* hot = static_cast<const uint8_t*>(summ) + head;
  const uint8_t* cold = a.cold_summaries != nullptr ? static_cast<const uint8_t*>(a.cold_summaries) + head
                                                    : hot + a.cold_summary_base * stride;
  return {hot, cold, stride};
}
// (One row: the other score kernels' form. Through SummaryRows it cost score_kernel 16
// registers, 63 -> 79, and a quarter of its CTAs an SM.)
template <typename T>
__device__ __forceinline__ const uint8_t* summary_row(const SparseSelect& a, const void* summ, int block, int h, int D) {
  int64_t row = block;
  if (is_cold_block(block)) {
    row = cold_slot_of(block);
    if (a.cold_summaries != nullptr) {
      summ = a.cold_summaries;
    } else {
      row += a.cold_summary_base;
    }
  }
  return static_cast<const uint8_t*>(summ) +
         ((row * a.num_layers + a.layer) * a.num_kv_heads + h) * summary_row_bytes(dtype_of<T>(), D, a.code_tiles);
}

// ---- summaries ----------------------------------------------------------------------

// Key codes of one tile of a block (keys 16u .. 16u + 15, k_at(t) this thread's channel of key
// t of the tile, n of them filled) into `out` (the tile's head_dim words), against the
// channel's coded range [lo, hi] x scale; every thread of the CTA (a thread per channel) calls it.
// codes: shared scratch of 16 x head_dim bytes.
template <typename KeyAt>
__device__ __forceinline__ void write_key_code_tile(KeyAt k_at, int n, int lo, int hi, float scale, int D,
                                                    uint8_t* codes, uint32_t* out) {
  const int d = threadIdx.x;
  const float base = static_cast<float>(lo) * scale;
  const float inv = hi > lo && scale > 0.0f ? 3.0f / (static_cast<float>(hi - lo) * scale) : 0.0f;
  for (int t = 0; t < 16; ++t) {
    float c = 0.0f;
    if (t < n) c = fminf(fmaxf(rintf((k_at(t) - base) * inv), 0.0f), 3.0f);  // NaN keys: 0
    codes[t * D + d] = static_cast<uint8_t>(c);
  }
  __syncthreads();
  // Word d of the tile (k25_cuda.h, summary_row_bytes): lane l = d / (D / 32), w = d % (D / 32).
  const int per = D / 32, l = d / per, w = d % per, g = l / 4, t4 = l % 4;
  const uint8_t* key = codes + (g + 8 * (w % 2)) * D + 64 * (w / 2) + 16 * t4;
  uint32_t word = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int c = (j % 4) + 8 * (j / 4);
    word |= (static_cast<uint32_t>(key[c]) << (2 * j)) | (static_cast<uint32_t>(key[c + 4]) << (16 + 2 * j));
  }
  out[d] = word;
  __syncthreads();  // codes is rewritten by the next tile
}

// A CTA per (sequence, KV head, z), a thread per channel (blockDim.x == head_dim).
template <typename T>
__global__ void summary_kernel(KVCache kv, int layer, uint8_t* __restrict__ summ, const int* query_start,
                               const int* context_lens, const int* block_tables, int max_blocks, int code_tiles) {
  pdl_wait();  // launched with launch_pdl: everything it reads may come from the kernel before
  pdl_trigger();
  const int s = blockIdx.x, h = blockIdx.y;
  const int q_len = query_start[s + 1] - query_start[s];
  const int ctx = context_lens[s];
  if (q_len <= 0 || ctx <= 0) return;  // uniform
  const int bs = kv.block_size, D = kv.head_dim, Hkv = kv.num_kv_heads, d = threadIdx.x;
  const T* cache = static_cast<const T*>(kv.data);
  const int* table = block_tables + static_cast<int64_t>(s) * max_blocks;
  __shared__ float wmax[32];
  __shared__ uint8_t codes[16 * 128];  // write_key_code_tile's (head_dim <= 128 with key codes)
  for (int j = max(0, ctx - q_len) / bs + blockIdx.z; j <= (ctx - 1) / bs; j += gridDim.z) {
    const int64_t block = table[j];
    const int fill = min(bs, ctx - j * bs);
    const T* K = cache + (((block * kv.num_layers + layer) * 2) * Hkv + h) * static_cast<int64_t>(bs) * D;
    uint8_t* out =
        summ + ((block * kv.num_layers + layer) * Hkv + h) * summary_row_bytes(dtype_of<T>(), D, code_tiles);
    float mn = INFINITY, mx = -INFINITY;
    for (int t = 0; t < fill; ++t) {
      const float k = to_f(K[static_cast<int64_t>(t) * D + d]);
      mn = fminf(mn, k);
      mx = fmaxf(mx, k);
    }
    if constexpr (!kCodedSummaries<T>) {
      reinterpret_cast<float*>(out)[d] = mn;
      reinterpret_cast<float*>(out)[D + d] = mx;
    } else {
      // The row's largest magnitude over the CTA's channels.
      float m = fmaxf(fabsf(mn), fabsf(mx));
      for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      if (d % 32 == 0) wmax[d / 32] = m;
      __syncthreads();
      m = wmax[0];
      for (int w = 1; w < D / 32; ++w) m = fmaxf(m, wmax[w]);
      __syncthreads();  // wmax is rewritten by the next block's pass
      // A hair over m / 7, so every code lies within [-7, 7] before the outward step.
      const float scale = m > 0.0f && m < INFINITY ? m * (1.0f / 7.0f) * 1.000001f : 0.0f;
      int lo = 0, hi = 0;
      if (scale > 0.0f) {
        lo = static_cast<int>(floorf(mn / scale));
        hi = static_cast<int>(ceilf(mx / scale));
        if (static_cast<float>(lo) * scale > mn) --lo;  // the division's rounding: one step out
        if (static_cast<float>(hi) * scale < mx) ++hi;
        lo = max(lo, -8);
        hi = min(hi, 7);
      }
      // Channels d and d + 1 (d even) share a byte of minima and one of maxima: the even
      // thread writes both.
      const int lo1 = __shfl_down_sync(0xffffffffu, lo, 1), hi1 = __shfl_down_sync(0xffffffffu, hi, 1);
      if (d % 2 == 0) {
        out[d / 2] = static_cast<uint8_t>((lo & 15) | ((lo1 & 15) << 4));
        out[D / 2 + d / 2] = static_cast<uint8_t>((hi & 15) | ((hi1 & 15) << 4));
      }
      if (d == 0) *reinterpret_cast<float*>(out + D) = scale;
      // Every key of the block coded again: a new key may have widened the range.
      for (int u = 0; u < code_tiles; ++u) {
        const T* Ku = K + static_cast<int64_t>(16 * u) * D;
        write_key_code_tile([&](int t) { return to_f(Ku[static_cast<int64_t>(t) * D + d]); }, fill - 16 * u, lo, hi,
                            scale, D, codes, reinterpret_cast<uint32_t*>(out + D + 16 + 4 * D * u));
      }
    }
  }
}

// ---- 1. scores --------------------------------------------------------------------------

// A warp per (KV head, run of `run` blocks). Lane l holds channels [l C, l C + C) of a
// pass of up to four query heads of the group, as q+ = max(q, 0) and q- = min(q, 0), in
// registers; per block it loads its channels of the summary (the warp reads min and max as
// two contiguous runs; the next two blocks' loads are issued before this one's math) and computes
// the bound u = q+·mx + q-·mn and u + l, l = q+·mn + q-·mx the lower bound (the centre is
// (u + l) / 2): four FMAs per channel and head, no shared memory. Then one reduce-scatter
// of the 8 values over the 32 lanes (9 shuffles), after which lane l holds value l / 4.
// (Earlier forms, under ncu at B1 @ 32K / B8 @ 128K: a half-warp per item with the query
// in shared memory, 20 / ~270 us; a quad of lanes per item, 13 / 264 us, bound by
// shared-memory wavefronts since a warp's quads re-read the same query words. This one:
// 11 / 191 us.)
constexpr int kScoreThreads = 256;  // 8 warps
// Blocks per warp (<= 32: a lane holds each's table entry): 16 when the step has work for
// many waves of warps (B8 @ 128K: 194 us under ncu, 204 with 8), else 8 for more warps in
// flight (B1 @ 32K: 11.5 us, 13.6 with 16).
constexpr int kScoreRunShort = 8, kScoreRunLong = 16;
constexpr int kScorePass = 4;       // query heads per pass: 8 values, the reduce-scatter's 3 halvings
static_assert(kScoreRunLong <= 32 && 2 * kScorePass == 8, "score_kernel's lane mapping");

// The score kernels' work split: a CTA of kScoreThreads / 32 warps works for one row s (the
// sequence), each warp a (KV head, run of `run` blocks from j0); a CTA past its row's blocks
// has none. Fixed runs (run > 0): CTA x of row y. Run 0 (the kernels on tensor cores): the
// launch is one wave of CTAs (`wave`) plus score_spare_ctas(Hkv) a row (score_grid), shared
// out by blocks, on the device, so a launch sized for the table's width (a CUDA graph's) need
// not know the lengths: every row's warps take runs of the same length, the shortest multiple
// of 8 (at least kScoreRunShort) with which the wave's warps cover all rows' blocks, and row s
// gets the ceil(Hkv ceil(nb_s / run) / 8) CTAs that needs, in row order. That many always fit:
// each row's count exceeds Hkv nb_s / (8 run) by under (Hkv + 7) / 8, the spare CTAs. Equal
// rows get an equal share of the wave, as before 2026-12-07; a long row beside short ones gets
// the warps the short rows do not need (before, an equal share of the wave each: the long
// row's runs were as long as at a batch of long rows).
struct ScoreTask {
  int s, nb, h, j0, run;
  bool cta_has_work;
};
__host__ __device__ constexpr int score_spare_ctas(int num_kv_heads) {
  return (num_kv_heads + 2 * (kScoreThreads / 32) - 2) / (kScoreThreads / 32);
}
// Run 0's CTAs for S rows of max_blocks columns on a device that holds `slots` warps at once.
inline int64_t score_grid(int64_t slots, int S, int Hkv, int max_blocks) {
  constexpr int kWarps = kScoreThreads / 32;
  const int64_t runs = (max_blocks + kScoreRunShort - 1) / kScoreRunShort;  // no more warps than runs of 8
  const int64_t wave = std::max<int64_t>(1, std::min<int64_t>(slots, static_cast<int64_t>(S) * Hkv * runs) / kWarps);
  return wave + static_cast<int64_t>(S) * score_spare_ctas(Hkv);
}
// Run 0: this CTA's row (-1: none), its blocks, the run and the CTA's index among its row's.
// Called by whole warps (it shuffles over the rows, 32 at a time); every lane gets the same.
__device__ __forceinline__ void score_share(const SparseSelect& a, int* s_out, int* nb_out, int* run_out,
                                            int* cta_out) {
  constexpr unsigned kAll = 0xffffffffu;
  constexpr int kWarps = kScoreThreads / 32;
  const int S = a.num_seqs, Hkv = a.num_kv_heads, lane = threadIdx.x % 32;
  const int64_t wave = static_cast<int64_t>(gridDim.x) - static_cast<int64_t>(S) * score_spare_ctas(Hkv);
  int nb = lane < S ? eligible_blocks(a, lane) : 0;  // the first 32 rows' stay in registers
  int64_t total = nb;
  for (int s = lane + 32; s < S; s += 32) total += eligible_blocks(a, s);
  for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(kAll, total, o);
  const int64_t per_warp = (total * Hkv + wave * kWarps - 1) / (wave * kWarps);
  const int run = per_warp <= kScoreRunShort ? kScoreRunShort : static_cast<int>((per_warp + 7) / 8 * 8);
  const int cta = blockIdx.x;
  int base = 0;
  *s_out = -1;
  for (int s0 = 0; s0 < S; s0 += 32) {
    const int s = s0 + lane;
    if (s0 > 0) nb = s < S ? eligible_blocks(a, s) : 0;
    const int n = (Hkv * ((nb + run - 1) / run) + kWarps - 1) / kWarps;
    int incl = n;
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(kAll, incl, o);
      if (lane >= o) incl += v;
    }
    const int excl = base + incl - n;
    const unsigned hit = __ballot_sync(kAll, s < S && cta >= excl && cta < excl + n);
    if (hit != 0) {
      const int src = __ffs(hit) - 1;
      *s_out = s0 + src;
      *nb_out = __shfl_sync(kAll, nb, src);
      *cta_out = cta - __shfl_sync(kAll, excl, src);
      *run_out = run;
      return;
    }
    base += __shfl_sync(kAll, incl, 31);
  }
}
__device__ __forceinline__ ScoreTask score_task(const SparseSelect& a, int run) {
  constexpr int kWarps = kScoreThreads / 32;
  ScoreTask w;
  const int Hkv = a.num_kv_heads;
  int cta = blockIdx.x;
  if (run == 0) {
    score_share(a, &w.s, &w.nb, &run, &cta);
    if (w.s < 0) {  // a spare CTA
      w = ScoreTask{0, 0, 0, 0, kScoreRunShort, false};
      return w;
    }
  } else {
    w.s = blockIdx.y;
    w.nb = eligible_blocks(a, w.s);
  }
  w.run = run;
  w.cta_has_work = (cta * kWarps / Hkv) * run < w.nb;
  const int task = cta * kWarps + threadIdx.x / 32;
  w.h = task % Hkv;
  w.j0 = (task / Hkv) * run;
  return w;
}

// A CTA past its sequence's blocks (uniform) still waits, so that the chain's "complete
// before" holds, and returns (for score kernels whose busy CTAs wait later).
__device__ __forceinline__ bool idle_cta(const ScoreTask& w) {
  if (w.cta_has_work) return false;
  pdl_wait();
  pdl_trigger();
  return true;
}

// The CTA's per-(query head, value) maxima (order_bits; 0 at rest) in shared memory: cleared
// first, then folded into the sequence's global maxima by atomicMax once every warp is done.
__device__ __forceinline__ void clear_maxima(uint32_t* smax, int Hq) {
  for (int i = threadIdx.x; i < 2 * Hq; i += blockDim.x) smax[i] = 0;
  __syncthreads();
}
__device__ __forceinline__ void flush_maxima(const uint32_t* smax, const SparseSelect& a, int s, int Hq) {
  __syncthreads();
  for (int i = threadIdx.x; i < 2 * Hq; i += blockDim.x) {
    if (smax[i] != 0) atomicMax(a.maxima + static_cast<int64_t>(s) * 2 * Hq + i, smax[i]);
  }
}

template <int B>
struct Bytes;
template <>
struct Bytes<1> {
  using type = uint8_t;
};
template <>
struct Bytes<2> {
  using type = uint16_t;
};
template <>
struct Bytes<4> {
  using type = uint32_t;
};
template <>
struct Bytes<8> {
  using type = uint2;
};
template <>
struct Bytes<16> {
  using type = uint4;
};

template <typename T, int D>
__global__ void __launch_bounds__(kScoreThreads)
    score_kernel(const T* __restrict__ q, int64_t q_stride, const void* __restrict__ summ, SparseSelect a, int run) {
  pdl_wait();
  pdl_trigger();
  static_assert(D % 32 == 0, "a lane's channels");
  constexpr int C = D / 32;  // channels per lane
  constexpr bool kCoded = kCodedSummaries<T>;
  static_assert(!kCoded || C % 2 == 0, "a lane's 4-bit codes in whole bytes");
  using E = std::conditional_t<kCoded, uint8_t, float>;  // a stored float, or a byte of two codes
  constexpr int kPer = kCoded ? C / 2 : C;                 // of them per lane in each half
  using V = typename Bytes<kPer * sizeof(E)>::type;
  const ScoreTask w = score_task(a, run);
  if (!w.cta_has_work) return;  // uniform
  const int s = w.s, nb = w.nb, h = w.h, j0 = w.j0, lane = threadIdx.x % 32;
  const int Hq = a.num_heads, Hkv = a.num_kv_heads, group = Hq / Hkv, MB = a.max_blocks;
  __shared__ uint32_t smax[2 * kMaxSparseHeads];
  clear_maxima(smax, Hq);
  if (j0 < nb) {  // warp-uniform
    const int j1 = min(nb, j0 + run);
    const int my_block = lane < j1 - j0 ? a.block_tables[static_cast<int64_t>(s) * MB + j0 + lane] : 0;
    const T* qrow = q + static_cast<int64_t>(a.query_start[s]) * q_stride + static_cast<int64_t>(h) * group * D;
    auto row_at = [&](int j) { return summary_row<T>(a, summ, __shfl_sync(0xffffffffu, my_block, j - j0), h, D); };
    const int vi = lane / 4, vg = vi % kScorePass, centre = vi / kScorePass;  // this lane's value
    for (int g0 = 0; g0 < group; g0 += kScorePass) {
      float qp[kScorePass][C], qn[kScorePass][C];
#pragma unroll
      for (int g = 0; g < kScorePass; ++g) {
        // Element by element: q rows need no alignment here (once per pass, not per block).
#pragma unroll
        for (int k = 0; k < C; ++k) {
          const float x = g0 + g < group ? to_f(qrow[(g0 + g) * D + lane * C + k]) : 0.0f;
          qp[g][k] = fmaxf(x, 0.0f);
          qn[g][k] = fminf(x, 0.0f);
        }
      }
      const bool live = g0 + vg < group;
      float* raw = a.raw + (static_cast<int64_t>(s) * Hq + h * group + g0 + vg) * 2 * MB + centre * MB;
      uint32_t run_max = 0;
      // Two blocks' loads in flight ahead of the math: this lane's minima and maxima, and
      // (coded rows) the row's scale.
      V mn[2], mx[2];
      float rs[2] = {1.0f, 1.0f};
      auto load = [&](int i, int j) {
        const uint8_t* row = row_at(j);
        const E* p = reinterpret_cast<const E*>(row) + lane * kPer;
        mn[i] = *reinterpret_cast<const V*>(p);
        mx[i] = *reinterpret_cast<const V*>(p + (kCoded ? D / 2 : D));
        if constexpr (kCoded) rs[i] = *reinterpret_cast<const float*>(row + D);
      };
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        if (j0 + i < j1) load(i, j0 + i);
      }
      for (int j = j0; j < j1; ++j) {
        const V cmn = mn[0], cmx = mx[0];
        const float row_scale = rs[0];
        mn[0] = mn[1];
        mx[0] = mx[1];
        rs[0] = rs[1];
        if (j + 2 < j1) load(1, j + 2);
        float lo[C], hi[C];
#pragma unroll
        for (int k = 0; k < C; ++k) {
          if constexpr (kCoded) {  // code k: byte k / 2's low (k even) or high nibble, signed
            const int sh = 4 * (k % 2);
            lo[k] = static_cast<float>((((reinterpret_cast<const E*>(&cmn)[k / 2] >> sh) & 15) ^ 8) - 8);
            hi[k] = static_cast<float>((((reinterpret_cast<const E*>(&cmx)[k / 2] >> sh) & 15) ^ 8) - 8);
          } else {
            lo[k] = reinterpret_cast<const E*>(&cmn)[k];
            hi[k] = reinterpret_cast<const E*>(&cmx)[k];
          }
        }
        float x[2 * kScorePass];
#pragma unroll
        for (int g = 0; g < kScorePass; ++g) {
          float u = 0.0f, w = 0.0f;
#pragma unroll
          for (int k = 0; k < C; ++k) {
            u = fmaf(qp[g][k], hi[k], fmaf(qn[g][k], lo[k], u));
            w = fmaf(qp[g][k], lo[k], fmaf(qn[g][k], hi[k], w));
          }
          x[g] = u;
          x[kScorePass + g] = u + w;
        }
        // Reduce-scatter: each step a lane keeps the half its lane bit names and adds its
        // partner's copy of that half.
        float y[4], z[2];
        const bool b4 = lane & 16, b3 = lane & 8, b2 = lane & 4;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          y[k] = (b4 ? x[k + 4] : x[k]) + __shfl_xor_sync(0xffffffffu, b4 ? x[k] : x[k + 4], 16);
        }
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          z[k] = (b3 ? y[k + 2] : y[k]) + __shfl_xor_sync(0xffffffffu, b3 ? y[k] : y[k + 2], 8);
        }
        float r = (b2 ? z[1] : z[0]) + __shfl_xor_sync(0xffffffffu, b2 ? z[0] : z[1], 4);
        r += __shfl_xor_sync(0xffffffffu, r, 2);
        r += __shfl_xor_sync(0xffffffffu, r, 1);
        const float val = (centre ? 0.5f * r : r) * (a.scale * row_scale);
        if (live) {
          run_max = max(run_max, order_bits(val));
          if (lane % 4 == 0) raw[j] = val;
        }
      }
      if (lane % 4 == 0 && live) atomicMax(&smax[2 * (h * group + g0 + vg) + centre], run_max);
    }
  }
  flush_maxima(smax, a, s, Hq);
}

// The power of two that puts mabs (a query's largest |q|, finite and > 0; else 1) in
// [2^top, 2^(top + 1)), and its inverse.
__device__ __forceinline__ float pow2_scale(float mabs, int top, float* inv) {
  int e = 0;
  if (mabs > 0.0f && mabs < INFINITY) e = min(126, max(-126, top - ((__float_as_int(mabs) >> 23) - 127)));
  *inv = __int_as_float((127 - e) << 23);
  return __int_as_float((127 + e) << 23);
}

// 4-bit codes at nibbles 0 and 4 of x = w ^ 0x88888888 (each code + 8, unsigned) as a half2,
// nibble 0 first: under an fp16 exponent of 2^10 (1024 + u, exact) by one mask-and-or, less
// 1032 by one half2 subtraction.
__device__ __forceinline__ uint32_t nibble_pair_h(uint32_t x) {
  const uint32_t r = (x & 0x000F000Fu) | 0x64006400u;
  const __half2 v = __hsub2(*reinterpret_cast<const __half2*>(&r), __half2half2(__ushort_as_half(0x6408)));  // 1032
  return *reinterpret_cast<const uint32_t*>(&v);
}

// The same two values on tensor cores, for 4-bit-coded summaries (16-bit KV): a warp per (KV
// head, run of blocks, a multiple of 8), one m16n8k16 fp16 product per 8 blocks and 16 summary
// codes. Rows of A are coefficients: row g the bound's of query head g0 + g (q- against the
// minima, q+ against the maxima, so the row times the codes is u / scale), row 8 + g its lower
// bound's (the other way round: l); columns of B are the 8 blocks' codes as fp16 (nibble_pair_h,
// exact) (k = the 2D codes, minima then maxima). Lane (g, t) holds block g's codes
// 64m + 16t .. 64m + 16t + 15 of each run m of 64 (one 8-byte load; a quad reads 32 contiguous
// bytes), as four k-steps' b0 / b1 in the order the nibbles unpack (codes c, c + 4 and c + 1,
// c + 5); the A fragments take the same k order, which is free since the sum over k does not
// care. The C fragment then gives lane (g, t) u and l of head
// g0 + g at blocks 2t and 2t + 1, times those blocks' scales (from the lanes that loaded them),
// so no shuffles per block beyond two. The query goes in as fp16 whatever T, times the power of
// two that puts the pass's largest |q| in [2^14, 2^15) (undone with the scale): a bf16 value is
// exact there down to 2^-28 of that largest. Products of 16-bit values are exact in fp32; only
// the order of the fp32 sums differs from score_kernel's. A tile's products run while the next
// tile's loads are in flight, in two accumulators (half the dependent chain). The launch is one
// wave of warps (16 an SM) shared out over the rows by their blocks (score_task, run 0), so a
// warp's fixed work (the query's fragments, the first tile's round trip) is spread over many
// tiles: B8 @ 128K 256 blocks a warp, B1 @ 32K 8.
// Same-call A/B on an H100 (2026-12-05, session 28; bench/RESULTS.md), score alone at
// B8 @ 128K / B8 @ 32K: 74.8 / 19.5 us with runs of 32 and the codes converted through fp32
// (I2F and a pack); 62.6 / 15.9 with the long runs; 73.0 / 17.4 with the byte-permute
// conversion; 62.2 / 13.3 with both. Two tiles of loads in flight instead of one: slower (79.7).
// (score_kernel, at ~115 instructions per (block, KV head) and ~0.4 IPC, ran at a third of the
// summaries' bandwidth: 191 us for 269 MB at B8 @ 128K.)
template <typename T, int D>
__global__ void __launch_bounds__(kScoreThreads)
    score_mma_kernel(const T* __restrict__ q, int64_t q_stride, const void* __restrict__ summ, SparseSelect a, int run) {
  // pdl_wait comes after the query's fragments and the first table entries: q and the block
  // tables are not written by the launch before this one (in a decode step that is summary_kernel,
  // which writes summary rows only; q's writer, rope_write_kv, is complete once summary_kernel
  // has passed its own pdl_wait). The summary rows, the raw scores and the maxima wait.
  static_assert(kCodedSummaries<T> && D % 64 == 0, "4-bit-coded rows of 64-channel runs");
  constexpr int kHalf = D / 64;       // 8-byte loads (16 codes) of a lane in each half (minima, maxima) of a row
  constexpr int kLoads = 2 * kHalf;
  const ScoreTask w = score_task(a, run);
  if (idle_cta(w)) return;
  const int s = w.s, nb = w.nb, h = w.h, j0 = w.j0, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int Hq = a.num_heads, Hkv = a.num_kv_heads, group = Hq / Hkv, MB = a.max_blocks;
  __shared__ uint32_t smax[2 * kMaxSparseHeads];
  clear_maxima(smax, Hq);
  bool waited = false;  // warp-uniform
  if (j0 < nb) {  // warp-uniform
    const int j1 = min(nb, j0 + w.run);
    const int* tab = a.block_tables + static_cast<int64_t>(s) * MB;
    const T* qrow = q + static_cast<int64_t>(a.query_start[s]) * q_stride + static_cast<int64_t>(h) * group * D;
    for (int g0 = 0; g0 < group; g0 += 8) {
      const bool live = g0 + g < group;
      uint32_t qf[kLoads][4][4];  // A fragments: load m, its four k-steps
      float inv_qscale;
      {
        float qv[kHalf][16];  // channels 64m + 16t .. 64m + 16t + 15 of head g0 + g (0: no head)
#pragma unroll
        for (int m = 0; m < kHalf; ++m) {
#pragma unroll
          for (int x = 0; x < 2; ++x) {
            uint4 v = make_uint4(0, 0, 0, 0);
            if (live) v = *reinterpret_cast<const uint4*>(qrow + (g0 + g) * D + 64 * m + 16 * t + 8 * x);
            const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
            for (int i = 0; i < 8; ++i) qv[m][8 * x + i] = to_f(e[i]);
          }
        }
        // fp16 products whatever T: the query scaled by a power of two that puts the pass's
        // largest |q| in [2^14, 2^15) (a bf16 q is then exact in fp16 down to 2^-28 of it).
        float mabs = 0.0f;
#pragma unroll
        for (int m = 0; m < kHalf; ++m) {
#pragma unroll
          for (int i = 0; i < 16; ++i) mabs = fmaxf(mabs, fabsf(qv[m][i]));
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) mabs = fmaxf(mabs, __shfl_xor_sync(0xffffffffu, mabs, o));
        const float qscale = pow2_scale(mabs, 14, &inv_qscale);
#pragma unroll
        for (int m = 0; m < kLoads; ++m) {
          const bool maxima = m >= kHalf;
#pragma unroll
          for (int st = 0; st < 4; ++st) {
            // k-step st takes the lane's codes c, c + 4 (b0) and c + 1, c + 5 (b1) of its 16,
            // c = 8 (st / 2) + 2 (st % 2): the order nibble_pair_h gives them in.
            const int c = 8 * (st / 2) + 2 * (st % 2);
            float u[4], l[4];  // coefficients of the lane's codes c, c + 4, c + 1, c + 5
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const float x = qv[m % kHalf][c + (i % 2) * 4 + i / 2] * qscale;
              u[i] = maxima ? fmaxf(x, 0.0f) : fminf(x, 0.0f);
              l[i] = maxima ? fminf(x, 0.0f) : fmaxf(x, 0.0f);
            }
            qf[m][st][0] = pack2<__half>(u[0], u[1]);  // (g, 2t..): pairs with b0
            qf[m][st][1] = pack2<__half>(l[0], l[1]);  // (g + 8, 2t..)
            qf[m][st][2] = pack2<__half>(u[2], u[3]);  // (g, 2t + 8..): pairs with b1
            qf[m][st][3] = pack2<__half>(l[2], l[3]);
          }
        }
      }
      float* raw = a.raw + (static_cast<int64_t>(s) * Hq + h * group + g0 + g) * 2 * MB;
      uint32_t max_u = 0, max_c = 0;
      // The run's table entries 32 at a time, lane l block cb + l of this chunk (tab_cur) and
      // of the next (tab_nxt, loaded a chunk ahead): a tile's summary loads then wait for one
      // round trip, not for a table load and then theirs.
      int cb = j0;
      int tab_cur = j0 + lane < j1 ? tab[j0 + lane] : 0, tab_nxt = j0 + 32 + lane < j1 ? tab[j0 + 32 + lane] : 0;
      if (!waited) {
        pdl_wait();
        pdl_trigger();
        waited = true;
      }
      // This lane's block of the tile at jt: its 8-byte runs of 16 codes and the row's scale
      // (zeros past the run).
      auto load_tile = [&](int jt, uint2(&b)[kLoads], float& sc) {
        const int r = jt - cb + g;  // r < 32 is warp-uniform (jt - cb a multiple of 8, g < 8)
        const int block = __shfl_sync(0xffffffffu, r < 32 ? tab_cur : tab_nxt, r % 32);  // every lane shuffles
        if (jt + g < j1) {
          const uint8_t* row = summary_row<T>(a, summ, block, h, D);
#pragma unroll
          for (int m = 0; m < kLoads; ++m) b[m] = *reinterpret_cast<const uint2*>(row + 32 * m + 8 * t);
          sc = *reinterpret_cast<const float*>(row + D);
        } else {
#pragma unroll
          for (int m = 0; m < kLoads; ++m) b[m] = make_uint2(0x88888888u, 0x88888888u);  // codes 0
          sc = 0.0f;
        }
      };
      uint2 next[kLoads];
      float next_sc;
      load_tile(j0, next, next_sc);
      for (int jt = j0; jt < j1; jt += 8) {
        if (jt - cb == 32) {  // the next chunk's entries now, and the one after's loads
          cb += 32;
          tab_cur = tab_nxt;
          tab_nxt = cb + 32 + lane < j1 ? tab[cb + 32 + lane] : 0;
        }
        uint2 b[kLoads];
#pragma unroll
        for (int m = 0; m < kLoads; ++m) b[m] = next[m];
        const float own_sc = next_sc;
        if (jt + 8 < j1) load_tile(jt + 8, next, next_sc);  // the next tile's loads in flight under this one's products
        // Two accumulators (even and odd k-steps): half the dependent chain of products.
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f}, acc2[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int m = 0; m < kLoads; ++m) {
          const uint32_t wd[2] = {b[m].x ^ 0x88888888u, b[m].y ^ 0x88888888u};  // codes + 8, unsigned
#pragma unroll
          for (int st = 0; st < 4; ++st) {
            const uint32_t x = wd[st / 2] >> (8 * (st % 2));  // codes c, c + 1, .., c + 4, c + 5 at nibbles 0, 1, 4, 5
            mma16816<__half>(st % 2 ? acc2 : acc, qf[m][st], nibble_pair_h(x), nibble_pair_h(x >> 4));
          }
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[i] += acc2[i];
        // The C fragment's blocks 2t and 2t + 1: their scales from the lanes that loaded them.
        float sc[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) sc[i] = __shfl_sync(0xffffffffu, own_sc, 4 * (2 * t + i)) * (a.scale * inv_qscale);
        if (live) {
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const int j = jt + 2 * t + i;
            if (j < j1) {
              const float u = acc[i] * sc[i], c = 0.5f * (acc[i] + acc[2 + i]) * sc[i];
              raw[j] = u;
              raw[MB + j] = c;
              max_u = max(max_u, order_bits(u));
              max_c = max(max_c, order_bits(c));
            }
          }
        }
      }
      max_u = max(max_u, __shfl_xor_sync(0xffffffffu, max_u, 1));
      max_u = max(max_u, __shfl_xor_sync(0xffffffffu, max_u, 2));
      max_c = max(max_c, __shfl_xor_sync(0xffffffffu, max_c, 1));
      max_c = max(max_c, __shfl_xor_sync(0xffffffffu, max_c, 2));
      if (t == 0 && live) {
        atomicMax(&smax[2 * (h * group + g0 + g)], max_u);
        atomicMax(&smax[2 * (h * group + g0 + g) + 1], max_c);
      }
    }
  }
  if (!waited) {
    pdl_wait();
    pdl_trigger();
  }
  flush_maxima(smax, a, s, Hq);
}

// ---- 1b. the key-code estimate (summaries with key codes, 16-bit KV) ----------------------

// Two fp16 values as a half2's bits.
__device__ __forceinline__ uint32_t h2_bits(__half2 v) { return *reinterpret_cast<uint32_t*>(&v); }
__device__ __forceinline__ __half2 bits_h2(uint32_t u) { return *reinterpret_cast<__half2*>(&u); }

// A k-step's two nibble pairs of a bound half (minima or maxima) of the lane's 8-byte run: pair
// 2 nh (b0's channels) and 2 nh + 1 (b1's) of word x, as half2 values 1024 + code + 8 (times 16
// for the second pair), exact.
struct NibblePairs {
  __half2 p0, p1;
};
// (x & m) ^ c and (x & m) | c as one LOP3 each: written out, since ptxas otherwise takes the two
// constants as immediates and spends an instruction on each (a third of codes_score_kernel's).
template <int kLut>
__device__ __forceinline__ uint32_t lop3(uint32_t x, uint32_t m, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, %4;" : "=r"(d) : "r"(x), "r"(m), "r"(c), "n"(kLut));
  return d;
}
__device__ __forceinline__ uint32_t and_xor(uint32_t x, uint32_t m, uint32_t c) { return lop3<0x6A>(x, m, c); }
__device__ __forceinline__ uint32_t and_or(uint32_t x, uint32_t m, uint32_t c) { return lop3<0xEA>(x, m, c); }

__device__ __forceinline__ NibblePairs nibble_pairs(uint2 run, int x, int nh) {
  // The xor with 8 (signed code to code + 8) and the or with 1024's bits in one: the masked
  // nibbles and 0x6400 share no bit.
  const uint32_t w = (x ? run.y : run.x) >> (8 * nh);
  return {bits_h2(and_xor(w, 0x000F000Fu, 0x64086408u)), bits_h2(and_xor(w, 0x00F000F0u, 0x64806480u))};
}

// The B fragment of a k-step's codes product: the lane's coefficients qr times r = hi - lo of
// the k-step's nibble pairs (lo's and hi's), exact small integers times powers of two.
struct RangeB {
  uint32_t b0, b1;
};
__device__ __forceinline__ RangeB range_fragment(const uint32_t (&qr)[2], NibblePairs lo, NibblePairs hi) {
  return {h2_bits(__hmul2(bits_h2(qr[0]), __hsub2(hi.p0, lo.p0))),
          h2_bits(__hmul2(bits_h2(qr[1]), __hsub2(hi.p1, lo.p1)))};
}

// The A fragment of a k-step (x, nh) from a lane's code words of keys g (w0) and g + 8 (w1): the
// codes c 4^(j % 4) at j % 4 = 2 nh (registers 0, 1) and 2 nh + 1 (2, 3), exact in fp16
// (1024 + c 4^(j % 4), less 1024).
__device__ __forceinline__ void code_fragment(uint32_t w0, uint32_t w1, int x, int nh, uint32_t (&af)[4]) {
  const uint32_t v0 = w0 >> (8 * x), v1 = w1 >> (8 * x);
  const uint32_t k0 = 0x00030003u << (4 * nh), k1 = 0x00030003u << (4 * nh + 2);
  const __half2 off = __float2half2_rn(1024.0f);
  af[0] = h2_bits(__hsub2(bits_h2(and_or(v0, k0, 0x64006400u)), off));
  af[1] = h2_bits(__hsub2(bits_h2(and_or(v1, k0, 0x64006400u)), off));
  af[2] = h2_bits(__hsub2(bits_h2(and_or(v0, k1, 0x64006400u)), off));
  af[3] = h2_bits(__hsub2(bits_h2(and_or(v1, k1, 0x64006400u)), off));
}

// The codes product of a block's further code tile u (keys 16u .. 16u + 15, read from its row in
// global memory: blocks of more than 16 keys), B from the lane's runs of the block's ranges.
template <int D>
__device__ __forceinline__ void further_tile_product(const uint8_t* row, int u, int lane,
                                                     const uint32_t (&qr)[D / 16][2], const uint2 (&lo)[D / 64],
                                                     const uint2 (&hi)[D / 64], float (&au)[4]) {
  constexpr int kWords = D / 32;
  using CodeV = typename Bytes<4 * kWords>::type;
  const CodeV cv = *reinterpret_cast<const CodeV*>(row + D + 16 + 4 * D * u + 4 * kWords * lane);
  uint32_t cu[kWords];
#pragma unroll
  for (int i = 0; i < kWords; ++i) cu[i] = reinterpret_cast<const uint32_t*>(&cv)[i];
#pragma unroll
  for (int i = 0; i < 4; ++i) au[i] = 0.0f;
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    const int m = ks / 4, x = (ks / 2) % 2, nh = ks % 2;
    const RangeB br = range_fragment(qr[ks], nibble_pairs(lo[m], x, nh), nibble_pairs(hi[m], x, nh));
    uint32_t af[4];
    code_fragment(cu[2 * m], cu[2 * m + 1], x, nh, af);
    mma16816<__half>(au, af, br.b0, br.b1);
  }
}

// Two keys' scores (log2 units; -inf for a key past the block's fill) folded into a running
// maximum m and sum l of exp2(x - m).
__device__ __forceinline__ void fold_keys(float x0, float x1, float& m, float& l) {
  const float mnew = fmaxf(m, fmaxf(x0, x1));
  if (mnew > -INFINITY) {
    l = l * exp2f(m - mnew) + exp2f(x0 - mnew) + exp2f(x1 - mnew);
    m = mnew;
  }
}

// A block's log-mass per query head: log sum_t exp(scale q.k_t) over its keys, each read back
// from its codes as lo + c (hi - lo) / 3 in the row's coded range (k25_cuda.h). A warp per
// (KV head, run of blocks) as score_mma_kernel's split, and per block and tile of 16 keys one
// m16n8k16 product a k-step of 16 channels with the keys as rows (A: the codes, as the summary
// kernel stored them in fragment order: one 16- or 8-byte load a lane) and up to 8 query heads
// as columns (B: q_d (hi_d - lo_d) of the lane's channels, the block's ranges times the query),
// plus one with A the block's lo_d in every row and B 3 q_d (every row gets the block's base
// 3 q.lo; blocks go in pairs, and one such product serves both: block 0 in rows 0..7, block 1
// in rows 8..15): C is then 3 x the key's q.k in code units. A lane's 8-byte runs of minima and
// maxima hold its channels as nibble pairs (n, n + 4) that one mask turns into half2 values
// (1024 + code + 8, times 16 for the odd pairs: exact), so r = hi - lo needs no offset; A codes
// c at bits 2j (and 16 + 2j) become c 4^(j % 4) exactly in fp16 (1024 + c 4^(j % 4), less 1024),
// the power folded into B (as fp16 subnormals without the subtraction they came out inexact on
// an H100: bench/gpu/variants/README.md). The query goes in times the power of two that puts
// each head's largest |q| in [2^10, 2^11) (B <= 15 x 2^11 and 3 x 2^11: inside fp16). Then per
// head a log-sum-exp over the 16 keys (rows g, g + 8 of the 8 lanes of a column pair), keys past
// the block's fill left out, and the result as both raw values (rank and size: docs/sparsity.md).
// Each warp stages the rows (bounds, scale, first code tile) of the next three pairs in shared
// memory with cp.async, kCodeSlots rows a warp (with one block's loads in flight a warp the
// kernel took 518 us at B8 @ 128K on an H100, staged 441; bench/RESULTS.md).
constexpr int kCodeSlots = 8;

// kPack (groups of up to 4 query heads, as Llama-3's 32 / 8): B's columns 0..3 are the first
// block's heads of a pair and 4..7 the second's, each lane's B built from its column's block, so
// a pair builds one B (not two) and each lane reduces one block's log-sum-exps (not two); the two
// codes products a k-step stay, each valid in its block's four columns. (Unpacked, columns past
// the group are zeros: half of them at groups of 4.) 257 us against 276 at B8 @ 128K on an H100
// (bench/gpu/variants/README.md, codes_pack4).
template <typename T, int D, bool kPack>
__global__ void __launch_bounds__(kScoreThreads, 2)
    codes_score_kernel(const T* __restrict__ q, int64_t q_stride, const void* __restrict__ summ, SparseSelect a,
                       int run) {
  static_assert(kCodedSummaries<T> && D % 64 == 0, "4-bit-coded rows of 64-channel runs");
  constexpr int kSteps = D / 16;         // k-steps of 16 channels
  constexpr int kRuns = D / 64;          // a lane's 8-byte runs of 16 channels in each half of the bounds
  constexpr int kWords = D / 32;         // code words a lane per tile
  constexpr int kSlot = 5 * D + 16;      // a row's bounds, scale, padding and first code tile
  static_assert(kSlot % 16 == 0, "16-byte copies");
  using CodeV = typename Bytes<4 * kWords>::type;
  __shared__ __align__(16) uint8_t stage[kScoreThreads / 32][kCodeSlots][kSlot];
  const ScoreTask w = score_task(a, run);
  if (idle_cta(w)) return;
  const int s = w.s, nb = w.nb, h = w.h, j0 = w.j0, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int Hq = a.num_heads, Hkv = a.num_kv_heads, group = Hq / Hkv, MB = a.max_blocks, bs = a.block_size;
  const int tiles = a.code_tiles;
  uint8_t* const my = &stage[threadIdx.x / 32][0][0];
  const uint32_t my_u32 = smem_u32(my);
  __shared__ uint32_t smax[2 * kMaxSparseHeads];
  clear_maxima(smax, Hq);
  bool waited = false;  // warp-uniform
  if (j0 < nb) {  // warp-uniform
    const int j1 = min(nb, j0 + w.run);
    const int last_n = a.context_lens[s] - (nb - 1) * bs;  // keys of the sequence's last block
    const int* tab = a.block_tables + static_cast<int64_t>(s) * MB;
    const SummaryRows rows = summary_rows<T>(a, summ, h, D);
    const T* qrow = q + static_cast<int64_t>(a.query_start[s]) * q_stride + static_cast<int64_t>(h) * group * D;
    for (int g0 = 0; g0 < group; g0 += 8) {
      // B coefficients of column g (query head g0 + g; zero past the group), per k-step
      // ks = 4m + 2x + nh: b0 the pair (c, c + 4), b1 (c + 1, c + 5), c = 64m + 16t + 8x + 2nh.
      uint32_t qr[kSteps][2], ql[kSteps][2];
      float inv_qs;  // of column g's head
      {
        const int hc = kPack ? g & 3 : g;  // column g's head in the pass
        const bool live = g0 + hc < group;
        float qv[kSteps][4];
        float mabs = 0.0f;
#pragma unroll
        for (int ks = 0; ks < kSteps; ++ks) {
          const int c = 64 * (ks / 4) + 16 * t + 8 * ((ks / 2) % 2) + 2 * (ks % 2);
          const int ch[4] = {c, c + 4, c + 1, c + 5};
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            qv[ks][i] = live ? to_f(qrow[(g0 + hc) * D + ch[i]]) : 0.0f;
            mabs = fmaxf(mabs, fabsf(qv[ks][i]));
          }
        }
        mabs = fmaxf(mabs, __shfl_xor_sync(0xffffffffu, mabs, 1));
        mabs = fmaxf(mabs, __shfl_xor_sync(0xffffffffu, mabs, 2));
        const float qs = pow2_scale(mabs, 10, &inv_qs);
#pragma unroll
        for (int ks = 0; ks < kSteps; ++ks) {
          // A's powers: 4^(2 nh) for b0's columns, 4^(2 nh + 1) for b1's; b1's pair also comes
          // times 16 (odd nibbles), as does its lo.
          const float f0 = qs / static_cast<float>(1 << (4 * (ks % 2)));
          const float f1 = qs / static_cast<float>(16 << (4 * (ks % 2) + 2));
          qr[ks][0] = pack2<__half>(qv[ks][0] * f0, qv[ks][1] * f0);
          qr[ks][1] = pack2<__half>(qv[ks][2] * f1, qv[ks][3] * f1);
          ql[ks][0] = pack2<__half>(3.0f * qs * qv[ks][0], 3.0f * qs * qv[ks][1]);
          ql[ks][1] = pack2<__half>(3.0f * qs / 16.0f * qv[ks][2], 3.0f * qs / 16.0f * qv[ks][3]);
        }
      }
      // This lane's C columns are heads g0 + 2t + i: their 1 / qs from the lanes that hold them.
      float col_inv[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) col_inv[i] = __shfl_sync(0xffffffffu, inv_qs, 4 * (2 * t + i));
      if (!waited) {
        pdl_wait();
        pdl_trigger();
        waited = true;
      }
      // The run's rows 32 at a time (lane l: the row of entry cb + l, and table entry cb + 32 + l a
      // chunk ahead; past the run, block 0's row, never copied); issue(jj), called for jj = j0,
      // j0 + 1, ... in order, copies block jj's row (its first code tile) into slot
      // (jj - j0) % kCodeSlots: two shuffles of its address, the layout's products paid a chunk
      // at a time.
      int cb = j0;
      const uint8_t* row_lo = rows(j0 + lane < j1 ? tab[j0 + lane] : 0);
      int tab_hi = j0 + 32 + lane < j1 ? tab[j0 + 32 + lane] : 0;
      auto issue = [&](int jj) {
        if (jj - cb == 32) {
          cb += 32;
          row_lo = rows(tab_hi);
          tab_hi = cb + 32 + lane < j1 ? tab[cb + 32 + lane] : 0;
        }
        const uint8_t* row = reinterpret_cast<const uint8_t*>(__shfl_sync(
                                 0xffffffffu, reinterpret_cast<unsigned long long>(row_lo), jj - cb)) +
                             16 * lane;
        const uint32_t dst = my_u32 + (static_cast<unsigned>(jj - j0) % kCodeSlots) * kSlot + 16 * lane;
#pragma unroll
        for (int c = 0; c < kSlot / 16; c += 32) {
          if (c + lane < kSlot / 16) cp_async16(dst + 16 * c, row + 16 * c, true);
        }
      };
      __syncwarp();  // (a second pass of heads: the first's last pair has been read)
      for (int p = 0; p < kCodeSlots / 2 - 1; ++p) {
        if (j0 + 2 * p < j1) issue(j0 + 2 * p);
        if (j0 + 2 * p + 1 < j1) issue(j0 + 2 * p + 1);
        cp_async_commit();
      }
      // After the pair's reductions lane bits 4 and 3 hold block bb and column ii (below): the
      // lane's two raw values of (head g0 + 2t + ii, block j + bb), stored by lanes with bit 2 clear.
      // Packed: t holds block t / 2 (its C columns), lane bit 4 column ii, head 2 (t % 2) + ii,
      // stored by lanes with bits 2 and 3 clear.
      const int bb = kPack ? t >> 1 : (lane >> 4) & 1, ii = kPack ? (lane >> 4) & 1 : (lane >> 3) & 1;
      const int hd = kPack ? 2 * (t & 1) + ii : 2 * t + ii;
      const bool stores = !(lane & (kPack ? 12 : 4)) && g0 + hd < group;
      const int bsel = kPack ? g >> 2 : 0;  // (packed) the block of the lane's B column
      float* const out = a.raw + (static_cast<int64_t>(s) * Hq + h * group + g0 + hd) * 2 * MB + bb;
      uint32_t run_max = 0;  // of the column this lane stores (below)
      for (int j = j0; j < j1; j += 2) {
        const int ja = j + kCodeSlots - 2;  // into the slots of the pair before, which every lane has read
        __syncwarp();
        if (ja < j1) issue(ja);
        if (ja + 1 < j1) issue(ja + 1);
        cp_async_commit();
        cp_async_wait<kCodeSlots / 2 - 1>();
        __syncwarp();  // the pair's rows, copied by every lane of the warp
        const bool two = j + 1 < j1;  // warp-uniform
        const uint8_t* sp[2] = {my + (static_cast<unsigned>(j - j0) % kCodeSlots) * kSlot,
                                my + (static_cast<unsigned>(j + 1 - j0) % kCodeSlots) * kSlot};
        uint2 lo[2][kRuns], hi[kPack ? 1 : 2][kRuns];
        uint32_t cw[2][kWords];
        float rs[2];
#pragma unroll
        for (int b = 0; b < 2; ++b) {
          // (Read unconditionally: for a lone last block the second slot may never have been filled,
          // and its values go unused; a guard here costs the kernel registers and a spill.)
#pragma unroll
          for (int m = 0; m < kRuns; ++m) {
            lo[b][m] = *reinterpret_cast<const uint2*>(sp[b] + 32 * m + 8 * t);
            if constexpr (!kPack) hi[b][m] = *reinterpret_cast<const uint2*>(sp[b] + D / 2 + 32 * m + 8 * t);
          }
          const CodeV cv = *reinterpret_cast<const CodeV*>(sp[b] + D + 16 + 4 * kWords * lane);
#pragma unroll
          for (int i = 0; i < kWords; ++i) cw[b][i] = reinterpret_cast<const uint32_t*>(&cv)[i];
          rs[b] = *reinterpret_cast<const float*>(sp[b] + D);
        }
        if constexpr (kPack) {
#pragma unroll
          for (int m = 0; m < kRuns; ++m) {
            hi[0][m] = *reinterpret_cast<const uint2*>((bsel ? sp[1] : sp[0]) + D / 2 + 32 * m + 8 * t);
          }
          // Per k-step: B from the ranges of the lane's column's block (lo selected from both
          // blocks' nibble pairs, which the base's A takes too), one codes product per block with
          // that same B, and the base product as unpacked.
          float acc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}}, base[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
          for (int ks = 0; ks < kSteps; ++ks) {
            const int m = ks / 4, x = (ks / 2) % 2, nh = ks % 2;
            const NibblePairs L0 = nibble_pairs(lo[0][m], x, nh), L1 = nibble_pairs(lo[1][m], x, nh);
            const RangeB br = range_fragment(qr[ks], bsel ? L1 : L0, nibble_pairs(hi[0][m], x, nh));
#pragma unroll
            for (int b = 0; b < 2; ++b) {
              uint32_t af[4];
              code_fragment(cw[b][2 * m], cw[b][2 * m + 1], x, nh, af);
              mma16816<__half>(acc[b], af, br.b0, br.b1);
            }
            const __half2 o0 = __float2half2_rn(1032.0f), o1 = __float2half2_rn(1152.0f);
            const uint32_t al[4] = {h2_bits(__hsub2(L0.p0, o0)), h2_bits(__hsub2(L1.p0, o0)),
                                    h2_bits(__hsub2(L0.p1, o1)), h2_bits(__hsub2(L1.p1, o1))};
            mma16816<__half>(base, al, ql[ks][0], ql[ks][1]);
          }
          // The lane's C columns (heads 2 (t % 2) + i of block bb): its two keys (rows g, g + 8) as
          // a running max and sum, then tiles past the first (every lane takes part in both
          // blocks' products; the lanes of the block fold them in).
          const bool have = bb == 0 || two;  // (warp-divergent)
          const int n = !have ? 0 : j + bb == nb - 1 ? last_n : bs;
          const float to_log2 = (bb ? rs[1] : rs[0]) * a.scale * 1.4426950408889634f / 3.0f;
          float bown[2], m2[2], mrun[2], lrun[2];  // bown: the base of the lane's block, per column
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            m2[i] = to_log2 * col_inv[i];
            bown[i] = bb ? base[2 + i] : base[i];
            const float x0 = g < n ? ((bb ? acc[1][i] : acc[0][i]) + bown[i]) * m2[i] : -INFINITY;
            const float x1 = g + 8 < n ? ((bb ? acc[1][2 + i] : acc[0][2 + i]) + bown[i]) * m2[i] : -INFINITY;
            mrun[i] = fmaxf(x0, x1);  // -inf (and lrun NaN, never read) only for a missing block
            lrun[i] = exp2f(x0 - mrun[i]) + exp2f(x1 - mrun[i]);
          }
          for (int b = 0; b < 2 && (b == 0 || two); ++b) {
            const int jb = j + b, nk = jb == nb - 1 ? last_n : bs;
            for (int u = 1; u < tiles && 16 * u < nk; ++u) {
              uint2 lob[kRuns];  // the ranges of the lane's B column's block
#pragma unroll
              for (int m = 0; m < kRuns; ++m) lob[m] = bsel ? lo[1][m] : lo[0][m];
              float au[4];
              further_tile_product<D>(rows(tab[jb]), u, lane, qr, lob, hi[0], au);
              if (b == bb) {
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                  fold_keys(16 * u + g < n ? (au[i] + bown[i]) * m2[i] : -INFINITY,
                            16 * u + g + 8 < n ? (au[2 + i] + bown[i]) * m2[i] : -INFINITY, mrun[i], lrun[i]);
                }
              }
            }
          }
          // The log-sum-exps of the lane's two columns over its 8 lanes (g): the maxima as one fp16
          // pair (3 shuffles), the sums transposed (lane bit 4 keeps column ii: 3 shuffles).
          __half2 hm = __floats2half2_rn(fminf(fmaxf(mrun[0], -60000.0f), 60000.0f),
                                         fminf(fmaxf(mrun[1], -60000.0f), 60000.0f));
#pragma unroll
          for (int o = 4; o < 32; o <<= 1) hm = __hmax2(hm, bits_h2(__shfl_xor_sync(0xffffffffu, h2_bits(hm), o)));
          const float mx[2] = {__low2float(hm), __high2float(hm)};
          float ls[2];
#pragma unroll
          for (int i = 0; i < 2; ++i) ls[i] = mrun[i] > -INFINITY ? lrun[i] * exp2f(mrun[i] - mx[i]) : 0.0f;
          float l = ii ? ls[1] : ls[0];
          l += __shfl_xor_sync(0xffffffffu, ii ? ls[0] : ls[1], 16);
          l += __shfl_xor_sync(0xffffffffu, l, 8);
          l += __shfl_xor_sync(0xffffffffu, l, 4);
          const float e = ((ii ? mx[1] : mx[0]) + log2f(l)) * 0.6931471805599453f;  // nats
          if (stores && have) {
            out[j] = e;
            out[MB + j] = e;
            run_max = max(run_max, order_bits(e));
          }
        } else {
          // Per k-step: the two blocks' codes products and one product of both blocks' base (A:
          // block 0's lo in rows 0..7, block 1's in rows 8..15). A lone last block's partner is
          // computed too, from whatever its slot holds (every value passes a mask: finite), and
          // left out below: a branch here put a warp sync before every product.
          float acc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}}, base[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
          for (int ks = 0; ks < kSteps; ++ks) {
            const int m = ks / 4, x = (ks / 2) % 2, nh = ks % 2;
            uint32_t l0[2], l1[2];
#pragma unroll
            for (int b = 0; b < 2; ++b) {
              // B from the block's ranges: r = hi - lo of the k-step's nibble pairs, times the
              // coefficients; lo (less 1024 + 8, 1024 + 128) for the base.
              const NibblePairs L = nibble_pairs(lo[b][m], x, nh);
              const RangeB br = range_fragment(qr[ks], L, nibble_pairs(hi[b][m], x, nh));
              l0[b] = h2_bits(__hsub2(L.p0, __float2half2_rn(1032.0f)));
              l1[b] = h2_bits(__hsub2(L.p1, __float2half2_rn(1152.0f)));
              // A: the codes of keys g (word 2m) and g + 8 (word 2m + 1).
              uint32_t af[4];
              code_fragment(cw[b][2 * m], cw[b][2 * m + 1], x, nh, af);
              mma16816<__half>(acc[b], af, br.b0, br.b1);
            }
            const uint32_t al[4] = {l0[0], l0[1], l1[0], l1[1]};
            mma16816<__half>(base, al, ql[ks][0], ql[ks][1]);
          }
          // Per block and head (columns 2t + i): the lane's two keys (rows g, g + 8) as a running max
          // and sum (tiles past the first, blocks over 16 keys, from global memory, folded in online).
          float mrun[2][2], lrun[2][2];
#pragma unroll
          for (int b = 0; b < 2; ++b) {
            if (b == 1 && !two) {
              mrun[1][0] = mrun[1][1] = -INFINITY;
              lrun[1][0] = lrun[1][1] = 0.0f;
              break;
            }
            const int jb = j + b;
            const int n = jb == nb - 1 ? last_n : bs;
            const float to_log2 = rs[b] * a.scale * 1.4426950408889634f / 3.0f;
            float m2[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
              m2[i] = to_log2 * col_inv[i];
              const float x0 = g < n ? (acc[b][i] + base[2 * b + i]) * m2[i] : -INFINITY;
              const float x1 = g + 8 < n ? (acc[b][2 + i] + base[2 * b + i]) * m2[i] : -INFINITY;
              mrun[b][i] = fmaxf(x0, x1);  // key 0 is always there: finite unless the scores are not
              lrun[b][i] = exp2f(x0 - mrun[b][i]) + exp2f(x1 - mrun[b][i]);
            }
            for (int u = 1; u < tiles && 16 * u < n; ++u) {
              float au[4];
              further_tile_product<D>(rows(tab[jb]), u, lane, qr, lo[b], hi[b], au);
#pragma unroll
              for (int i = 0; i < 2; ++i) {
                fold_keys(16 * u + g < n ? (au[i] + base[2 * b + i]) * m2[i] : -INFINITY,
                          16 * u + g + 8 < n ? (au[2 + i] + base[2 * b + i]) * m2[i] : -INFINITY, mrun[b][i],
                          lrun[b][i]);
              }
            }
          }
          // The log-sum-exp of each of the pair's four columns over its 8 lanes (g). The shift needs
          // only be near the maximum (the result is the same for any shift that keeps the sums in
          // range), so the four maxima go as two fp16 pairs (clamped into fp16's range): 6 shuffles
          // for the four. The sums are reduced transposed: each level keeps half of the values and
          // sends the other half, so that lane bits 4 and 3 end with block b and column i (4
          // shuffles for the four), and each lane has one log to take and one column to store.
          __half2 hm[2];
#pragma unroll
          for (int b = 0; b < 2; ++b) {
            hm[b] = __floats2half2_rn(fminf(fmaxf(mrun[b][0], -60000.0f), 60000.0f),
                                      fminf(fmaxf(mrun[b][1], -60000.0f), 60000.0f));
          }
#pragma unroll
          for (int o = 4; o < 32; o <<= 1) {
#pragma unroll
            for (int b = 0; b < 2; ++b) {
              hm[b] = __hmax2(hm[b], bits_h2(__shfl_xor_sync(0xffffffffu, h2_bits(hm[b]), o)));
            }
          }
          float ls[2][2], mx[2][2];
#pragma unroll
          for (int b = 0; b < 2; ++b) {
            mx[b][0] = __low2float(hm[b]);
            mx[b][1] = __high2float(hm[b]);
            // (A lane with no key of the block, g >= n, has mrun -inf and lrun NaN: its term is 0.)
            ls[b][0] = mrun[b][0] > -INFINITY ? lrun[b][0] * exp2f(mrun[b][0] - mx[b][0]) : 0.0f;
            ls[b][1] = mrun[b][1] > -INFINITY ? lrun[b][1] * exp2f(mrun[b][1] - mx[b][1]) : 0.0f;
          }
          float k0 = bb ? ls[1][0] : ls[0][0], k1 = bb ? ls[1][1] : ls[0][1];
          const float s0 = bb ? ls[0][0] : ls[1][0], s1 = bb ? ls[0][1] : ls[1][1];
          k0 += __shfl_xor_sync(0xffffffffu, s0, 16);
          k1 += __shfl_xor_sync(0xffffffffu, s1, 16);
          float l = ii ? k1 : k0;
          l += __shfl_xor_sync(0xffffffffu, ii ? k0 : k1, 8);
          l += __shfl_xor_sync(0xffffffffu, l, 4);
          const float mb0 = bb ? mx[1][0] : mx[0][0], mb1 = bb ? mx[1][1] : mx[0][1];
          const float e = ((ii ? mb1 : mb0) + log2f(l)) * 0.6931471805599453f;  // nats
          if (stores && (bb == 0 || two)) {
            out[j] = e;
            out[MB + j] = e;
            run_max = max(run_max, order_bits(e));
          }
        }
      }
      cp_async_wait<0>();  // (empty groups only: the loop waited for every copy it used)
      // Column ii's maximum over both blocks of the pairs (lanes 16 apart), from the lanes that stored.
      // (Packed: a head's lanes of the two blocks are 2 apart; those with t < 2 hold head 2t + ii.)
      run_max = max(run_max, __shfl_xor_sync(0xffffffffu, run_max, kPack ? 2 : 16));
      if ((lane & (kPack ? 14 : 20)) == 0) {
        const int hq = h * group + g0 + 2 * t + ii;
        if (g0 + 2 * t + ii < group) {
          atomicMax(&smax[2 * hq], run_max);
          atomicMax(&smax[2 * hq + 1], run_max);
        }
      }
    }
  }
  if (!waited) {
    pdl_wait();
    pdl_trigger();
  }
  flush_maxima(smax, a, s, Hq);
}

// ---- 2. scores relative to the best, masses, histograms ---------------------------------

constexpr int kBinThreads = 256;

// Block j's mass n exp(es) (n keys, es its estimate relative to the best, maxed over the
// group) in fixed point, 0 for NaN keys; its m log m (the entropy statistic) added to mlogm.
__device__ __forceinline__ unsigned long long block_mass(int n, double log_n, float es, double& mlogm) {
  float m = static_cast<float>(n) * expf(es);
  if (!(m >= 0.0f && m <= static_cast<float>(n))) m = 0.0f;  // NaN keys
  if (m > 0.0f) mlogm += static_cast<double>(m) * (static_cast<double>(es) + log_n);
  return __double2ull_rn(static_cast<double>(m) * kMassUnit);
}

// Block j's keys of a sequence of nb blocks of bs, ctx keys, and their log (log_bs given:
// only the last block's is computed).
struct BlockKeys {
  int n;
  double log_n;
};
__device__ __forceinline__ BlockKeys block_keys(int j, int nb, int ctx, int bs, double log_bs) {
  if (j != nb - 1) return {bs, log_bs};
  const int n = ctx - (nb - 1) * bs;
  return {n, log(static_cast<double>(n))};
}

// The CTA's sums of three per-thread values, in thread 0.
template <int kThreads>
__device__ __forceinline__ void cta_sums(unsigned long long& total, unsigned long long& covered, double& mlogm) {
  for (int o = 16; o > 0; o >>= 1) {
    total += __shfl_xor_sync(0xffffffffu, total, o);
    covered += __shfl_xor_sync(0xffffffffu, covered, o);
    mlogm += __shfl_xor_sync(0xffffffffu, mlogm, o);
  }
  __shared__ unsigned long long st[kThreads / 32][2];
  __shared__ double sm[kThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    st[warp][0] = total;
    st[warp][1] = covered;
    sm[warp] = mlogm;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) {
      total += st[w][0];
      covered += st[w][1];
      mlogm += sm[w];
    }
  }
}

__global__ void __launch_bounds__(kBinThreads) bin_kernel(SparseSelect a) {
  pdl_wait();
  pdl_trigger();
  const int s = blockIdx.z, h = blockIdx.y;
  const int nb = eligible_blocks(a, s);
  const int j = blockIdx.x * kBinThreads + threadIdx.x;
  if (blockIdx.x * kBinThreads >= nb) return;
  const int Hq = a.num_heads, Hkv = a.num_kv_heads, group = Hq / Hkv, MB = a.max_blocks;
  const int64_t sh = static_cast<int64_t>(s) * Hkv + h;
  unsigned long long total = 0, covered = 0;
  double mlogm = 0.0;
  if (j < nb) {
    float sc = -INFINITY, es = -INFINITY;
    for (int g = 0; g < group; ++g) {
      const int hq = h * group + g;
      const float* raw = a.raw + (static_cast<int64_t>(s) * Hq + hq) * 2 * MB;
      const uint32_t* mx = a.maxima + (static_cast<int64_t>(s) * Hq + hq) * 2;
      sc = fmaxf(sc, raw[j] - from_order_bits(mx[0]));
      es = fmaxf(es, raw[MB + j] - from_order_bits(mx[1]));
    }
    a.score[sh * MB + j] = sc;
    const BlockKeys k = a.code_tiles > 0 ? BlockKeys{1, 0.0}  // the estimate is the block's log-mass
                                         : block_keys(j, nb, a.context_lens[s], a.block_size,
                                                      log(static_cast<double>(a.block_size)));
    const unsigned long long fixed = block_mass(k.n, k.log_n, es, mlogm);
    total = fixed;
    int ob, oe;
    others_range(a, nb, &ob, &oe);
    if (j < ob || j >= oe) {
      covered = fixed;
    } else {
      const int64_t hb = sh * kBins;
      const int be = quantum(es);
      atomicAdd(a.mass_hist + hb + be, fixed);
      atomicAdd(a.est_hist + hb + be, 1);
      atomicAdd(a.score_hist + hb + quantum(sc), 1);
    }
  }
  // The CTA's sums, then one atomic each.
  cta_sums<kBinThreads>(total, covered, mlogm);
  if (threadIdx.x == 0) {
    atomicAdd(a.head_mass + 2 * sh, total);
    atomicAdd(a.head_mass + 2 * sh + 1, covered);
    atomicAdd(a.head_mlogm + sh, mlogm);
  }
}

// ---- 3. counts ---------------------------------------------------------------------------

// Over a warp's histograms (lane l holds bins [kBins - 32 (l + 1), kBins - 32 l), the
// best bins in lane 0): the first bin, from the top, at which the running sum of `val`
// (starting at `have`) reaches `want`, the sums of value and count of the bins above it,
// and its own. Integer sums, so the lanes' prefix and the walk agree exactly. bin -1: the
// total stays below `want`.
struct Crossing {
  int bin = -1;
  unsigned long long above = 0, val = 0;
  int count_above = 0, count = 0;
};

// The second level of a crossing: lane `src` holds the crossing bin. Each lane reloads one
// of src's bins (just read: cached) and one scan over the lanes finds it, instead of src
// walking its 32 bins alone. base: the running value above src's bins (val may be the
// counts themselves); the crossing's `above` comes back relative to base.
template <typename V>
__device__ __forceinline__ Crossing second_level(const V* val, const int* cnt, int src, V base, int cbase, V want) {
  const int lane = threadIdx.x % 32;
  const int bin = kBins - 1 - 32 * src - lane;
  const V vb = val[bin];
  const int cb = cnt[bin];
  V iv = vb;
  int ic = cb;
  for (int o = 1; o < 32; o <<= 1) {
    const V x = __shfl_up_sync(0xffffffffu, iv, o);
    const int y = __shfl_up_sync(0xffffffffu, ic, o);
    if (lane >= o) {
      iv += x;
      ic += y;
    }
  }
  const int f = __ffs(__ballot_sync(0xffffffffu, base + iv >= want)) - 1;  // found: src's total reaches want
  Crossing r;
  r.bin = kBins - 1 - 32 * src - f;
  r.above = static_cast<unsigned long long>(__shfl_sync(0xffffffffu, iv - vb, f));
  r.val = static_cast<unsigned long long>(__shfl_sync(0xffffffffu, vb, f));
  r.count_above = cbase + __shfl_sync(0xffffffffu, ic - cb, f);
  r.count = __shfl_sync(0xffffffffu, cb, f);
  return r;
}

// Sums of a lane's 32 bins [kBins - 32 (l + 1), kBins - 32 l) from 16-byte loads, in four
// independent chains (the walk to the crossing bin is second_level's).
__device__ __forceinline__ int lane_count_sum(const int* cnt) {
  const uint4* p = reinterpret_cast<const uint4*>(cnt + kBins - 32 * (threadIdx.x % 32 + 1));
  int t[4] = {0, 0, 0, 0};
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const uint4 x = p[k];
    t[k % 4] += static_cast<int>(x.x + x.y + x.z + x.w);
  }
  return (t[0] + t[1]) + (t[2] + t[3]);
}
__device__ __forceinline__ unsigned long long lane_mass_sum(const unsigned long long* val) {
  const uint4* p = reinterpret_cast<const uint4*>(val + kBins - 32 * (threadIdx.x % 32 + 1));
  unsigned long long t[4] = {0, 0, 0, 0};
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    const uint4 x = p[k];
    t[k % 4] += (x.x | (static_cast<unsigned long long>(x.y) << 32)) + (x.z | (static_cast<unsigned long long>(x.w) << 32));
  }
  return (t[0] + t[1]) + (t[2] + t[3]);
}

// A count histogram's lane sums and their exclusive prefix over the lanes: split from
// count_crossing so that the loads can be issued before a barrier and the rest after it.
struct CountBins {
  int above = 0, total = 0;
};
__device__ __forceinline__ CountBins load_count_bins(const int* cnt) {
  const int lane = threadIdx.x % 32;
  CountBins b;
  b.total = lane_count_sum(cnt);
  int pc = b.total;
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, pc, o);
    if (lane >= o) pc += y;
  }
  b.above = pc - b.total;
  return b;
}

// The crossing of a count histogram `cnt` (loaded as b) at `want` blocks.
__device__ __forceinline__ Crossing count_crossing(const int* cnt, const CountBins& b, int want) {
  const unsigned hit = __ballot_sync(0xffffffffu, b.above + b.total >= want);
  if (hit == 0) return Crossing{};
  const int src = __ffs(hit) - 1;
  const int base = __shfl_sync(0xffffffffu, b.above, src);
  return second_level<int>(cnt, cnt, src, base, base, want);
}

// The crossing of the mass histogram `val` (fixed point) with its counts `cnt`, from the
// lane sums lv = lane_mass_sum(val), lc = lane_count_sum(cnt).
__device__ __forceinline__ Crossing find_crossing(const unsigned long long* val, const int* cnt, unsigned long long lv,
                                                  int lc, unsigned long long have, unsigned long long want) {
  const int lane = threadIdx.x % 32;
  // Exclusive prefix over the lanes (lane 0 first).
  unsigned long long pv = lv;
  int pc = lc;
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned long long x = __shfl_up_sync(0xffffffffu, pv, o);
    const int y = __shfl_up_sync(0xffffffffu, pc, o);
    if (lane >= o) {
      pv += x;
      pc += y;
    }
  }
  pv -= lv;
  pc -= lc;
  const unsigned hit = __ballot_sync(0xffffffffu, have + pv + lv >= want);
  if (hit == 0) return Crossing{};
  const int src = __ffs(hit) - 1;
  const unsigned long long base = __shfl_sync(0xffffffffu, pv, src);
  Crossing r = second_level<unsigned long long>(val, cnt, src, have + base, __shfl_sync(0xffffffffu, pc, src), want);
  r.above += base;  // above: relative to `have`
  return r;
}

// The mass (fixed point) a head's kept blocks must reach: mass_target of its total.
__device__ __forceinline__ unsigned long long mass_want(const SparseSelect& a, unsigned long long total) {
  return static_cast<unsigned long long>(ceil(static_cast<double>(a.mass_target) * static_cast<double>(total)));
}

// Within the crossing quantum (val: its mass, count: its blocks), as many blocks as its mean
// mass says are needed for the `rest` of the wanted mass.
__device__ __forceinline__ int quantum_need(unsigned long long rest, unsigned long long val, int count) {
  const double mean = static_cast<double>(val) / max(count, 1);
  return min(count, max(1, static_cast<int>(ceil(static_cast<double>(rest) / mean - 1e-9))));
}

// A KV head's need (one warp): the mandatory blocks plus the fewest others, best estimate
// first, whose mass reaches mass_target of the total. lv, lc: the lane sums of its mass and
// estimate-count histograms (lane_mass_sum, lane_count_sum).
__device__ __forceinline__ int head_need(const SparseSelect& a, const unsigned long long* mass, const int* est,
                                         unsigned long long lv, int lc, unsigned long long total,
                                         unsigned long long covered, int nb, int n_mand) {
  const unsigned long long want = mass_want(a, total);
  if (covered >= want) return n_mand;
  const Crossing c = find_crossing(mass, est, lv, lc, covered, want);
  if (c.bin < 0) return nb;  // rounding: everything
  return n_mand + c.count_above + quantum_need(want - covered - c.above, c.val, c.count);
}

// What a head keeps (select's four values): keep blocks; sparse: the threshold quantum `bin`
// of its score histogram and how many blocks of it (the others above it all kept).
struct Pick {
  int keep = 0, bin = kBins, in_bin = 0, sparse = 0;
};

// The pick's keep and sparse flag alone (the threshold left past the top): the need clamped to
// the ratios, at least the mandatory blocks; sparse unless that is every block.
__device__ __forceinline__ Pick clamped_keep(const SparseSelect& a, int need, int nb, int n_mand) {
  const int keep_min = static_cast<int>(ceil(nb * (1.0 - a.max_ratio) - 1e-9));
  const int keep_max = static_cast<int>(floor(nb * (1.0 - a.min_ratio) + 1e-9));
  Pick p;
  p.keep = max(n_mand, min(max(need, keep_min), keep_max));
  if (p.keep >= nb) {
    p.keep = nb;
  } else {
    p.sparse = 1;
  }
  return p;
}

// From the largest need of the sequence's heads, clamped so the skipped fraction lies in
// [min_ratio, max_ratio], one head's pick (one warp; scr its score-count histogram).
__device__ __forceinline__ Pick head_pick(const SparseSelect& a, int need, int nb, int n_mand, const int* scr,
                                          const CountBins& score_bins) {
  Pick p = clamped_keep(a, need, nb, n_mand);
  if (!p.sparse) return p;
  const int take = p.keep - n_mand;
  if (take > 0) {  // else no other block: bin stays past the top
    const Crossing c = count_crossing(scr, score_bins, take);
    p.bin = c.bin;  // always found: take <= the others' count
    p.in_bin = take - c.count_above;
  }
  return p;
}

// A sparse head's statistics (one thread): blocks, kept, one selection, entropy in bits.
__device__ __forceinline__ void add_stats(const SparseSelect& a, int nb, int keep, unsigned long long total,
                                          double mlogm) {
  double* st = a.layer_stats;
  atomicAdd(st, static_cast<double>(nb));
  atomicAdd(st + 1, static_cast<double>(keep));
  atomicAdd(st + 2, 1.0);
  const double t = static_cast<double>(total) / kMassUnit;
  if (t > 0) atomicAdd(st + 3, (log(t) - mlogm / t) / log(2.0));
}

__global__ void __launch_bounds__(32 * kMaxSparseKvHeads) count_kernel(SparseSelect a) {
  pdl_wait();
  pdl_trigger();
  const int s = blockIdx.x, h = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int nb = eligible_blocks(a, s);
  if (nb == 0) return;  // uniform: table_kernel copies the table
  const int Hkv = a.num_kv_heads;
  const int64_t sh = static_cast<int64_t>(s) * Hkv + h;
  int ob, oe;
  others_range(a, nb, &ob, &oe);
  const int n_mand = nb - (oe - ob);
  const unsigned long long* mass = a.mass_hist + sh * kBins;
  const int* est = a.est_hist + sh * kBins;
  const int* scr = a.score_hist + sh * kBins;
  // Every histogram load first (they need nothing computed), so their round trips overlap.
  const unsigned long long lv = lane_mass_sum(mass);
  const int lc = lane_count_sum(est);
  const CountBins score_bins = load_count_bins(scr);
  const unsigned long long total = a.head_mass[2 * sh], covered = a.head_mass[2 * sh + 1];
  const int need = head_need(a, mass, est, lv, lc, total, covered, nb, n_mand);
  __shared__ int needs[kMaxSparseKvHeads];
  if (lane == 0) needs[h] = need;
  __syncthreads();
  int most = n_mand;
  for (int i = 0; i < Hkv; ++i) most = max(most, needs[i]);
  const Pick p = head_pick(a, most, nb, n_mand, scr, score_bins);
  if (lane == 0) {
    int* sel = a.select + 4 * sh;
    sel[0] = p.keep;
    sel[1] = p.bin;
    sel[2] = p.in_bin;
    sel[3] = p.sparse;
    if (p.sparse) add_stats(a, nb, p.keep, total, a.head_mlogm[sh]);
  }
}

// ---- 4. tables ---------------------------------------------------------------------------

constexpr int kTableThreads = 512;

// The head table of (s, h) and the sequence's kept keys (a CTA of kThreads): with p.sparse,
// the kept blocks (mandatory, quantum above p.bin, and the lowest-numbered p.in_bin of it; bin_of(j)
// block j's score quantum) in position order; else a copy of the table. The block reads
// counted for a decode row.
template <int kThreads, typename BinOf, int kBatch = 8>
__device__ __forceinline__ void write_head_table(const SparseSelect& a, int s, int h, int nb, const Pick& p,
                                                 BinOf bin_of) {
  const int MB = a.max_blocks, bs = a.block_size;
  const int64_t sh = static_cast<int64_t>(s) * a.num_kv_heads + h;
  const int ctx = a.context_lens[s];
  const int* table = a.block_tables + static_cast<int64_t>(s) * MB;
  int* out = a.head_tables + sh * MB;
  // The passes that read each block position (a decode row's; a prompt chunk predicts nothing).
  int* reads = a.block_reads != nullptr && a.query_start[s + 1] - a.query_start[s] == 1
                   ? a.block_reads + static_cast<int64_t>(s) * a.reads_stride
                   : nullptr;
  // Selection reuse: the slot's kept selection of this layer (ru odd), or where this one goes (even).
  const int ru = reuse_of(a, s);
  const int64_t slot_layer = ru >= 0 ? static_cast<int64_t>(ru >> 1) * a.num_layers + a.layer : -1;
  int* kept = ru >= 0 ? a.kept_positions + (slot_layer * a.num_kv_heads + h) * a.kept_stride : nullptr;
  if (ru >= 0 && (ru & 1)) {
    const int n = ctx > 0 ? (ctx + bs - 1) / bs : 0;
    const int rc = a.kept_counts[slot_layer];
    const int last = rc > 0 ? kept[rc - 1] : n;
    if (rc > 0 && last < n) {
      // The kept positions, then every block written since (uniform per sequence: each
      // head's kept list ends at the last block it had).
      const int keep = rc + (n - 1 - last);
      for (int i = threadIdx.x; i < keep; i += kThreads) {
        const int j = i < rc ? kept[i] : last + 1 + (i - rc);
        out[i] = table[j];
        if (reads) atomicAdd(reads + j, 1);
      }
      if (h == 0 && threadIdx.x == 0) a.context_lens_out[s] = (keep - 1) * bs + (ctx - (n - 1) * bs);
      if (threadIdx.x == 0) {
        atomicAdd(a.layer_stats, static_cast<double>(n));
        atomicAdd(a.layer_stats + 1, static_cast<double>(keep));
        if (a.reused_stats != nullptr) atomicAdd(a.reused_stats, 1.0);
      }
      return;
    }
    // A kept selection that stayed dense (or none): dense, the copy below (nb is 0 here).
  }
  if (ru >= 0 && !(ru & 1) && h == 0 && threadIdx.x == 0) {
    a.kept_counts[slot_layer] = nb > 0 && p.sparse ? p.keep : 0;  // the positions follow below
  }
  if (!(ru >= 0 && !(ru & 1))) kept = nullptr;  // stored only by a row that selects and keeps
  if (nb == 0 || !p.sparse) {
    const int n = ctx > 0 ? (ctx + bs - 1) / bs : 0;
    // kBatch loads before their stores: out may alias table as far as the compiler knows,
    // so a load after a store would wait for the one before it (a round trip per entry).
    for (int j0 = threadIdx.x; j0 < n; j0 += kBatch * kThreads) {
      int v[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) v[i] = j0 + i * kThreads < n ? table[j0 + i * kThreads] : 0;
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int j = j0 + i * kThreads;
        if (j >= n) break;
        out[j] = v[i];
        if (reads) atomicAdd(reads + j, 1);
      }
    }
    if (h == 0 && threadIdx.x == 0) a.context_lens_out[s] = ctx;
    return;
  }
  int ob, oe;
  others_range(a, nb, &ob, &oe);
  // Each thread a run of blocks in position order: its threshold-quantum blocks (ties) and
  // the others it keeps outright (mandatory or above the quantum).
  const int per = (nb + kThreads - 1) / kThreads;
  const int lo = min(nb, static_cast<int>(threadIdx.x) * per), hi = min(nb, lo + per);
  int2 cnt = make_int2(0, 0);  // ties, outright
  for (int j = lo; j < hi; ++j) {
    const bool other = j >= ob && j < oe;
    const int b = other ? bin_of(j) : 0;
    cnt.x += other && b == p.bin;
    cnt.y += !other || b > p.bin;
  }
  // One scan of both: the ties before this thread (tie_rank) and the outright kept before it.
  // Of the ties the first in_bin in position order are kept, so the kept blocks before this
  // thread are its outright prefix plus min(in_bin, tie_rank).
  using Scan = cub::BlockScan<int2, kThreads>;
  __shared__ typename Scan::TempStorage tmp;
  int2 before;
  Scan(tmp).ExclusiveScan(cnt, before, make_int2(0, 0),
                          [](int2 x, int2 y) { return make_int2(x.x + y.x, x.y + y.y); });
  const int tie_rank = before.x;
  int pos = before.y + min(p.in_bin, tie_rank);
  // Whether block j is kept; r counts this thread's threshold-quantum blocks so far.
  auto kept_at = [&](int j, int& r) {
    if (j < ob || j >= oe) return true;
    const int b = bin_of(j);
    return b > p.bin || (b == p.bin && r++ < p.in_bin);
  };
  for (int j0 = lo, r = tie_rank; j0 < hi; j0 += kBatch) {
    int v[kBatch];  // loaded before the stores (above)
#pragma unroll
    for (int i = 0; i < kBatch; ++i) v[i] = j0 + i < hi ? table[j0 + i] : 0;
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int j = j0 + i;
      if (j >= hi) break;
      if (!kept_at(j, r)) continue;
      if (kept) kept[pos] = j;
      out[pos++] = v[i];
      if (reads) atomicAdd(reads + j, 1);
    }
  }
  if (h == 0 && threadIdx.x == 0) a.context_lens_out[s] = (p.keep - 1) * bs + (ctx - (nb - 1) * bs);
}

__global__ void __launch_bounds__(kTableThreads) table_kernel(SparseSelect a) {
  pdl_wait();
  pdl_trigger();
  const int h = blockIdx.x, s = blockIdx.y;
  const int Hkv = a.num_kv_heads, MB = a.max_blocks;
  const int64_t sh = static_cast<int64_t>(s) * Hkv + h;
  const int nb = eligible_blocks(a, s);
  Pick p;
  if (nb > 0) {
    // Back to zero for the next layer or step: the readers of the histograms, sums and
    // maxima (bin_kernel, count_kernel) are done.
    unsigned long long* mh = a.mass_hist + sh * kBins;
    for (int b = threadIdx.x; b < kBins; b += blockDim.x) {
      mh[b] = 0;
      a.est_hist[sh * kBins + b] = 0;
      a.score_hist[sh * kBins + b] = 0;
    }
    if (threadIdx.x == 0) {
      a.head_mass[2 * sh] = 0;
      a.head_mass[2 * sh + 1] = 0;
      a.head_mlogm[sh] = 0;
    }
    const int group = a.num_heads / Hkv;
    for (int i = threadIdx.x; i < 2 * group; i += blockDim.x) {
      a.maxima[(static_cast<int64_t>(s) * a.num_heads + h * group) * 2 + i] = 0;
    }
    const int* sel = a.select + 4 * sh;
    p.keep = sel[0];
    p.bin = sel[1];
    p.in_bin = sel[2];
    p.sparse = sel[3];
  }
  const float* score = a.score + sh * MB;
  write_head_table<kTableThreads>(a, s, h, nb, p, [&](int j) { return quantum(score[j]); });
}

// ---- 2-4 in one launch (sm_90) -------------------------------------------------------------

// choose_kernel: bin, count and table of one (sequence, KV head) per CTA, the sequence's KV
// heads one thread-block cluster, which exchanges their needs through distributed shared
// memory. The histograms and each block's score quantum stay in the CTA's shared memory, so
// there are no global histogram atomics, no scratch to clear, and two launches fewer. Used
// where the cluster fits (compute capability 9.0, at most 8 KV heads, max_blocks within
// kChooseMaxBlocks); elsewhere the three kernels above.
constexpr int kChooseThreads = 512;
constexpr int kChooseMaxBlocks = 65536;  // 128 KB of score quanta (1M keys at block size 16)

// Dynamic shared memory: the three histograms, then a uint16 score quantum per block.
__host__ __device__ constexpr size_t choose_smem(int max_blocks) {
  return static_cast<size_t>(kBins) * (8 + 4 + 4) + 2 * static_cast<size_t>(max_blocks);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// *p += x for a fixed-point mass in shared memory, as 32-bit atomics (a 64-bit add there is a
// compare-and-swap loop): the low word, then the high word with the low word's carry. The
// result is exact and independent of the order once every add is done.
__device__ __forceinline__ void add_fixed(unsigned long long* p, unsigned long long x) {
  unsigned* w = reinterpret_cast<unsigned*>(p);  // little-endian: low word first
  const unsigned lo = static_cast<unsigned>(x), old = atomicAdd(w, lo);
  const unsigned hi = static_cast<unsigned>(x >> 32) + (old + lo < old ? 1u : 0u);
  if (hi != 0) atomicAdd(w + 1, hi);
}

// The KV heads' needs are pushed, not pulled: lane r stores its head's need into CTA r's
// `needs` with st.async, which completes bytes on CTA r's mbarrier, so no cluster barrier with
// release semantics (MEMBAR.ALL.GPU: it waits for every earlier global store and atomic of the
// thread) sits on the path. The one cluster barrier left is relaxed, arrived at right after the
// mbarrier's initialisation and waited for just before the first remote store (its wait orders
// the initialisation before any remote completion). A CTA reads no other CTA's shared memory
// and leaves only once every store into its own has landed, so none needs the others to stay.
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;" ::: "memory"); }
__device__ __forceinline__ void mbar_init_expect(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// v into the int at `p` of the cluster's CTA `rank`, completing 4 bytes on its mbarrier `bar`.
__device__ __forceinline__ void push_cluster_int(const int* p, uint32_t bar, int rank, int v) {
  const uint32_t local = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  uint32_t rp, rb;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(rp) : "r"(local), "r"(rank));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(rb) : "r"(bar), "r"(rank));
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.s32 [%0], %1, [%2];" ::"r"(rp), "r"(v), "r"(rb)
               : "memory");
}
// choose_kernel's scan over its histograms (ChooseSums: one thread's two bins, and its blocks'
// mandatory mass and entropy term).
struct ChooseSums {
  unsigned long long mass, covered;
  double mlogm;
  int est, scr;
};
struct AddSums {
  __device__ __forceinline__ ChooseSums operator()(const ChooseSums& x, const ChooseSums& y) const {
    return {x.mass + y.mass, x.covered + y.covered, x.mlogm + y.mlogm, x.est + y.est, x.scr + y.scr};
  }
};

__device__ __forceinline__ void mbar_wait_cluster(uint32_t bar) {
  uint32_t done;
  do {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], 0;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar)
        : "memory");
  } while (!done);
}
#endif

__global__ void __launch_bounds__(kChooseThreads) choose_kernel(SparseSelect a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Before pdl_wait: only what the score kernel (the launch before) does not write (the batch's
  // lengths and block tables) and this CTA's shared memory.
  const int h = blockIdx.x, s = blockIdx.y;  // cluster (Hkv, 1): rank h
  const int Hq = a.num_heads, Hkv = a.num_kv_heads, group = Hq / Hkv, MB = a.max_blocks, bs = a.block_size;
  const int nb = eligible_blocks(a, s);  // the same in the whole cluster: every barrier or none
  const int ctx = a.context_lens[s];
  __shared__ float best[2][kMaxSparseHeads];
  // needs: every KV head's (pushed); choose_need: this head's; pick: the threshold quantum and
  // how many blocks of it.
  __shared__ int needs[kMaxSparseKvHeads], choose_need, pick[2];
  __shared__ __align__(8) unsigned long long needs_bar;
  extern __shared__ __align__(16) unsigned char smem[];
  auto* mass = reinterpret_cast<unsigned long long*>(smem);
  int* est = reinterpret_cast<int*>(mass + kBins);
  int* scr = est + kBins;
  auto* qbin = reinterpret_cast<uint16_t*>(scr + kBins);
  const uint32_t bar = static_cast<uint32_t>(__cvta_generic_to_shared(&needs_bar));
  if (nb > 0) {
    if (threadIdx.x == 0) {
      mbar_init_expect(bar, 4 * Hkv);
      choose_need = nb;  // unless a crossing is found
    }
    cluster_arrive_relaxed();  // waited for before the pushes (warp 0) or at the end (the rest)
    for (int b = threadIdx.x; b < kBins; b += kChooseThreads) {
      mass[b] = 0;
      est[b] = 0;
      scr[b] = 0;
    }
    // The table entries write_head_table reads in this thread's run of positions, into L1.
    const int per = (nb + kChooseThreads - 1) / kChooseThreads;
    const int lo = min(nb, static_cast<int>(threadIdx.x) * per), hi = min(nb, lo + per);
    const int* tab = a.block_tables + static_cast<int64_t>(s) * MB;
    for (int j = lo & ~31; j < hi; j += 32) asm volatile("prefetch.L1 [%0];" ::"l"(tab + j));  // 128-byte lines
  }
  pdl_wait();
  pdl_trigger();
  // The group's maxima (bound, centre), loaded with this thread's first raw scores: one round trip.
  uint32_t* mx = a.maxima + (static_cast<int64_t>(s) * Hq + h * group) * 2;  // this CTA's alone
  uint32_t my_max = 0;
  if (threadIdx.x < 2 * group) my_max = mx[threadIdx.x];
  if (nb == 0) {
    write_head_table<kChooseThreads>(a, s, h, 0, Pick{}, [](int) { return 0; });
    return;
  }
  const float* raw = a.raw + (static_cast<int64_t>(s) * Hq + h * group) * 2 * MB;
  const bool vec = MB % 4 == 0;  // rows 16-byte aligned
  // Four blocks a chunk, a float4 of each head's bound and centre.
  auto load4 = [&](int g, int j0, float(&uv)[4], float(&cv)[4]) {
    const float* u = raw + static_cast<int64_t>(g) * 2 * MB + j0;
    if (vec) {
      const float4 x = *reinterpret_cast<const float4*>(u), y = *reinterpret_cast<const float4*>(u + MB);
      uv[0] = x.x, uv[1] = x.y, uv[2] = x.z, uv[3] = x.w;
      cv[0] = y.x, cv[1] = y.y, cv[2] = y.z, cv[3] = y.w;
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        uv[i] = j0 + i < nb ? u[i] : -INFINITY;
        cv[i] = j0 + i < nb ? u[MB + i] : -INFINITY;
      }
    }
  };
  // The first chunk's scores of up to kPre heads, in flight with the maxima.
  constexpr int kPre = 4;
  const int jf = 4 * threadIdx.x;
  float pu[kPre][4], pc[kPre][4];
#pragma unroll
  for (int g = 0; g < kPre; ++g) {
    if (g < group && jf < nb) load4(g, jf, pu[g], pc[g]);
  }
  if (threadIdx.x < 2 * group) {
    best[threadIdx.x % 2][threadIdx.x / 2] = from_order_bits(my_max);
    mx[threadIdx.x] = 0;  // at rest for the next layer or step
  }
  __syncthreads();
  int ob, oe;
  others_range(a, nb, &ob, &oe);
  unsigned long long covered = 0;  // the mandatory blocks' mass (the others' is in the histogram)
  double mlogm = 0.0;
  const double log_bs = log(static_cast<double>(bs));
  auto add_blocks = [&](int j0, const float(&sc)[4], const float(&es)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int j = j0 + i;
      if (j >= nb) break;
      const int bq = quantum(sc[i]);
      qbin[j] = static_cast<uint16_t>(bq);
      const BlockKeys k = a.code_tiles > 0 ? BlockKeys{1, 0.0} : block_keys(j, nb, ctx, bs, log_bs);
      const unsigned long long fixed = block_mass(k.n, k.log_n, es[i], mlogm);
      if (j < ob || j >= oe) {
        covered += fixed;
      } else {
        const int be = quantum(es[i]);
        add_fixed(mass + be, fixed);
        atomicAdd(est + be, 1);
        atomicAdd(scr + bq, 1);
      }
    }
  };
  // A head's bound and centre of four blocks into their scores relative to its best, maxed
  // over the group.
  auto fold = [&](int g, const float(&uv)[4], const float(&cv)[4], float(&sc)[4], float(&es)[4]) {
    const float bu = best[0][g], bc = best[1][g];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      sc[i] = fmaxf(sc[i], uv[i] - bu);
      es[i] = fmaxf(es[i], cv[i] - bc);
    }
  };
  // Chunk m of this thread starts at jf + 4 m kChooseThreads: the first from the preloaded
  // scores, then a chunk a pass with four heads' loads issued together (one round trip a
  // pass at group 4; a pass over two chunks of two heads each would wait as long).
  for (int j0 = jf; j0 < nb; j0 += 4 * kChooseThreads) {
    float sc[4], es[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) sc[i] = es[i] = -INFINITY;
    int g0 = 0;
    if (j0 == jf) {
#pragma unroll
      for (int g = 0; g < kPre; ++g) {
        if (g < group) fold(g, pu[g], pc[g], sc, es);
      }
      g0 = kPre;
    }
    for (int g = g0; g < group; g += 4) {
      float uv[4][4], cv[4][4];
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        if (g + x < group) load4(g + x, j0, uv[x], cv[x]);
      }
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        if (g + x < group) fold(g + x, uv[x], cv[x], sc, es);
      }
    }
    add_blocks(j0, sc, es);
  }
  // The rest with every thread (no warp's serial walk): one scan over the histograms from the
  // top bin down, two bins a thread, carrying the CTA's sums of the mandatory mass and the
  // entropy term. A head's need and its threshold are then the crossings head_need and head_pick
  // find, each found by the one thread whose bins hold it (the same integer prefixes, so the same
  // counts as count_kernel's).
  static_assert(kBins == 2 * kChooseThreads, "two bins a thread");
  __syncthreads();  // the histograms are complete
  const int b0 = kBins - 1 - 2 * static_cast<int>(threadIdx.x), b1 = b0 - 1;
  const unsigned long long m0 = mass[b0], m1 = mass[b1];
  const int e0 = est[b0], e1 = est[b1], r0 = scr[b0], r1 = scr[b1];
  const ChooseSums mine{m0 + m1, covered, mlogm, e0 + e1, r0 + r1};
  ChooseSums incl, all;
  {
    using Scan = cub::BlockScan<ChooseSums, kChooseThreads, cub::BLOCK_SCAN_WARP_SCANS>;
    __shared__ typename Scan::TempStorage tmp;
    Scan(tmp).InclusiveScan(mine, incl, AddSums{}, all);
  }
  const int n_mand = nb - (oe - ob);
  const unsigned long long head_total = all.mass + all.covered;  // every block's mass
  {
    const unsigned long long want = mass_want(a, head_total);
    const unsigned long long m_above = incl.mass - mine.mass;  // the others' mass in bins above b0
    const int c_above = incl.est - mine.est;
    // Within the crossing quantum, head_need's rule.
    auto need_at = [&](unsigned long long above, unsigned long long val, int count_above, int count) {
      return n_mand + count_above + quantum_need(want - all.covered - above, val, count);
    };
    if (all.covered >= want) {
      if (threadIdx.x == 0) choose_need = n_mand;
    } else if (all.covered + m_above < want && all.covered + m_above + m0 >= want) {
      choose_need = need_at(m_above, m0, c_above, e0);
    } else if (all.covered + m_above + m0 < want && all.covered + m_above + m0 + m1 >= want) {
      choose_need = need_at(m_above + m0, m1, c_above + e0, e1);
    }  // no crossing anywhere (rounding): choose_need stays nb
  }
  __syncthreads();
  cluster_wait();  // every CTA's barrier initialised
  if (threadIdx.x < Hkv) push_cluster_int(&needs[h], bar, threadIdx.x, choose_need);  // thread r: to head r
  mbar_wait_cluster(bar);  // every head's need here
  int most = n_mand;
  for (int i = 0; i < Hkv; ++i) most = max(most, needs[i]);
  // head_pick's clamp (uniform), then the threshold quantum from the score counts' crossing.
  Pick p = clamped_keep(a, most, nb, n_mand);
  if (p.sparse) {
    const int take = p.keep - n_mand;
    if (take > 0) {  // else no other block: bin stays past the top
      const int r_above = incl.scr - mine.scr;
      if (r_above < take && r_above + r0 >= take) {
        pick[0] = b0;
        pick[1] = take - r_above;
      } else if (r_above + r0 < take && r_above + r0 + r1 >= take) {
        pick[0] = b1;
        pick[1] = take - r_above - r0;
      }  // always found: take <= the others' count
      __syncthreads();
      p.bin = pick[0];
      p.in_bin = pick[1];
    }
    if (threadIdx.x == 0) add_stats(a, nb, p.keep, head_total, all.mlogm);
  }
  write_head_table<kChooseThreads>(a, s, h, nb, p, [&](int j) { return static_cast<int>(qbin[j]); });
#endif
}

// choose_kernel where its cluster fits: compute capability 9.0 or later, at most 8 KV heads
// (a portable cluster), max_blocks within kChooseMaxBlocks; K25_SPARSE_FUSED=0 (read at every
// launch, for comparisons and tests) keeps the three kernels.
bool use_choose(const SparseSelect& a) {
  return device_compute_major() >= 9 && !env_is_zero("K25_SPARSE_FUSED") && a.num_kv_heads <= 8 &&
         a.max_blocks <= kChooseMaxBlocks;
}

// A cluster of the sequence's KV heads per sequence.
void launch_choose(const SparseSelect& a, cudaStream_t stream) {
  // Past 48 KB of dynamic shared memory only with the attribute (once: the device used first).
  static const cudaError_t attr_set =
      cudaFuncSetAttribute(choose_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(choose_smem(kChooseMaxBlocks)));
  (void)attr_set;
  launch_pdl_clusters(choose_kernel, dim3(a.num_kv_heads, a.num_seqs), kChooseThreads, choose_smem(a.max_blocks),
                      stream, static_cast<unsigned>(a.num_kv_heads), a);
}

template <typename T, int D>
void launch_select(const void* q, int64_t q_stride, const void* summaries, const SparseSelect& a,
                   cudaStream_t stream) {
  const int S = a.num_seqs, MB = a.max_blocks, Hkv = a.num_kv_heads;
  if (S == 0) return;
  // Fewer long runs than the device holds warps (SMs x 32 at this kernel's registers):
  // shorter runs. The SM count of the first device used stands for all (a heuristic only).
  static const int sms = [] {
    int n = 0, dev = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    return n > 0 ? n : 132;
  }();
  // A kernel's long runs while they still give every SM `warps_per_sm` warps, else short ones
  // (max_blocks standing for every sequence's length). long_run 0: one wave of warps shared
  // out over the rows by their blocks on the device (score_task, score_grid): short rows in a
  // table sized for long ones (a CUDA graph's) keep short runs and many warps.
  auto launch_score = [&](auto kernel, int long_run, int warps_per_sm) {
    constexpr int kWarps = kScoreThreads / 32;
    const int64_t slots = static_cast<int64_t>(sms) * warps_per_sm;
    if (long_run == 0) {
      launch_pdl(kernel, dim3(static_cast<unsigned>(score_grid(slots, S, Hkv, MB))), kScoreThreads, 0, stream,
                 static_cast<const T*>(q), q_stride, summaries, a, 0);
      return;
    }
    const int64_t long_warps = static_cast<int64_t>(S) * Hkv * ((MB + long_run - 1) / long_run);
    const int run = long_warps >= slots ? long_run : kScoreRunShort;
    const int tasks = Hkv * ((MB + run - 1) / run);
    launch_pdl(kernel, dim3((tasks + kWarps - 1) / kWarps, S), kScoreThreads, 0, stream, static_cast<const T*>(q),
               q_stride, summaries, a, run);
  };
  if constexpr (std::is_same_v<T, float>) {
    launch_score(score_kernel<T, D>, kScoreRunLong, 32);
  } else {
    // Tensor cores for coded summaries (q rows 16-byte aligned, as the QKV buffer leaves
    // them); K25_SPARSE_SCORE_MMA=0 keeps the CUDA-core kernel (for comparisons).
    static const bool mma = !env_is_zero("K25_SPARSE_SCORE_MMA");
    const bool aligned = reinterpret_cast<uintptr_t>(q) % 16 == 0 && q_stride % 8 == 0;
    if (a.code_tiles > 0) {
      launch_score(a.num_heads / Hkv <= 4 ? codes_score_kernel<T, D, true> : codes_score_kernel<T, D, false>, 0, 16);
    } else if (mma && aligned) {
      launch_score(score_mma_kernel<T, D>, 0, 16);
    } else {
      launch_score(score_kernel<T, D>, kScoreRunLong, 32);
    }
  }
  if (use_choose(a)) {
    launch_choose(a, stream);
  } else {
    launch_pdl(bin_kernel, dim3((MB + kBinThreads - 1) / kBinThreads, Hkv, S), kBinThreads, 0, stream, a);
    launch_pdl(count_kernel, S, 32 * Hkv, 0, stream, a);
    launch_pdl(table_kernel, dim3(Hkv, S), kTableThreads, 0, stream, a);
  }
}

}  // namespace

void update_block_summaries(DType t, KVCache kv, int32_t layer, void* summaries, const int32_t* query_start,
                            const int32_t* context_lens, const int32_t* block_tables, int32_t max_blocks,
                            int32_t num_seqs, int32_t code_tiles, cudaStream_t stream) {
  if (num_seqs == 0) return;
  // A decode touches one block per sequence; a prompt chunk many: spread those over z.
  const dim3 grid(num_seqs, kv.num_kv_heads, 8);
  if (t == DType::kF32) code_tiles = 0;  // (rejected by the glue: no key codes for float32 KV)
  K25_DISPATCH_DTYPE(t, (launch_pdl(summary_kernel<T>, grid, kv.head_dim, 0, stream, kv, layer,
                                    static_cast<uint8_t*>(summaries), query_start, context_lens, block_tables,
                                    max_blocks, code_tiles)));
}

void select_blocks(DType t, const void* q, int64_t q_stride, const void* summaries, int32_t head_dim,
                   const SparseSelect& a, cudaStream_t stream) {
  switch (head_dim) {
    case 64:
      K25_DISPATCH_DTYPE(t, (launch_select<T, 64>(q, q_stride, summaries, a, stream)));
      break;
    case 128:
      K25_DISPATCH_DTYPE(t, (launch_select<T, 128>(q, q_stride, summaries, a, stream)));
      break;
    default:
      break;  // rejected by the glue (supported head dims: 64, 128)
  }
}

}  // namespace k25::cuda
