// CUDA kernels of k25: host launchers on raw device pointers (no torch types).
//
// Each launcher enqueues on `stream` and returns; errors surface through
// cudaGetLastError(), which the ATen glue checks after every launch. Element types are
// float, __half or __nv_bfloat16 (DType); arithmetic is float32 and each result is
// rounded to the element type where PyTorch's eager ops would round it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace k25::cuda {

enum class DType : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

// Paged KV storage: [blocks][layers][K, V][kv heads][block_size][head_dim].
// Cold blocks (tiered KV, a sequence longer than the device pool; docs/offload.md): a
// block-table entry id <= -2 names slot (-2 - id) of the L2 pool, pinned host memory mapped
// into the device's address space (cold_data, its device pointer), which the attention
// kernels read in place over the bus. A slot holds a block in the same layout at its start;
// slots are cold_block_elems elements apart (a block plus its page trailer, rounded up).
struct KVCache {
  void* data = nullptr;
  int32_t num_layers = 0, num_kv_heads = 0, head_dim = 0, block_size = 0;
  const void* cold_data = nullptr;
  int64_t cold_block_elems = 0;
};
constexpr __host__ __device__ bool is_cold_block(int32_t id) { return id <= -2; }
constexpr __host__ __device__ int32_t cold_slot_of(int32_t id) { return -2 - id; }

// One unit of attention work: query tokens [q_begin, q_end) of sequence `seq` for the
// query heads of KV head `kv_head`, against keys [key_begin, key_end); partial >= 0
// writes an unnormalised partial result to that slot (split-KV) for a later merge.
// merge >= 0 (a decode item with a partial, batch.split_counters set): the index in
// batch.merge of its merge, which the decode kernel's last CTA of that merge does itself
// (see AttnBatch::split_counters); -1 otherwise.
struct AttnWork {
  int32_t seq, kv_head, q_begin, q_end, key_begin, key_end, partial, merge;
};

struct AttnBatch {
  const int32_t* query_start;   // [S + 1]
  const int32_t* context_lens;  // [S]
  const int32_t* block_tables;  // [S * max_blocks]
  int32_t max_blocks;
  const AttnWork* work;         // [num_work]
  int32_t num_work;
  // The first num_decode_work items are single-token decodes (a sequence whose query is
  // one token): they run in the decode kernel, the rest in the tiled kernel.
  int32_t num_decode_work = 0;
  float* partials;              // [num_partials][group][head_dim + kPartialPad] or null
  const int32_t* merge;         // [num_merges * 4]: seq, kv_head, first slot, slot count
  int32_t num_merges;
  // > 0: a decode-only batch of num_seqs sequences (one token each) whose work is derived
  // on the device: num_seqs x num_kv_heads x decode_splits CTAs, their key ranges shared out
  // over the sequences by context_lens, each at most c keys long (common.cuh, derived_item;
  // equal lengths get decode_splits each), so the launch shape does not depend on the lengths
  // (CUDA graphs).
  int32_t decode_splits = 0;
  int32_t num_seqs = 0;
  // With decode_splits: 0, or N >= 2: num_seqs x num_kv_heads x N more CTAs after the
  // decode_splits ones, tail ranges: a (sequence, KV head) with two or more ranges of
  // kTailMinRangeKeys keys or more on average gives its last tenth of keys to shorter ranges,
  // which start as the first wave's CTAs finish (common.cuh, derived_tail_keys). Like the long
  // ranges they are N a sequence with equal lengths and shared out by keys otherwise (a long
  // row may take many more than N, each at least min_split_keys keys; a merge at most
  // kMaxFusedSplits). Partials: decode_splits + decode_tail slots per (sequence, KV head).
  int32_t decode_tail = 0;
  // The tail ranges a (sequence, KV head) has in this launch: decode_tail with device-derived
  // splits (below 2: none), else 0. The launch's item count and derived_item's items and partial
  // slots ask here; the hosts that size the partials pass decode_tail as 0 or >= 2 (glue's
  // decode_tail_for, AttentionCall), so their S + decode_tail slots are the same count.
  __host__ __device__ int32_t tail_items() const {
    return decode_splits > 0 && decode_tail >= 2 ? decode_tail : 0;
  }
  int32_t min_split_keys = 256;  // derived splits cover at least this many keys each
  // Split-KV merges done inside the decode kernel: one counter per merge, zero at rest.
  // Each CTA of a split decode, after writing its partial, counts itself on its merge's
  // counter; the last one merges the partials (merge_kernel's arithmetic and order), writes
  // the output and sets the counter back to 0 (so CUDA-graph replays need no memset).
  // Work list: merges [0, num_decode_merges) are done so (their pieces carry merge >= 0),
  // merge_kernel does the rest. Device-derived splits: num_seqs * num_kv_heads counters,
  // one per (sequence, KV head), every merge done so when the decode kernel runs them.
  // Null: merge_kernel does every merge.
  int32_t* split_counters = nullptr;
  int32_t num_decode_merges = 0;
  // Dynamic block sparsity (select_blocks): [S][num_kv_heads][max_blocks], each (sequence,
  // KV head) its own block table of kept blocks in position order; context_lens then holds
  // the kept keys' count. Read by the decode kernels (and the tiled kernel); the prefill
  // kernels keep block_tables, which is the same table for a multi-token sequence (the
  // selection copies it). Null: every head reads its sequence's block_tables row.
  const int32_t* head_tables = nullptr;
};

