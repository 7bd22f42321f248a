#include "ops/block_sparsity.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <iterator>
#include <utility>

#include "k25/status.h"
#include "ops/parallel.h"
#include "ops/vec16.h"
#include "ops/vecn.h"

namespace k25 {

namespace {

// Key `off` of a block's head, channel d (the CPU cache keeps K transposed); T is the pool's
// element (float, or uint16_t for bfloat16).
template <typename T>
inline float key_at(const T* K, const KVLayout& L, int32_t off, int32_t d) {
  return cpu::as_float(L.k_transposed ? K[static_cast<int64_t>(d) * L.block_size + off]
                                      : K[static_cast<int64_t>(off) * L.head_dim + d]);
}

// The key codes of one block's first n keys (SummaryLayout), from the summary row's bounds;
// codes past n are 0.
template <typename T>
void write_key_codes(const T* K, const KVLayout& L, float* row, const SummaryLayout& S, int32_t n) {
  const int32_t D = L.head_dim;
  float* codes = row + S.codes_at();
  for (int32_t d = 0; d < D; ++d) {
    uint32_t w;
    std::memcpy(&w, row + d, 4);
    const float lo = summary_min(w), inv = key_code_scale(lo, summary_max(w));
    for (int32_t i = 0; i < S.code_words; ++i) {
      uint32_t word = 0;
      for (int32_t t = 16 * i; t < std::min(n, 16 * i + 16); ++t) {
        word |= key_code(key_at(K, L, t, d), lo, inv) << (2 * (t % 16));
      }
      std::memcpy(codes + static_cast<int64_t>(i) * D + d, &word, 4);
    }
  }
}

template <typename T>
void update_key_summaries_of(const T* kv, const KVLayout& L, float* summaries, const SummaryLayout& S,
                             int32_t layer, const cpu::AttentionBatch& B) {
  const int32_t bs = L.block_size, D = L.head_dim;
  // Sequences never share a block that is being written: one task per sequence keeps
  // each block's updates in position order without locks.
  parallel_for(0, B.num_seqs, 1, [&](int64_t sb, int64_t se) {
    for (int64_t s = sb; s < se; ++s) {
      const int32_t q_len = B.query_start[s + 1] - B.query_start[s];
      const int32_t ctx = B.context_lens[s];
      const int32_t* table = B.block_tables + s * B.max_blocks_per_seq;
      for (int32_t pos = ctx - q_len; pos < ctx; ++pos) {
        const int64_t block = table[pos / bs];
        const int32_t off = pos % bs;
        for (int32_t h = 0; h < L.num_kv_heads; ++h) {
          const T* K = kv + L.k_offset(block, layer, h);
          float* row = summaries + S.offset(block, layer, h);
          // Rounding is monotone, so the rounded minimum of the keys is the minimum of their
          // rounded values: each key folds in rounded.
          for (int32_t d = 0; d < D; ++d) {
            const float k = key_at(K, L, off, d);
            float lo = bf16_outward(k, false), hi = bf16_outward(k, true);
            if (off != 0) {
              uint32_t w;
              std::memcpy(&w, row + d, 4);
              lo = std::min(lo, summary_min(w));
              hi = std::max(hi, summary_max(w));
            }
            const uint32_t w = summary_word(lo, hi);
            std::memcpy(row + d, &w, 4);
          }
          // The block's codes, once the step's last key in it is folded (a prompt chunk codes
          // each block once): every key so far, against the bounds as they now stand.
          if (S.code_words > 0 && (off == bs - 1 || pos == ctx - 1)) write_key_codes(K, L, row, S, off + 1);
          if (!S.has_sums()) continue;
          float* sk = row + S.sums_at();
          float* sv = sk + D;
          const T* v = kv + L.v_offset(block, layer, h) + static_cast<int64_t>(off) * D;
          for (int32_t d = 0; d < D; ++d) {
            const float k = key_at(K, L, off, d), vd = cpu::as_float(v[d]);
            sk[d] = off == 0 ? k : sk[d] + k;
            sv[d] = off == 0 ? vd : sv[d] + vd;
          }
        }
      }
    }
  });
}

}  // namespace

void update_key_summaries(const void* kv, const KVLayout& L, float* summaries, const SummaryLayout& S,
                          int32_t layer, const cpu::AttentionBatch& B) {
  with_elem(L, kv, [&](auto* pool) { update_key_summaries_of(pool, L, summaries, S, layer, B); });
}

namespace {

// A block's summary and keys of one layer and KV head: in the pool, or for a cold block
// (negative id, kv_layout.h) where the batch's cold lists put them.
inline const float* summary_at(const float* summaries, const SummaryLayout& S, const cpu::AttentionBatch& B,
                               int32_t block, int32_t layer, int32_t h) {
  return block >= 0 ? summaries + S.offset(block, layer, h)
                    : B.cold_summaries[cold_block_index(block)] + S.offset(0, layer, h);
}
// (Bytes: the pool's element is L.elem.)
inline const void* keys_at(const void* kv, const KVLayout& L, const cpu::AttentionBatch& B, int32_t block,
                           int32_t layer, int32_t h) {
  const char* base = block >= 0 ? static_cast<const char*>(kv) + block * L.block_elems() * L.elem_bytes()
                                : static_cast<const char*>(B.cold_blocks[cold_block_index(block)]);
  return base + L.k_in_block(layer, h) * L.elem_bytes();
}

using cpu::fold_lanes;
using cpu::kLanes;
using cpu::loadn;
using cpu::vn;
using cpu::vni;

constexpr float kNegInf = -INFINITY;

// Blocks per scoring task: a sequence of a few hundred blocks spreads over the threads in
// enough tasks that the threads, claiming tasks as they finish (parallel_for_dynamic), end
// together, and a task is still long enough to pay for itself.
constexpr int32_t kBlocksPerTask = 16;

// A block's rank as one integer, larger is better: the score's bits mapped to an unsigned
// order, then the block index reversed, so that equal scores rank the lower block first
// (the order a stable sort by descending score gives). Integer keys also give NaN scores
// a fixed place, where a float comparison would break the ordering nth_element needs.
inline uint64_t rank_key(float score, int32_t j) {
  uint32_t u;
  const float x = score + 0.0f;  // -0 ranks as +0
  std::memcpy(&u, &x, sizeof(u));
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (static_cast<uint64_t>(u) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(j));
}

inline int32_t key_block(uint64_t key) { return static_cast<int32_t>(0xFFFFFFFFu - static_cast<uint32_t>(key)); }

// The R channels of largest |q_d|, largest first (ties: lower channel first), by insertion
// into a list of R: the same channels in the same order as sorting all D.
void top_channels(const float* q, int32_t D, int32_t R, int32_t* chan) {
  int32_t n = 0;
  for (int32_t d = 0; d < D; ++d) {
    const float a = std::fabs(q[d]);
    if (n == R && !(a > std::fabs(q[chan[R - 1]]))) continue;
    int32_t i = n < R ? n++ : R - 1;
    for (; i > 0 && a > std::fabs(q[chan[i - 1]]); --i) chan[i] = chan[i - 1];
    chan[i] = d;
  }
}

// The scoring's vectors are the machine's own width (ops/vecn.h: 8 floats with AVX2, 16
// with AVX-512, 4 with NEON); a wider GCC vector than the registers is kept in memory in
// these loops (with fold_lanes' old run-time shuffle masks the scoring was 2-3x slower on
// AVX2). The keys of one channel come in groups of 16 (the fast path's block sizes are
// multiples of 16): kV vectors a group.
constexpr int kV = 16 / kLanes;
// Blocks scored together by one query head: independent chains of vector work that the
// core overlaps (one block alone is a chain of dependent reductions), sharing the head's
// channel list and weights; kBatch * kV accumulators fill about half the registers.
constexpr int kBatch = 8 / kV > 0 ? 8 / kV : 1;

// What scoring needs of one query head, prepared once per step: for the channel estimate
// the chosen channels, scale * q on them, and scale * q / 2 zeroed on them (the centre
// term's weights); for the bound max(q, 0) and min(q, 0).
struct QueryPrep {
  const float* q;    // [D]
  const float* a;    // [D]: scale * q / 2 off the chosen channels (estimate) or max(q, 0) (bound)
  const float* b;    // [D]: min(q, 0) (bound)
  const int32_t* chan;
  const float* qv;   // [R]: scale * q on the chosen channels
};

// A summary row's packed minima and maxima (SummaryLayout field 0), kLanes channels from d:
// the bfloat16 halves widened to floats by a shift and a mask.
typedef uint32_t vnw __attribute__((vector_size(sizeof(vn))));
inline void load_bounds(const float* row, int32_t d, vn* lo, vn* hi) {
  vnw w;
  std::memcpy(&w, row + d, sizeof(w));  // one unaligned vector load
  const vnw l = w << 16, h = w & 0xFFFF0000u;
  std::memcpy(lo, &l, sizeof(l));
  std::memcpy(hi, &h, sizeof(h));
}
inline void scalar_bounds(const float* row, int32_t d, float* lo, float* hi) {
  uint32_t w;
  std::memcpy(&w, row + d, 4);
  *lo = summary_min(w);
  *hi = summary_max(w);
}

// Per block of kB: sum_d w_d * (mn_d + mx_d) (row: the block's summary row).
template <int kB>
inline void centre_dots(const float* w, const float* const* row, int32_t D, float* out) {
  vn acc[kB] = {};
  int32_t d = 0;
  for (; d + kLanes <= D; d += kLanes) {
    const vn wd = loadn(w + d);
    for (int b = 0; b < kB; ++b) {
      vn lo, hi;
      load_bounds(row[b], d, &lo, &hi);
      acc[b] += wd * (lo + hi);
    }
  }
  for (int b = 0; b < kB; ++b) {
    out[b] = fold_lanes<false>(acc[b]);
    for (int32_t t = d; t < D; ++t) {
      float lo, hi;
      scalar_bounds(row[b], t, &lo, &hi);
      out[b] += w[t] * (lo + hi);
    }
  }
}

// One group of 16 keys' scores (kV vectors, `valid` of them real keys) folded into a block's
// running maximum m and sum l = sum exp(score - m); `first` starts them. Lanes past the
// block's last key are masked by selecting -inf (they may hold garbage).
inline void lse_group(vn* sc, int32_t valid, bool first, float* m, float* l) {
  if (valid < 16) {
    for (int v = 0; v < kV; ++v) {
      vn lane;
      for (int t = 0; t < kLanes; ++t) lane[t] = static_cast<float>(v * kLanes + t);
      sc[v] = lane < static_cast<float>(valid) ? sc[v] : vn{} + kNegInf;
    }
  }
  vn top_v = sc[0];
  for (int v = 1; v < kV; ++v) top_v = top_v > sc[v] ? top_v : sc[v];
  const float top = fold_lanes<true>(top_v);
  const float m_new = first ? top : std::max(*m, top);
  vn sum{};
  for (int v = 0; v < kV; ++v) sum += cpu::vexp_lanes<vn, vni, true>(sc[v] - m_new);
  const float add = fold_lanes<false>(sum);
  *l = first ? add : *l * cpu::vexp(*m - m_new) + add;
  *m = m_new;
}

// The channel estimate of kB blocks for one query head: each key's exact q_d k_d on the
// chosen channels plus q_d (min_d + max_d) / 2 on the others, scaled (the prepared weights
// carry the scale); per block the maximum m of those scores over its n keys and
// l = sum exp(score - m), so that its log-mass is m + log l. The centre term is the same
// for every key of a block, so it is added to m at the end, not to each key's score.
// Fast path: K stored [D][bs] with bs a multiple of 16, so one channel of 16 keys is kV
// vector loads. T: the pool's element (K points at T).
template <int kB, typename T>
inline void channel_lse(const QueryPrep& qp, int32_t R, int32_t D, int32_t bs, const void* const* K,
                        const float* const* mn, const int32_t* n, float* m, float* l) {
  int32_t n_max = 0;
  for (int b = 0; b < kB; ++b) n_max = std::max(n_max, n[b]);
  for (int32_t c = 0; c < n_max; c += 16) {
    vn acc[kB][kV] = {};
    for (int32_t i = 0; i < R; ++i) {
      const int64_t off = static_cast<int64_t>(qp.chan[i]) * bs + c;
      const float qd = qp.qv[i];
      for (int b = 0; b < kB; ++b) {
        const T* at = static_cast<const T*>(K[b]) + off;
        for (int v = 0; v < kV; ++v) acc[b][v] += loadn(at + v * kLanes) * qd;
      }
    }
    for (int b = 0; b < kB; ++b) {
      if (c < n[b]) lse_group(acc[b], n[b] - c, c == 0, m + b, l + b);
    }
  }
  float rest[kB];
  centre_dots<kB>(qp.a, mn, D, rest);
  for (int b = 0; b < kB; ++b) m[b] += rest[b];
}

// The same for one block of any layout and block size: keys gathered 16 at a time.
template <typename T>
inline void channel_lse_any(const QueryPrep& qp, int32_t R, const KVLayout& L, const T* K, const float* mn,
                            int32_t n, float* m, float* l) {
  for (int32_t c = 0; c < n; c += 16) {
    const int32_t cnt = std::min(16, n - c);
    vn acc[kV] = {};
    for (int32_t i = 0; i < R; ++i) {
      float k[16] = {};
      for (int32_t t = 0; t < cnt; ++t) k[t] = key_at(K, L, c + t, qp.chan[i]);
      for (int v = 0; v < kV; ++v) acc[v] += loadn(k + v * kLanes) * qp.qv[i];
    }
    lse_group(acc, cnt, c == 0, m, l);
  }
  float rest;
  centre_dots<1>(qp.a, &mn, L.head_dim, &rest);
  *m += rest;
}

// The Quest bound and the centre estimate of kB blocks for one query head, scaled:
// sum_d (max(q_d, 0) mx_d + min(q_d, 0) mn_d) (= sum_d max(q_d mn_d, q_d mx_d), mn <= mx,
// without a comparison) and q·(mn + mx) / 2.
template <int kB>
inline void bound_and_centre(const QueryPrep& qp, int32_t D, const float* const* mn, float scale, float* ub,
                             float* ctr) {
  vn u[kB] = {}, c[kB] = {};
  int32_t d = 0;
  for (; d + kLanes <= D; d += kLanes) {
    const vn qa = loadn(qp.a + d), qb = loadn(qp.b + d), q = loadn(qp.q + d);
    for (int b = 0; b < kB; ++b) {
      vn lo, hi;
      load_bounds(mn[b], d, &lo, &hi);
      u[b] += qa * hi + qb * lo;
      c[b] += q * (lo + hi);
    }
  }
  for (int b = 0; b < kB; ++b) {
    float us = fold_lanes<false>(u[b]), cs = fold_lanes<false>(c[b]);
    for (int32_t t = d; t < D; ++t) {
      float lo, hi;
      scalar_bounds(mn[b], t, &lo, &hi);
      us += qp.a[t] * hi + qp.b[t] * lo;
      cs += qp.q[t] * (lo + hi);
    }
    ub[b] = us * scale;
    ctr[b] = 0.5f * cs * scale;
  }
}

// The key-code estimate of one block for G query heads of one KV head (their prepared weights
// a = scale * q): key t's score scale * sum_d q_d (lo_d + c_td (hi_d - lo_d) / 3), its codes
// c_td read back in the channels' bounds, i.e. base + sum_d coef_d c_td with base = sum_d
// a_d lo_d and coef_d = a_d (hi_d - lo_d) / 3; per head the block's log-mass over its n keys,
// e[g] = m + log l. A channel's 16 codes are widened once and serve the G heads. row: the
// summary row (its bounds); codes: its code words. coef: scratch of G * D floats.
template <int G>
inline void codes_lse(const QueryPrep* qp, int32_t D, const float* row, const float* codes, int32_t n,
                      const vni* shifts, float* coef, float* e) {
  float base[G];
  {
    vn acc[G] = {};
    const vn third = vn{} + (1.0f / 3.0f);
    int32_t d = 0;
    for (; d + kLanes <= D; d += kLanes) {
      vn lo, hi;
      load_bounds(row, d, &lo, &hi);
      const vn step = (hi - lo) * third;
      for (int g = 0; g < G; ++g) {
        const vn a = loadn(qp[g].a + d);
        acc[g] += a * lo;
        cpu::storen(coef + g * D + d, a * step);
      }
    }
    for (int g = 0; g < G; ++g) base[g] = fold_lanes<false>(acc[g]);
    for (; d < D; ++d) {
      float lo, hi;
      scalar_bounds(row, d, &lo, &hi);
      for (int g = 0; g < G; ++g) {
        base[g] += qp[g].a[d] * lo;
        coef[g * D + d] = qp[g].a[d] * ((hi - lo) * (1.0f / 3.0f));
      }
    }
  }
  float m[G], l[G];
  for (int32_t i = 0; 16 * i < n; ++i) {
    vn acc[G][kV] = {};
    for (int32_t d = 0; d < D; ++d) {
      int32_t w;
      std::memcpy(&w, codes + static_cast<int64_t>(i) * D + d, 4);
      vn c[kV];
      for (int v = 0; v < kV; ++v) c[v] = __builtin_convertvector(((vni{} + w) >> shifts[v]) & 3, vn);
      for (int g = 0; g < G; ++g) {
        const float cf = coef[g * D + d];
        for (int v = 0; v < kV; ++v) acc[g][v] += c[v] * cf;
      }
    }
    for (int g = 0; g < G; ++g) {
      for (int v = 0; v < kV; ++v) acc[g][v] += base[g];
      lse_group(acc[g], n - 16 * i, i == 0, m + g, l + g);
    }
  }
  for (int g = 0; g < G; ++g) e[g] = m[g] + std::log(l[g]);
}

// The largest of x[0, n), a vector at a time (a running scalar maximum is a chain of
// dependent compares); the maximum does not depend on the order.
inline float max_of(const float* x, int32_t n) {
  vn acc = vn{} + kNegInf;
  int32_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const vn v = loadn(x + j);
    acc = acc < v ? v : acc;
  }
  float top = fold_lanes<true>(acc);
  for (; j < n; ++j) top = std::max(top, x[j]);
  return top;
}

// The greedy mass rule over candidate blocks: while `have` < `want`, take the best
// remaining candidate (keys: rank keys, larger first) and add its mass. Returns how many
// it takes. Rather than sorting, it splits the candidates at their middle rank with
// nth_element and adds or keeps whole halves (expected O(n)); the partial sums are added
// in another order than one by one, so the count can differ from running down the
// sorted order only where `want` lies within rounding of a partial sum.
int32_t greedy_count(uint64_t* first, uint64_t* last, const double* mass, double have, double want) {
  int32_t taken = 0;
  while (have < want && first != last) {
    if (last - first == 1) return taken + 1;
    uint64_t* mid = first + (last - first) / 2;
    std::nth_element(first, mid, last, std::greater<uint64_t>());
    double s = 0;
    for (const uint64_t* k = first; k < mid; ++k) s += mass[key_block(*k)];
    if (have + s >= want) {
      last = mid;
    } else {
      have += s;
      taken += static_cast<int32_t>(mid - first);
      first = mid;
    }
  }
  return taken;
}

// Buffers of one selection, kept by the calling thread across calls (the engine thread
// selects layer after layer, step after step).
struct SelectScratch {
  std::vector<int32_t> nbs, chan, need, keep;
  std::vector<size_t> base;
  std::vector<int64_t> items, tasks;
  std::vector<float> qbuf, raw, raw2, score, est;
  std::vector<uint64_t> keys;
  std::vector<double> entropy;
  std::vector<QueryPrep> prep;
};

// Per-task buffers of the workers.
struct TaskScratch {
  std::vector<double> mass;
  std::vector<uint8_t> kept;
  std::vector<uint64_t> all;
};

}  // namespace

