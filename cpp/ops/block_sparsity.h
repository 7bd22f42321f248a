// Dynamic block sparsity for single-token (decode) attention, on the CPU.
//
// Every KV block keeps, per layer and KV head, the per-channel minimum and maximum of
// its keys. A decode step of a long sequence estimates each block's softmax mass, keeps
// the sink and recent blocks and the best-scoring others, and attends exactly over the
// kept blocks only. How many it keeps adapts per sequence and layer (docs/sparsity.md):
//   1. the channel estimate (score_channels = R > 0, the default): for query head q, the
//      R channels of largest |q_d|; each key's score is estimated as its exact q_d k_d on
//      those channels plus q_d (min_d + max_d) / 2 (the block centre) on the others, and
//      the block's log-mass as the log-sum-exp of its keys' estimated scores (times the
//      softmax scale). It ranks the blocks and sizes the count. With R = 0, the Quest
//      bound sum_d max(q_d * min_d, q_d * max_d) ranks, and the centre estimate
//      q·(min + max)/2 plus log(token count) sizes. With key_codes (the key-code estimate),
//      each key read back from 2-bit codes of its channels in the block's [min, max] (kept
//      in the summary), every channel; the block's log-mass the log-sum-exp of those
//      scores, as the channel estimate's. Either way, per query head relative
//      to that head's best block (heads differ in scale); per KV head, the largest of
//      those over the group's query heads (a block any head needs is kept);
//   2. a block's estimated softmax mass is exp(its estimate - best); a head needs the
//      fewest blocks (mandatory ones first, then by that estimate) whose estimated mass
//      reaches mass_target of its total. (Masses from the Quest bounds themselves look
//      peaked — the spread inflates a few blocks — and the cap would bind everywhere.)
//   3. the sequence-layer keeps the largest need over its heads, clamped so that the
//      skipped fraction lies in [min_ratio, max_ratio]; every head keeps that many of
//      its own best blocks, so all heads of a sequence see one (virtual) length.
// The kept blocks of a head become a block table in position order, and attention runs
// over it unchanged: RoPE is already in the keys, so only the skipped keys are missing.
// With compensation, each skipped block then comes back as one pseudo-key: the mean of
// its keys and values with weight (token count), i.e. n * exp(scale * q·mean_k) * mean_v
// in the softmax numerator and n * exp(scale * q·mean_k) in its denominator (Jensen: a
// low estimate of the block's true mass, exact when its keys are alike). Summaries then
// also keep the per-channel sums of keys and of values.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "ops/cpu_kernels.h"
#include "ops/kv_layout.h"