// A split-KV partial row: head_dim accumulators, the row's max and sum, then padding, so
// that every row starts 16 bytes aligned (the fused merge copies them with cp.async).
constexpr int32_t kPartialPad = 4;

// At most this many partials per merge are merged inside the decode kernel (its shared
// memory holds a weight and a sum per partial and GQA row); longer merges, and
// decode_splits above it, go to merge_kernel.
constexpr int32_t kMaxFusedSplits = 256;


// Rows of at most this many (tokens x GQA heads) share one CTA's K/V tiles.
constexpr int32_t kAttnMaxRows = 16;
// The same for multi-token items in bf16 / fp16, which run on tensor cores
// (prefill_attention): the planner's max_rows for those dtypes.
constexpr int32_t kPrefillRows = 128;

void rms_norm(DType t, const void* x, int64_t x_stride, const void* w, void* out, int64_t out_stride,
              int64_t rows, int32_t n, float eps, cudaStream_t stream);
void add_rms_norm(DType t, void* h, const void* delta, const void* w, void* out, int64_t rows, int32_t n,
                  float eps, cudaStream_t stream);
void silu_mul(DType t, const void* gu, void* out, int64_t rows, int32_t n, cudaStream_t stream);
// Cold blocks gathered a layer ahead (cuda/cold_stage.cu): slots[0] entries (at most
// capacity), entry j's slice_bytes at `offset` in L2 slot slots[1 + j] (slots slot_bytes apart
// from l2, a device pointer) copied to dst + j * slice_bytes. slice_bytes, slot_bytes and offset
// are multiples of 16; the count is read on the device (a CUDA graph replays one launch).
void gather_cold_layer(void* dst, const void* l2, int64_t slot_bytes, int64_t offset, int64_t slice_bytes,
                       const int32_t* slots, int32_t capacity, cudaStream_t stream);
// RoPE (rotate-half) on q in place and on k, with the k/v cache write fused.
void rope_write_kv(DType t, void* qkv, int64_t row_stride, const int32_t* positions, const int64_t* slots,
                   int64_t rows, int32_t num_heads, const float* cos, const float* sin, KVCache kv,
                   int32_t layer, cudaStream_t stream);
// The unfused pair: RoPE on q and k in place, then the cache write of k and v.
void rope_inplace(DType t, void* qkv, int64_t row_stride, const int32_t* positions, int64_t rows,
                  int32_t num_heads, int32_t num_kv_heads, int32_t head_dim, const float* cos, const float* sin,
                  cudaStream_t stream);
void write_kv(DType t, const void* qkv, int64_t row_stride, const int64_t* slots, int64_t rows, int32_t num_heads,
              KVCache kv, int32_t layer, cudaStream_t stream);
// Causal attention of each work item's queries over the paged KV; q rows have stride
// q_stride, out is [T][num_heads * head_dim] contiguous.
void paged_attention(DType t, const void* q, int64_t q_stride, void* out, KVCache kv, int32_t layer,
                     const AttnBatch& batch, int32_t num_heads, float scale, int32_t window, cudaStream_t stream);
