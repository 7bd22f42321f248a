// ATen glue for the CUDA kernels of cuda/: checks tensors, passes raw pointers and the
// current stream, and turns launch errors into k25::Error. Built only with CUDA.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "k25/sampling.h"

#include "kv/tiers/block_copier.h"
#include "kv/tiers/host_tier.h"
#include "ops/attention_plan.h"
#include "ops/block_sparsity.h"
#include "ops/kv_layout.h"

namespace k25::cuda_glue {

bool available();                         // built with CUDA and a device is visible

// Tiered KV on CUDA: L2 in pinned host memory (cudaHostAlloc), and a copier that moves
// whole blocks between the device pool (block b at base + b * block_bytes) and host memory
// with cudaMemcpyAsync on its own stream; each copy's completion (cudaLaunchHostFunc) is
// posted to `completions` (no CUDA call may run inside a host function). Each copy waits for
// the work queued on the engine's compute stream when it is asked for (make_cuda_block_copier):
// the engine does not wait for every step (not for one that samples nothing), so a block a
// copy reads or writes may still be in use by a kernel in flight. The engine reads fetched
// blocks only after their completion.
HostAllocator pinned_allocator();
// The device's address of pinned host memory from pinned_allocator() (mapped); nullptr if
// the device cannot address it.
const void* device_address(const void* pinned);
// Copies run on their own stream, each behind the work `compute` (the engine's stream) has
// queued when it is asked for.
std::unique_ptr<BlockCopier> make_cuda_block_copier(void* base, int64_t block_bytes, int32_t num_blocks, int device,
                                                    TaskRunner* completions, cudaStream_t compute);
void device_memory(int device, int64_t* free_bytes, int64_t* total_bytes);

// Whether the attention kernels can name every row (head_dim elements of row_bytes) of an L2
// pool of num_slots slots of slot_bytes as a cold row: 31-bit row indices (cuda::kColdRow).
bool cold_rows_fit(int64_t num_slots, int64_t slot_bytes, int64_t row_bytes);

// The L2 pool (pinned host memory, mapped) as the attention kernels read cold blocks in it.
struct ColdPool {
  const void* data = nullptr;  // device pointer of slot 0
  int64_t slot_bytes = 0;      // a block plus its page trailer, rounded up (page_bytes_for)
  int32_t num_slots = 0;
};

// The per-step attention batch on the device.
struct DeviceBatch {
  at::Tensor query_start, context_lens, block_tables;  // int32
  at::Tensor work, merges;                             // int32 [N, 8], [M, 4]
  at::Tensor partials;                                 // float32
  // int32, zero at rest: one per merge that the decode kernel does itself (the first
  // num_decode_merges of a work list; num_seqs * num_kv_heads for derived splits); see
  // cuda::AttnBatch::split_counters. Undefined: merge_kernel does every merge.
  at::Tensor split_counters;
  int32_t num_work = 0, num_merges = 0, max_blocks = 0;
  int32_t num_decode_work = 0;  // leading single-token items (AttentionPlan::num_decode)
  int32_t num_decode_merges = 0;
  // > 0: decode-only, work derived on the device (see cuda::AttnBatch::decode_splits).
  int32_t decode_splits = 0, num_seqs = 0;
  int32_t decode_tail = 0;  // tail ranges per (sequence, KV head) (cuda::AttnBatch::decode_tail)
  int32_t min_split_keys = 256;  // derived splits cover at least this many keys each
  // Dynamic block sparsity: int32 [S, num_kv_heads, max_blocks] of kept blocks, with
  // context_lens the kept keys (select_blocks); undefined: dense.
  at::Tensor head_tables;
  // Cold blocks (cuda::KVCache): block-table ids <= -2 name slots of this L2 pool, which
  // the attention kernels read in place (device pointer of the mapped pinned memory).
  ColdPool cold;
  // Selection reuse: int32 [S], per row -1, 2 m (select, keep in SparseMemory slot m) or
  // 2 m + 1 (use slot m's kept selection) (cuda::SparseSelect::reuse); undefined: none.
  at::Tensor reuse;
};
// The device form of a plan: its merges reordered so that those the decode kernel can do
// itself come first (every piece one of the leading num_decode items, group <= the decode
// kernel's, at most cuda::kMaxFusedSplits pieces), their pieces' merge fields renumbered,
// every other item's merge -1, and zeroed counters for them.
DeviceBatch make_batch(const at::Tensor& query_start, const at::Tensor& context_lens, const at::Tensor& block_tables,
                       const AttentionPlan& plan, int32_t group, int32_t head_dim, const at::Device& device);
// The counters of a device-derived decode batch (decode_splits > 1) of num_seqs sequences:
// zeroed, one per (sequence, KV head); allocate them with the partials, once per batch shape.
at::Tensor derived_split_counters(int32_t num_seqs, int32_t num_kv_heads, const at::Device& device);
// Its partials: splits + tail slots per (sequence, KV head) (tail: decode_tail_for's 0 or >= 2),
// each `group` rows of partial_row_floats(head_dim).
at::Tensor derived_partials(int32_t num_seqs, int32_t num_kv_heads, int32_t splits, int32_t tail, int32_t group,
                            int32_t head_dim, const at::Device& device);

// Dynamic block sparsity on the device (cuda/block_sparsity.cu, docs/sparsity.md "CUDA").
// Key summaries of every block: bytes (uint8), a row of cuda::summary_row_bytes per (block,
// layer, KV head) (4-bit codes and a scale for 16-bit KV, floats for float32); key_codes (the
// key-code estimate, 16-bit KV only: kUnsupported for float32) adds the keys' 2-bit codes.
// Bytes of one block's key summaries (all its layers and KV heads).
int64_t block_summary_bytes(const KVLayout& layout, at::ScalarType kv_dtype, bool key_codes = false);
at::Tensor make_block_summaries(int64_t num_blocks, const KVLayout& layout, at::ScalarType kv_dtype,
                                const at::Device& device, bool key_codes = false);
// Recomputes the summaries of `layer` of every block this step's tokens wrote.
void update_block_summaries(const at::Tensor& kv, const KVLayout& layout, int32_t layer, at::Tensor& summaries,
                            const DeviceBatch& batch, bool key_codes = false);
// The selection's buffers for batches of up to num_seqs sequences of up to max_blocks blocks.
struct SparseScratch {
  at::Tensor raw, score, select, head_tables, context_lens;
  at::Tensor zeroed;  // maxima, histograms and per-head sums: zero at rest (cuda::SparseSelect)
  // count_reads: int32 [num_seqs, max_blocks] on the device, which every selection adds its
  // block reads to (cuda::SparseSelect::block_reads; the caller zeroes it), and a pinned host
  // copy of it; undefined otherwise.
  at::Tensor reads, host_reads;
  int32_t num_seqs = 0, max_blocks = 0, num_heads = 0, num_kv_heads = 0;
};
SparseScratch make_sparse_scratch(int32_t num_seqs, int32_t max_blocks, int32_t num_heads, int32_t num_kv_heads,
                                  const at::Device& device, bool count_reads = false);
// The device bytes make_sparse_scratch allocates for those sizes (the pinned host copy of
// the read counts not included): what gpu_memory_utilization's sizing sets aside.
int64_t sparse_scratch_bytes(int32_t num_seqs, int32_t max_blocks, int32_t num_heads, int32_t num_kv_heads,
                             bool count_reads);
// Selections kept across steps on the device (sparsity_selection_interval): per memory slot and
// layer, each KV head's kept block positions and their count (cuda::SparseSelect::reuse).
struct SparseMemory {
  at::Tensor positions;  // int32 [slots, num_layers, num_kv_heads, stride]
  at::Tensor counts;     // int32 [slots, num_layers], zero at first
};
SparseMemory make_sparse_memory(int32_t slots, const KVLayout& layout, int32_t stride, const at::Device& device);
// The device bytes make_sparse_memory allocates (for the pool's sizing).
int64_t sparse_memory_bytes(int32_t slots, const KVLayout& layout, int32_t stride);

// Selects the blocks of `layer` for the batch's single-token sequences longer than
// p.min_context (Quest bound ranks, centre estimate sizes; with p.key_codes the key-code
// estimate does both, on summaries made with key_codes) and returns the batch with
// head_tables and the kept lengths set. layer_stats: float64 [num_layers, 4 or 5] on the
// device, added to (blocks, kept blocks, selections, entropy bits, and with 5 the reused
// selections). With batch.reuse, memory holds the kept selections. p.score_channels must be 0
// and p.compensation off: the device does neither (ConfigError before this). With cold
// blocks (batch.cold), the summaries of L2 slot s are block row pool_blocks + s, past the
// KV pool's pool_blocks rows (TorchExecutor::grow_cold_summaries); with cold_summaries
// defined (a staged step: cold blocks in L3, cold ids naming the step's cold entries), those
// of cold entry j are its block row j (block_summary_bytes each).
DeviceBatch select_blocks(const at::Tensor& qkv, const KVLayout& layout, int32_t layer, const at::Tensor& summaries,
                          int64_t pool_blocks, const DeviceBatch& batch, int32_t num_heads, double scale,
                          const SparsityParams& p, SparseScratch& scratch, at::Tensor& layer_stats,
                          const at::Tensor& cold_summaries = at::Tensor(), const SparseMemory* memory = nullptr);
// Waits for the work queued on the current stream.
void synchronize_stream();

// dst (pinned host) = src (device), same size, on the current stream without waiting
// (a plain cudaMemcpyAsync: capturable in a CUDA graph).
void copy_to_host_async(const at::Tensor& src, at::Tensor& dst);

// Linear layers of a few rows (cuda/gemv.cu): whether gemv() takes x [M, K], w [N, K]
// (and b [N], or undefined): bf16 / fp16, M == cuda::kGemvMaxRows (1), K % 8 == 0,
// 16-byte aligned rows, unit inner strides; and the environment variable K25_GEMV is not
// "0" (read at every call: 0 sends every product to cuBLAS, for A/B runs).
bool gemv_supported(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b);
at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b);  // y = x w^T (+ b)

