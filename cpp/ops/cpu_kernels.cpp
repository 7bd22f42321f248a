#include "ops/cpu_kernels.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "ops/attention_plan.h"
#include "ops/parallel.h"
#include "ops/vec16.h"
#include "ops/vecn.h"

namespace k25::cpu {

namespace {

inline float inv_rms(const float* x, int64_t n, float eps) {
  // 16 partial sums: vectorises, and keeps the rounding error of long rows small.
  float acc[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int j = 0; j < 16; ++j) acc[j] += x[i + j] * x[i + j];
  }
  float s = 0.0f;
  for (; i < n; ++i) s += x[i] * x[i];
  for (int j = 0; j < 16; ++j) s += acc[j];
  return 1.0f / std::sqrt(s / static_cast<float>(n) + eps);
}

int64_t grain_for(int64_t rows, int64_t work_per_row) {
  // Below ~32K flops a task is not worth a thread.
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, work_per_row));
}

}  // namespace

void rms_norm(const float* x, int64_t x_stride, const float* w, float* out, int64_t out_stride,
              int64_t rows, int64_t n, float eps) {
  parallel_for(0, rows, grain_for(rows, 3 * n), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* xr = x + t * x_stride;
      float* o = out + t * out_stride;
      const float inv = inv_rms(xr, n, eps);
      for (int64_t i = 0; i < n; ++i) o[i] = w[i] * (xr[i] * inv);
    }
  });
}

void add_rms_norm(float* h, const float* delta, const float* w, float* out, int64_t rows,
                  int64_t n, float eps) {
  parallel_for(0, rows, grain_for(rows, 4 * n), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      float* hr = h + t * n;
      const float* dr = delta + t * n;
      for (int64_t i = 0; i < n; ++i) hr[i] += dr[i];
      const float inv = inv_rms(hr, n, eps);
      float* o = out + t * n;
      for (int64_t i = 0; i < n; ++i) o[i] = w[i] * (hr[i] * inv);
    }
  });
}

void silu_mul(const float* gu, float* out, int64_t rows, int64_t n) {
  parallel_for(0, rows, grain_for(rows, 8 * n), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* g = gu + t * 2 * n;
      const float* u = g + n;
      float* o = out + t * n;
      for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (1.0f + vexp(-g[i])) * u[i];
    }
  });
}

namespace {

inline void rotate(float* x, const float* c, const float* s, int32_t half) {
  for (int32_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    x[i] = x1 * c[i] - x2 * s[i];
    x[i + half] = x2 * c[i] + x1 * s[i];
  }
}

inline void store_kv(const float* k, const float* v, int64_t slot, void* pool, const KVLayout& L,
                     int32_t layer, int32_t head) {
  const int64_t block = slot / L.block_size;
  const int32_t off = static_cast<int32_t>(slot % L.block_size);
  with_elem(L, pool, [&](auto* kv) {
    auto* kd = kv + L.k_offset(block, layer, head);
    auto* vd = kv + L.v_offset(block, layer, head) + static_cast<int64_t>(off) * L.head_dim;
    for (int32_t d = 0; d < L.head_dim; ++d) store_elem(kd + static_cast<int64_t>(d) * L.block_size + off, k[d]);
    if constexpr (std::is_same_v<decltype(vd), float*>) {
      std::memcpy(vd, v, sizeof(float) * L.head_dim);
    } else {
      for (int32_t d = 0; d < L.head_dim; ++d) store_elem(vd + d, v[d]);
    }
  });
}

}  // namespace

void rope_inplace(float* qkv, int64_t row_stride, const int32_t* positions, int64_t rows,
                  int32_t num_heads, int32_t num_kv_heads, int32_t head_dim,
                  const float* cos_table, const float* sin_table) {
  const int32_t half = head_dim / 2;
  parallel_for(0, rows, grain_for(rows, 6 * (num_heads + num_kv_heads) * head_dim), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* c = cos_table + static_cast<int64_t>(positions[t]) * half;
      const float* s = sin_table + static_cast<int64_t>(positions[t]) * half;
      float* row = qkv + t * row_stride;
      for (int32_t h = 0; h < num_heads + num_kv_heads; ++h) rotate(row + h * head_dim, c, s, half);
    }
  });
}