// The decode kernel alone (paged_attention calls it): items [0, num_items) of the batch.
void decode_attention(DType t, const void* q, int64_t q_stride, void* out, KVCache kv, int32_t layer,
                      const AttnBatch& batch, int32_t num_heads, float scale, int32_t window, int32_t num_items,
                      cudaStream_t stream);
// The tensor-core kernel alone (bf16 / fp16; paged_attention calls it for the items past
// the decodes): items [first_item, first_item + num_items) of a work list, each of at most
// kPrefillRows rows.
void prefill_attention(DType t, const void* q, int64_t q_stride, void* out, KVCache kv, int32_t layer,
                       const AttnBatch& batch, int32_t num_heads, float scale, int32_t window, int32_t first_item,
                       int32_t num_items, cudaStream_t stream);
// The Hopper form of prefill_attention (wgmma, prefill_attention_sm90.cu), which
// prefill_attention tries first: launches and returns true on a compute capability 9.0
// device with an sm_90a build, for bf16 / fp16 and head_dim 128; otherwise returns false
// and does nothing. The environment variable K25_PREFILL_ATTENTION=mma makes it decline
// (read at every call), so tests can compare it with the mma.sync kernel.
bool prefill_attention_sm90(DType t, const void* q, int64_t q_stride, void* out, KVCache kv, int32_t layer,
                            const AttnBatch& batch, int32_t num_heads, float scale, int32_t window,
                            int32_t first_item, int32_t num_items, cudaStream_t stream);
// CTAs of the decode kernel resident on the whole device at once (one wave), for a dtype,
// head_dim and GQA group: split counts aim at this so no CTA waits for a second wave.
int32_t decode_attention_wave(DType t, int32_t head_dim, int32_t group);
// Query heads per KV head up to which decodes take the decode kernel.
constexpr int32_t kDecodeMaxGroup = 8;
// ---- Dynamic block sparsity on the device (block_sparsity.cu; docs/sparsity.md "CUDA") ----
// Key summaries: bytes, [num_blocks][num_layers][num_kv_heads] rows of summary_row_bytes.
// float32 KV: the keys' per-channel minima then maxima (2 x head_dim floats). 16-bit KV: their
// 4-bit codes in [-8, 7] (minima rounded down, maxima up: the Quest bound stays a bound), two a
// byte (code i in byte i / 2, the even one in the low nibble; minima then maxima), then the row's
// float scale (value = code x scale) and 12 bytes of padding: head_dim + 16 bytes.
// With key codes (16-bit KV only; code_tiles = key_code_tiles(block_size) > 0), code_tiles tiles
// of 4 x head_dim bytes follow: tile u holds keys 16u .. 16u + 15, each key and channel as a 2-bit
// code c in 0..3, the key's place in the channel's coded range [lo, hi] (times the scale):
// round(3 (k - lo x scale) / ((hi - lo) x scale)) clamped to 0..3 (0 where hi == lo, and for
// slots past the block's fill), read back as lo + c (hi - lo) / 3 (docs/sparsity.md "The
// key-code estimate"). A tile is head_dim 32-bit words in the order of the score kernel's
// m16n8k16 A fragments (keys as rows), head_dim / 32 words a lane: word i belongs to lane
// l = i / (head_dim / 32), w = i % (head_dim / 32); with g = l / 4, t = l % 4 it holds key
// 16u + g + 8 (w % 2) at channels b + 0..15, b = 64 (w / 2) + 16 t: bits 2j (j = 0..7) the code
// of channel b + (j % 4) + 8 (j / 4), bits 16 + 2j that of the channel 4 above it.
constexpr __host__ __device__ int32_t key_code_tiles(int32_t block_size) { return (block_size + 15) / 16; }
constexpr __host__ __device__ int64_t summary_row_bytes(DType t, int32_t head_dim, int32_t code_tiles = 0) {
  return t == DType::kF32 ? 8 * static_cast<int64_t>(head_dim)
                          : static_cast<int64_t>(head_dim) + 16 + 4 * static_cast<int64_t>(head_dim) * code_tiles;
}
// Recomputes, for every block that this step's tokens wrote (positions [ctx - q_len, ctx)
// of each sequence), its summary of `layer` from the keys in the cache (slots below the
// block's fill only); with code_tiles > 0 (16-bit KV) the key codes of every key of the block.
void update_block_summaries(DType t, KVCache kv, int32_t layer, void* summaries, const int32_t* query_start,
                            const int32_t* context_lens, const int32_t* block_tables, int32_t max_blocks,
                            int32_t num_seqs, int32_t code_tiles, cudaStream_t stream);