void rms_norm(const at::Tensor& x, const at::Tensor& w, at::Tensor& out, double eps);
void add_rms_norm(at::Tensor& h, const at::Tensor& delta, const at::Tensor& w, at::Tensor& out, double eps);
void silu_mul(const at::Tensor& gu, at::Tensor& out);
void rope_write_kv(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& slots, int32_t num_heads,
                   const at::Tensor& cos, const at::Tensor& sin, at::Tensor& kv, const KVLayout& layout, int32_t layer);
void rope_inplace(at::Tensor& qkv, const at::Tensor& positions, int32_t num_heads, int32_t num_kv_heads,
                  const at::Tensor& cos, const at::Tensor& sin);
void write_kv(const at::Tensor& qkv, const at::Tensor& slots, int32_t num_heads, at::Tensor& kv,
              const KVLayout& layout, int32_t layer);
void paged_attention(const at::Tensor& qkv, at::Tensor& out, const at::Tensor& kv, const KVLayout& layout,
                     int32_t layer, const DeviceBatch& batch, int32_t num_heads, double scale, int32_t window);
// Split count per (sequence, KV head) for a decode-only batch of num_seqs sequences, so
// its CTAs fill one wave of the decode kernel (at most 64, at least 1); and that wave.
// Floats of one split-KV partial row (accumulators, max, sum, padding to 16 bytes): what
// AttnBatch::partials holds per (partial, GQA row).
int32_t partial_row_floats(int32_t head_dim);
int32_t decode_splits_for(at::ScalarType dtype, int32_t head_dim, int32_t group, int32_t num_seqs,
                          int32_t num_kv_heads);
