// The seam between the engine (policy, torch-free) and a backend that runs the model.
//
// Everything the model needs for a step is in BatchMeta; the executor returns one sampled
// token per SampleInput and copies whole logits rows where asked. CPU and (later) CUDA
// executors implement it; where sampling happens is the executor's business.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/sampler.h"
#include "k25/engine.h"
#include "k25/status.h"

namespace k25 {

struct TierConfig;

// Cold blocks in L3 (the CPU backend; docs/offload.md): entries of BatchMeta::cold_blocks
// whose KV is in the L3 file are read one layer at a time while the step runs. layer(l)
// waits for layer l's reads and returns the cold-block list for that layer (an L3 entry's
// pointer is then good for layer l's K and V only, until the next call), and starts the
// next layer's reads.
//
// On CUDA the kernels read every cold block of a step from one staging region per layer
// instead (layer_region): entry j of the cold list, in L2 or L3, is copied or read into it,
// and `device` is placed so that entry j's layer-l bytes lie at device + j * stride plus
// layer l's offset in a block (the kernels' own arithmetic). Before asking for layer l the
// caller makes sure the device is done reading layer l - 1's region, which is refilled.
class ColdLayerSource {
 public:
  struct Region {
    const void* device = nullptr;
    int64_t stride = 0;  // bytes between entries
    int32_t count = 0;
  };
  virtual ~ColdLayerSource() = default;
  virtual const void* const* layer(int32_t layer) = 0;
  virtual Region layer_region(int32_t layer) = 0;
  // Selective reads (ColdReadPlan): only some halves of a layer were read ahead. The model
  // selects first, then says which entries its attention reads (need[j] != 0: entry j of the
  // cold list); true when that started reads, which layer() then waits for.
  virtual bool selective() const { return false; }
  virtual bool need(int32_t layer, const std::vector<uint8_t>& need) {
    (void)layer;
    (void)need;
    return false;
  }
};

// How a step's cold blocks in L3 are read (ModelExecutor::cold_read_plan). Selective: with
// dynamic sparsity a layer's selection runs before its attention, so ahead of a layer only
// what the selection reads is read: the K halves when it estimates from keys (the CPU's
// channel estimate), nothing with the bound rule; after it, the rest of the blocks its
// attention reads (ColdLayerSource::need). Entries of rows that select nothing (prompt
// chunks, short contexts) and layers that run no selection are read whole ahead. With
// halves (the CPU), each layer of a page has two checksummed halves, its K and its V
// (TierConfig::l3_slices is twice the layers); without (CUDA, staged), a layer's slice is
// read whole or not at all.
struct ColdReadPlan {
  bool selective = false;       // else every layer of every entry is read whole ahead
  bool halves = false;          // pages have K and V halves (selective; else one slice per layer)
  bool keys_ahead = false;      // the K halves of every entry are read ahead (halves only)
  std::vector<uint8_t> whole;   // per entry of the cold list: read whole ahead
  std::vector<uint8_t> layers;  // per layer: 1 when it may select (else read whole ahead)
  // Empty, or [entry of the cold list][layer]: 1 reads that layer of the entry whole ahead
  // (the previous step's attention read it: the selection changes little from step to step).
  std::vector<uint8_t> ahead;
};

// Two staging buffers for ColdLayerSource::layer_region: pinned host memory the device can
// address (host and device pointers of each). Empty: none (the CPU backend).
struct ColdStage {
  uint8_t* host[2] = {nullptr, nullptr};
  const void* device[2] = {nullptr, nullptr};
};

struct BatchMeta {
  // Per token (T = num_tokens). Sequences are laid out one after another.
  std::vector<int32_t> token_ids;
  std::vector<int32_t> positions;
  std::vector<int64_t> slot_mapping;  // block_id * block_size + offset of each new token
  // Per sequence (S = num_seqs).
  std::vector<int32_t> query_start;   // [S + 1] offsets of each sequence's tokens
  std::vector<int32_t> context_lens;  // [S] tokens with KV after this step (incl. new)
  std::vector<int32_t> block_tables;  // [S * max_blocks_per_seq], unused entries -1
  // [S] the request of each sequence (dynamic sparsity keeps selections across its steps:
  // SelectionMemory), or empty: none named.
  std::vector<int64_t> seq_ids;
  int32_t max_blocks_per_seq = 0;
  int32_t max_query_len = 0;
  int32_t max_context_len = 0;
  // Rows of the token batch whose logits are needed, ascending.
  std::vector<int32_t> logits_rows;
  // Pipelined decode (launch_async): per token, -1, or the logits row of the previous
  // launched step whose sampled id this token is (token_ids holds a placeholder then).
  // Empty: every id is in token_ids.
  std::vector<int32_t> prev_rows;
  // Cold blocks (kv_layout.h): block table entry cold_block_id(j) is the block whose KV lies
  // at cold_blocks[j] (host memory, the pool's block layout). Only where
  // ModelExecutor::supports_cold_blocks().
  std::vector<const void*> cold_blocks;
  // With dynamic sparsity: [j] for cold_blocks[j] (block_summaries; on CUDA cold_l3_summaries
  // for L3 blocks, null for L2 ones, whose summaries are on the device).
  std::vector<const float*> cold_summaries;
  // Not null when some cold blocks are in L3: the forward asks it for each layer's list
  // (cold_blocks' L3 entries are null). Not owned; CPU only.
  ColdLayerSource* cold_layers = nullptr;