void write_kv(const float* qkv, int64_t row_stride, const int64_t* slot_mapping, int64_t rows,
              int32_t num_heads, void* kv, const KVLayout& L, int32_t layer) {
  const int32_t D = L.head_dim;
  parallel_for(0, rows, grain_for(rows, 4 * L.num_kv_heads * D), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* row = qkv + t * row_stride;
      for (int32_t h = 0; h < L.num_kv_heads; ++h) {
        const float* k = row + (num_heads + h) * D;
        const float* v = row + (num_heads + L.num_kv_heads + h) * D;
        store_kv(k, v, slot_mapping[t], kv, L, layer, h);
      }
    }
  });
}

void rope_write_kv(float* qkv, int64_t row_stride, const int32_t* positions,
                   const int64_t* slot_mapping, int64_t rows, int32_t num_heads,
                   const float* cos_table, const float* sin_table, void* kv, const KVLayout& L,
                   int32_t layer) {
  const int32_t D = L.head_dim, half = D / 2;
  parallel_for(0, rows, grain_for(rows, 8 * (num_heads + L.num_kv_heads) * D), [&](int64_t b, int64_t e) {
    std::vector<float> k(D);
    for (int64_t t = b; t < e; ++t) {
      const float* c = cos_table + static_cast<int64_t>(positions[t]) * half;
      const float* s = sin_table + static_cast<int64_t>(positions[t]) * half;
      float* row = qkv + t * row_stride;
      for (int32_t h = 0; h < num_heads; ++h) rotate(row + h * D, c, s, half);
      for (int32_t h = 0; h < L.num_kv_heads; ++h) {
        std::memcpy(k.data(), row + (num_heads + h) * D, sizeof(float) * D);
        rotate(k.data(), c, s, half);
        store_kv(k.data(), row + (num_heads + L.num_kv_heads + h) * D, slot_mapping[t], kv, L, layer, h);
      }
    }
  });
}

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

using WorkItem = AttnWorkItem;

// Split-KV partial results of one row: the accumulator, then the running max and sum.
struct Partials {
  float* base = nullptr;
  int32_t head_dim = 0;
  int32_t rows = 0;  // rows per slot (the GQA group size)
  float* row(int32_t slot, int32_t r) const {
    return base + (static_cast<int64_t>(slot) * rows + r) * (head_dim + 2);
  }
};

// The KV blocks a step reads: pool blocks by id, cold blocks (negative ids) by pointer; T is
// the pool's element (float, or uint16_t for bfloat16).
template <typename T>
struct KVBlocks {
  const T* pool;
  const void* const* cold;
  const KVLayout& L;
  const T* block(int32_t id) const {
    return id >= 0 ? pool + id * L.block_elems() : static_cast<const T*>(cold[cold_block_index(id)]);
  }
  const T* k(int32_t id, int32_t layer, int32_t head) const { return block(id) + L.k_in_block(layer, head); }
  const T* v(int32_t id, int32_t layer, int32_t head) const { return block(id) + L.v_in_block(layer, head); }
};