// Tail ranges per (sequence, KV head) for such a batch split `splits` ways
// (cuda::AttnBatch::decode_tail): with two or more sequences and splits, about a wave of
// tail CTAs (at least 2 a pair, at most 64); else 0. K25_DECODE_TAIL=0 (read once) turns them off.
int32_t decode_tail_for(at::ScalarType dtype, int32_t head_dim, int32_t group, int32_t num_seqs,
                        int32_t num_kv_heads, int32_t splits);
int32_t decode_wave(at::ScalarType dtype, int32_t head_dim, int32_t group);
// Query rows (tokens x GQA heads) per multi-token work item for the kernel that runs them
// in this dtype: AttentionPlanParams::max_rows of a CUDA plan.
int32_t attention_max_rows(at::ScalarType dtype);
// Sampling on the device (cuda/sample.cu): one row per spec; only the outputs come back.
struct SampleSpec {
  const SamplingParams* params = nullptr;
  int32_t logits_row = 0;
  uint64_t seed = 0, counter = 0;
  std::vector<std::pair<int32_t, int32_t>> penalties;  // distinct (token, count in the output)
  const std::vector<int32_t>* banned = nullptr;
};
struct SampleOutput {
  int32_t token = -1;
  bool error = false;
  float logprob = 0.0f;
  std::vector<std::pair<int32_t, float>> top;  // best first
};
// Fills spec.penalties from a request's tokens (prompt then output) as its params need:
// every distinct token for a repetition penalty, the output's for presence/frequency.
// counts: vocab_size ints, all zero (sized on first use), left all zero.
void add_penalties(SampleSpec& spec, const std::vector<int32_t>& tokens, int32_t num_prompt_tokens,
                   std::vector<int32_t>& counts);