// Bins of the estimates' quantisation: estimates relative to the best block, in steps of
// 1 / kSparsityBinsPerNat nat over [-kSparsityBins / kSparsityBinsPerNat, 0].
constexpr int32_t kSparsityBins = 1024;
constexpr int32_t kSparsityBinsPerNat = 32;
// The selection's limits: KV heads (a warp each in one CTA) and query heads.
constexpr int32_t kMaxSparseKvHeads = 16;
constexpr int32_t kMaxSparseHeads = 128;
// One layer's selection for a batch of up to num_seqs sequences. Scratch marked "zero at
// rest" is allocated zeroed once; the selection leaves it zero.
struct SparseSelect {
  const int32_t* query_start;
  const int32_t* context_lens;
  const int32_t* block_tables;
  int32_t max_blocks, num_seqs;
  int32_t num_heads, num_kv_heads, block_size, num_layers, layer;
  float scale;
  int32_t min_context, sink_blocks, recent_blocks;
  float min_ratio, max_ratio, mass_target;
  float* raw;                     // [S][num_heads][2][max_blocks]: bound, centre (scaled)
  uint32_t* maxima;               // [S][num_heads][2], zero at rest
  float* score;                   // [S][Hkv][max_blocks]: rank score relative to the best
  unsigned long long* mass_hist;  // [S][Hkv][kSparsityBins], zero at rest (fixed point)
  int32_t* est_hist;              // [S][Hkv][kSparsityBins], zero at rest
  int32_t* score_hist;            // [S][Hkv][kSparsityBins], zero at rest
  unsigned long long* head_mass;  // [S][Hkv][2]: total, mandatory (fixed point), zero at rest
  double* head_mlogm;             // [S][Hkv], zero at rest
  int32_t* select;                // [S][Hkv][4]: keep, threshold bin, blocks taken from it, sparse
  int32_t* head_tables;           // [S][Hkv][max_blocks]: out (AttnBatch::head_tables)
  int32_t* context_lens_out;      // [S]: out, kept keys (sparse) or the context
  double* layer_stats;            // [4] of this layer, added to: blocks, kept, selections, entropy bits
  // Cold blocks (KVCache): the summaries of L2 slot s are at summary block cold_summary_base + s;
  // with cold_summaries (a step whose cold blocks are staged, cold blocks in L3), those of the
  // step's cold entry j are its block j instead.
  int32_t cold_summary_base = 0;
  const void* cold_summaries = nullptr;
  // Optional (null: not counted): [S][reads_stride], added to for every single-token row,
  // KV head and block position the head tables keep (sparse) or copy (dense): the passes
  // that read each block, which the tiered KV's predictor observes (docs/offload.md).
  int32_t* block_reads = nullptr;
  int32_t reads_stride = 0;
  // > 0: the summaries hold key codes (summary_row_bytes) and the key-code estimate ranks and
  // sizes instead: a block's log-mass, the log-sum-exp of the scaled q.k over its keys read back
  // from the codes, as both raw values (16-bit KV only).
  int32_t code_tiles = 0;
  // Selection reuse (sparsity_selection_interval, docs/sparsity.md "Selection reuse"): null, or
  // per row [S]: -1, none; 2 m, select and keep the result in memory slot m; 2 m + 1, use slot
  // m's kept selection of this layer instead of selecting (the row is not scored; the blocks
  // written since it are kept too; a kept count of 0, a selection that stayed dense, is dense
  // again). The caller gives a step's rows distinct slots and reuses only a selection of the
  // same sequence made at a shorter context (positions below its block count).
  const int32_t* reuse = nullptr;
  int32_t* kept_positions = nullptr;  // [slots][num_layers][num_kv_heads][kept_stride]: ascending
  int32_t* kept_counts = nullptr;     // [slots][num_layers]: kept blocks of each KV head
  int32_t kept_stride = 0;            // >= max_blocks
  double* reused_stats = nullptr;     // of this layer (optional), added to: reused (sequence, KV head) selections
};
// Selects for every single-token sequence longer than min_context (the Quest bound ranks,
// the centre estimate sizes; with code_tiles the key-code estimate does both: docs/sparsity.md), and writes head_tables / context_lens_out
// for every sequence (a copy of the table and the context where it stays dense).
// q: rows of q_stride after RoPE; summaries as update_block_summaries keeps them.
void select_blocks(DType t, const void* q, int64_t q_stride, const void* summaries, int32_t head_dim,
                   const SparseSelect& a, cudaStream_t stream);

