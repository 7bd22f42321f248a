#include "kv/tiers/predictor.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "k25/status.h"

namespace k25 {

namespace {

void check_range(bool ok, const char* name, double v, const char* range) {
  if (!ok) fail(ErrorCode::kInvalidArgument, std::string(name) + "=" + std::to_string(v) + " must be in " + range);
}

}  // namespace

BlockPredictor::BlockPredictor(const PredictorConfig& c) : config_(c) {
  check_range(c.decay >= 0 && c.decay < 1, "predictor_decay", c.decay, "[0, 1)");
  check_range(c.promote_heat > 0 && c.promote_heat <= 1, "predictor_promote_heat", c.promote_heat, "(0, 1]");
  check_range(c.margin >= 0 && c.margin <= 1, "predictor_margin", c.margin, "[0, 1]");
  check_range(c.max_moves >= 0, "predictor_max_moves", c.max_moves, "[0, inf)");
  check_range(c.free_watermark >= 0 && c.free_watermark <= 1, "predictor_free_watermark", c.free_watermark,
              "[0, 1]");
  check_range(c.max_entropy >= 0 && c.max_entropy <= 1, "predictor_max_entropy", c.max_entropy, "[0, 1]");
}

void BlockPredictor::observe(int64_t seq, const int32_t* reads, const uint8_t* cold, int32_t num_blocks,
                             int32_t passes, bool sparse, int64_t step) {
  if (num_blocks <= 0 || passes <= 0) return;
  for (int32_t b = 0; b < num_blocks; ++b) {
    if (cold[b] > kReadFromL3) fail(ErrorCode::kInvalidArgument, "a block read from no such tier");
  }
  for (int32_t b = 0; b < num_blocks; ++b) {
    (cold[b] == kReadFromL1 ? counters_.reads_l1 : cold[b] == kReadFromL2 ? counters_.reads_l2 : counters_.reads_l3) +=
        reads[b];
  }
  counters_.reads_lower = counters_.reads_l2 + counters_.reads_l3;
  SeqState& s = seqs_[seq];
  if (static_cast<int32_t>(s.heat.size()) < num_blocks) {
    s.heat.resize(num_blocks, 1.0f);  // unknown: as hot as can be (a new block is read by every pass)
    s.last_read.resize(num_blocks, -1);
  }
  // Promotions planned with this step or before: did it read them? Later ones wait.
  size_t kept = 0;
  for (const auto& [p, planned] : s.watched) {
    if (planned > step) {
      s.watched[kept++] = {p, planned};
    } else if (p < num_blocks && reads[p] > 0) {
      ++counters_.promotions_read;
    }
  }
  s.watched.resize(kept);
  if (!sparse) return;
  ++counters_.steps;
  ++s.observations;
  const float keep = static_cast<float>(config_.decay), take = 1.0f - keep;
  int64_t total = 0;
  for (int32_t b = 0; b < num_blocks; ++b) {
    s.heat[b] = keep * s.heat[b] + take * static_cast<float>(reads[b]) / static_cast<float>(passes);
    if (reads[b] > 0) s.last_read[b] = s.observations;
    total += reads[b];
  }
  // The step's access entropy over its blocks, normalized to [0, 1] (one block: 0), of the
  // reads above the floor every block got (the passes that ran no selection, e.g. layers
  // with a sliding window, read every block: they would make any selection look spread).
  // Every block read alike: 1.
  const int32_t floor = *std::min_element(reads, reads + num_blocks);
  total -= static_cast<int64_t>(floor) * num_blocks;
  double h = 1;
  if (num_blocks <= 1) {
    h = 0;
  } else if (total > 0) {
    h = 0;
    for (int32_t b = 0; b < num_blocks; ++b) {
      if (reads[b] == floor) continue;
      const double p = static_cast<double>(reads[b] - floor) / static_cast<double>(total);
      h -= p * std::log(p);
    }
    h = std::min(1.0, h / std::log(static_cast<double>(num_blocks)));
  }
  s.entropy = s.entropy < 0 ? h : config_.decay * s.entropy + (1 - config_.decay) * h;
  counters_.entropy_sum += h;
}

// Strict weak order: a before b when a is the better block to demote.
bool BlockPredictor::colder(const SeqState* s, int32_t a, int32_t b) const {
  if (s) {
    const float ha = a < static_cast<int32_t>(s->heat.size()) ? s->heat[a] : 1.0f;
    const float hb = b < static_cast<int32_t>(s->heat.size()) ? s->heat[b] : 1.0f;
    if (ha != hb) return ha < hb;
    const int64_t ra = a < static_cast<int32_t>(s->last_read.size()) ? s->last_read[a] : -1;
    const int64_t rb = b < static_cast<int32_t>(s->last_read.size()) ? s->last_read[b] : -1;
    if (ra != rb) return ra < rb;
  }
  return a < b;
}

void BlockPredictor::order_for_demotion(int64_t seq, std::vector<int32_t>* positions) const {
  auto it = seqs_.find(seq);
  const SeqState* s = it == seqs_.end() ? nullptr : &it->second;
  std::sort(positions->begin(), positions->end(), [&](int32_t a, int32_t b) { return colder(s, a, b); });
}

std::vector<BlockPredictor::Move> BlockPredictor::decide(int64_t seq, const std::vector<int32_t>& cold,
                                                         const std::vector<int32_t>& resident,
                                                         int32_t free_blocks) {
  std::vector<Move> moves;
  auto it = seqs_.find(seq);
  if (it == seqs_.end() || config_.max_moves == 0 || cold.empty()) return moves;
  const SeqState* s = &it->second;
  // Reads spread nearly evenly: heat differences are noise that an exchange would chase.
  const bool spread = s->entropy < 0 || s->entropy > config_.max_entropy;
  std::vector<int32_t> hot = cold;
  std::sort(hot.begin(), hot.end(), [&](int32_t a, int32_t b) { return colder(s, b, a); });  // hottest first
  std::vector<int32_t> out = resident;
  std::sort(out.begin(), out.end(), [&](int32_t a, int32_t b) { return colder(s, a, b); });
  size_t next_out = 0;
  for (int32_t c : hot) {
    if (static_cast<int32_t>(moves.size()) >= config_.max_moves) break;
    const double hc = heat(seq, c);
    if (hc < config_.promote_heat) break;  // the rest are colder still
    if (free_blocks > 0) {
      moves.push_back({c, -1});
      --free_blocks;
      continue;
    }
    if (next_out >= out.size() || heat(seq, out[next_out]) + config_.margin > hc) break;
    if (spread) {
      ++counters_.entropy_holds;
      break;
    }
    moves.push_back({c, out[next_out++]});
  }
  return moves;
}

void BlockPredictor::moved(int64_t seq, const Move& m) {
  ++counters_.promotions;
  if (m.demote >= 0) ++counters_.exchanges;
  seqs_[seq].watched.push_back({m.promote, plan_step_});
}

void BlockPredictor::forget(int64_t seq) { seqs_.erase(seq); }

double BlockPredictor::entropy(int64_t seq) const {
  auto it = seqs_.find(seq);
  return it == seqs_.end() || it->second.entropy < 0 ? 1.0 : it->second.entropy;
}

double BlockPredictor::heat(int64_t seq, int32_t pos) const {
  auto it = seqs_.find(seq);
  if (it == seqs_.end() || pos < 0 || pos >= static_cast<int32_t>(it->second.heat.size())) return 1.0;
  return it->second.heat[pos];
}

int32_t BlockPredictor::free_blocks_above_watermark(int32_t free_blocks, int32_t total_blocks) const {
  const int32_t keep = static_cast<int32_t>(std::ceil(config_.free_watermark * total_blocks));
  return std::max(0, free_blocks - keep);
}

}  // namespace k25
