// Engine configuration shared by the scheduler, the KV pool and the executors.
#pragma once

#include <cstdint>
#include <string>

namespace k25 {

struct EngineConfig {
  int32_t max_batch_size = 64;           // sequences per step
  int32_t max_num_batched_tokens = 2048; // token budget of one step (prefill chunks + decodes)
  int32_t prefill_chunk_size = 512;      // most prompt tokens one sequence computes per step
  int32_t block_size = 16;               // tokens per KV block
  int32_t num_kv_blocks = 0;             // size of the primary KV pool, in blocks
  int32_t max_seq_len = 8192;            // prompt + generated tokens of one sequence
  int32_t decode_max_tokens = 0;         // cap on max_new_tokens of any request (0: none)
  int32_t num_threads = 0;               // intra-op threads of the engine thread (0: default)
  // The KV pool's dtype: "" is the model's compute dtype; "bfloat16" with float32 compute on
  // the CPU halves the pool (keys and values rounded to nearest-even as they are written).
  std::string kv_cache_dtype;
  float admission_watermark = 0.01f;     // fraction of blocks kept free when admitting
  double batching_window_ms = 0;         // an idle engine waits this long to gather arrivals
  // Prefix caching: full computed blocks are registered by the hash of their token prefix
  // and shared with later requests that start with the same tokens (BlockPool).
  bool enable_prefix_caching = false;
  // Dynamic block sparsity of decode attention (docs/sparsity.md; CPU backend).
  bool enable_dynamic_sparsity = false;
  float max_sparsity_ratio = 0.6f;       // most of a sequence-layer's blocks skipped
  int32_t sparsity_min_context = 2048;   // sequences longer than this go sparse
  int32_t sparsity_recent_blocks = 16;    // newest blocks always kept
  int32_t sparsity_sink_blocks = 1;      // first blocks always kept
  float sparsity_mass_target = 0.95f;    // estimated softmax mass the kept blocks reach
  int32_t sparsity_score_channels = 8;   // channels of the mass estimate (0: Quest bound)
  bool sparsity_key_codes = false;       // the key-code estimate instead (score_channels unused)
  bool sparsity_compensation = false;    // skipped blocks folded back as mean pseudo-keys
  int32_t sparsity_selection_interval = 1;  // a sequence's selection serves up to this many decode steps
  // Tiered KV (cache_mode="hierarchical", docs/offload.md; CPU backend): preemption
  // parks a sequence's computed KV in L2 host memory (L3 file when L2 is full) instead of
  // dropping it, and fetches it back on readmission.
  bool swap_preempted = false;
  int64_t l2_bytes = 0;                  // L2 host pool
  std::string l3_path;                   // L3 file or block device ("": no L3)
  int64_t l3_bytes = 0;
  // The predictor of a sequence longer than L1 (kv/tiers/predictor.h, docs/offload.md):
  // which resident blocks go cold first and which cold blocks come back.
  double predictor_decay = 0.75;          // weight of a block's history in its heat
  double predictor_promote_heat = 0.5;    // a cold block at least this hot comes back to L1
  double predictor_margin = 0.25;         // an exchange needs the resident block this much colder
  int32_t predictor_max_moves = 2;        // promotions per sequence per step
  double predictor_free_watermark = 0.1;  // share of L1 that promotions leave free
  double predictor_max_entropy = 0.95;    // no exchanges for a sequence whose access entropy is above this
};

}  // namespace k25