// Query rows of one tile (the heads of a GQA group for a few tokens of one sequence)
// against every key they may see, with an online softmax over chunks of kChunkKeys keys at
// positions aligned to kChunkKeys. One pass over the keys serves all rows, so each K/V vector
// is loaded once per tile rather than once per row. A chunk is three steps: the rows' raw
// scores, in groups of up to kRowGroup rows and 16 keys at a time (a group's scores, kRowGroup
// x 16 lanes, stay in registers on AVX2 as on AVX-512); each row's softmax step over the
// whole chunk (one max, one rescale of the accumulators and one sum per kChunkKeys keys,
// where 16 keys a step spent 40% of the time on them on an AVX2 host); and the rows' output
// columns, kRowGroup x 16 at a time, accumulated over the chunk's keys. The output rows live
// in an L1-resident buffer between chunks. A row's arithmetic depends only on its own query,
// position and window, not on the other rows of its tile: chunks are aligned to absolute
// key positions, and a key a row may not see is masked to -inf (so p = 0) whatever the tile.
constexpr int kRowGroup = 4;
constexpr int kMaxTileRows = 32;
constexpr int kChunkKeys = 64;
constexpr int kPieces = kChunkKeys / 16;  // 16-key pieces of a chunk

struct TileRows {
  const float* const* q;
  float* o;                  // [rows][kD] accumulators
  float* s;                  // [rows][kChunkKeys] this chunk's scores, then probabilities
  float* alpha;              // [rows] this chunk's rescale of the accumulators
  float* m;                  // [rows] running max
  float* l;                  // [rows] running sum
  const int32_t* pos;
  const int32_t* lo;
};

// The hot loops below use the machine's own vector width (vecn.h). A scalar operand of a
// vector product is broadcast as it is loaded; `vn{} + x` would cost a scalar add (0 + x is
// not x for x = -0) and a register broadcast on every use.
constexpr int kParts = 16 / kLanes;             // vn per 16 keys (or 16 output columns)
constexpr int kChunkParts = kChunkKeys / kLanes;  // vn per chunk

// Max or sum of N vn: halves folded lane for lane, then across the lanes (i ^ stride).
template <bool kMax, int N>
inline float reduce(const vn (&x)[N]) {
  vn parts[N];
  for (int h = 0; h < N; ++h) parts[h] = x[h];
  for (int half = N / 2; half > 0; half /= 2) {
    for (int h = 0; h < half; ++h) {
      parts[h] = kMax ? (parts[h] > parts[h + half] ? parts[h] : parts[h + half]) : parts[h] + parts[h + half];
    }
  }
  return fold_lanes<kMax>(parts[0]);
}

// Raw scores q.k of rows [r0, r0 + NR) for the 16 keys of piece `piece` (K^T of the piece at
// Kt: [D][bs]) into t.s.
template <int kD, int NR, typename T>
inline void score_group(const TileRows& t, int r0, const T* Kt, int32_t bs, int piece) {
  vn s[NR][kParts];
  for (int r = 0; r < NR; ++r) {
    for (int h = 0; h < kParts; ++h) s[r][h] = vn{};
  }
  const float* q[NR];
  for (int r = 0; r < NR; ++r) q[r] = t.q[r0 + r];
  for (int d = 0; d < kD; ++d) {
    vn k[kParts];
    for (int h = 0; h < kParts; ++h) k[h] = loadn(Kt + static_cast<int64_t>(d) * bs + h * kLanes);
    for (int r = 0; r < NR; ++r) {
      const float qd = q[r][d];
      for (int h = 0; h < kParts; ++h) s[r][h] += k[h] * qd;
    }
  }
  for (int r = 0; r < NR; ++r) {
    float* sr = t.s + (r0 + r) * kChunkKeys + 16 * piece;
    for (int h = 0; h < kParts; ++h) storen(sr + h * kLanes, s[r][h]);
  }
}

