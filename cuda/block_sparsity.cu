// Dynamic block sparsity on the device (issue #5; docs/sparsity.md "CUDA").
//
// Per layer and decode step, four launches that need no host decision (CUDA graphs):
//   1. score_kernel (CTAs over (sequence, 8 blocks)): per block and query head the Quest
//      bound sum_d max(q_d mn_d, q_d mx_d) and the centre estimate q·(mn + mx) / 2, scaled,
//      from the block's summary; the per-(sequence, query head) maxima by atomicMax.
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
// Quantised (1/32 nat) rather than sorted: the count and the ranking need only prefix sums
// of a histogram, so a head's selection is a few passes over its blocks, spread over CTAs,
// not a sort in one CTA (at batch 1 there are only num_kv_heads of those).
#include <cub/block/block_scan.cuh>

#include <cmath>

#include "common.cuh"

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

// Blocks of sequence s that select (single-token step, more than min_context keys), else 0.
__device__ __forceinline__ int eligible_blocks(const SparseSelect& a, int s) {
  const int q_len = a.query_start[s + 1] - a.query_start[s];
  const int ctx = a.context_lens[s];
  return q_len == 1 && ctx > a.min_context ? (ctx + a.block_size - 1) / a.block_size : 0;
}

// Mandatory blocks of nb: [0, ob) and [oe, nb).
__device__ __forceinline__ void others_range(const SparseSelect& a, int nb, int* ob, int* oe) {
  *ob = min(max(a.sink_blocks, 0), nb);
  *oe = max(*ob, nb - max(a.recent_blocks, 0));
}

template <typename T, int C>
__device__ __forceinline__ void load_floats(const T* p, float (&out)[C]) {
  if constexpr ((C * sizeof(T)) % 16 == 0) {
    constexpr int kPer = 16 / sizeof(T);
#pragma unroll
    for (int i = 0; i < C / kPer; ++i) {
      const uint4 v = reinterpret_cast<const uint4*>(p)[i];
      const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
      for (int k = 0; k < kPer; ++k) out[i * kPer + k] = to_f(e[k]);
    }
  } else {
#pragma unroll
    for (int c = 0; c < C; ++c) out[c] = to_f(p[c]);
  }
}

__device__ __forceinline__ int64_t summary_offset(const SparseSelect& a, int block, int h, int D) {
  return ((static_cast<int64_t>(block) * a.num_layers + a.layer) * a.num_kv_heads + h) * 2 * D;
}

// ---- summaries ----------------------------------------------------------------------

template <typename T>
__global__ void summary_kernel(KVCache kv, int layer, T* __restrict__ summ, const int* query_start,
                               const int* context_lens, const int* block_tables, int max_blocks) {
  const int s = blockIdx.x, h = blockIdx.y;
  const int q_len = query_start[s + 1] - query_start[s];
  const int ctx = context_lens[s];
  if (q_len <= 0 || ctx <= 0) return;
  const int bs = kv.block_size, D = kv.head_dim, Hkv = kv.num_kv_heads;
  const T* cache = static_cast<const T*>(kv.data);
  const int* table = block_tables + static_cast<int64_t>(s) * max_blocks;
  for (int j = max(0, ctx - q_len) / bs + blockIdx.z; j <= (ctx - 1) / bs; j += gridDim.z) {
    const int64_t block = table[j];
    const int fill = min(bs, ctx - j * bs);
    const T* K = cache + (((block * kv.num_layers + layer) * 2) * Hkv + h) * static_cast<int64_t>(bs) * D;
    T* out = summ + ((block * kv.num_layers + layer) * Hkv + h) * 2 * static_cast<int64_t>(D);
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
      float mn = INFINITY, mx = -INFINITY;
      for (int t = 0; t < fill; ++t) {
        const float k = to_f(K[static_cast<int64_t>(t) * D + d]);
        mn = fminf(mn, k);
        mx = fmaxf(mx, k);
      }
      out[d] = from_f<T>(mn);
      out[D + d] = from_f<T>(mx);
    }
  }
}

// ---- 1. scores --------------------------------------------------------------------------

constexpr int kScoreBlocks = 8;     // blocks per CTA (many CTAs: at batch 1 the work is one sequence)
constexpr int kScoreThreads = 256;  // 16 half-warps, one (block, KV head) each at a time

