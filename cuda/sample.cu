// Sampling on the device: penalties, temperature, top-k, min-p, top-p, a seeded draw and
// raw logprobs, one CTA per row; only the result structs go back to the host.
//
// The rules are the host sampler's (cpp/engine/sampler.cpp), step for step, so that the
// same logits give the same token on either side:
//   - candidates are ranked by (scaled logit descending, token id ascending);
//   - top-k keeps the first k, min-p zeroes candidates whose probability relative to the
//     best is below min_p, top-p keeps the shortest ranked prefix whose mass reaches
//     top_p of the total, and the draw walks the survivors until the running mass passes
//     u * total, with u = counter_uniform(seed, output index) — in ranked order when
//     top-k or top-p ranked them, in id order otherwise (as the host does).
// Ranked prefixes are found without sorting: a radix select over the 32-bit order key of
// each scaled logit, four 8-bit digits from the top, then a scan in id order among the
// elements that tie on the final key. Masses are fixed-point integers (probability x
// 2^kMassBits), so every sum is exact and independent of the order the threads add in:
// a row samples the same token whatever else is in the batch. The float arithmetic that
// feeds them uses round-to-nearest intrinsics, immune to --use_fast_math, and exp in
// double rounded to float, as the host's expf is.
#include <cfloat>
#include <cstdint>

#include "common.cuh"

namespace k25::cuda {

namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ uint32_t order_key(float x) {
  const uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The host's counter_uniform: a double in [0, 1).
__device__ __forceinline__ double counter_uniform(uint64_t seed, uint64_t counter) {
  const uint64_t bits = splitmix64(splitmix64(seed) ^ (counter * 0xD1B54A32D192ED03ull + 1));
  return static_cast<double>(bits >> 11) * (1.0 / 9007199254740992.0);
}

constexpr int kCopies = 8;  // histogram copies (warps w and w + 8k share one)

struct Shared {
  unsigned long long copies[kCopies][256];
  unsigned long long hist[256];
  unsigned long long warp_sum[kWarps];
  double dwarp[kWarps];
  float fwarp[kWarps];
  int iwarp[kWarps];
  // Results of the block-wide steps, read by every thread.
  uint32_t key;
  int id;
  unsigned long long above, found, total;
  float fval;
  double dval;
};

__device__ float block_max(float v, Shared& sh) {
  v = warp_max(v);
  __syncthreads();
  if (threadIdx.x % 32 == 0) sh.fwarp[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    float w = sh.fwarp[threadIdx.x];
    w = warp_max(w);
    if (threadIdx.x == 0) sh.fval = w;
  }
  __syncthreads();
  return sh.fval;
}

__device__ double block_sum(double v, Shared& sh) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if (threadIdx.x % 32 == 0) sh.dwarp[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    double w = sh.dwarp[threadIdx.x];
    for (int o = 16; o > 0; o >>= 1) w += __shfl_xor_sync(0xffffffffu, w, o);
    if (threadIdx.x == 0) sh.dval = w;
  }
  __syncthreads();
  return sh.dval;
}

// The best (key, lowest id) among elements ranked strictly after (after_key, after_id)
// (or all, when after_id < 0); returns the id, -1 when there is none.
template <typename KeyOf>
__device__ int block_next(int n, KeyOf key_of, uint32_t after_key, int after_id, Shared& sh) {
  uint32_t best = 0;
  int bid = -1;
  for (int i = threadIdx.x; i < n; i += kThreads) {
    const uint32_t k = key_of(i);
    if (after_id >= 0 && (k > after_key || (k == after_key && i <= after_id))) continue;
    if (bid < 0 || k > best) {  // ids ascend within a thread: the first of equals wins
      best = k;
      bid = i;
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    const uint32_t ob = __shfl_xor_sync(0xffffffffu, best, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bid, o);
    if (oi >= 0 && (bid < 0 || ob > best || (ob == best && oi < bid))) {
      best = ob;
      bid = oi;
    }
  }
  __syncthreads();
  if (threadIdx.x % 32 == 0) {
    sh.iwarp[threadIdx.x / 32] = bid;
    sh.hist[threadIdx.x / 32] = best;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int b = -1;
    uint32_t bk = 0;
    for (int w = 0; w < kWarps; ++w) {
      const int i = sh.iwarp[w];
      const uint32_t k = static_cast<uint32_t>(sh.hist[w]);
      if (i >= 0 && (b < 0 || k > bk || (k == bk && i < b))) {
        b = i;
        bk = k;
      }
    }
    sh.id = b;
    sh.key = bk;
  }
  __syncthreads();
  return sh.id;
}

// Inclusive scan of one 64-bit value per thread in thread order; returns the exclusive
// prefix of this thread.
__device__ unsigned long long block_exclusive_scan(unsigned long long v, Shared& sh) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  unsigned long long inc = v;
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned long long t = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += t;
  }
  __syncthreads();
  if (lane == 31) sh.warp_sum[warp] = inc;
  __syncthreads();
  unsigned long long before = 0;
  for (int w = 0; w < warp; ++w) before += sh.warp_sum[w];
  return before + inc - v;
}