// Row `row`'s online-softmax step over the chunk of keys [base, base + kChunkKeys): its
// scores in t.s, scaled, become probabilities; t.alpha, t.m and t.l follow. Keys outside
// [lo, pos] (not yet written, before the window, or in pieces not computed) are masked by
// selecting -inf, not by multiplying, which keeps garbage in unwritten slots out.
inline void softmax_row(const TileRows& t, int row, int32_t base, const vn (&iota)[kChunkParts], float scale) {
  float* sr = t.s + row * kChunkKeys;
  const float lo_r = static_cast<float>(t.lo[row] - base), pos_r = static_cast<float>(t.pos[row] - base);
  vn x[kChunkParts];
  for (int h = 0; h < kChunkParts; ++h) {
    const auto ok = (iota[h] >= lo_r) & (iota[h] <= pos_r);
    x[h] = ok ? loadn(sr + h * kLanes) * scale : vn{} + kNegInf;
  }
  const float cmax = reduce<true>(x);
  if (cmax == kNegInf) {
    for (int h = 0; h < kChunkParts; ++h) storen(sr + h * kLanes, vn{});
    t.alpha[row] = 1.0f;  // x * 1 is exact: the row is unchanged
    return;
  }
  const float m_new = std::max(t.m[row], cmax);
  const float alpha = vexp(t.m[row] - m_new);  // 0 while m is -inf
  for (int h = 0; h < kChunkParts; ++h) {
    x[h] = vexp_lanes<vn, vni>(x[h] - m_new);
    storen(sr + h * kLanes, x[h]);
  }
  t.l[row] = t.l[row] * alpha + reduce<false>(x);
  t.m[row] = m_new;
  t.alpha[row] = alpha;
}

// One 16-key piece of a chunk for the accumulation: its V rows ([bs][D], from the piece's
// first key) and the keys [t0, t1) of it that hold written K/V.
template <typename T>
struct Piece {
  const T* v;
  int32_t t0, t1;
};

// Rows [r0, r0 + NR): the accumulators times alpha, plus the chunk's keys weighted by their
// probabilities, piece by piece in key order.
template <int kD, int NR, typename T>
inline void accumulate_group(const TileRows& t, int r0, const Piece<T>* pieces) {
  for (int j = 0; j < kD / 16; ++j) {
    vn acc[NR][kParts];
    float* o[NR];
    for (int r = 0; r < NR; ++r) {
      o[r] = t.o + static_cast<int64_t>(r0 + r) * kD + 16 * j;
      const float a = t.alpha[r0 + r];
      for (int h = 0; h < kParts; ++h) acc[r][h] = loadn(o[r] + h * kLanes) * a;
    }
    for (int pc = 0; pc < kPieces; ++pc) {
      const Piece<T>& P = pieces[pc];
      const T* V = P.v + 16 * j;
      const float* p = t.s + r0 * kChunkKeys + 16 * pc;
      for (int32_t k = P.t0; k < P.t1; ++k) {
        vn vv[kParts];
        for (int h = 0; h < kParts; ++h) vv[h] = loadn(V + static_cast<int64_t>(k) * kD + h * kLanes);
        for (int r = 0; r < NR; ++r) {
          const float pk = p[r * kChunkKeys + k];
          for (int h = 0; h < kParts; ++h) acc[r][h] += vv[h] * pk;
        }
      }
    }
    for (int r = 0; r < NR; ++r) {
      for (int h = 0; h < kParts; ++h) storen(o[r] + h * kLanes, acc[r][h]);
    }
  }
}

