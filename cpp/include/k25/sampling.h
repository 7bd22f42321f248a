// Per-request sampling and stopping parameters (the fields of an OpenAI request that the
// engine honours). Validated by validate_sampling_params() before a request is queued.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace k25 {

// Temperatures below this are greedy (as in vLLM): 1/T would overflow the logits.
constexpr float kGreedyTemperature = 1e-5f;

struct SamplingParams {
  float temperature = 1.0f;         // < kGreedyTemperature selects greedy decoding
  int32_t top_k = 0;                // 0 disables
  float top_p = 1.0f;               // 1 disables
  float min_p = 0.0f;               // 0 disables; keeps tokens with p >= min_p * p_max
  float repetition_penalty = 1.0f;  // HF/CTRL style over prompt and output tokens
  float presence_penalty = 0.0f;    // OpenAI style over output tokens
  float frequency_penalty = 0.0f;   // OpenAI style over output tokens
  bool has_seed = false;            // without a seed the engine draws one per request
  uint64_t seed = 0;
  int32_t max_new_tokens = 16;
  int32_t min_new_tokens = 0;       // EOS and stop tokens are ignored before this many
  std::vector<int32_t> stop_token_ids;
  std::vector<std::string> stop;    // stop strings, matched on the output's UTF-8 bytes
  bool ignore_eos = false;
  int32_t logprobs = -1;            // -1: none; 0: sampled token; n: also the top n
};

// Repetition, presence and frequency penalties are computed from the tokens so far.
inline bool reads_token_history(const SamplingParams& p) {
  return p.repetition_penalty != 1.0f || p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f;
}

// Throws k25::Error(kInvalidArgument) naming the first bad field.
void validate_sampling_params(const SamplingParams& p, int32_t vocab_size);

enum class Priority : int32_t { kGold = 0, kSilver = 1, kBronze = 2 };

}  // namespace k25
