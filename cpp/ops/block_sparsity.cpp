#include "ops/block_sparsity.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "ops/parallel.h"

namespace k25 {

namespace {

// Key `off` of a block's head, channel d (the CPU cache keeps K transposed).
inline float key_at(const float* K, const KVLayout& L, int32_t off, int32_t d) {
  return L.k_transposed ? K[static_cast<int64_t>(d) * L.block_size + off]
                        : K[static_cast<int64_t>(off) * L.head_dim + d];
}

}  // namespace

void update_key_summaries(const float* kv, const KVLayout& L, float* summaries, const SummaryLayout& S,
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
          const float* K = kv + L.k_offset(block, layer, h);
          float* mn = summaries + S.offset(block, layer, h);
          float* mx = mn + D;
          for (int32_t d = 0; d < D; ++d) {
            const float k = key_at(K, L, off, d);
            if (off == 0) {
              mn[d] = k;
              mx[d] = k;
            } else {
              mn[d] = std::min(mn[d], k);
              mx[d] = std::max(mx[d], k);
            }
          }
          if (S.fields < 4) continue;
          float* sk = mn + 2 * D;
          float* sv = mn + 3 * D;
          const float* v = kv + L.v_offset(block, layer, h) + static_cast<int64_t>(off) * D;
          for (int32_t d = 0; d < D; ++d) {
            const float k = key_at(K, L, off, d);
            sk[d] = off == 0 ? k : sk[d] + k;
            sv[d] = off == 0 ? v[d] : sv[d] + v[d];
          }
        }
      }
    }
  });
}