template <int kD, typename T>
void attend_tile(int rows, const float* const* qrows, float* const* orows, float* const* lrows, const int32_t* pos,
                 const int32_t* lo, const KVBlocks<T>& kv, const KVLayout& L, int32_t layer, int32_t kv_head,
                 const int32_t* table, float scale, bool partial) {
  alignas(64) float o_buf[kMaxTileRows * kD];
  alignas(64) float s_buf[kMaxTileRows * kChunkKeys];
  float alpha[kMaxTileRows], m[kMaxTileRows], l[kMaxTileRows];
  const TileRows t{qrows, o_buf, s_buf, alpha, m, l, pos, lo};
  const int32_t bs = L.block_size;
  int32_t lo_min = lo[0], pos_max = pos[0];
  for (int r = 0; r < rows; ++r) {
    std::fill(o_buf + static_cast<int64_t>(r) * kD, o_buf + static_cast<int64_t>(r + 1) * kD, 0.0f);
    m[r] = kNegInf;
    l[r] = 0.0f;
    lo_min = std::min(lo_min, lo[r]);
    pos_max = std::max(pos_max, pos[r]);
  }
  vn iota[kChunkParts];
  for (int i = 0; i < kChunkKeys; ++i) iota[i / kLanes][i % kLanes] = static_cast<float>(i);
  // Row groups: full groups of kRowGroup, then the rest in one group of its size.
  auto each_group = [&](auto&& f) {
    int r0 = 0;
    for (; r0 + kRowGroup <= rows; r0 += kRowGroup) f(std::integral_constant<int, kRowGroup>{}, r0);
    switch (rows - r0) {
      case 1: f(std::integral_constant<int, 1>{}, r0); break;
      case 2: f(std::integral_constant<int, 2>{}, r0); break;
      case 3: f(std::integral_constant<int, 3>{}, r0); break;
      default: break;
    }
  };
  const int64_t piece_bytes = 16 * kD * static_cast<int64_t>(sizeof(T));
  for (int32_t cbase = lo_min / kChunkKeys * kChunkKeys; cbase <= pos_max; cbase += kChunkKeys) {
    // The chunk's pieces holding written keys in [lo_min, pos_max]; the others are not read
    // (their keys are masked for every row).
    Piece<T> pieces[kPieces];
    for (int pc = 0; pc < kPieces; ++pc) {
      const int32_t base = cbase + 16 * pc;
      Piece<T>& P = pieces[pc];
      P.t0 = std::clamp(lo_min - base, 0, 16);
      P.t1 = std::clamp(pos_max - base + 1, 0, 16);
      if (P.t0 >= P.t1) {
        P.t0 = P.t1 = 0;
        P.v = nullptr;
        continue;
      }
      const int32_t id = table[base / bs], off = base % bs;
      const T* Kt = kv.k(id, layer, kv_head) + off;
      P.v = kv.v(id, layer, kv_head) + static_cast<int64_t>(off) * kD;
      each_group([&](auto nr, int r0) { score_group<kD, decltype(nr)::value>(t, r0, Kt, bs, pc); });
      // Blocks of one sequence are scattered in the pool, so the hardware prefetcher cannot
      // follow; fetch the next chunk's piece K and this piece's V while the scores are done.
      const int32_t next = base + kChunkKeys;
      if (next <= pos_max) {
        const int32_t nid = table[next / bs], noff = next % bs;
        const char* nk = reinterpret_cast<const char*>(kv.k(nid, layer, kv_head) + noff);
        for (int64_t b = 0; b < piece_bytes; b += 64) __builtin_prefetch(nk + b);
      }
      const char* vb = reinterpret_cast<const char*>(P.v);
      for (int64_t b = 0; b < piece_bytes; b += 64) __builtin_prefetch(vb + b);
    }
    for (int r = 0; r < rows; ++r) softmax_row(t, r, cbase, iota, scale);
    each_group([&](auto nr, int r0) { accumulate_group<kD, decltype(nr)::value>(t, r0, pieces); });
  }
  for (int r = 0; r < rows; ++r) {
    const float inv = partial ? 1.0f : 1.0f / l[r];
    const v16* acc = reinterpret_cast<const v16*>(o_buf + static_cast<int64_t>(r) * kD);
    for (int j = 0; j < kD / 16; ++j) *reinterpret_cast<v16u*>(orows[r] + 16 * j) = acc[j] * inv;
    if (partial) {
      orows[r][kD] = m[r];
      orows[r][kD + 1] = l[r];
    } else if (lrows[r]) {
      *lrows[r] = m[r] + std::log(l[r]);
    }
  }
}