// One (block j, KV head h) of sequence s for every query head of the group: the bound
// and the centre estimate from the block's summary (this lane's C channels), reduced over
// the half-warp; lane 0 writes them and folds them into the CTA's maxima.
template <int C>
__device__ __forceinline__ void score_item(const SparseSelect& a, int s, int j, int h, int group, const float* qs,
                                           int hl, uint32_t mask, const float (&mn)[C], const float (&mx)[C],
                                           uint32_t* smax) {
  constexpr int D = 16 * C;
  const int Hq = a.num_heads, MB = a.max_blocks;
  for (int g = 0; g < group; ++g) {
    const int hq = h * group + g;
    const float* qv = qs + hq * D + hl * C;
    float u = 0.0f, c = 0.0f;
#pragma unroll
    for (int k = 0; k < C; ++k) {
      u += fmaxf(qv[k] * mn[k], qv[k] * mx[k]);
      c = fmaf(qv[k], mn[k] + mx[k], c);
    }
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) {
      u += __shfl_xor_sync(mask, u, o);
      c += __shfl_xor_sync(mask, c, o);
    }
    if (hl == 0) {
      u *= a.scale;
      c *= 0.5f * a.scale;
      float* raw = a.raw + (static_cast<int64_t>(s) * Hq + hq) * 2 * MB;
      raw[j] = u;
      raw[MB + j] = c;
      atomicMax(&smax[2 * hq], order_bits(u));
      atomicMax(&smax[2 * hq + 1], order_bits(c));
    }
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kScoreThreads)
    score_kernel(const T* __restrict__ q, int64_t q_stride, const T* __restrict__ summ, SparseSelect a) {
  constexpr int C = D / 16;  // channels per lane of a half-warp
  const int s = blockIdx.y;
  const int nb = eligible_blocks(a, s);
  const int j0 = blockIdx.x * kScoreBlocks;
  if (j0 >= nb) return;
  const int Hq = a.num_heads, Hkv = a.num_kv_heads, group = Hq / Hkv, MB = a.max_blocks;
  __shared__ uint32_t smax[2 * kMaxSparseHeads];
  extern __shared__ __align__(16) float qs[];  // [Hq][D]: the sequence's query, as float
  __shared__ int blocks[kScoreBlocks];           // the CTA's block-table entries
  for (int i = threadIdx.x; i < 2 * Hq; i += blockDim.x) smax[i] = 0;
  if (threadIdx.x < min(kScoreBlocks, nb - j0)) {
    blocks[threadIdx.x] = a.block_tables[static_cast<int64_t>(s) * MB + j0 + threadIdx.x];
  }
  {
    const T* qr = q + static_cast<int64_t>(a.query_start[s]) * q_stride;
    for (int i = threadIdx.x; i < Hq * D; i += blockDim.x) qs[i] = to_f(qr[i]);
  }
  __syncthreads();
  const int cnt = min(kScoreBlocks, nb - j0);
  const int half = threadIdx.x / 16, hl = threadIdx.x % 16;
  const uint32_t mask = 0xFFFFu << (16 * ((threadIdx.x % 32) / 16));
  // One item at a time: loading several items' summaries ahead (tried: 112 registers, 2
  // CTAs per SM instead of 5) was slower.
  for (int item = half; item < cnt * Hkv; item += kScoreThreads / 16) {
    const int h = item / cnt, j = j0 + item % cnt;
    float mn[C], mx[C];
    const T* sp = summ + summary_offset(a, blocks[item % cnt], h, D) + hl * C;
    load_floats<T, C>(sp, mn);
    load_floats<T, C>(sp + D, mx);
    score_item<C>(a, s, j, h, group, qs, hl, mask, mn, mx, smax);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < 2 * Hq; i += blockDim.x) {
    if (smax[i] != 0) atomicMax(a.maxima + static_cast<int64_t>(s) * 2 * Hq + i, smax[i]);
  }
}

// ---- 2. scores relative to the best, masses, histograms ---------------------------------

constexpr int kBinThreads = 256;