namespace k25 {

struct SparsityParams {
  int32_t min_context = 2048;   // sequences with more keys than this go sparse
  int32_t recent_blocks = 16;   // always kept: the newest blocks (incl. the partial one)
  int32_t sink_blocks = 1;      // always kept: the first blocks (attention sinks)
  float min_ratio = 0.1f;       // skipped fraction is at least this ...
  float max_ratio = 0.6f;       // ... and at most this (max_sparsity_ratio)
  float mass_target = 0.95f;    // estimated softmax mass the kept blocks must reach
  bool compensation = false;    // skipped blocks as mean pseudo-keys (needs summary sums)
  int32_t score_channels = 8;   // R > 0: channel estimate on the R largest |q_d| (min(R, head_dim));
                                // 0: Quest bound ranks, centre estimate sizes
  bool key_codes = false;       // the key-code estimate (summaries with codes; score_channels unused)
  int32_t selection_interval = 1;  // a sequence's selection serves this many of its decode steps (SelectionMemory)
};

// Block summaries: [num_blocks][num_layers][num_kv_heads][fields][head_dim] 32-bit words.
// Field 0 holds, per channel, the keys' minimum and maximum as bfloat16 in one word (the
// minimum rounded down in the low half, the maximum rounded up in the high half: the Quest
// bound stays a bound, and the scoring reads half the bytes of two floats). With key codes,
// fields 1 .. code_words follow: per channel, each key of the block as a 2-bit code of its
// place in the channel's [min, max] (key_code), 16 keys a word (word w holds keys 16w ..
// 16w + 15, key t at bits 2 (t % 16)), so code_words = ceil(block_size / 16). With sums (for
// compensation) the float sums of the keys and of the values come last.
// (The rows live in float32 storage, but the code words are bit patterns, often NaN ones as
// floats: move rows by bytes, never through float arithmetic or comparisons.)
struct SummaryLayout {
  int32_t num_layers = 0, num_kv_heads = 0, head_dim = 0;
  int32_t fields = 1;      // 1 + code_words, plus 2 with sums
  int32_t code_words = 0;  // 0: no key codes
  bool has_sums() const { return fields == 3 + code_words; }
  int64_t block_elems() const { return static_cast<int64_t>(num_layers) * num_kv_heads * fields * head_dim; }
  int64_t offset(int64_t block, int32_t layer, int32_t head) const {
    return block * block_elems() + (static_cast<int64_t>(layer) * num_kv_heads + head) * fields * head_dim;
  }
  // Within a row: the codes' words, then the key sums (the value sums follow those).
  int64_t codes_at() const { return head_dim; }
  int64_t sums_at() const { return static_cast<int64_t>(1 + code_words) * head_dim; }
  // The rows for a KV layout: with key codes (ceil(block_size / 16) words a channel), with sums.
  static SummaryLayout of(const KVLayout& L, bool key_codes, bool sums) {
    const int32_t cw = key_codes ? (L.block_size + 15) / 16 : 0;
    return SummaryLayout{L.num_layers, L.num_kv_heads, L.head_dim, 1 + cw + (sums ? 2 : 0), cw};
  }
};

// A key's 2-bit code in its channel's [lo, hi] (a summary word's bounds): (k - lo) times
// key_code_scale(lo, hi) = 3 / (hi - lo) in float32, rounded (halves to even) and clamped to
// 0..3, i.e. the nearest of lo + c (hi - lo) / 3 up to float32 rounding; 0 where lo == hi. The
// key-code estimate reads it back as that value.
inline float key_code_scale(float lo, float hi) { return hi > lo ? 3.0f / (hi - lo) : 0.0f; }
inline uint32_t key_code(float k, float lo, float scale) {
  const long c = std::lrint((k - lo) * scale);
  return static_cast<uint32_t>(c < 0 ? 0 : (c > 3 ? 3 : c));
}

// Folds the keys (and with sums the values) this step wrote for `layer` into their blocks'
// summaries, token by token in position order: a block's first slot resets it. With key
// codes, every key of a block this step wrote to is coded again against the block's new
// bounds (a new key can widen them). Keys are read back from the cache (after RoPE), so any
// write path works.
void update_key_summaries(const void* kv, const KVLayout& L, float* summaries, const SummaryLayout& S,
                          int32_t layer, const cpu::AttentionBatch& B);

// A summary word's bfloat16 halves (field 0 of SummaryLayout) and their making: x rounded
// up (toward +inf) or down to the nearest bfloat16, kept as a float. Dropping the low half
// rounds toward zero, which is outward for one sign; for the other sign (and low bits set) the
// magnitude goes one step further. A finite x past the largest bfloat16 stays at the largest
// (it is then no bound; keys never come near 3.4e38).
inline float summary_min(uint32_t w) { return std::bit_cast<float>(w << 16); }
inline float summary_max(uint32_t w) { return std::bit_cast<float>(w & 0xFFFF0000u); }
inline float bf16_outward(float x, bool up) {
  uint32_t b = std::bit_cast<uint32_t>(x);
  const bool negative = (b >> 31) != 0;
  if ((b & 0xFFFFu) != 0 && negative != up && ((b >> 16) & 0x7FFFu) < 0x7F7Fu) b += 0x10000u;
  return std::bit_cast<float>(b & 0xFFFF0000u);
}
inline uint32_t summary_word(float mn, float mx) {
  return (std::bit_cast<uint32_t>(mx) & 0xFFFF0000u) | (std::bit_cast<uint32_t>(mn) >> 16);
}

// One layer's selection for one step.
struct LayerSelection {
  std::vector<int32_t> context_lens;  // [S]: virtual length for sparse sequences, else real
  std::vector<uint8_t> sparse;        // [S]
  std::vector<int32_t> head_tables;   // [S][Hkv][max_blocks]: kept blocks in position order
  std::vector<int32_t> positions;     // [S][Hkv][max_blocks]: their positions in the block table, then -1
  std::vector<uint8_t> reused;        // [S]: the sequence's tables came from an earlier step (ReusedSelection)
  int32_t max_blocks = 0;
  // Statistics over this layer's sparse (sequence, head) selections: blocks over the fresh and
  // the reused ones, the entropy over the fresh ones (selections), which a reused one has not.
  int64_t blocks_total = 0, blocks_kept = 0;
  double entropy_bits = 0;   // sum over selections of the entropy of the estimated masses
  int64_t selections = 0;
  int64_t reused_selections = 0;  // (sequence, KV head) selections carried over from an earlier step
  std::vector<int32_t> top_blocks;  // best-scoring physical blocks of the first selection, best first
};

// Whether sequence s of B selects blocks (a single-token row with more than min_context keys).
inline bool selects_blocks(const cpu::AttentionBatch& B, int32_t s, const SparsityParams& p) {
  return B.query_start[s + 1] - B.query_start[s] == 1 && B.context_lens[s] > p.min_context;
}

// An earlier step's selection of a sequence, used again instead of selecting afresh: per KV
// head the positions (in the block table) of the blocks it kept, ascending, `count` each
// ([Hkv][count]). The blocks written since (past its last position) are kept too: they are
// the newest, which a selection always keeps. Null positions: select afresh.
struct ReusedSelection {
  const int32_t* positions = nullptr;
  int32_t count = 0;
};

// Whether a selection made at context length `chosen_at` serves a decode step at `ctx` under
// selection_interval n (SelectionMemory's rule: the latest selection made at or after the
// last multiple of n, and before ctx).
inline bool reuse_due(int32_t chosen_at, int32_t ctx, int32_t n) {
  return n > 1 && chosen_at >= 0 && chosen_at < ctx && chosen_at >= ctx - ctx % n;
}

// The CUDA form's host side (cuda::SparseSelect::reuse): per request a slot of the device's
// kept selections (cuda_glue::SparseMemory, `slots` of them, `stride` blocks wide) and the
// context length of the latest selection its rows kept there. The same rule as
// SelectionMemory, decided on the host for every layer at once (a layer whose kept selection
// stayed dense is dense again on the device, where the CPU would select it afresh: the same
// attention).
class ReuseSlots {
 public:
  ReuseSlots(int32_t slots, int32_t stride) : owner_(slots, -1), chosen_at_(slots, -1), stamp_(slots, 0), stride_(stride) {}
  // Per row of a step (B: its query starts and context lengths, ids[s] its requests; null:
  // none named): -1, 2 m (select and keep in slot m) or 2 m + 1 (use slot m's). A row that is
  // not a decode (a prompt chunk, a recompute) gives up its slot; a row over `stride` blocks
  // or beyond the slots (more rows than slots) selects without one.
  void modes(const cpu::AttentionBatch& B, const int64_t* ids, const SparsityParams& p, int32_t block_size,
             std::vector<int32_t>* out);