bool select_blocks(const float* q, int64_t q_stride, const float* kv, const float* summaries, const SummaryLayout& S,
                   const KVLayout& L, int32_t layer, const cpu::AttentionBatch& B, int32_t num_heads, float scale,
                   const SparsityParams& p, LayerSelection* out) {
  const int32_t Hkv = L.num_kv_heads, group = num_heads / Hkv, D = L.head_dim, bs = L.block_size;
  const int32_t R = std::min(std::max(p.score_channels, 0), D);  // 0: the bound rule
  const int32_t nseq = B.num_seqs, MB = B.max_blocks_per_seq;
  out->context_lens.assign(B.context_lens, B.context_lens + nseq);
  out->sparse.assign(nseq, 0);
  out->max_blocks = MB;
  out->head_tables.clear();
  out->blocks_total = out->blocks_kept = out->selections = 0;
  out->entropy_bits = 0;
  out->top_blocks.clear();
  bool any = false;
  for (int32_t s = 0; s < nseq; ++s) {
    any = any || (B.query_start[s + 1] - B.query_start[s] == 1 && B.context_lens[s] > p.min_context);
  }
  if (!any) return false;
  out->head_tables.assign(static_cast<size_t>(nseq) * Hkv * MB, -1);

  // Eligible sequences: their block counts and where their scores start in the flat
  // buffers ([Hkv][nb] per sequence).
  std::vector<int32_t> nbs(nseq, 0);
  std::vector<size_t> base(nseq, 0);
  std::vector<int64_t> items;  // s * Hkv + h of every eligible (sequence, KV head)
  size_t flat = 0;
  for (int32_t s = 0; s < nseq; ++s) {
    if (B.query_start[s + 1] - B.query_start[s] != 1 || B.context_lens[s] <= p.min_context) continue;
    nbs[s] = (B.context_lens[s] + bs - 1) / bs;
    base[s] = flat;
    flat += static_cast<size_t>(Hkv) * nbs[s];
    for (int32_t h = 0; h < Hkv; ++h) items.push_back(static_cast<int64_t>(s) * Hkv + h);
  }
  std::vector<float> score_all(flat, -INFINITY);  // per KV head: the rank score
  std::vector<float> est_all(flat, -INFINITY);    // per KV head: the estimate the count uses
  // 1. Scores, one (sequence, KV head) per task (a batch of one sequence still spreads over
  //    the threads): per query head the channel estimate (or the bound) relative to its
  //    best block; per KV head the largest of those over the group.
  parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t ib, int64_t ie) {
    std::vector<float> ub;         // [nb]: one query head's bounds (or channel estimates)
    std::vector<float> ctr;        // [nb]: one query head's q . (block key centre) (or channel estimates)
    std::vector<int32_t> chan(D);  // channels by |q_d|, largest first
    std::vector<float> acc(bs);    // one block's estimated scores
    for (int64_t it = ib; it < ie; ++it) {
      const int32_t s = static_cast<int32_t>(items[it] / Hkv), h = static_cast<int32_t>(items[it] % Hkv);
      const int32_t ctx = B.context_lens[s];
      const int32_t nb = nbs[s];
      const int32_t* table = B.block_tables + s * MB;
      const float* qrow = q + static_cast<int64_t>(B.query_start[s]) * q_stride;
      auto tokens = [&](int32_t j) { return j == nb - 1 ? ctx - (nb - 1) * bs : bs; };
      ub.resize(nb);
      ctr.resize(nb);
      float* sc = score_all.data() + base[s] + static_cast<size_t>(h) * nb;
      float* es = est_all.data() + base[s] + static_cast<size_t>(h) * nb;
      for (int32_t g = 0; g < group; ++g) {
        const float* qh = qrow + static_cast<int64_t>(h * group + g) * D;
        if (R > 0) {
          // The R channels of largest |q_d| (ties: lower channel first).
          std::iota(chan.begin(), chan.end(), 0);
          std::partial_sort(chan.begin(), chan.begin() + R, chan.end(), [&](int32_t a, int32_t b) {
            const float fa = std::fabs(qh[a]), fb = std::fabs(qh[b]);
            return fa > fb || (fa == fb && a < b);
          });
        }
        for (int32_t j = 0; j < nb; ++j) {
          const float* mn = summaries + S.offset(table[j], layer, h);
          const float* mx = mn + D;
          if (R > 0) {
            // Channel estimate: each key's exact q_d k_d on the chosen channels plus
            // q_d (min_d + max_d) / 2 on the others; the block's log-mass is the
            // log-sum-exp of those scores (token count included). Rank and count both.
            float rest = 0.0f;
            for (int32_t d = 0; d < D; ++d) rest += qh[d] * (mn[d] + mx[d]);
            rest *= 0.5f;
            const int32_t n = tokens(j);
            std::fill(acc.begin(), acc.begin() + n, 0.0f);
            const float* K = kv + L.k_offset(table[j], layer, h);
            for (int32_t i = 0; i < R; ++i) {
              const int32_t d = chan[i];
              const float qd = qh[d];
              rest -= qd * 0.5f * (mn[d] + mx[d]);
              if (L.k_transposed) {
                const float* row = K + static_cast<int64_t>(d) * bs;
                for (int32_t t = 0; t < n; ++t) acc[t] += qd * row[t];
              } else {
                for (int32_t t = 0; t < n; ++t) acc[t] += qd * K[static_cast<int64_t>(t) * D + d];
              }
            }
            float top = -INFINITY;
            for (int32_t t = 0; t < n; ++t) {
              acc[t] = (acc[t] + rest) * scale;
              top = std::max(top, acc[t]);
            }
            float sum = 0.0f;
            for (int32_t t = 0; t < n; ++t) sum += std::exp(acc[t] - top);
            ub[j] = ctr[j] = top + std::log(sum);
            continue;
          }
          float b = 0.0f, c = 0.0f;
          for (int32_t d = 0; d < D; ++d) {
            b += std::max(qh[d] * mn[d], qh[d] * mx[d]);
            c += qh[d] * (mn[d] + mx[d]);
          }
          ub[j] = b * scale;
          ctr[j] = 0.5f * c * scale;
        }
        // Relative to this head's best block, so that a head with small logits still
        // gets its blocks: heads differ in scale, and the kept set is shared.
        const float top = *std::max_element(ub.begin(), ub.begin() + nb);
        for (int32_t j = 0; j < nb; ++j) sc[j] = std::max(sc[j], ub[j] - top);
        const float ctop = *std::max_element(ctr.begin(), ctr.begin() + nb);
        for (int32_t j = 0; j < nb; ++j) es[j] = std::max(es[j], ctr[j] - ctop);
      }
    }
  });
  struct SeqStats {
    int64_t total = 0, kept = 0, selections = 0;
    double entropy = 0;
    std::vector<int32_t> top;
  };
  std::vector<SeqStats> stats(nseq);
  // 2-3. Per sequence: the count, then every head's kept blocks.
  parallel_for(0, nseq, 1, [&](int64_t sb, int64_t se) {
    std::vector<int32_t> order;
    std::vector<double> mass;   // [nb]: one head's estimated softmax masses
    std::vector<uint8_t> kept;  // [nb]: one head's selection
    for (int64_t s = sb; s < se; ++s) {
      const int32_t nb = nbs[s];
      if (nb == 0) continue;
      const int32_t ctx = B.context_lens[s];
      const int32_t* table = B.block_tables + s * MB;
      auto tokens = [&](int32_t j) { return j == nb - 1 ? ctx - (nb - 1) * bs : bs; };
      const float* score = score_all.data() + base[s];
      const float* est = est_all.data() + base[s];
      // Mandatory blocks: sinks and the newest ones.
      auto mandatory = [&](int32_t j) { return j < p.sink_blocks || j >= nb - p.recent_blocks; };
      int32_t n_mand = 0;
      for (int32_t j = 0; j < nb; ++j) n_mand += mandatory(j) ? 1 : 0;
      // The non-mandatory blocks into `order`, best first by `sc`.
      auto rank_others = [&](const float* sc) {
        order.clear();
        for (int32_t j = 0; j < nb; ++j) {
          if (!mandatory(j)) order.push_back(j);
        }
        std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return sc[a] > sc[b]; });
      };
      // 2. Each head's need under the mass rule, with masses from the channel estimate
      //    (or, with R = 0, the centre estimate).
      int32_t need = n_mand;
      SeqStats& st = stats[s];
      mass.resize(nb);
      for (int32_t h = 0; h < Hkv; ++h) {
        // With R = 0 the count comes from the centre estimate: the bound exceeds it by the
        // block's spread, so masses estimated from bounds look peaked and the cap would
        // always bind.
        const float* sc = est + static_cast<size_t>(h) * nb;
        const float top = *std::max_element(sc, sc + nb);
        double total = 0, covered = 0;
        for (int32_t j = 0; j < nb; ++j) {
          // (The channel estimate already counts the block's tokens.)
          mass[j] = (R > 0 ? 1 : tokens(j)) * std::exp(static_cast<double>(sc[j] - top));
          total += mass[j];
          if (mandatory(j)) covered += mass[j];
        }
        // Entropy (bits) of the estimated mass over blocks: low when a few blocks dominate.
        double ent = 0;
        for (int32_t j = 0; j < nb; ++j) {
          const double w = mass[j] / total;
          if (w > 0) ent -= w * std::log2(w);
        }
        st.entropy += ent;
        rank_others(sc);
        int32_t k = n_mand;
        for (int32_t j : order) {
          if (covered >= p.mass_target * total) break;
          covered += mass[j];
          ++k;
        }
        need = std::max(need, k);
      }
      // 3. Clamp the skipped fraction to [min_ratio, max_ratio] (mandatory blocks stay).
      const int32_t keep_min = static_cast<int32_t>(std::ceil(nb * (1.0 - p.max_ratio) - 1e-9));
      const int32_t keep_max = static_cast<int32_t>(std::floor(nb * (1.0 - p.min_ratio) + 1e-9));
      const int32_t keep = std::max(n_mand, std::min(std::max(need, keep_min), keep_max));
      if (keep >= nb) continue;  // nothing to skip: stays dense
      // Every head: mandatory blocks plus its best others, in position order.
      for (int32_t h = 0; h < Hkv; ++h) {
        const float* sc = score + static_cast<size_t>(h) * nb;
        rank_others(sc);
        if (h == 0 && st.top.empty()) {
          std::vector<int32_t> all(nb);
          std::iota(all.begin(), all.end(), 0);
          std::stable_sort(all.begin(), all.end(), [&](int32_t a, int32_t b) { return sc[a] > sc[b]; });
          for (int32_t i = 0; i < std::min<int32_t>(8, nb); ++i) st.top.push_back(table[all[i]]);
        }
        kept.resize(nb);
        for (int32_t j = 0; j < nb; ++j) kept[j] = mandatory(j) ? 1 : 0;
        for (int32_t i = 0; i < keep - n_mand; ++i) kept[order[i]] = 1;
        int32_t* ht = out->head_tables.data() + (static_cast<size_t>(s) * Hkv + h) * MB;
        int32_t n = 0;
        for (int32_t j = 0; j < nb; ++j) {
          if (kept[j]) ht[n++] = table[j];
        }
      }
      out->sparse[s] = 1;
      out->context_lens[s] = (keep - 1) * bs + tokens(nb - 1);
      st.total += static_cast<int64_t>(nb) * Hkv;
      st.kept += static_cast<int64_t>(keep) * Hkv;
      st.selections += Hkv;
    }
  });
  bool sparse_any = false;
  for (int32_t s = 0; s < nseq; ++s) {
    if (!out->sparse[s]) continue;
    sparse_any = true;
    out->blocks_total += stats[s].total;
    out->blocks_kept += stats[s].kept;
    out->selections += stats[s].selections;
    out->entropy_bits += stats[s].entropy;
    if (out->top_blocks.empty()) out->top_blocks = stats[s].top;
  }
  return sparse_any;
}

