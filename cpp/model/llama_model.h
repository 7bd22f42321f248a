// The Llama-family decoder on ATen: weights and one forward pass over a BatchMeta.
//
// Linear layers go through ATen (MKL/oneDNN on CPU). The fused path uses the kernels of
// cpp/ops (RoPE + KV write, residual add + RMSNorm, SiLU·mul, paged attention); the
// unfused path (enable_kernel_fusion=False) uses plain ATen ops and SDPA over KV
// gathered from the pages, so the two can be compared and timed.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "engine/executor.h"
#ifdef K25_WITH_CUDA
#include "model/cuda_glue.h"
#endif
#include "model/model_config.h"
#include "ops/block_sparsity.h"
#include "ops/kv_layout.h"

namespace k25 {

struct LayerWeights {
  at::Tensor attn_norm;  // [H]
  at::Tensor wqkv;       // [(Hq + 2 Hkv) D, H]: q rows, then k, then v
  at::Tensor bqkv;       // [(Hq + 2 Hkv) D] or undefined
  at::Tensor wo;         // [H, Hq D]
  at::Tensor bo;         // [H] or undefined
  at::Tensor ffn_norm;   // [H]
  at::Tensor w_gate_up;  // [2 I, H]: gate rows, then up
  at::Tensor w_down;     // [H, I]
};

struct LlamaWeights {
  at::Tensor embed;       // [V, H]
  at::Tensor final_norm;  // [H]
  at::Tensor lm_head;     // [V, H]; the same storage as embed when tied
  std::vector<LayerWeights> layers;
  at::Tensor rope_freq_factors;  // [D / 2] divisors of the inverse frequencies, or undefined
};

// A step's inputs already on the device, in buffers that outlive the step (CUDA graphs
// capture a forward over them and replay it with new contents).
struct DeviceStep {
  at::Tensor ids, positions, slots, logits_rows;
#ifdef K25_WITH_CUDA
  cuda_glue::DeviceBatch batch;
  // Cold blocks gathered a layer ahead (cuda_glue::ColdPrefetch): the block tables name
  // cold entries (cold_block_id(j)), whose L2 slots are in cold_slots ([count, slot...]),
  // and cold_l2 is where they lie. Null: cold ids name L2 slots (batch.cold).
  cuda_glue::ColdPrefetch* prefetch = nullptr;
  at::Tensor cold_slots;
  cuda_glue::ColdPool cold_l2;
#endif
};

// Dynamic block sparsity of a step (CPU fused path; ops/block_sparsity.h): the key
// summaries of every block, the rule's parameters, and per layer the step's selection
// (read back by the executor for statistics).
// The CPU kernels' view of a step's sequences (query starts, lengths, block tables).
inline cpu::AttentionBatch cpu_attention_batch(const BatchMeta& meta) {
  cpu::AttentionBatch ab;
  ab.query_start = meta.query_start.data();
  ab.context_lens = meta.context_lens.data();
  ab.block_tables = meta.block_tables.data();
  ab.max_blocks_per_seq = meta.max_blocks_per_seq;
  ab.num_seqs = meta.num_seqs();
  return ab;
}

struct SparseStep {
  SparsityParams params;
  float* summaries = nullptr;
  SummaryLayout layout;
  std::vector<LayerSelection> layers;  // sized num_layers by the caller
  std::vector<float> lse;              // [T][num_heads] scratch for compensation
  SelectionMemory memory;              // selections kept across steps (params.selection_interval > 1)
#ifdef K25_WITH_CUDA
  // The CUDA form (cuda/block_sparsity.cu): summaries in the KV dtype on the device; the
  // selection's scratch (one for every step and graph: steps run in order on one stream);
  // per-layer statistics [num_layers, 5] on the device, copied to host_stats (pinned) at
  // the end of every forward.
  at::Tensor device_summaries, layer_stats, host_stats;
  cuda_glue::SparseScratch scratch;
  // Selection reuse (params.selection_interval > 1; undefined otherwise): the kept selections,
  // and an eager step's rows' cuda::SparseSelect::reuse modes (empty: none; a CUDA graph's
  // batch carries its own).
  cuda_glue::SparseMemory device_memory;
  std::vector<int32_t> reuse_rows;
#endif
};

// Where the CUDA attention kernels find cold blocks (a sequence longer than the device
// pool, docs/offload.md): the tiers' L2 pool, pinned and mapped; meta.cold_blocks point
// into it (host addresses), the kernels read slot (addr - host) / slot_bytes at device.
struct ColdRegion {
  const uint8_t* host = nullptr;
  const void* device = nullptr;
  int64_t slot_bytes = 0;
  int32_t num_slots = 0;
#ifdef K25_WITH_CUDA
  // Set by the executor for an eager step whose cold entries it has gathered (dense, no more
  // than prefetch->capacity()): each layer's are gathered ahead into device memory
  // (cuda_glue::ColdPrefetch) instead of read over the bus.
  cuda_glue::ColdPrefetch* prefetch = nullptr;
#endif
};

// The slot of `region` whose block lies at host address `block` (a cold block's KV);
// an internal error if it is not a slot's start.
int32_t cold_slot(const ColdRegion& region, const void* block);

// meta.block_tables with each cold id (an index into meta.cold_blocks) replaced by the id of
// its slot in `region` (cuda::KVCache's encoding, the same -2 - j form): the block tables the
// CUDA kernels read.
std::vector<int32_t> cold_slot_tables(const BatchMeta& meta, const ColdRegion* region);

// The step's cold entries as cuda_glue::ColdPrefetch reads them: out[0] their count, out[1 + j]
// entry j's slot in `region` (out holds 1 + meta.cold_blocks.size() ints).
void cold_entry_slots(const BatchMeta& meta, const ColdRegion& region, int32_t* out);

class LlamaModel {
 public:
  LlamaModel(ModelConfig config, LlamaWeights weights, int32_t max_positions);

