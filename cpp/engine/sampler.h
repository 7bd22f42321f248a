// Token sampling on host float32 logits: penalties, temperature, top-k, top-p, min-p,
// greedy, seeded draws and logprobs.
//
// Randomness is counter based: the draw for output token i of a request is a hash of
// (seed, i). So a request gives the same tokens for the same seed whatever batch it runs
// in and whether or not it was preempted and recomputed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "k25/sampling.h"

namespace k25 {

struct TokenLogprob {
  int32_t token;
  float logprob;
};

struct SampleResult {
  int32_t token = -1;
  float logprob = 0.0f;            // of the sampled token under the raw model distribution
  std::vector<TokenLogprob> top;   // the top-n raw logprobs, best first (when asked)
  std::string error;               // set (and token -1) when this row could not be sampled
};

struct SampleInput {
  const SamplingParams* params = nullptr;
  const std::vector<int32_t>* tokens = nullptr;  // prompt followed by output so far
  int32_t num_prompt_tokens = 0;
  uint64_t seed = 0;
  const std::vector<int32_t>* banned = nullptr;  // ids masked out (EOS before min_new_tokens)
};

class Sampler {
 public:
  explicit Sampler(int32_t vocab_size);
  // Samples one token. `logits` ([vocab_size]) is modified in place.
  SampleResult sample(float* logits, const SampleInput& in);
  int32_t vocab_size() const { return vocab_size_; }

 private:
  int32_t vocab_size_;
  std::vector<float> raw_;
  std::vector<int32_t> order_;
  std::vector<float> probs_;
  std::vector<int32_t> counts_;
};

// Uniform double in [0, 1) for draw `counter` of a stream `seed`.
double counter_uniform(uint64_t seed, uint64_t counter);

}  // namespace k25