// Any head_dim and block size: the same algorithm one key at a time.
template <typename T>
inline void attend_row_generic(const float* qr, float* out, float* lse, const KVBlocks<T>& kv, const KVLayout& L,
                               int32_t layer, int32_t kv_head, const int32_t* table, int32_t pos, int32_t lo,
                               float scale, bool partial, std::vector<float>& acc) {
  const int32_t bs = L.block_size, D = L.head_dim;
  acc.assign(D, 0.0f);
  float m = kNegInf, l = 0.0f;
  for (int32_t kp = lo; kp <= pos; ++kp) {
    const int32_t block = table[kp / bs];
    const int32_t off = kp % bs;
    const T* Kt = kv.k(block, layer, kv_head);
    const T* v = kv.v(block, layer, kv_head) + static_cast<int64_t>(off) * D;
    float s = 0.0f;
    for (int32_t d = 0; d < D; ++d) s += qr[d] * as_float(Kt[static_cast<int64_t>(d) * bs + off]);
    s *= scale;
    const float m_new = std::max(m, s);
    const float alpha = vexp(m - m_new), p = vexp(s - m_new);
    l = l * alpha + p;
    for (int32_t d = 0; d < D; ++d) acc[d] = acc[d] * alpha + p * as_float(v[d]);
    m = m_new;
  }
  if (partial) {
    for (int32_t d = 0; d < D; ++d) out[d] = acc[d];
    out[D] = m;
    out[D + 1] = l;
    return;
  }
  for (int32_t d = 0; d < D; ++d) out[d] = acc[d] / l;
  if (lse) *lse = m + std::log(l);
}

template <typename T>
void attend_item(const WorkItem& w, const float* q, int64_t q_stride, float* out, const KVBlocks<T>& kv,
                 const KVLayout& L, int32_t layer, const AttentionBatch& B, int32_t num_heads, float scale,
                 int32_t window, const Partials& partials, std::vector<float>& scratch) {
  const bool partial = w.partial >= 0;
  const int32_t D = L.head_dim;
  const int32_t group = num_heads / L.num_kv_heads;
  const int32_t q0 = B.query_start[w.seq];
  const int32_t q_len = B.query_start[w.seq + 1] - q0;
  const int32_t first_pos = B.context_lens[w.seq] - q_len;  // position of the first new token
  const int32_t* table = B.sparse_seq && B.sparse_seq[w.seq]
                             ? B.head_tables + (static_cast<int64_t>(w.seq) * L.num_kv_heads + w.kv_head) *
                                                   B.max_blocks_per_seq
                             : B.block_tables + static_cast<int64_t>(w.seq) * B.max_blocks_per_seq;
  const bool fast = L.block_size % 16 == 0 && (D == 64 || D == 128);
  const float* qrows[kMaxTileRows];
  float* orows[kMaxTileRows];
  float* lrows[kMaxTileRows];
  int32_t pos[kMaxTileRows], lo[kMaxTileRows];
  int rows = 0;
  auto flush = [&] {
    if (rows == 0) return;
    if (D == 64) {
      attend_tile<64>(rows, qrows, orows, lrows, pos, lo, kv, L, layer, w.kv_head, table, scale, partial);
    } else {
      attend_tile<128>(rows, qrows, orows, lrows, pos, lo, kv, L, layer, w.kv_head, table, scale, partial);
    }
    rows = 0;
  };
  for (int32_t qi = w.q_begin; qi < w.q_end; ++qi) {
    const int32_t p = std::min(first_pos + qi, w.key_end - 1);
    const int32_t l = std::max(window > 0 ? std::max(0, first_pos + qi - window + 1) : 0, w.key_begin);
    for (int32_t j = 0; j < group; ++j) {
      const int32_t head = w.kv_head * group + j;
      const float* qr = q + static_cast<int64_t>(q0 + qi) * q_stride + static_cast<int64_t>(head) * D;
      float* o = partial ? partials.row(w.partial, j)
                         : out + static_cast<int64_t>(q0 + qi) * num_heads * D + static_cast<int64_t>(head) * D;
      float* lse = !partial && B.row_lse ? B.row_lse + static_cast<int64_t>(q0 + qi) * num_heads + head : nullptr;
      if (!fast) {
        attend_row_generic(qr, o, lse, kv, L, layer, w.kv_head, table, p, l, scale, partial, scratch);
        continue;
      }
      qrows[rows] = qr;
      orows[rows] = o;
      lrows[rows] = lse;
      pos[rows] = p;
      lo[rows] = l;
      if (++rows == kMaxTileRows) flush();
    }
  }
  flush();
}