__global__ void __launch_bounds__(kBinThreads) bin_kernel(SparseSelect a) {
  const int s = blockIdx.z, h = blockIdx.y;
  const int nb = eligible_blocks(a, s);
  const int j = blockIdx.x * kBinThreads + threadIdx.x;
  if (blockIdx.x * kBinThreads >= nb) return;
  const int Hq = a.num_heads, Hkv = a.num_kv_heads, group = Hq / Hkv, MB = a.max_blocks, bs = a.block_size;
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
    const int ctx = a.context_lens[s];
    const int n = j == nb - 1 ? ctx - (nb - 1) * bs : bs;
    float m = static_cast<float>(n) * expf(es);
    if (!(m >= 0.0f && m <= static_cast<float>(n))) m = 0.0f;  // NaN keys
    const unsigned long long fixed = __double2ull_rn(static_cast<double>(m) * kMassUnit);
    total = fixed;
    if (m > 0.0f) mlogm = static_cast<double>(m) * (static_cast<double>(es) + log(static_cast<double>(n)));
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
  for (int o = 16; o > 0; o >>= 1) {
    total += __shfl_xor_sync(0xffffffffu, total, o);
    covered += __shfl_xor_sync(0xffffffffu, covered, o);
    mlogm += __shfl_xor_sync(0xffffffffu, mlogm, o);
  }
  __shared__ unsigned long long st[kBinThreads / 32][2];
  __shared__ double sm[kBinThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    st[warp][0] = total;
    st[warp][1] = covered;
    sm[warp] = mlogm;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kBinThreads / 32; ++w) {
      total += st[w][0];
      covered += st[w][1];
      mlogm += sm[w];
    }
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

// Lane l's 32 count bins (c[i] = bin top - i), loaded as 16-byte vectors, with the exclusive
// prefix over the lanes of their sums: split from count_crossing so that the loads can be
// issued before a barrier and the walk made after it.
struct CountBins {
  int c[32];
  int above = 0, total = 0;
};
__device__ __forceinline__ CountBins load_count_bins(const int* cnt) {
  const int lane = threadIdx.x % 32;
  CountBins b;
  const uint4* p = reinterpret_cast<const uint4*>(cnt + kBins - 32 * (lane + 1));
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const uint4 x = p[k];
    b.c[31 - 4 * k] = static_cast<int>(x.x);
    b.c[30 - 4 * k] = static_cast<int>(x.y);
    b.c[29 - 4 * k] = static_cast<int>(x.z);
    b.c[28 - 4 * k] = static_cast<int>(x.w);
  }
#pragma unroll
  for (int i = 0; i < 32; ++i) b.total += b.c[i];
  int pc = b.total;
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, pc, o);
    if (lane >= o) pc += y;
  }
  b.above = pc - b.total;
  return b;
}

// The crossing of a count histogram (val = count) at `want` blocks.
__device__ Crossing count_crossing(const CountBins& b, int want) {
  const int lane = threadIdx.x % 32;
  const unsigned hit = __ballot_sync(0xffffffffu, b.above + b.total >= want);
  Crossing r;
  if (hit == 0) return r;
  const int src = __ffs(hit) - 1;
  if (lane == src) {
    int n = b.above;
    bool found = false;
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      if (!found && n + b.c[i] >= want) {
        found = true;
        r.bin = kBins - 1 - 32 * lane - i;
        r.count_above = n;
        r.count = b.c[i];
      }
      n += b.c[i];
    }
  }
  r.bin = __shfl_sync(0xffffffffu, r.bin, src);
  r.count_above = __shfl_sync(0xffffffffu, r.count_above, src);
  r.count = __shfl_sync(0xffffffffu, r.count, src);
  return r;
}

