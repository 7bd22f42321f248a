// The state of one request inside the engine. The scheduler owns every Sequence.
//
// A sequence is its token list (prompt, then generated tokens) and how many of those
// tokens already have KV in the cache (num_computed). Each step computes some of the
// rest: a chunk of the prompt, or the one newest token. There is no prefill/decode
// phase; after a preemption by recompute num_computed is 0 again and the generated
// tokens are recomputed along with the prompt. After a preemption by swap, num_computed
// comes back when the parked KV has been fetched into new blocks.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "k25/sampling.h"

namespace k25 {

enum class SeqStatus { kWaiting, kRunning, kFinished };

// Preemption by swap (cache_mode="hierarchical"): kOut while the computed KV is on its way
// to, or parked in, L2/L3 (the sequence waits, holding no L1 blocks); kIn while it runs
// with blocks allocated and fetches filling them (it is skipped until they land).
enum class SwapState { kNone, kOut, kIn };

enum class FinishReason { kNone, kStop, kLength, kAbort, kError };

// Pipelined decode: the token a launched step is sampling, until its result is collected
// (always the last of Sequence::tokens; see Engine::step).
constexpr int32_t kPendingToken = -1;
// A block_table entry for a cold block (see Sequence::cold_keys).
constexpr int32_t kColdBlock = -2;
const char* finish_reason_name(FinishReason r);

struct Sequence {
  int64_t id = 0;
  Priority priority = Priority::kSilver;
  uint64_t arrival = 0;  // admission order; ties in priority go to the earliest
  std::vector<int32_t> tokens;
  int32_t num_prompt_tokens = 0;
  int32_t num_computed = 0;
  int32_t max_total_tokens = 0;  // prompt + allowed new tokens (<= max_seq_len)
  std::vector<int32_t> block_table;
  int32_t pending_row = -1;  // logits row, in the step in flight, of a kPendingToken
  // Prefix caching: chain hashes of the leading full blocks of `tokens` computed so far
  // (they depend on the tokens only, so they outlive preemptions), and how many leading
  // blocks of block_table were offered to the cache (reset when the blocks are released).
  std::vector<uint64_t> block_hashes;
  int32_t num_cache_checked = 0;
  SamplingParams params;
  uint64_t seed = 0;  // effective sampling seed
  SeqStatus status = SeqStatus::kWaiting;
  FinishReason finish_reason = FinishReason::kNone;
  int32_t num_preemptions = 0;
  // Swap state (the engine's KVSwap owns the keys; the scheduler reads the rest).
  SwapState swap = SwapState::kNone;
  int32_t swap_tokens = 0;            // tokens whose KV is parked (num_computed to restore)
  std::vector<uint64_t> swap_keys;    // tier key of block i of those tokens
  int32_t swap_out_pending = 0;       // demotes not completed yet
  int32_t swap_in_pending = 0;        // fetches not completed yet
  int32_t swap_in_bad_block = -1;     // first block whose fetch failed (recomputed from there)
  // swap_keys[i] is fetched into block_table[swap_first_block + i]: 0 for a swapped-out
  // sequence; the number of prefix blocks found in L1 for one that takes cached prefix
  // blocks from L2/L3 (their chain hashes in tier_prefix_hashes until KVSwap takes them).
  int32_t swap_first_block = 0;
  std::vector<uint64_t> tier_prefix_hashes;
  bool prefix_fetch = false;  // this swap-in fetches cached prefix blocks (not its own KV)
  // Cold blocks (tiered KV, a sequence longer than L1; docs/offload.md): block_table[i] is
  // kColdBlock for a computed block whose KV was moved to L2, where the attention reads it
  // in place; cold_keys[i] is its tier key (0 for a resident block; entries past the end
  // are resident too). Freed when the sequence ends or is preempted (it recomputes then).
  std::vector<uint64_t> cold_keys;
  int32_t num_cold = 0;
  // With dynamic sparsity: each cold block's key summaries, saved when it left L1 (its L1
  // block's summaries are another block's from then on); empty entries otherwise.
  std::vector<std::vector<float>> cold_summaries;
  // With selective L3 reads (ColdReadPlan): per block index, the layers whose attention read
  // that cold block in the last lane step (its halves are read ahead in the next).
  std::vector<std::vector<uint8_t>> l3_kept;
  // Cold entries whose copy back to L1 (a predictor promotion) is running: 1 until KVSwap
  // puts the block in the table or gives up.
  std::vector<uint8_t> promoting;
  // In the engine's L3 lane: a step of it runs a layer at a time between the others' steps
  // (docs/offload.md); until it ends the scheduler skips it (preempting it drops that step).
  bool in_lane = false;
  // Steps whose cold blocks in L3 could not be written or read back (each made it recompute).
  int32_t cold_tier_faults = 0;
  bool want_prompt_logits = false;
  // Tokens from this index on are computed one per step, as decodes are (>= 0): scoring
  // a text the way generation would compute it (teacher-forced decoding).
  int32_t single_token_from = -1;
  std::vector<float> prompt_logits;  // [num_prompt_tokens, vocab] when asked
  std::string output_bytes_tail;  // last bytes of the output, for stop strings
  double arrival_time = 0;        // seconds, engine clock
  double first_scheduled_time = -1;
  double first_token_time = -1;
  int32_t prefill_chunks = 0;     // steps that computed prompt tokens (recomputation included)
  double prefill_time_s = 0;      // duration of those steps

  int32_t num_tokens() const { return static_cast<int32_t>(tokens.size()); }
  int32_t num_output_tokens() const { return num_tokens() - num_prompt_tokens; }
  // A sequence that still has tokens without KV is prefilling (or recomputing).
  bool is_prefill() const { return num_tokens() - num_computed > 1; }
  // Most tokens this sequence may compute in one step, given the prompt chunk size.
  int32_t step_limit(int32_t chunk) const {
    if (single_token_from < 0) return chunk;
    if (num_computed >= single_token_from) return 1;
    return std::min(chunk, single_token_from - num_computed);
  }
};

}  // namespace k25