bool select_blocks(const float* q, int64_t q_stride, const void* kv, const float* summaries, const SummaryLayout& S,
                   const KVLayout& L, int32_t layer, const cpu::AttentionBatch& B, int32_t num_heads, float scale,
                   const SparsityParams& p, LayerSelection* out, const ReusedSelection* reuse) {
  const int32_t Hkv = L.num_kv_heads, group = num_heads / Hkv, D = L.head_dim, bs = L.block_size;
  // The rule: the key-code estimate, the channel estimate on R channels, or (R == 0) the bound.
  const bool codes = p.key_codes;
  if (codes && S.code_words != SummaryLayout::of(L, true, false).code_words) {
    fail(ErrorCode::kInvalidArgument, "the key-code estimate needs summaries with key codes");
  }
  const int32_t R = codes ? 0 : std::min(std::max(p.score_channels, 0), D);
  const bool bound = !codes && R == 0;  // the count from the centre estimate, not the ranking one
  const int32_t nseq = B.num_seqs, MB = B.max_blocks_per_seq;
  out->context_lens.assign(B.context_lens, B.context_lens + nseq);
  out->sparse.assign(nseq, 0);
  out->reused.assign(nseq, 0);
  out->max_blocks = MB;
  out->head_tables.clear();
  out->positions.clear();
  out->blocks_total = out->blocks_kept = out->selections = out->reused_selections = 0;
  out->entropy_bits = 0;
  out->top_blocks.clear();
  bool any = false;
  for (int32_t s = 0; s < nseq; ++s) {
    const bool selects = selects_blocks(B, s, p);
    any = any || selects;
    out->reused[s] = selects && reuse && reuse[s].positions && reuse[s].count > 0;
  }
  if (!any) return false;
  out->head_tables.assign(static_cast<size_t>(nseq) * Hkv * MB, -1);
  out->positions.assign(static_cast<size_t>(nseq) * Hkv * MB, -1);

  // (A reference: the workers' lambdas must see this thread's buffers, not their own.)
  thread_local SelectScratch scratch;
  SelectScratch& X = scratch;
  // Eligible sequences: their block counts and where their scores start in the flat
  // buffers ([Hkv][nb] per sequence; the per-query-head ones are [Hkv][group][nb]).
  X.nbs.assign(nseq, 0);
  X.base.assign(nseq, 0);
  X.items.clear();  // s * Hkv + h of every eligible (sequence, KV head)
  X.tasks.clear();  // (s, first block) of every scoring task, as s * 2^32 + block
  size_t flat = 0;
  for (int32_t s = 0; s < nseq; ++s) {
    if (!selects_blocks(B, s, p) || out->reused[s]) continue;  // reused: not scored
    const int32_t nb = (B.context_lens[s] + bs - 1) / bs;
    X.nbs[s] = nb;
    X.base[s] = flat;
    flat += static_cast<size_t>(Hkv) * nb;
    for (int32_t h = 0; h < Hkv; ++h) X.items.push_back(static_cast<int64_t>(s) * Hkv + h);
    for (int32_t j = 0; j < nb; j += kBlocksPerTask) X.tasks.push_back((static_cast<int64_t>(s) << 32) | j);
  }
  // Each eligible query row, prepared once (not once per block).
  X.prep.assign(static_cast<size_t>(nseq) * num_heads, QueryPrep{});
  X.qbuf.resize(static_cast<size_t>(nseq) * num_heads * (2 * D + R));
  X.chan.resize(static_cast<size_t>(nseq) * num_heads * R);
  for (int32_t s = 0; s < nseq; ++s) {
    if (X.nbs[s] == 0) continue;
    for (int32_t hq = 0; hq < num_heads; ++hq) {
      const size_t i = static_cast<size_t>(s) * num_heads + hq;
      QueryPrep& qp = X.prep[i];
      qp.q = q + static_cast<int64_t>(B.query_start[s]) * q_stride + static_cast<int64_t>(hq) * D;
      float* a = X.qbuf.data() + i * (2 * D + R);
      float* b = a + D;
      float* qv = b + D;
      int32_t* chan = X.chan.data() + i * R;
      qp.a = a;
      qp.b = b;
      qp.chan = chan;
      qp.qv = qv;
      if (codes) {
        for (int32_t d = 0; d < D; ++d) a[d] = scale * qp.q[d];
      } else if (R > 0) {
        top_channels(qp.q, D, R, chan);
        for (int32_t d = 0; d < D; ++d) a[d] = 0.5f * scale * qp.q[d];
        for (int32_t k = 0; k < R; ++k) {
          qv[k] = scale * qp.q[chan[k]];
          a[chan[k]] = 0.0f;
        }
      } else {
        for (int32_t d = 0; d < D; ++d) {
          a[d] = std::max(qp.q[d], 0.0f);
          b[d] = std::min(qp.q[d], 0.0f);
        }
      }
    }
  }
  X.raw.resize(flat * group);                // per query head: channel estimates (or bounds)
  X.raw2.resize(bound ? flat * group : 0);   // per query head: centre estimates (bound rule)
  X.score.resize(flat);                      // per KV head: the rank score
  X.est.resize(bound ? flat : 0);            // per KV head: the estimate the count uses (bound rule)
  X.keys.resize(flat);
  X.need.assign(static_cast<size_t>(nseq) * Hkv, 0);
  X.keep.assign(nseq, 0);
  X.entropy.assign(static_cast<size_t>(nseq) * Hkv, 0.0);
  const bool fast = L.k_transposed && bs % 16 == 0;

  // 1. Per block and query head: the channel estimate (or the bound and the centre
  //    estimate), blocks in chunks so that one long sequence spreads over the threads.
  //    Claimed one task at a time: the scoring's random reads run at different speeds on
  //    the two threads, and equal halves left one idle for ~100 us a layer at 4K.
  parallel_for_dynamic(0, static_cast<int64_t>(X.tasks.size()), [&](int64_t tb, int64_t te) {
    const float* mn[kBlocksPerTask];
    const void* K[kBlocksPerTask];
    int32_t n[kBlocksPerTask];
    float m[kBlocksPerTask], l[kBlocksPerTask];
    // The key-code estimate's lane shifts (key t of a word at bits 2t) and weights.
    vni shifts[kV];
    for (int v = 0; v < kV; ++v) {
      for (int t = 0; t < kLanes; ++t) shifts[v][t] = 2 * (v * kLanes + t);
    }
    thread_local std::vector<float> coef;
    if (codes) coef.resize(static_cast<size_t>(4) * D);
    for (int64_t ti = tb; ti < te; ++ti) {
      const int32_t s = static_cast<int32_t>(X.tasks[ti] >> 32), j0 = static_cast<int32_t>(X.tasks[ti] & 0xFFFFFFFF);
      const int32_t nb = X.nbs[s], ctx = B.context_lens[s];
      const int32_t cnt = std::min(nb - j0, kBlocksPerTask);
      const int32_t* table = B.block_tables + static_cast<int64_t>(s) * MB + j0;
      const QueryPrep* prep = X.prep.data() + static_cast<size_t>(s) * num_heads;
      float* raw = X.raw.data() + X.base[s] * group + j0;
      float* raw2 = bound ? X.raw2.data() + X.base[s] * group + j0 : nullptr;
      for (int32_t k = 0; k < cnt; ++k) n[k] = j0 + k == nb - 1 ? ctx - (nb - 1) * bs : bs;
      for (int32_t h = 0; h < Hkv; ++h) {
        for (int32_t k = 0; k < cnt; ++k) {
          mn[k] = summary_at(summaries, S, B, table[k], layer, h);
          K[k] = R > 0 ? keys_at(kv, L, B, table[k], layer, h) : nullptr;  // only the channel estimate reads keys
        }
        if (codes) {  // the group's heads together, up to four at a time
          for (int32_t k = 0; k < cnt; ++k) {
            const float* cw = mn[k] + S.codes_at();
            for (int32_t g0 = 0; g0 < group; g0 += 4) {
              const QueryPrep* qg = prep + h * group + g0;
              float e[4];
              const int32_t gn = std::min(4, group - g0);
              switch (gn) {
                case 1: codes_lse<1>(qg, D, mn[k], cw, n[k], shifts, coef.data(), e); break;
                case 2: codes_lse<2>(qg, D, mn[k], cw, n[k], shifts, coef.data(), e); break;
                case 3: codes_lse<3>(qg, D, mn[k], cw, n[k], shifts, coef.data(), e); break;
                default: codes_lse<4>(qg, D, mn[k], cw, n[k], shifts, coef.data(), e); break;
              }
              for (int32_t gi = 0; gi < gn; ++gi) raw[static_cast<size_t>(h * group + g0 + gi) * nb + k] = e[gi];
            }
          }
          continue;
        }
        for (int32_t g = 0; g < group; ++g) {
          const QueryPrep& qp = prep[h * group + g];
          const size_t at = static_cast<size_t>(h * group + g) * nb;
          int32_t k = 0;
          if (R > 0) {
            with_elem(L, kv, [&](auto* pool) {  // the blocks' keys (K) are of the pool's element
              using T = std::remove_const_t<std::remove_pointer_t<decltype(pool)>>;
              if (fast) {
                for (; k + kBatch <= cnt; k += kBatch) {
                  channel_lse<kBatch, T>(qp, R, D, bs, K + k, mn + k, n + k, m + k, l + k);
                }
                for (; k < cnt; ++k) channel_lse<1, T>(qp, R, D, bs, K + k, mn + k, n + k, m + k, l + k);
              } else {
                for (; k < cnt; ++k) channel_lse_any(qp, R, L, static_cast<const T*>(K[k]), mn[k], n[k], m + k, l + k);
              }
            });
            // log-mass = m + log l, a vector of blocks at a time (l >= 1: the best key adds exp(0)).
            for (k = 0; k < cnt; k += kLanes) {
              vn lv = vn{} + 1.0f, mv{};
              for (int32_t t = 0; t < std::min(kLanes, cnt - k); ++t) {
                lv[t] = l[k + t];
                mv[t] = m[k + t];
              }
              const vn e = mv + cpu::vlog_lanes<vn, vni>(lv);
              for (int32_t t = 0; t < std::min(kLanes, cnt - k); ++t) raw[at + k + t] = e[t];
            }
          } else {
            for (; k + kBatch <= cnt; k += kBatch) {
              bound_and_centre<kBatch>(qp, D, mn + k, scale, raw + at + k, raw2 + at + k);
            }
            for (; k < cnt; ++k) bound_and_centre<1>(qp, D, mn + k, scale, raw + at + k, raw2 + at + k);
          }
        }
      }
    }
  });

  // Mandatory blocks of a sequence of nb blocks: sinks [0, sink) and the newest
  // [nb - recent, nb); the others are [others_begin, others_end).
  auto others_range = [&](int32_t nb) {
    const int32_t b = std::min(std::max(p.sink_blocks, 0), nb);
    const int32_t e = std::max(b, nb - std::max(p.recent_blocks, 0));
    return std::pair<int32_t, int32_t>(b, e);
  };
  // Per query head relative to its best block (heads differ in scale, and the kept set is
  // shared, so a head with small logits still gets its blocks); per KV head the largest of
  // those over the group.
  auto combine = [&](const float* per_head, float* dst, int32_t nb) {
    for (int32_t g = 0; g < group; ++g) {
      const float* r = per_head + static_cast<size_t>(g) * nb;
      const float top = max_of(r, nb);
      if (g == 0) {
        for (int32_t j = 0; j < nb; ++j) dst[j] = r[j] - top;
      } else {
        for (int32_t j = 0; j < nb; ++j) dst[j] = std::max(dst[j], r[j] - top);
      }
    }
  };

  // 2. Per (sequence, KV head): the group's scores, the estimated masses and their
  //    entropy, and the head's need under the mass rule.
  parallel_for(0, static_cast<int64_t>(X.items.size()), 1, [&](int64_t ib, int64_t ie) {
    thread_local TaskScratch T;
    for (int64_t it = ib; it < ie; ++it) {
      const int32_t s = static_cast<int32_t>(X.items[it] / Hkv), h = static_cast<int32_t>(X.items[it] % Hkv);
      const int32_t nb = X.nbs[s], ctx = B.context_lens[s];
      const size_t off = X.base[s] + static_cast<size_t>(h) * nb;
      float* sc = X.score.data() + off;
      combine(X.raw.data() + off * group, sc, nb);
      float* es = sc;
      if (bound) {
        // The count comes from the centre estimate: the bound exceeds it by the block's
        // spread, so masses estimated from bounds look peaked and the cap would always bind.
        es = X.est.data() + off;
        combine(X.raw2.data() + off * group, es, nb);
      }
      const float top = max_of(es, nb);
      const auto [ob, oe] = others_range(nb);
      // Masses exp(e - best), times the token count with the bound rule (the channel
      // estimate already counts them). Entropy (bits) of the masses, low when a few blocks
      // dominate: log T - sum m log m / T with log m = x + log(tokens), so no log per block.
      // (exp in double, a vector of blocks at a time: the count compares sums of masses.)
      T.mass.resize(nb);
      for (int32_t j = 0; j < nb; j += cpu::kLanesD) {
        cpu::vnd x{};
        for (int32_t t = 0; t < std::min(cpu::kLanesD, nb - j); ++t) x[t] = static_cast<double>(es[j + t] - top);
        const cpu::vnd e = cpu::vexp_d_lanes<cpu::vnd, cpu::vnl>(x);
        for (int32_t t = 0; t < std::min(cpu::kLanesD, nb - j); ++t) T.mass[j + t] = e[t];
      }
      const double log_bs = std::log(static_cast<double>(bs));
      const int32_t last_tokens = ctx - (nb - 1) * bs;
      double total = 0, covered = 0, mlogm = 0;
      for (int32_t j = 0; j < nb; ++j) {
        const double x = static_cast<double>(es[j] - top);
        const bool last = j == nb - 1;
        const double m = bound ? (last ? last_tokens : bs) * T.mass[j] : T.mass[j];
        T.mass[j] = m;
        total += m;
        if (j < ob || j >= oe) covered += m;
        if (m > 0) mlogm += m * (x + (bound ? (last ? std::log(static_cast<double>(last_tokens)) : log_bs) : 0.0));
      }
      X.entropy[static_cast<size_t>(s) * Hkv + h] = (std::log(total) - mlogm / total) / std::log(2.0);
      uint64_t* keys = X.keys.data() + off;
      for (int32_t j = ob; j < oe; ++j) keys[j - ob] = rank_key(es[j], j);
      const int32_t n_mand = nb - (oe - ob);
      X.need[static_cast<size_t>(s) * Hkv + h] =
          n_mand + greedy_count(keys, keys + (oe - ob), T.mass.data(), covered, p.mass_target * total);
    }
  });

  // The count per sequence: the largest need over its heads, the skipped fraction clamped
  // to [min_ratio, max_ratio] (mandatory blocks stay).
  int32_t first_sparse = -1;
  for (int32_t s = 0; s < nseq; ++s) {
    const int32_t nb = X.nbs[s];
    if (nb == 0) continue;
    const auto [ob, oe] = others_range(nb);
    const int32_t n_mand = nb - (oe - ob);
    int32_t need = n_mand;
    for (int32_t h = 0; h < Hkv; ++h) need = std::max(need, X.need[static_cast<size_t>(s) * Hkv + h]);
    const int32_t keep_min = static_cast<int32_t>(std::ceil(nb * (1.0 - p.max_ratio) - 1e-9));
    const int32_t keep_max = static_cast<int32_t>(std::floor(nb * (1.0 - p.min_ratio) + 1e-9));
    const int32_t keep = std::max(n_mand, std::min(std::max(need, keep_min), keep_max));
    if (keep >= nb) continue;  // nothing to skip: stays dense
    out->sparse[s] = 1;
    out->context_lens[s] = (keep - 1) * bs + (B.context_lens[s] - (nb - 1) * bs);
    X.keep[s] = keep;
    out->blocks_total += static_cast<int64_t>(nb) * Hkv;
    out->blocks_kept += static_cast<int64_t>(keep) * Hkv;
    out->selections += Hkv;
    for (int32_t h = 0; h < Hkv; ++h) out->entropy_bits += X.entropy[static_cast<size_t>(s) * Hkv + h];
    if (first_sparse < 0) first_sparse = s;
  }
  // The reused selections: the kept positions, then the blocks written since.
  bool any_reused = false;
  for (int32_t s = 0; s < nseq; ++s) {
    if (!out->reused[s]) continue;
    const ReusedSelection& r = reuse[s];
    const int32_t ctx = B.context_lens[s], nb = (ctx + bs - 1) / bs;
    const int32_t last = r.positions[r.count - 1];
    for (int32_t h = 0; h < Hkv; ++h) {
      const int32_t* kept = r.positions + static_cast<size_t>(h) * r.count;
      for (int32_t i = 0; i < r.count; ++i) {
        if (kept[i] < 0 || (i > 0 && kept[i] <= kept[i - 1]) || (i == r.count - 1 && kept[i] != last)) {
          fail(ErrorCode::kInvalidArgument, "a reused selection's positions must ascend from 0 and every KV "
                                            "head's must end at the same block");
        }
      }
    }
    const int32_t keep = r.count + (nb - 1 - last);
    if (last >= nb || keep >= nb) {
      fail(ErrorCode::kInvalidArgument, "a reused selection must name fewer blocks than the sequence has, "
                                        "positions below its block count");
    }
    const int32_t* table = B.block_tables + static_cast<int64_t>(s) * MB;
    for (int32_t h = 0; h < Hkv; ++h) {
      const int32_t* kept = r.positions + static_cast<size_t>(h) * r.count;
      const size_t at = (static_cast<size_t>(s) * Hkv + h) * MB;
      int32_t* ht = out->head_tables.data() + at;
      int32_t* pt = out->positions.data() + at;
      std::copy(kept, kept + r.count, pt);
      for (int32_t i = r.count; i < keep; ++i) pt[i] = last + 1 + (i - r.count);
      for (int32_t i = 0; i < keep; ++i) ht[i] = table[pt[i]];
    }
    out->sparse[s] = 1;
    out->context_lens[s] = (keep - 1) * bs + (ctx - (nb - 1) * bs);
    out->blocks_total += static_cast<int64_t>(nb) * Hkv;
    out->blocks_kept += static_cast<int64_t>(keep) * Hkv;
    out->reused_selections += Hkv;
    any_reused = true;
  }
  if (first_sparse < 0) return any_reused;

  // 3. Every head of a sparse sequence: its mandatory blocks plus its best-scoring others
  //    (nth_element, not a sort), as a block table in position order.
  std::vector<int32_t> top;
  parallel_for(0, static_cast<int64_t>(X.items.size()), 1, [&](int64_t ib, int64_t ie) {
    thread_local TaskScratch T;
    for (int64_t it = ib; it < ie; ++it) {
      const int32_t s = static_cast<int32_t>(X.items[it] / Hkv), h = static_cast<int32_t>(X.items[it] % Hkv);
      if (!out->sparse[s]) continue;
      const int32_t nb = X.nbs[s];
      const int32_t keep = X.keep[s];
      const int32_t* table = B.block_tables + static_cast<int64_t>(s) * MB;
      const size_t off = X.base[s] + static_cast<size_t>(h) * nb;
      const float* sc = X.score.data() + off;
      const auto [ob, oe] = others_range(nb);
      uint64_t* keys = X.keys.data() + off;
      // The channel estimate ranks by the scores phase 2 keyed; the bound rule by others.
      if (bound) {
        for (int32_t j = ob; j < oe; ++j) keys[j - ob] = rank_key(sc[j], j);
      }
      const int32_t take = keep - (nb - (oe - ob));
      if (take > 0 && take < oe - ob) std::nth_element(keys, keys + take, keys + (oe - ob), std::greater<uint64_t>());
      T.kept.assign(nb, 0);
      for (int32_t j = 0; j < nb; ++j) T.kept[j] = j < ob || j >= oe;
      for (int32_t i = 0; i < take; ++i) T.kept[key_block(keys[i])] = 1;
      int32_t* ht = out->head_tables.data() + (static_cast<size_t>(s) * Hkv + h) * MB;
      int32_t* pt = out->positions.data() + (static_cast<size_t>(s) * Hkv + h) * MB;
      int32_t n = 0;
      for (int32_t j = 0; j < nb; ++j) {
        if (!T.kept[j]) continue;
        ht[n] = table[j];
        pt[n++] = j;
      }
      if (s == first_sparse && h == 0) {
        // Statistics: the best-scoring blocks (mandatory ones included), best first.
        T.all.resize(nb);
        for (int32_t j = 0; j < nb; ++j) T.all[j] = rank_key(sc[j], j);
        const int32_t k = std::min<int32_t>(8, nb);
        std::partial_sort(T.all.begin(), T.all.begin() + k, T.all.end(), std::greater<uint64_t>());
        for (int32_t i = 0; i < k; ++i) top.push_back(table[key_block(T.all[i])]);
      }
    }
  });
  out->top_blocks = std::move(top);
  return true;
}