// The crossing of the mass histogram `val` (fixed point) with its counts `cnt`.
__device__ Crossing find_crossing(const unsigned long long* val, const int* cnt, unsigned long long have,
                                  unsigned long long want) {
  const int lane = threadIdx.x % 32;
  const int top = kBins - 1 - 32 * lane;
  // The lane's 32 bins into registers first, in 16-byte loads (the walk below stops early,
  // and loads inside it would be issued one round trip at a time): v[i], c[i] is bin top - i.
  unsigned long long v[32];
  int c[32];
  {
    const uint4* pv = reinterpret_cast<const uint4*>(val + top - 31);
    const uint4* pc = reinterpret_cast<const uint4*>(cnt + top - 31);
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      const uint4 x = pv[k];
      v[31 - 2 * k] = x.x | (static_cast<unsigned long long>(x.y) << 32);
      v[30 - 2 * k] = x.z | (static_cast<unsigned long long>(x.w) << 32);
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint4 x = pc[k];
      c[31 - 4 * k] = static_cast<int>(x.x);
      c[30 - 4 * k] = static_cast<int>(x.y);
      c[29 - 4 * k] = static_cast<int>(x.z);
      c[28 - 4 * k] = static_cast<int>(x.w);
    }
  }
  unsigned long long lv = 0;
  int lc = 0;
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    lv += v[i];
    lc += c[i];
  }
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
  Crossing r;
  if (hit == 0) return r;
  const int src = __ffs(hit) - 1;
  if (lane == src) {
    unsigned long long acc = have + pv;
    int n = pc;
    bool found = false;
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      if (!found && acc + v[i] >= want) {
        found = true;
        r.bin = top - i;
        r.above = acc - have;
        r.val = v[i];
        r.count_above = n;
        r.count = c[i];
      }
      acc += v[i];
      n += c[i];
    }
  }
  r.bin = __shfl_sync(0xffffffffu, r.bin, src);
  r.above = __shfl_sync(0xffffffffu, r.above, src);
  r.val = __shfl_sync(0xffffffffu, r.val, src);
  r.count_above = __shfl_sync(0xffffffffu, r.count_above, src);
  r.count = __shfl_sync(0xffffffffu, r.count, src);
  return r;
}

__global__ void __launch_bounds__(32 * kMaxSparseKvHeads) count_kernel(SparseSelect a) {
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
  const unsigned long long total = a.head_mass[2 * sh], covered = a.head_mass[2 * sh + 1];
  const unsigned long long want =
      static_cast<unsigned long long>(ceil(static_cast<double>(a.mass_target) * static_cast<double>(total)));
  int need = n_mand;
  if (covered < want) {
    const Crossing c = find_crossing(mass, est, covered, want);
    if (c.bin < 0) {
      need = nb;  // rounding: everything
    } else {
      // Within the crossing quantum, as many blocks as its mean mass says.
      const double mean = static_cast<double>(c.val) / max(c.count, 1);
      const double rest = static_cast<double>(want - covered - c.above);
      const int k = min(c.count, max(1, static_cast<int>(ceil(rest / mean - 1e-9))));
      need = n_mand + c.count_above + k;
    }
  }
  // The score histogram's loads and lane prefix before the barrier (they need no count).
  const CountBins score_bins = load_count_bins(scr);
  __shared__ int needs[kMaxSparseKvHeads];
  if (lane == 0) needs[h] = need;
  __syncthreads();
  int keep = n_mand;
  for (int i = 0; i < Hkv; ++i) keep = max(keep, needs[i]);
  const int keep_min = static_cast<int>(ceil(nb * (1.0 - a.max_ratio) - 1e-9));
  const int keep_max = static_cast<int>(floor(nb * (1.0 - a.min_ratio) + 1e-9));
  keep = max(n_mand, min(max(keep, keep_min), keep_max));
  int* sel = a.select + 4 * sh;
  if (keep >= nb) {
    if (lane == 0) {
      sel[0] = nb;
      sel[3] = 0;
    }
  } else {
    const int take = keep - n_mand;
    int bin = kBins, in_bin = 0;  // take == 0: no other block
    if (take > 0) {
      const Crossing c = count_crossing(score_bins, take);
      bin = c.bin;  // always found: take <= the others' count
      in_bin = take - c.count_above;
    }
    if (lane == 0) {
      sel[0] = keep;
      sel[1] = bin;
      sel[2] = in_bin;
      sel[3] = 1;
      double* st = a.layer_stats;
      atomicAdd(st, static_cast<double>(nb));
      atomicAdd(st + 1, static_cast<double>(keep));
      atomicAdd(st + 2, 1.0);
      const double t = static_cast<double>(total) / kMassUnit;
      if (t > 0) atomicAdd(st + 3, (log(t) - a.head_mlogm[sh] / t) / log(2.0));
    }
  }
}

// ---- 4. tables ---------------------------------------------------------------------------

constexpr int kTableThreads = 512;