// ---- Sampling on the device (sample.cu): the host sampler's rules, see there. ----
constexpr int32_t kMaxTopLogprobs = 20;
constexpr float kGreedyTemp = 1e-5f;  // = k25::kGreedyTemperature
struct SampleRow {
  float temperature, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty;
  int32_t top_k, logprobs;  // logprobs < 0: none; 0: the sampled token's; n: also the top n
  int32_t logits_row;       // row of the logits matrix
  int32_t pen_begin, pen_count, ban_begin, ban_count;
  uint64_t seed, counter;   // the draw is counter_uniform(seed, counter)
};
// A distinct token of the prompt and output (repetition penalty) or of the output
// (presence/frequency), with its count in the output; `raw` receives its logit before
// the penalties.
struct PenaltyEntry {
  int32_t token, out_count;
  float raw;
};
struct SampleOut {
  int32_t token, error, num_top;
  float logprob;
  int32_t top_ids[kMaxTopLogprobs];
  float top_logprobs[kMaxTopLogprobs];
};
// logits: float32 rows of row_stride, modified in place (penalties, bans); scratch:
// num_rows * vocab floats.
void sample_rows(float* logits, int64_t row_stride, int32_t vocab, const SampleRow* rows, int32_t num_rows,
                 PenaltyEntry* penalties, const int32_t* bans, float* scratch, SampleOut* out, cudaStream_t stream);

// Pipelined decode: ids[rows[i].logits_row] = out[i].token (-1 where out[i] is an error).
void scatter_sampled_ids(const SampleOut* out, const SampleRow* rows, int32_t num_rows, int32_t* ids,
                         cudaStream_t stream);

// Linear layers of a few rows (gemv.cu): y[m] = W x[m] (+ b) for m < M, W [N][K] row-major.
// For 2-byte types (kF16, kBF16), 1 <= M <= kGemvMaxRows, K a multiple of 8, and x, W, y
// rows 16-byte aligned (x_stride, y_stride in elements); float32 and larger M go to cuBLAS.
// One row only: on the H200 (8B shape) a batch-2 decode ran at 0.96x cuBLAS with it and
// 4 rows at 0.7x (x is converted once per W chunk and row), while batch 1 gains 1.08x.
constexpr int32_t kGemvMaxRows = 1;
void gemv(DType t, const void* x, int64_t x_stride, const void* w, const void* bias, void* y, int64_t y_stride,
          int32_t M, int32_t N, int32_t K, cudaStream_t stream);

// Index of the largest value of each row of a float32 [rows][n] matrix (lowest on ties;
// NaN skipped). scratch: rows * argmax_chunks(n) 8-byte words.
int32_t argmax_chunks(int32_t n);
void argmax_rows(const float* x, int64_t rows, int32_t n, int32_t* out, void* scratch, cudaStream_t stream);
// Pipelined decode: ids[r] = last_ids[prev_rows[r]] for rows with prev_rows[r] >= 0 (the
// previous step's sampled ids, still on the device; 0 where outside [0, vocab)); other
// rows are left as they are.
void take_previous_ids(int32_t* ids, const int32_t* prev_rows, const int32_t* last_ids, int32_t n, int32_t vocab,
                       cudaStream_t stream);

}  // namespace k25::cuda