cpu::AttentionBatch sparse_batch(const cpu::AttentionBatch& B, const LayerSelection& sel) {
  cpu::AttentionBatch b = B;
  b.context_lens = sel.context_lens.data();
  b.head_tables = sel.head_tables.data();
  b.sparse_seq = sel.sparse.data();
  return b;
}

void sparse_decode_attention(const float* q, int64_t q_stride, float* out, const void* kv, const KVLayout& L,
                             int32_t layer, const cpu::AttentionBatch& B, const float* summaries,
                             const SummaryLayout& S, int32_t num_heads, float scale, const SparsityParams& p,
                             LayerSelection* sel, std::vector<float>* lse, const ReusedSelection* reuse) {
  const bool selected = select_blocks(q, q_stride, kv, summaries, S, L, layer, B, num_heads, scale, p, sel, reuse);
  attend_selected(q, q_stride, out, kv, L, layer, B, summaries, S, num_heads, scale, p, selected, *sel, lse);
}

void attend_selected(const float* q, int64_t q_stride, float* out, const void* kv, const KVLayout& L, int32_t layer,
                     const cpu::AttentionBatch& B, const float* summaries, const SummaryLayout& S, int32_t num_heads,
                     float scale, const SparsityParams& p, bool selected, const LayerSelection& sel,
                     std::vector<float>* lse) {
  cpu::AttentionBatch use = B;
  if (selected) {
    use = sparse_batch(B, sel);
    if (p.compensation) {
      lse->resize(static_cast<size_t>(B.query_start[B.num_seqs]) * num_heads);
      use.row_lse = lse->data();
    }
  }
  cpu::paged_attention(q, q_stride, out, kv, L, layer, use, num_heads, scale, 0);
  if (use.row_lse) compensate_skipped(q, q_stride, out, use.row_lse, summaries, S, L, layer, B, sel, num_heads, scale);
}

