// The work list of one attention call: which CTA / task handles which queries against
// which keys. Planned once per step on the host (it depends only on the batch shape), then
// used by every layer — FlashInfer's plan/run split.
#pragma once

#include <cstdint>
#include <vector>

namespace k25 {

// The same layout as k25::cuda::AttnWork. A piece of a split (partial >= 0) has merge =
// the index of its merge in AttentionPlan::merges (4 ints each); -1 otherwise.
struct AttnWorkItem {
  int32_t seq, kv_head, q_begin, q_end, key_begin, key_end, partial, merge;
};

struct AttentionPlan {
  std::vector<AttnWorkItem> work;
  // Split-KV merges, 4 ints each: seq, kv_head, first partial slot, slot count.
  std::vector<int32_t> merges;
  int32_t num_partials = 0;
  // With AttentionPlanParams::decode_first: work[0, num_decode) are the items of
  // single-token sequences (the GPU runs them in its decode kernel).
  int32_t num_decode = 0;
};

struct AttentionPlanParams {
  int32_t num_kv_heads = 0;
  int32_t group = 1;           // query heads per KV head
  int32_t max_rows = 16;       // query rows (tokens x group) per work item
  int32_t parallelism = 1;     // workers to keep busy (threads): splits aim at 2x this many items
  // > 0 (GPU): split so that the items fit this many concurrent CTAs (one wave), instead.
  int32_t wave = 0;
  int32_t min_split_keys = 256;
  int32_t sliding_window = 0;
  bool decode_first = false;   // single-token items before the others (see num_decode)
};

// query_start: [S + 1]; context_lens: [S].
AttentionPlan plan_attention(const int32_t* query_start, const int32_t* context_lens, int32_t num_seqs,
                             const AttentionPlanParams& p);

}  // namespace k25