cpu::AttentionBatch sparse_batch(const cpu::AttentionBatch& B, const LayerSelection& sel) {
  cpu::AttentionBatch b = B;
  b.context_lens = sel.context_lens.data();
  b.head_tables = sel.head_tables.data();
  b.sparse_seq = sel.sparse.data();
  return b;
}

void sparse_decode_attention(const float* q, int64_t q_stride, float* out, const float* kv, const KVLayout& L,
                             int32_t layer, const cpu::AttentionBatch& B, const float* summaries,
                             const SummaryLayout& S, int32_t num_heads, float scale, const SparsityParams& p,
                             LayerSelection* sel, std::vector<float>* lse) {
  cpu::AttentionBatch use = B;
  if (select_blocks(q, q_stride, kv, summaries, S, L, layer, B, num_heads, scale, p, sel)) {
    use = sparse_batch(B, *sel);
    if (p.compensation) {
      lse->resize(static_cast<size_t>(B.query_start[B.num_seqs]) * num_heads);
      use.row_lse = lse->data();
    }
  }
  cpu::paged_attention(q, q_stride, out, kv, L, layer, use, num_heads, scale, 0);
  if (use.row_lse) compensate_skipped(q, q_stride, out, use.row_lse, summaries, S, L, layer, B, *sel, num_heads, scale);
}

void compensate_skipped(const float* q, int64_t q_stride, float* out, const float* lse, const float* summaries,
                        const SummaryLayout& S, const KVLayout& L, int32_t layer, const cpu::AttentionBatch& B,
                        const LayerSelection& sel, int32_t num_heads, float scale) {
  const int32_t Hkv = L.num_kv_heads, group = num_heads / Hkv, D = L.head_dim, bs = L.block_size;
  const int32_t MB = B.max_blocks_per_seq;
  if (S.fields < 4) return;
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
          const float* sk = summaries + S.offset(skipped[b], layer, h) + 2 * D;
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
          const float* sv = summaries + S.offset(skipped[b], layer, h) + 3 * D;
          for (int32_t d = 0; d < D; ++d) mv[d] += w * inv_n * sv[d];
        }
        const float inv = 1.0f / den;
        for (int32_t d = 0; d < D; ++d) o[d] = (o[d] * w0 + mv[d]) * inv;
      }
    }
  });
}

}  // namespace k25