__global__ void __launch_bounds__(kTableThreads) table_kernel(SparseSelect a) {
  const int h = blockIdx.x, s = blockIdx.y;
  const int Hkv = a.num_kv_heads, MB = a.max_blocks, bs = a.block_size;
  const int64_t sh = static_cast<int64_t>(s) * Hkv + h;
  const int ctx = a.context_lens[s];
  const int* table = a.block_tables + static_cast<int64_t>(s) * MB;
  int* out = a.head_tables + sh * MB;
  const int nb = eligible_blocks(a, s);
  const int* sel = a.select + 4 * sh;
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
  }
  if (nb == 0 || sel[3] == 0) {
    const int n = ctx > 0 ? (ctx + bs - 1) / bs : 0;
    for (int j = threadIdx.x; j < n; j += blockDim.x) out[j] = table[j];
    if (h == 0 && threadIdx.x == 0) a.context_lens_out[s] = ctx;
    return;
  }
  const int keep = sel[0], bin = sel[1], in_bin = sel[2];
  int ob, oe;
  others_range(a, nb, &ob, &oe);
  const float* score = a.score + sh * MB;
  // Each thread a run of blocks in position order.
  const int per = (nb + kTableThreads - 1) / kTableThreads;
  const int lo = min(nb, threadIdx.x * per), hi = min(nb, lo + per);
  int ties = 0;
  for (int j = lo; j < hi; ++j) ties += j >= ob && j < oe && quantum(score[j]) == bin;
  using Scan = cub::BlockScan<int, kTableThreads>;
  __shared__ typename Scan::TempStorage tmp;
  int tie_rank;
  Scan(tmp).ExclusiveSum(ties, tie_rank);
  __syncthreads();
  // Whether block j is kept; r counts this thread's threshold-quantum blocks so far.
  auto kept_at = [&](int j, int& r) {
    if (j < ob || j >= oe) return true;
    const int b = quantum(score[j]);
    return b > bin || (b == bin && r++ < in_bin);
  };
  int kept = 0;
  for (int j = lo, r = tie_rank; j < hi; ++j) kept += kept_at(j, r);
  int pos;
  __syncthreads();  // the scan's storage is reused
  Scan(tmp).ExclusiveSum(kept, pos);
  for (int j = lo, r = tie_rank; j < hi; ++j) {
    if (kept_at(j, r)) out[pos++] = table[j];
  }
  if (h == 0 && threadIdx.x == 0) a.context_lens_out[s] = (keep - 1) * bs + (ctx - (nb - 1) * bs);
}

template <typename T, int D>
void launch_select(const void* q, int64_t q_stride, const void* summaries, const SparseSelect& a,
                   cudaStream_t stream) {
  const int S = a.num_seqs, MB = a.max_blocks, Hkv = a.num_kv_heads;
  if (S == 0) return;
  const size_t q_bytes = static_cast<size_t>(a.num_heads) * D * sizeof(float);  // <= 64 KB (kMaxSparseHeads)
  static bool configured = false;  // per instantiation; raising the limit is idempotent
  if (!configured) {
    cudaFuncSetAttribute(score_kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         static_cast<int>(kMaxSparseHeads * D * sizeof(float)));
    configured = true;
  }
  score_kernel<T, D><<<dim3((MB + kScoreBlocks - 1) / kScoreBlocks, S), kScoreThreads, q_bytes, stream>>>(
      static_cast<const T*>(q), q_stride, static_cast<const T*>(summaries), a);
  bin_kernel<<<dim3((MB + kBinThreads - 1) / kBinThreads, Hkv, S), kBinThreads, 0, stream>>>(a);
  count_kernel<<<S, 32 * Hkv, 0, stream>>>(a);
  table_kernel<<<dim3(Hkv, S), kTableThreads, 0, stream>>>(a);
}

}  // namespace

void update_block_summaries(DType t, KVCache kv, int32_t layer, void* summaries, const int32_t* query_start,
                            const int32_t* context_lens, const int32_t* block_tables, int32_t max_blocks,
                            int32_t num_seqs, cudaStream_t stream) {
  if (num_seqs == 0) return;
  // A decode touches one block per sequence; a prompt chunk many: spread those over z.
  const dim3 grid(num_seqs, kv.num_kv_heads, 8);
  K25_DISPATCH_DTYPE(t, (summary_kernel<T><<<grid, kv.head_dim, 0, stream>>>(
                            kv, layer, static_cast<T*>(summaries), query_start, context_lens, block_tables,
                            max_blocks)));
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