// The element at which the running weight, in ranked order (key descending, id
// ascending), first reaches `need` (>= 1): its key and id, and the weight ranked before
// it. Elements of weight 0 never hold that place. `need` above the total gives id -1.
template <typename KeyOf, typename WeightOf>
__device__ void ranked_select(int n, KeyOf key_of, WeightOf weight_of, unsigned long long need, Shared& sh,
                              uint32_t* out_key, int* out_id, unsigned long long* out_before) {
  uint32_t prefix = 0, mask = 0;
  unsigned long long above = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int d = threadIdx.x; d < kCopies * 256; d += kThreads) sh.copies[d / 256][d % 256] = 0;
    __syncthreads();
    // Most weight sits in a few digits (logits share their high bits), so a thread sums
    // runs of one digit before it adds, and warps add into kCopies histograms: shared
    // atomics on one address would otherwise serialise the whole row.
    unsigned long long* hist = sh.copies[(threadIdx.x / 32) % kCopies];
    uint32_t run_digit = 256;
    unsigned long long run = 0;
    for (int i = threadIdx.x; i < n; i += kThreads) {
      const uint32_t k = key_of(i);
      if ((k & mask) != prefix) continue;
      const unsigned long long w = weight_of(i);
      if (!w) continue;
      const uint32_t digit = (k >> shift) & 255u;
      if (digit != run_digit) {
        if (run) atomicAdd(&hist[run_digit], run);
        run_digit = digit;
        run = 0;
      }
      run += w;
    }
    if (run) atomicAdd(&hist[run_digit], run);
    __syncthreads();
    for (int d = threadIdx.x; d < 256; d += kThreads) {
      unsigned long long t = 0;
      for (int c = 0; c < kCopies; ++c) t += sh.copies[c][d];
      sh.hist[d] = t;
    }
    __syncthreads();
    if (threadIdx.x < 32) {
      // Lane j holds digits 255 - 8j down to 248 - 8j.
      const int lane = threadIdx.x;
      unsigned long long local = 0;
      for (int j = 0; j < 8; ++j) local += sh.hist[255 - 8 * lane - j];
      unsigned long long inc = local;
      for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long t = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += t;
      }
      const unsigned long long excl = inc - local;
      const bool hit = above + inc >= need && above + excl < need;
      const unsigned ballot = __ballot_sync(0xffffffffu, hit);
      if (ballot == 0) {
        if (lane == 0) {
          sh.found = 0;  // need exceeds the total
        }
      } else if (hit) {
        unsigned long long run = above + excl;
        int digit = 255 - 8 * lane;
        for (int j = 0; j < 8; ++j) {
          const int d = 255 - 8 * lane - j;
          if (run + sh.hist[d] >= need) {
            digit = d;
            break;
          }
          run += sh.hist[d];
        }
        sh.found = 1;
        sh.key = static_cast<uint32_t>(digit);
        sh.above = run;
      }
    }
    __syncthreads();
    if (!sh.found) {
      *out_id = -1;
      *out_key = 0;
      *out_before = 0;
      return;
    }
    prefix |= sh.key << shift;
    mask |= 255u << shift;
    above = sh.above;
    __syncthreads();
  }
  // Ties on the full key: in id order. Thread t scans ids [t * chunk, (t + 1) * chunk).
  if (threadIdx.x == 0) sh.id = -1;
  const int chunk = (n + kThreads - 1) / kThreads;
  const int lo = min(n, static_cast<int>(threadIdx.x) * chunk), hi = min(n, lo + chunk);
  unsigned long long local = 0;
  for (int i = lo; i < hi; ++i) {
    if (key_of(i) == prefix) local += weight_of(i);
  }
  const unsigned long long excl = block_exclusive_scan(local, sh);
  if (local > 0 && above + excl < need && above + excl + local >= need) {
    unsigned long long run = above + excl;
    for (int i = lo; i < hi; ++i) {
      if (key_of(i) != prefix) continue;
      const unsigned long long w = weight_of(i);
      if (w && run + w >= need) {
        sh.id = i;
        sh.above = run;
        break;
      }
      run += w;
    }
  }
  __syncthreads();
  *out_key = prefix;
  *out_id = sh.id;
  *out_before = sh.above;
  __syncthreads();
}