 private:
  std::unordered_map<int64_t, int32_t> slot_of_;
  std::vector<int64_t> owner_;
  std::vector<int32_t> chosen_at_;
  std::vector<uint64_t> stamp_;  // the step that last named the slot's request
  int32_t stride_;
  uint64_t step_ = 0;
};

// Selects for every single-token sequence longer than min_context (layers without a
// sliding window only). q: rows after RoPE; kv: the cache (read on the chosen channels
// by the channel estimate). reuse (null, or [S]): the sequences whose tables come from an
// earlier selection (such a row is not scored). Returns whether any sequence went sparse.
bool select_blocks(const float* q, int64_t q_stride, const void* kv, const float* summaries, const SummaryLayout& S,
                   const KVLayout& L, int32_t layer, const cpu::AttentionBatch& B, int32_t num_heads, float scale,
                   const SparsityParams& p, LayerSelection* out, const ReusedSelection* reuse = nullptr);

// Selections kept across steps, per request and layer (SparsityParams::selection_interval
// N > 1): a decode step whose context length is a multiple of N selects afresh, and the
// steps up to the next multiple reuse that selection (the latest one made since the last
// multiple: a sequence with none, e.g. at its first sparse step, selects afresh at any
// length). So which steps select depends on the context length only, not on the batch or
// its history. A prompt chunk of a request drops its entry (its KV is being recomputed), a
// step that leaves a layer dense that layer's; entries of requests not seen for 64 steps are
// dropped (a missing entry only means a fresh selection). Held by the engine thread's
// executor.
class SelectionMemory {
 public:
  // Before each step (forward pass) that may select: drops the entries of requests no step
  // has named for 64 steps.
  void begin_step();
  // For `layer` of a step of B whose rows belong to requests ids[s]: reuse[s] (sized S)
  // names the kept selection of each sequence that may use one, else null. Valid until the
  // next store() of the layer.
  void lookup(const cpu::AttentionBatch& B, const int64_t* ids, int32_t layer, const SparsityParams& p,
              std::vector<ReusedSelection>* reuse);
  // After select_blocks: keeps the fresh selections of `sel` (a sequence that selected and
  // stayed dense forgets its entry).
  void store(const cpu::AttentionBatch& B, const int64_t* ids, int32_t layer, int32_t num_kv_heads,
             int32_t block_size, const SparsityParams& p, const LayerSelection& sel);

