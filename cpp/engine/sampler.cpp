#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>

#include "k25/status.h"

namespace k25 {

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Index of the largest value; the lowest index wins ties.
int32_t argmax(const float* x, int32_t n) {
  int32_t best = 0;
  for (int32_t i = 1; i < n; ++i) {
    if (x[i] > x[best]) best = i;
  }
  return best;
}

float log_sum_exp(const float* x, int32_t n) {
  float m = x[argmax(x, n)];
  if (!std::isfinite(m)) return m;
  double s = 0.0;
  for (int32_t i = 0; i < n; ++i) s += std::exp(static_cast<double>(x[i] - m));
  return m + static_cast<float>(std::log(s));
}

}  // namespace

double counter_uniform(uint64_t seed, uint64_t counter) {
  uint64_t bits = splitmix64(splitmix64(seed) ^ (counter * 0xD1B54A32D192ED03ull + 1));
  return static_cast<double>(bits >> 11) * (1.0 / 9007199254740992.0);  // 53 bits
}

void validate_sampling_params(const SamplingParams& p, int32_t vocab_size) {
  auto bad = [](const std::string& m) { fail(ErrorCode::kInvalidArgument, m); };
  if (!(p.temperature >= 0.0f) || !std::isfinite(p.temperature)) bad("temperature must be >= 0");
  if (p.top_k < 0) bad("top_k must be >= 0 (0 disables it)");
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) bad("top_p must be in (0, 1]");
  if (!(p.min_p >= 0.0f && p.min_p <= 1.0f)) bad("min_p must be in [0, 1]");
  if (!(p.repetition_penalty > 0.0f) || !std::isfinite(p.repetition_penalty)) {
    bad("repetition_penalty must be > 0");
  }
  if (!(std::fabs(p.presence_penalty) <= 2.0f)) bad("presence_penalty must be in [-2, 2]");
  if (!(std::fabs(p.frequency_penalty) <= 2.0f)) bad("frequency_penalty must be in [-2, 2]");
  if (p.max_new_tokens < 0) bad("max_new_tokens must be >= 0");
  if (p.min_new_tokens < 0) bad("min_new_tokens must be >= 0");
  if (p.logprobs < -1 || p.logprobs > 20) bad("logprobs must be between 0 and 20");
  for (int32_t t : p.stop_token_ids) {
    if (t < 0 || t >= vocab_size) bad("stop_token_ids holds " + std::to_string(t) + ", outside the vocabulary");
  }
  for (const std::string& s : p.stop) {
    if (s.empty()) bad("stop strings must not be empty");
  }
}

Sampler::Sampler(int32_t vocab_size)
    : vocab_size_(vocab_size), raw_(vocab_size), probs_(vocab_size), counts_(vocab_size, 0) {
  order_.resize(vocab_size);
}

SampleResult Sampler::sample(float* logits, const SampleInput& in) {
  const SamplingParams& p = *in.params;
  const int32_t V = vocab_size_;
  SampleResult out;

  const bool want_logprobs = p.logprobs >= 0;
  float raw_lse = 0.0f;
  if (want_logprobs) {
    std::copy(logits, logits + V, raw_.begin());
    raw_lse = log_sum_exp(logits, V);
  }

  // Penalties. Repetition (HF semantics) over prompt and output; presence and frequency
  // (OpenAI semantics) over the output only.
  const std::vector<int32_t>& toks = *in.tokens;
  if (p.repetition_penalty != 1.0f) {
    for (int32_t t : toks) counts_[t] = 1;
    for (int32_t t : toks) {
      if (counts_[t]) {
        float& l = logits[t];
        l = l > 0 ? l / p.repetition_penalty : l * p.repetition_penalty;
        counts_[t] = 0;
      }
    }
  }
  if (p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f) {
    for (size_t i = in.num_prompt_tokens; i < toks.size(); ++i) ++counts_[toks[i]];
    for (size_t i = in.num_prompt_tokens; i < toks.size(); ++i) {
      int32_t t = toks[i];
      if (counts_[t]) {
        logits[t] -= p.presence_penalty + p.frequency_penalty * static_cast<float>(counts_[t]);
        counts_[t] = 0;
      }
    }
  }
  if (in.banned) {
    for (int32_t t : *in.banned) logits[t] = kNegInf;
  }

  if (p.temperature < kGreedyTemperature || p.top_k == 1) {
    out.token = argmax(logits, V);
  } else {
    const float inv_t = 1.0f / p.temperature;
    for (int32_t i = 0; i < V; ++i) logits[i] *= inv_t;
    // Candidates in descending logit order (ties: lower id first) where a filter needs it.
    auto desc = [logits](int32_t a, int32_t b) {
      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    };
    std::iota(order_.begin(), order_.end(), 0);
    int32_t n = V;
    bool sorted = false;
    if (p.top_k > 0 && p.top_k < V) {
      n = p.top_k;
      std::partial_sort(order_.begin(), order_.begin() + n, order_.end(), desc);
      sorted = true;
    }
    float m = kNegInf;
    for (int32_t k = 0; k < n; ++k) m = std::max(m, logits[order_[k]]);
    if (!std::isfinite(m)) fail(ErrorCode::kInternal, "sampler: no finite logit");
    // Unnormalised probabilities, indexed by token. min-p is relative to the most likely
    // candidate, whose unnormalised probability is 1.
    double total = 0.0;
    for (int32_t k = 0; k < n; ++k) {
      const int32_t t = order_[k];
      float q = std::exp(logits[t] - m);
      if (q < p.min_p) q = 0.0f;
      probs_[t] = q;
      total += q;
    }
    if (p.top_p < 1.0f) {
      const double target = static_cast<double>(p.top_p) * total;
      if (!sorted) {
        // Sort only as far as the nucleus reaches: usually a small part of the vocabulary.
        int32_t k = std::min<int32_t>(n, 64);
        while (true) {
          std::partial_sort(order_.begin(), order_.begin() + k, order_.begin() + n, desc);
          double c = 0.0;
          for (int32_t j = 0; j < k; ++j) c += probs_[order_[j]];
          if (c >= target || k == n) break;
          k = static_cast<int32_t>(std::min<int64_t>(n, 4LL * k));
        }
      }
      double cum = 0.0;
      int32_t keep = 0;
      while (keep < n) {
        cum += probs_[order_[keep]];
        ++keep;
        if (cum >= target) break;
      }
      n = keep;
      total = cum;
    }
    const double u = counter_uniform(in.seed, static_cast<uint64_t>(toks.size() - in.num_prompt_tokens)) * total;
    double cum = 0.0;
    out.token = -1;
    for (int32_t k = 0; k < n; ++k) {
      const int32_t t = order_[k];
      if (probs_[t] <= 0.0f) continue;
      out.token = t;
      cum += probs_[t];
      if (u < cum) break;
    }
    if (out.token < 0) fail(ErrorCode::kInternal, "sampler: empty candidate set");
  }

  if (want_logprobs) {
    out.logprob = raw_[out.token] - raw_lse;
    if (p.logprobs > 0) {
      int32_t k = std::min<int32_t>(p.logprobs, V);
      std::iota(order_.begin(), order_.end(), 0);
      const float* r = raw_.data();
      std::partial_sort(order_.begin(), order_.begin() + k, order_.end(), [r](int32_t a, int32_t b) {
        return r[a] > r[b] || (r[a] == r[b] && a < b);
      });
      for (int32_t j = 0; j < k; ++j) out.top.push_back({order_[j], r[order_[j]] - raw_lse});
    }
  }
  return out;
}

}  // namespace k25