__global__ void __launch_bounds__(kThreads) sample_kernel(float* logits, int64_t row_stride, int n,
                                                          const SampleRow* rows, PenaltyEntry* penalties,
                                                          const int32_t* bans, float* scratch, int mass_bits,
                                                          SampleOut* outs) {
  __shared__ Shared sh;
  const SampleRow& p = rows[blockIdx.x];
  SampleOut& out = outs[blockIdx.x];
  float* x = logits + static_cast<int64_t>(p.logits_row) * row_stride;
  float* q = scratch + static_cast<int64_t>(blockIdx.x) * n;
  if (threadIdx.x == 0) sh.id = -1;

  // Raw logprobs first: before penalties change the row.
  float raw_lse = 0.0f;
  if (p.logprobs >= 0) {
    float mx = -INFINITY;
    for (int i = threadIdx.x; i < n; i += kThreads) mx = fmaxf(mx, x[i]);
    mx = block_max(mx, sh);
    double s = 0.0;
    for (int i = threadIdx.x; i < n; i += kThreads) s += exp(static_cast<double>(__fsub_rn(x[i], mx)));
    s = block_sum(s, sh);
    raw_lse = isfinite(mx) ? __fadd_rn(mx, static_cast<float>(log(s))) : mx;
    auto raw_key = [&](int i) { return order_key(x[i]); };
    int after = -1;
    uint32_t after_key = 0;
    for (int j = 0; j < p.logprobs && j < kMaxTopLogprobs; ++j) {
      const int id = block_next(n, raw_key, after_key, after, sh);
      if (id < 0) break;
      if (threadIdx.x == 0) {
        out.top_ids[j] = id;
        out.top_logprobs[j] = __fsub_rn(x[id], raw_lse);
      }
      after = id;
      after_key = sh.key;
    }
  }
  __syncthreads();

  // Penalties (repetition over prompt and output, presence/frequency over the output),
  // then the banned ids. Entries are distinct tokens: no two threads touch one logit.
  for (int e = threadIdx.x; e < p.pen_count; e += kThreads) {
    PenaltyEntry& pe = penalties[p.pen_begin + e];
    float l = x[pe.token];
    pe.raw = l;
    if (p.repetition_penalty != 1.0f) {
      l = l > 0.0f ? __fdiv_rn(l, p.repetition_penalty) : __fmul_rn(l, p.repetition_penalty);
    }
    if (pe.out_count > 0 && (p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f)) {
      l = __fsub_rn(l, __fadd_rn(p.presence_penalty, __fmul_rn(p.frequency_penalty, static_cast<float>(pe.out_count))));
    }
    x[pe.token] = l;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < p.ban_count; e += kThreads) x[bans[p.ban_begin + e]] = -INFINITY;
  __syncthreads();

  int token = -1;
  if (p.temperature < kGreedyTemp || p.top_k == 1) {
    auto key = [&](int i) { return order_key(x[i]); };
    token = block_next(n, key, 0, -1, sh);
  } else {
    const float inv_t = __fdiv_rn(1.0f, p.temperature);
    auto key = [&](int i) { return order_key(__fmul_rn(x[i], inv_t)); };
    // Top-k: the k-th ranked candidate bounds the set.
    uint32_t k_key = 0;
    int k_id = n;  // everything
    if (p.top_k > 0 && p.top_k < n) {
      unsigned long long before;
      ranked_select(n, key, [](int) { return 1ull; }, static_cast<unsigned long long>(p.top_k), sh, &k_key, &k_id,
                    &before);
    }
    auto in_top_k = [&](int i, uint32_t k) { return k_id >= n || k > k_key || (k == k_key && i <= k_id); };
    float mx = -INFINITY;
    for (int i = threadIdx.x; i < n; i += kThreads) {
      const float s = __fmul_rn(x[i], inv_t);
      if (in_top_k(i, order_key(s))) mx = fmaxf(mx, s);
    }
    mx = block_max(mx, sh);
    if (isfinite(mx)) {
      // Probabilities relative to the best (min-p zeroes the small ones) as fixed point.
      const double one = ldexp(1.0, mass_bits);
      unsigned long long total_local = 0;
      for (int i = threadIdx.x; i < n; i += kThreads) {
        const float s = __fmul_rn(x[i], inv_t);
        float v = 0.0f;
        if (in_top_k(i, order_key(s))) {
          v = static_cast<float>(exp(static_cast<double>(__fsub_rn(s, mx))));
          if (v < p.min_p) v = 0.0f;
        }
        q[i] = v;
        total_local += static_cast<unsigned long long>(static_cast<double>(v) * one);
      }
      auto weight = [&](int i) { return static_cast<unsigned long long>(static_cast<double>(q[i]) * one); };
      const unsigned long long before_me = block_exclusive_scan(total_local, sh);
      if (threadIdx.x == kThreads - 1) sh.total = before_me + total_local;
      __syncthreads();
      unsigned long long mass = sh.total;
      // Top-p: the shortest ranked prefix with mass >= top_p * total.
      uint32_t p_key = 0;
      int p_id = n;
      if (p.top_p < 1.0f) {
        const double target = static_cast<double>(p.top_p) * static_cast<double>(mass);
        unsigned long long need = static_cast<unsigned long long>(ceil(target));
        if (need < 1) need = 1;
        unsigned long long before;
        ranked_select(n, key, weight, need, sh, &p_key, &p_id, &before);
        if (p_id >= 0) mass = before + weight(p_id);
        else p_id = n;
      }
      // The draw: the first ranked survivor whose running mass passes u * mass.
      const double u = counter_uniform(p.seed, p.counter) * static_cast<double>(mass);
      const unsigned long long need = static_cast<unsigned long long>(floor(u)) + 1;
      auto survivor = [&](int i) {
        const uint32_t k = key(i);
        return p_id >= n || k > p_key || (k == p_key && i <= p_id) ? weight(i) : 0ull;
      };
      uint32_t t_key;
      unsigned long long before;
      if ((p.top_k > 0 && p.top_k < n) || p.top_p < 1.0f) {
        ranked_select(n, key, survivor, need, sh, &t_key, &token, &before);
      } else {
        // Without a ranking filter the host walks the vocabulary in id order: all keys
        // equal makes the select a scan in id order.
        ranked_select(n, [](int) { return 0u; }, survivor, need, sh, &t_key, &token, &before);
      }
    }
  }

  if (threadIdx.x == 0) {
    out.token = token;
    out.error = token < 0 ? 1 : 0;
    out.logprob = 0.0f;
    out.num_top = p.logprobs > 0 ? min(p.logprobs, kMaxTopLogprobs) : 0;
  }
  if (token >= 0 && p.logprobs >= 0) {
    // The sampled token's raw logit: saved by its penalty entry, if it had one.
    __syncthreads();
    if (threadIdx.x == 0) sh.fval = x[token];
    __syncthreads();
    for (int e = threadIdx.x; e < p.pen_count; e += kThreads) {
      if (penalties[p.pen_begin + e].token == token) sh.fval = penalties[p.pen_begin + e].raw;
    }
    __syncthreads();
    if (threadIdx.x == 0) out.logprob = __fsub_rn(sh.fval, raw_lse);
  }
}

}  // namespace