  const ModelConfig& config() const { return config_; }
  const LlamaWeights& weights() const { return weights_; }
  int64_t weight_bytes() const;
  at::Device device() const { return weights_.embed.device(); }
  at::ScalarType dtype() const { return weights_.embed.scalar_type(); }

  // Moves the weights to `device` in `dtype` (the RoPE tables stay float32).
  void to(at::Device device, at::ScalarType dtype);

  // Runs every layer for the step's tokens, writing their K and V into `kv` (a pool on
  // the model's device laid out as `layout`), and returns float32 logits
  // [meta.logits_rows.size(), vocab] on the model's device.
  // With `prepared` (fused CUDA only) the inputs come from there and `meta` is unused.
  // `cold`: where meta.cold_blocks lie, for the CUDA kernels (see ColdRegion).
  at::Tensor forward(const BatchMeta& meta, at::Tensor& kv, const KVLayout& layout, bool fused,
                     const DeviceStep* prepared = nullptr, SparseStep* sparse = nullptr,
                     const ColdRegion* cold = nullptr) const;

  // The same forward pass a layer at a time: forward() is begin, run_layer for every layer,
  // then logits(). A step of the engine's L3 lane runs its layers between other steps
  // (docs/offload.md). The pass refers to `meta`, `kv`, `layout`, `sparse` and `cold`: they
  // must outlive it.
  class Pass {
   public:
    ~Pass();
    int32_t next_layer() const;
    int32_t num_layers() const;
    void run_layer();      // the next layer
    at::Tensor logits();   // after the last one: float32 [meta.logits_rows.size(), vocab]
    // On CUDA, a step with dynamic sparsity whose cold blocks are staged (cold blocks in L3):
    // the block reads its selections counted, summed over the layers so far, as
    // cuda_glue::SparseScratch::reads lays them out; null otherwise.
    const std::vector<int32_t>* staged_reads() const;

   private:
    friend class LlamaModel;
    struct State;
    explicit Pass(std::unique_ptr<State> s);
    std::unique_ptr<State> s_;
  };
  std::unique_ptr<Pass> begin(const BatchMeta& meta, at::Tensor& kv, const KVLayout& layout, bool fused,
                              const DeviceStep* prepared = nullptr, SparseStep* sparse = nullptr,
                              const ColdRegion* cold = nullptr) const;

 private:
  void attention_unfused(const at::Tensor& qkv, const BatchMeta& meta, const at::Tensor& kv,
                         const KVLayout& layout, int32_t layer, at::Tensor& out) const;

  ModelConfig config_;
  LlamaWeights weights_;
  at::Tensor rope_cos_;  // [max_positions, D / 2]
  at::Tensor rope_sin_;
};

// Reads a GGUF file or a Hugging Face directory and builds float32 weights.
struct LoadedModel {
  ModelConfig config;
  LlamaWeights weights;
  std::string path;
  std::string format;  // gguf | safetensors
};
LoadedModel load_llama_weights(const std::string& path, int32_t num_threads);

// The tensor type of a dtype name of the API ("float32", "bfloat16", "float16"); anything else
// is kInvalidArgument.
at::ScalarType scalar_type_of(const std::string& dtype);

}  // namespace k25
