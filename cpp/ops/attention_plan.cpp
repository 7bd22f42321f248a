#include "ops/attention_plan.h"

#include <algorithm>

#include "k25/status.h"

namespace k25 {

AttentionPlan plan_attention(const int32_t* query_start, const int32_t* context_lens, int32_t num_seqs,
                             const AttentionPlanParams& p) {
  if (p.group > p.max_rows) {
    fail(ErrorCode::kUnsupported, "attention: " + std::to_string(p.group) +
                                      " query heads per KV head exceed the kernel's " +
                                      std::to_string(p.max_rows) + " rows per work item");
  }
  const int32_t tile = std::max(1, p.max_rows / p.group);
  AttentionPlan plan;
  for (int32_t s = 0; s < num_seqs; ++s) {
    const int32_t q_len = query_start[s + 1] - query_start[s];
    for (int32_t h = 0; h < p.num_kv_heads; ++h) {
      for (int32_t b = 0; b < q_len; b += tile) {
        plan.work.push_back({s, h, b, std::min(q_len, b + tile), 0, INT32_MAX, -1, -1});
      }
    }
  }
  auto single = [&](const AttnWorkItem& w) { return query_start[w.seq + 1] - query_start[w.seq] == 1; };
  // Split-KV (flash-decoding): with too few items to keep every worker busy, long
  // single-token rows are cut into key ranges and merged afterwards. The single-token items
  // share want x their number of ranges by their keys: every range at most c keys long, an
  // item of span n taking ceil(n / c) of them (at least 1, at most n / min_split_keys), for the
  // c the device-derived form (cuda/common.cuh, derived_item) searches for the same way (its
  // per-row cap differs: ceil(n / min_split_keys) and kMaxFusedSplits): ceil(N / T)
  // first (T = want x singles, N their keys), twice scaled by how far the counts overshoot T,
  // at last ceil(N / (T - singles)), which always fits. Equal rows get `want` ranges each; a
  // long row beside short ones takes the ranges the short rows do not need.
  const int64_t base = static_cast<int64_t>(plan.work.size());
  const int64_t target = p.wave > 0 ? p.wave : 2LL * p.parallelism;
  if (base > 0 && base < target) {
    // A wave is a hard bound (a CTA past it waits for a whole second round); worker
    // counts are soft (round up so every worker gets something).
    const int32_t want = static_cast<int32_t>(p.wave > 0 ? target / base : (target + base - 1) / base);
    auto key_lo = [&](const AttnWorkItem& w) {
      const int32_t ctx = context_lens[w.seq];
      return p.sliding_window > 0 ? std::max(0, ctx - p.sliding_window) : 0;
    };
    auto span_of = [&](const AttnWorkItem& w) { return context_lens[w.seq] - key_lo(w); };
    const int32_t min_keys = std::max(1, p.min_split_keys);
    int64_t singles = 0, total = 0;
    for (const AttnWorkItem& w : plan.work) {
      if (!single(w)) continue;
      ++singles;
      total += span_of(w);
    }
    auto parts_at = [&](int32_t span, int64_t c) {
      return static_cast<int32_t>(std::min<int64_t>(std::max<int64_t>(1, (span + c - 1) / c), span / min_keys));
    };
    const int64_t T = want * singles;
    int64_t c = T > 0 ? std::max<int64_t>(1, (total + T - 1) / T) : 1;
    for (int tries = 0; want > 1 && singles > 0; ++tries) {
      int64_t t = 0;
      for (const AttnWorkItem& w : plan.work) {
        if (single(w)) t += std::max(1, parts_at(span_of(w), c));
      }
      if (t <= T) break;
      c = tries < 2 ? (c * t + T - 1) / T : std::max(c, (total + T - singles - 1) / (T - singles));
      if (tries >= 2) break;
    }
    std::vector<AttnWorkItem> kept;
    std::vector<AttnWorkItem> pieces;
    for (const AttnWorkItem& w : plan.work) {
      const int32_t lo = key_lo(w);
      const int32_t span = span_of(w);
      const int32_t parts = want > 1 ? parts_at(span, c) : 1;
      if (!single(w) || parts < 2) {
        kept.push_back(w);
        continue;
      }
      const int32_t merge = static_cast<int32_t>(plan.merges.size() / 4);
      plan.merges.insert(plan.merges.end(), {w.seq, w.kv_head, plan.num_partials, parts});
      for (int32_t i = 0; i < parts; ++i) {
        AttnWorkItem piece = w;
        piece.merge = merge;
        piece.key_begin = lo + static_cast<int32_t>(static_cast<int64_t>(span) * i / parts);
        piece.key_end = lo + static_cast<int32_t>(static_cast<int64_t>(span) * (i + 1) / parts);
        piece.partial = plan.num_partials++;
        pieces.push_back(piece);
      }
    }
    kept.insert(kept.end(), pieces.begin(), pieces.end());
    plan.work = std::move(kept);
  }
  // Longest first: later tiles of a prefill and long contexts see the most keys.
  auto cost = [&](const AttnWorkItem& w) {
    const int32_t first = context_lens[w.seq] - (query_start[w.seq + 1] - query_start[w.seq]);
    return std::min(first + w.q_end, w.key_end) - w.key_begin;
  };
  std::stable_sort(plan.work.begin(), plan.work.end(),
                   [&](const AttnWorkItem& a, const AttnWorkItem& b) { return cost(a) > cost(b); });
  if (p.decode_first) {
    const auto mid = std::stable_partition(plan.work.begin(), plan.work.end(), single);
    plan.num_decode = static_cast<int32_t>(mid - plan.work.begin());
  }
  return plan;
}

}  // namespace k25