void cold_entries_read(const cpu::AttentionBatch& B, int32_t block_size, int32_t num_kv_heads, bool selected,
                       const LayerSelection& sel, std::vector<uint8_t>* need) {
  const int32_t MB = B.max_blocks_per_seq;
  for (int32_t s = 0; s < B.num_seqs; ++s) {
    const int32_t nb = (B.context_lens[s] + block_size - 1) / block_size;
    const int32_t* table = B.block_tables + static_cast<int64_t>(s) * MB;
    if (!selected || !sel.sparse[s]) {
      for (int32_t b = 0; b < nb; ++b) {
        if (table[b] <= cold_block_id(0)) (*need)[static_cast<size_t>(cold_block_index(table[b]))] = 1;
      }
      continue;
    }
    for (int32_t h = 0; h < num_kv_heads; ++h) {
      const int32_t* kept = sel.head_tables.data() + (static_cast<int64_t>(s) * num_kv_heads + h) * MB;
      for (int32_t k = 0; k < MB && kept[k] != -1; ++k) {
        if (kept[k] <= cold_block_id(0)) (*need)[static_cast<size_t>(cold_block_index(kept[k]))] = 1;
      }
    }
  }
}

void compensate_skipped(const float* q, int64_t q_stride, float* out, const float* lse, const float* summaries,
                        const SummaryLayout& S, const KVLayout& L, int32_t layer, const cpu::AttentionBatch& B,
                        const LayerSelection& sel, int32_t num_heads, float scale) {
  const int32_t Hkv = L.num_kv_heads, group = num_heads / Hkv, D = L.head_dim, bs = L.block_size;
  const int32_t MB = B.max_blocks_per_seq;
  if (!S.has_sums()) return;
  parallel_for(0, static_cast<int64_t>(B.num_seqs) * Hkv, 1, [&](int64_t ib, int64_t ie) {
    std::vector<int32_t> skipped;
    std::vector<float> c, mk, mv;
    for (int64_t i = ib; i < ie; ++i) {
      const int32_t s = static_cast<int32_t>(i / Hkv), h = static_cast<int32_t>(i % Hkv);
      if (!sel.sparse[s]) continue;
      // The kept table is a subsequence of the block table (position order): walk both.
      const int32_t nb = (B.context_lens[s] + bs - 1) / bs;
      const int32_t* table = B.block_tables + static_cast<int64_t>(s) * MB;
      const int32_t* kept = sel.head_tables.data() + (static_cast<int64_t>(s) * Hkv + h) * MB;
      skipped.clear();
      for (int32_t j = 0, k = 0; j < nb; ++j) {
        if (kept[k] == table[j]) {
          ++k;
        } else {
          skipped.push_back(table[j]);  // never the last (partial) block: recent blocks stay
        }
      }
      if (skipped.empty()) continue;
      const int32_t row = B.query_start[s];
      const float inv_n = 1.0f / static_cast<float>(bs), log_n = std::log(static_cast<float>(bs));
      for (int32_t g = 0; g < group; ++g) {
        const int32_t head = h * group + g;
        const float* qh = q + static_cast<int64_t>(row) * q_stride + static_cast<int64_t>(head) * D;
        float* o = out + static_cast<int64_t>(row) * num_heads * D + static_cast<int64_t>(head) * D;
        const float base = lse[static_cast<int64_t>(row) * num_heads + head];
        // Pseudo-key scores: scale * q·(sum_k / n) + log n; combined with the kept keys'
        // softmax through their log-sum-exp.
        c.resize(skipped.size());
        float m = base;
        for (size_t b = 0; b < skipped.size(); ++b) {
          const float* sk = summary_at(summaries, S, B, skipped[b], layer, h) + S.sums_at();
          float dot = 0.0f;
          for (int32_t d = 0; d < D; ++d) dot += qh[d] * sk[d];
          c[b] = scale * dot * inv_n + log_n;
          m = std::max(m, c[b]);
        }
        const float w0 = std::exp(base - m);
        float den = w0;
        mv.assign(D, 0.0f);
        for (size_t b = 0; b < skipped.size(); ++b) {
          const float w = std::exp(c[b] - m);
          den += w;
          const float* sv = summary_at(summaries, S, B, skipped[b], layer, h) + S.sums_at() + D;
          for (int32_t d = 0; d < D; ++d) mv[d] += w * inv_n * sv[d];
        }
        const float inv = 1.0f / den;
        for (int32_t d = 0; d < D; ++d) o[d] = (o[d] * w0 + mv[d]) * inv;
      }
    }
  });
}