template <typename T>
void paged_attention_of(const float* q, int64_t q_stride, float* out, const T* kv,
                        const KVLayout& L, int32_t layer, const AttentionBatch& B,
                        int32_t num_heads, float scale, int32_t sliding_window) {
  // Query tiles of a few tokens: one pass over the keys serves all rows (tokens x GQA
  // heads) of a tile; long single-token rows are split over the threads (split-KV).
  const int32_t threads = num_threads();
  const int32_t group = num_heads / L.num_kv_heads;
  AttentionPlanParams pp;
  pp.num_kv_heads = L.num_kv_heads;
  pp.group = group;
  pp.max_rows = std::max(kMaxTileRows, group);
  pp.parallelism = threads;
  pp.sliding_window = sliding_window;
  const AttentionPlan plan = plan_attention(B.query_start, B.context_lens, B.num_seqs, pp);
  const std::vector<WorkItem>& items = plan.work;
  std::vector<float> partial_buf(static_cast<size_t>(plan.num_partials) * group * (L.head_dim + 2));
  const Partials partials{partial_buf.data(), L.head_dim, group};
  // parallel_for splits a range into contiguous chunks; deal the sorted items round-robin
  // instead so that every thread gets a similar mix of long and short ones.
  const int64_t n = static_cast<int64_t>(items.size());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(threads, n));
  const KVBlocks<T> blocks{kv, B.cold_blocks, L};
  parallel_for(0, workers, 1, [&](int64_t wb, int64_t we) {
    std::vector<float> scratch;
    for (int64_t wid = wb; wid < we; ++wid) {
      for (int64_t i = wid; i < n; i += workers) {
        attend_item(items[i], q, q_stride, out, blocks, L, layer, B, num_heads, scale, sliding_window, partials, scratch);
      }
    }
  });
  // Merge the pieces of each split row: rescale every partial to the global max.
  const int32_t D = L.head_dim;
  for (size_t mi = 0; mi < plan.merges.size(); mi += 4) {
    const int32_t seq = plan.merges[mi], kv_head = plan.merges[mi + 1];
    const int32_t first = plan.merges[mi + 2], count = plan.merges[mi + 3];
    const int32_t row = B.query_start[seq];
    for (int32_t r = 0; r < group; ++r) {
      float m = kNegInf;
      for (int32_t k = first; k < first + count; ++k) m = std::max(m, partials.row(k, r)[D]);
      float* o = out + static_cast<int64_t>(row) * num_heads * D + static_cast<int64_t>(kv_head * group + r) * D;
      float l = 0.0f;
      for (int32_t d = 0; d < D; ++d) o[d] = 0.0f;
      for (int32_t k = first; k < first + count; ++k) {
        const float* pr = partials.row(k, r);
        if (pr[D + 1] == 0.0f) continue;  // a piece with no keys for this row
        const float f = vexp(pr[D] - m);
        l += pr[D + 1] * f;
        for (int32_t d = 0; d < D; ++d) o[d] += pr[d] * f;
      }
      const float inv = 1.0f / l;
      for (int32_t d = 0; d < D; ++d) o[d] *= inv;
      if (B.row_lse) B.row_lse[static_cast<int64_t>(row) * num_heads + kv_head * group + r] = m + std::log(l);
    }
  }
}

}  // namespace

void paged_attention(const float* q, int64_t q_stride, float* out, const void* kv, const KVLayout& L, int32_t layer,
                     const AttentionBatch& B, int32_t num_heads, float scale, int32_t sliding_window) {
  with_elem(L, kv, [&](auto* pool) {
    paged_attention_of(q, q_stride, out, pool, L, layer, B, num_heads, scale, sliding_window);
  });
}

}  // namespace k25::cpu