  int32_t num_tokens() const { return static_cast<int32_t>(token_ids.size()); }
  // seq_ids when it names every sequence, else null.
  const int64_t* named_ids() const {
    return seq_ids.size() == context_lens.size() ? seq_ids.data() : nullptr;
  }
  int32_t num_seqs() const { return static_cast<int32_t>(context_lens.size()); }
  bool is_decode_only() const { return max_query_len == 1; }
};

// Which blocks the last step's attention read, per sequence: the tiered-KV predictor's
// input (kv/tiers/predictor.h). A pass is one layer and KV head of one sequence.
struct BlockReads {
  int32_t passes = 0;                       // passes per sequence: layers x KV heads
  std::vector<std::vector<int32_t>> reads;  // [S][block position]: passes that read the block (empty: not a decode row)
  std::vector<uint8_t> sparse;              // [S]: some layer selected blocks (else all were read)
};

struct SampleRequest {
  int32_t logits_row;  // index into BatchMeta::logits_rows
  SampleInput input;
};

struct LogitsCopy {
  int32_t logits_row;  // index into BatchMeta::logits_rows
  float* dst;          // vocab_size floats
};

// A step whose forward runs one layer at a time, between other steps: the engine's L3 lane
// (steps of sequences with cold blocks in L3, docs/offload.md). The BatchMeta and samples it
// was begun with must outlive it; only whole steps run on the model between two of its
// layers. Dropped before its end, it waits for the device to finish its launched layers.
class LayeredStep {
 public:
  virtual ~LayeredStep() = default;
  virtual int32_t next_layer() const = 0;
  virtual int32_t num_layers() const = 0;
  virtual void run_layer() = 0;  // the next layer
  // After the last layer: fills results and copies as execute() does.
  virtual void finish(std::vector<SampleResult>* results, const std::vector<LogitsCopy>& copies) = 0;
  // After the last layer: ModelExecutor::block_reads of this step (meta: the one it began with).
  virtual bool block_reads(const BatchMeta& meta, BlockReads* out) const {
    (void)meta;
    (void)out;
    return false;
  }
};

class ModelExecutor {
 public:
  virtual ~ModelExecutor() = default;
  // Called once on the engine thread before the first step.
  virtual void prepare_thread() {}
  // Called once before the engine starts: prepares what steps of up to max_batch_size
  // sequences need (CUDA graphs of every decode bucket).
  virtual void warm_up(int32_t max_batch_size) { (void)max_batch_size; }
  virtual int32_t vocab_size() const = 0;
  // Positions the model has RoPE tables for: the longest sequence it can run.
  virtual int32_t max_positions() const = 0;
  // Runs one step: writes KV for the new tokens, fills results[i] for samples[i], and
  // copies the logits rows named in copies.
  virtual void execute(const BatchMeta& meta, const std::vector<SampleRequest>& samples,
                       std::vector<SampleResult>* results,
                       const std::vector<LogitsCopy>& copies) = 0;
  // The same step as execute(), a layer at a time (LayeredStep).
  virtual std::unique_ptr<LayeredStep> begin_layered(const BatchMeta& meta, const std::vector<SampleRequest>& samples) {
    (void)meta;
    (void)samples;
    fail(ErrorCode::kUnsupported, "this executor runs steps whole only");
  }
  // Pipelined decode (async scheduling): a decode-only step without penalties, of at most
  // max_async_batch() sequences is launched without waiting for it; its ids may come from
  // the previous launched step on the device (BatchMeta::prev_rows). collect_async() waits
  // for the oldest launched step and fills one result per sample of it. At most two steps
  // are in flight; execute() must not be called while one is.
  virtual bool supports_async() const { return false; }
  virtual int32_t max_async_batch() const { return 0; }
  // Cold blocks a launched step may read (its graph gathers them a layer ahead: TorchExecutor's
  // prefetch_capacity); a step with more runs whole and eager.
  virtual int64_t max_async_cold_blocks() const { return INT64_MAX; }
  virtual void launch_async(const BatchMeta&, const std::vector<SampleRequest>&) {
    fail(ErrorCode::kUnsupported, "this executor runs steps synchronously");
  }
  virtual void collect_async(std::vector<SampleResult>*) {
    fail(ErrorCode::kUnsupported, "this executor runs steps synchronously");
  }
  // After collect_async: what the collected step's decode rows read, as block_reads gives it
  // after execute(); false when this executor does not report it.
  virtual bool collected_block_reads(BlockReads* out) const {
    (void)out;
    return false;
  }
  // Dynamic sparsity statistics per layer (empty when off); called on the engine thread.
  virtual std::vector<LayerSparsityStats> sparsity_stats() const { return {}; }
  // The KV pool when it is in host memory (block b at base + b * kv_block_bytes()), for
  // the tiers' L1 copies; nullptr on a device.
  virtual void* kv_host_base() { return nullptr; }
  // Tiered KV where the pool is not host memory (CUDA): sets the L2 allocator (pinned) and
  // the L1 <-> L2 copier (a copy stream). Returns false when this executor has none.
  virtual bool configure_tiers(TierConfig* config) {
    (void)config;
    return false;
  }
  virtual int64_t kv_block_bytes() const { return 0; }
  // The KV pool's dtype ("float32", "bfloat16", ...; "" where the executor has no pool).
  virtual std::string kv_dtype() const { return ""; }
  // Cold entries gathered a layer ahead so far (CUDA; Stats::cold_gathered).
  virtual int64_t cold_gathered() const { return 0; }
  // KV fetched back from the tiers into L1 (tokens [context_lens[s] - query length,
  // context_lens[s]) of each sequence of `runs`, through its block table): rebuild what
  // the executor derives from the keys as they are written (dynamic-sparsity summaries).
  virtual void refresh_fetched_kv(const BatchMeta& runs) { (void)runs; }
  // Whether steps may name cold blocks (BatchMeta::cold_blocks): the attention reads them in
  // host memory.
  virtual bool supports_cold_blocks() const { return false; }
  // Cold blocks in L3 as well (read layer by layer through BatchMeta::cold_layers): how many
  // equal slices a block has, one per layer or two (ColdReadPlan::halves); 0 where the
  // executor cannot.
  virtual int32_t cold_l3_slices() const { return 0; }
  // How a step of `meta` (whose cold list names L3 entries) reads them: halves when
  // cold_l3_slices() gave two per layer.
  virtual ColdReadPlan cold_read_plan(const BatchMeta& meta) const {
    (void)meta;
    return {};
  }
  // Staging buffers of at least `bytes` each for a step's cold blocks (CUDA; valid until the
  // next call, which may only come once the device is done with the step that used them).
  // Whether steps with cold blocks in L3 read them through cold_stage's buffers
  // (ColdLayerSource::layer_region) rather than by host pointer (layer).
  virtual bool stages_cold_blocks() const { return false; }
  virtual ColdStage cold_stage(int64_t bytes) {
    (void)bytes;
    return {};
  }
  // After execute(meta, ...): which blocks that step's decode rows' attention read
  // (BlockReads; prompt chunks read every block and are left empty); false when this
  // executor does not report it.
  virtual bool block_reads(const BatchMeta& meta, BlockReads* out) const {
    (void)meta;
    (void)out;
    return false;
  }
  // A copy of what the executor derives from one L1 block's keys (dynamic-sparsity
  // summaries), for a block that goes cold; empty when it derives nothing.
  virtual std::vector<float> block_summaries(int32_t block) const {
    (void)block;
    return {};
  }
  // The same where the executor keeps it on its device: L1 block `block` went cold, its KV
  // now at `cold_data` (an L2 slot); called before the step that reuses the L1 block.
  virtual void keep_cold_summaries(int32_t block, const void* cold_data) {
    (void)block;
    (void)cold_data;
  }
  // Where it keeps them on its device and the block went to L3 instead (no L2 slot for
  // keep_cold_summaries): a host copy of them (the executor's own bytes in a float vector's
  // storage; empty when it keeps none), which BatchMeta::cold_summaries hands back to the
  // steps that read the block.
  virtual std::vector<float> cold_l3_summaries(int32_t block) {
    (void)block;
    return {};
  }
};

}  // namespace k25