void SelectionMemory::begin_step() {
  if (++steps_ % 64 != 0) return;
  // Requests not seen for 64 steps (finished, aborted, long preempted) are forgotten.
  for (auto it = entries_.begin(); it != entries_.end();) {
    it = steps_ - it->second.used > 64 ? entries_.erase(it) : std::next(it);
  }
}

void SelectionMemory::lookup(const cpu::AttentionBatch& B, const int64_t* ids, int32_t layer,
                             const SparsityParams& p, std::vector<ReusedSelection>* reuse) {
  const int32_t nseq = B.num_seqs;
  reuse->assign(nseq, ReusedSelection{});
  if (p.selection_interval <= 1 || ids == nullptr) return;
  const int32_t N = p.selection_interval;
  for (int32_t s = 0; s < nseq; ++s) {
    const auto it = entries_.find(ids[s]);
    if (it == entries_.end()) continue;
    if (B.query_start[s + 1] - B.query_start[s] != 1) {
      entries_.erase(it);  // a prompt chunk (a recomputed sequence): its KV is new
      continue;
    }
    it->second.used = steps_;
    if (layer >= static_cast<int32_t>(it->second.layers.size())) continue;
    const Kept& k = it->second.layers[layer];
    // Fresh selections fall on context lengths that are multiples of N; the steps in between
    // use the latest one made since then (with no entry, e.g. its first sparse step, a
    // sequence selects afresh at any length).
    if (k.count > 0 && reuse_due(k.context_len, B.context_lens[s], N)) {
      (*reuse)[s] = ReusedSelection{k.positions.data(), k.count};
    }
  }
}

