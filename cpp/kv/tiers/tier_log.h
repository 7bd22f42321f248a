// Where the tiers report what an operator should see (a fallback taken, a fault handled):
// one line per event, "[KV_CACHE] ..." with key=value fields. The engine routes them into
// its log; without a sink they go to stderr.
#pragma once

#include <cstdio>
#include <functional>
#include <string>

namespace k25 {

using TierLog = std::function<void(const std::string& line)>;

inline void tier_log(const TierLog& log, const std::string& line) {
  if (log) {
    log(line);
  } else {
    std::fprintf(stderr, "%s\n", line.c_str());
  }
}

}  // namespace k25