 private:
  struct Kept {
    int32_t context_len = 0;  // at the selection
    int32_t count = 0;        // 0: none
    std::vector<int32_t> positions;  // [Hkv][count]
  };
  struct Entry {
    std::vector<Kept> layers;
    uint64_t used = 0;  // steps_ when a step last named the request
  };
  std::unordered_map<int64_t, Entry> entries_;
  uint64_t steps_ = 0;
};

// The batch attention should use after select_blocks: context lengths and per-head tables.
cpu::AttentionBatch sparse_batch(const cpu::AttentionBatch& B, const LayerSelection& sel);

// Decode attention with block selection, for a layer without a sliding window: selects
// (select_blocks), attends over the kept blocks of the sequences that went sparse and
// over all blocks of the others, then, with p.compensation, folds the skipped blocks back
// in (compensate_skipped; `lse` is its scratch). `sel` receives the selection.
void sparse_decode_attention(const float* q, int64_t q_stride, float* out, const void* kv, const KVLayout& L,
                             int32_t layer, const cpu::AttentionBatch& B, const float* summaries,
                             const SummaryLayout& S, int32_t num_heads, float scale, const SparsityParams& p,
                             LayerSelection* sel, std::vector<float>* lse, const ReusedSelection* reuse = nullptr);
// Its second half, for a selection made already: `selected` is what select_blocks returned.
void attend_selected(const float* q, int64_t q_stride, float* out, const void* kv, const KVLayout& L, int32_t layer,
                     const cpu::AttentionBatch& B, const float* summaries, const SummaryLayout& S, int32_t num_heads,
                     float scale, const SparsityParams& p, bool selected, const LayerSelection& sel,
                     std::vector<float>* lse);
// The entries of B's cold list that attention over `sel` reads (need[j], sized num_cold):
// every cold block of a sequence that did not go sparse, the kept ones of those that did.
void cold_entries_read(const cpu::AttentionBatch& B, int32_t block_size, int32_t num_kv_heads, bool selected,
                       const LayerSelection& sel, std::vector<uint8_t>* need);

// Compensation: folds every skipped block of the sparse sequences back into their output
// rows as a mean pseudo-key. out: the attention output over the kept blocks; lse: its
// per-(row, query head) log-sum-exp of the scaled scores ([T][num_heads], as
// paged_attention writes it when AttentionBatch::row_lse is set). B: the original batch.
void compensate_skipped(const float* q, int64_t q_stride, float* out, const float* lse, const float* summaries,
                        const SummaryLayout& S, const KVLayout& L, int32_t layer, const cpu::AttentionBatch& B,
                        const LayerSelection& sel, int32_t num_heads, float scale);

}  // namespace k25