void ReuseSlots::modes(const cpu::AttentionBatch& B, const int64_t* ids, const SparsityParams& p, int32_t block_size,
                       std::vector<int32_t>* out) {
  const int32_t nseq = B.num_seqs, N = p.selection_interval;
  out->assign(nseq, -1);
  if (N <= 1 || ids == nullptr) return;
  ++step_;
  auto release = [&](int64_t id) {
    const auto it = slot_of_.find(id);
    if (it == slot_of_.end()) return;
    owner_[it->second] = -1;
    slot_of_.erase(it);
  };
  // Rows that select and fit a slot's width.
  auto selects = [&](int32_t s) {
    return selects_blocks(B, s, p) && (B.context_lens[s] + block_size - 1) / block_size <= stride_;
  };
  // The step's requests that keep their slots first (so that no other row of the step takes them).
  for (int32_t s = 0; s < nseq; ++s) {
    if (B.query_start[s + 1] - B.query_start[s] != 1) {
      release(ids[s]);  // its KV is being (re)computed
      continue;
    }
    const auto it = slot_of_.find(ids[s]);
    if (it != slot_of_.end()) stamp_[it->second] = step_;
  }
  for (int32_t s = 0; s < nseq; ++s) {
    if (!selects(s)) continue;
    auto it = slot_of_.find(ids[s]);
    if (it == slot_of_.end()) {
      // A free slot, else the one named longest ago by a request not in this step.
      int32_t m = -1;
      for (int32_t i = 0; i < static_cast<int32_t>(owner_.size()); ++i) {
        if (owner_[i] == -1) {
          m = i;
          break;
        }
        if (stamp_[i] < step_ && (m < 0 || stamp_[i] < stamp_[m])) m = i;
      }
      if (m < 0) continue;  // more rows than slots: this one selects without keeping
      if (owner_[m] != -1) slot_of_.erase(owner_[m]);
      owner_[m] = ids[s];
      chosen_at_[m] = -1;
      stamp_[m] = step_;
      it = slot_of_.emplace(ids[s], m).first;
    }
    const int32_t m = it->second, ctx = B.context_lens[s];
    if (reuse_due(chosen_at_[m], ctx, N)) {
      (*out)[s] = 2 * m + 1;
    } else {
      (*out)[s] = 2 * m;
      chosen_at_[m] = ctx;
    }
  }
}