// logits: float32 [rows, vocab] on the device, modified in place.
std::vector<SampleOutput> sample(at::Tensor& logits, const std::vector<SampleSpec>& specs);
// The same in two halves, for a step whose results are read later: launches the sampling
// (on the current stream, no wait) and returns the device buffer of its outputs; with
// ids_out (int32 on the device) the sampled ids also go to ids_out[spec.logits_row]
// (-1 for a row without a finite logit). sample_read() turns those outputs, once copied
// to the host, into SampleOutputs.
at::Tensor sample_launch(at::Tensor& logits, const std::vector<SampleSpec>& specs, at::Tensor* ids_out);
std::vector<SampleOutput> sample_read(const uint8_t* host_outs, int32_t rows, int32_t vocab);
at::Tensor argmax_rows(const at::Tensor& logits);  // float32 [R, V] -> int32 [R]
void argmax_rows_into(const at::Tensor& logits, at::Tensor& out);  // out: int32 [R], contiguous
// Pipelined decode: ids[r] = last_ids[prev_rows[r]] where prev_rows[r] >= 0 (int32 tensors;
// an id outside [0, vocab) becomes 0).
void take_previous_ids(at::Tensor& ids, const at::Tensor& prev_rows, const at::Tensor& last_ids, int32_t vocab);

// Two events on the current stream, for a host that refills a buffer the device reads: the
// host records one after the kernels that read buffer i and waits on it before refilling i
// (cold blocks in L3 staged a layer at a time). Throws kInternal when an event call fails.
// Cold blocks gathered a layer ahead (docs/offload.md "Cold blocks on CUDA"): for a dense
// step whose cold blocks lie in the L2 pool, layer l + 1's K and V of every cold entry are
// copied from L2 into a device buffer on a stream beside the layers while layer l runs, and
// layer l + 1's attention reads them there instead of over the bus. Two buffers of
// capacity() entries (layer parity); the entries' L2 slots come in a device int32 tensor
// [1 + capacity]: the count, then entry j's slot (read on the device: one CUDA graph replays
// any count). The calls go on the current stream in this order within a step: begin_step,
// gather(0), then per layer l: gather(l + 1) (before its GEMMs), ready(l) (before its
// attention), attended(l) (after it). Under stream capture the side stream forks from and
// joins the captured stream.
class ColdPrefetch {
 public:
  ColdPrefetch(int64_t slice_bytes, int32_t capacity, const at::Device& device);
  ~ColdPrefetch();
  ColdPrefetch(const ColdPrefetch&) = delete;
  ColdPrefetch& operator=(const ColdPrefetch&) = delete;
  int32_t capacity() const { return capacity_; }
  int64_t bytes() const { return 2 * capacity_ * slice_bytes_; }
  void begin_step();
  // Enqueues layer's gather from `l2` (the mapped pool) into buffer layer % 2, after the
  // attention that last read that buffer (layer - 2's).
  void gather(int32_t layer, const ColdPool& l2, const at::Tensor& slots);
  // The current stream waits for layer's gather; returns the buffer as layer's kernels
  // address cold blocks (cuda::KVCache: entry j's layer-l bytes at the slot's layer offset).
  ColdPool ready(int32_t layer);
  void attended(int32_t layer);

 private:
  void release();
  int64_t slice_bytes_ = 0;
  int32_t capacity_ = 0;
  at::Tensor buffer_;  // uint8 [2 * capacity * slice_bytes]
  void* side_ = nullptr;  // cudaStream_t
  void* forked_ = nullptr;  // cudaEvent_t
  void* gathered_[2] = {nullptr, nullptr};
  void* read_[2] = {nullptr, nullptr};
};

class HostFence {
 public:
  HostFence();
  ~HostFence();
  HostFence(const HostFence&) = delete;
  HostFence& operator=(const HostFence&) = delete;
  void record(int i);
  void wait(int i);  // no-op before the first record(i)

 private:
  void* ev_[2] = {nullptr, nullptr};
  bool recorded_[2] = {false, false};
};

}  // namespace k25::cuda_glue