namespace {

// ids[rows[i].logits_row] = out[i].token: the sampled ids where the next pipelined step
// reads them (take_previous_ids checks their range).
__global__ void scatter_sampled_ids_kernel(const SampleOut* out, const SampleRow* rows, int n, int32_t* ids) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) ids[rows[i].logits_row] = out[i].error ? -1 : out[i].token;
}

}  // namespace

void scatter_sampled_ids(const SampleOut* out, const SampleRow* rows, int32_t num_rows, int32_t* ids,
                         cudaStream_t stream) {
  if (num_rows <= 0) return;
  scatter_sampled_ids_kernel<<<(num_rows + 127) / 128, 128, 0, stream>>>(out, rows, num_rows, ids);
}

void sample_rows(float* logits, int64_t row_stride, int32_t vocab, const SampleRow* rows, int32_t num_rows,
                 PenaltyEntry* penalties, const int32_t* bans, float* scratch, SampleOut* out, cudaStream_t stream) {
  if (num_rows <= 0) return;
  // Fixed-point masses: the largest probability is 1, and vocab of them must fit 63 bits.
  int bits = 0;
  while ((1ll << bits) < vocab) ++bits;
  sample_kernel<<<num_rows, kThreads, 0, stream>>>(logits, row_stride, vocab, rows, penalties, bans, scratch,
                                                   62 - bits, out);
}

}  // namespace k25::cuda