void SelectionMemory::store(const cpu::AttentionBatch& B, const int64_t* ids, int32_t layer, int32_t num_kv_heads,
                            int32_t block_size, const SparsityParams& p, const LayerSelection& sel) {
  if (p.selection_interval <= 1 || ids == nullptr || sel.positions.empty()) return;
  const int32_t MB = sel.max_blocks;
  for (int32_t s = 0; s < B.num_seqs; ++s) {
    if (!selects_blocks(B, s, p) || sel.reused[s]) continue;  // a reused one keeps its entry (and its age)
    Entry& e = entries_[ids[s]];
    e.used = steps_;
    if (static_cast<int32_t>(e.layers.size()) <= layer) e.layers.resize(layer + 1);
    Kept& k = e.layers[layer];
    k.context_len = B.context_lens[s];
    k.count = 0;
    if (!sel.sparse[s]) continue;  // stayed dense: the next step selects afresh
    const int32_t* row = sel.positions.data() + static_cast<size_t>(s) * num_kv_heads * MB;
    int32_t count = 0;
    while (count < MB && row[count] != -1) ++count;
    // Reusable only if every head kept the last block (always, with recent_blocks >= 1).
    const int32_t last = (B.context_lens[s] - 1) / block_size;
    bool ends = count > 0;
    for (int32_t h = 0; h < num_kv_heads && ends; ++h) ends = row[static_cast<size_t>(h) * MB + count - 1] == last;
    if (!ends) continue;
    k.count = count;
    k.positions.resize(static_cast<size_t>(num_kv_heads) * count);
    for (int32_t h = 0; h < num_kv_heads; ++h) {
      std::copy(row + static_cast<size_t>(h) * MB, row + static_cast<size_t>(h) * MB + count,
                k.positions.begin() + static_cast<size_t>(h) * count);
    }
  }
}

}  // namespace k25
