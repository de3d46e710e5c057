// The host reference of what a device sampler does with a PenaltyTable (engine/penalties.h) per token, for the
// tests (the engine tests' fake device backend, the table's own tests): the penalties on the table's logits before
// a choice (sample.cu penalize_kernel) and the chosen id counted after it (count_token_kernel).
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>

#include "engine/penalties.h"

namespace lily::test {

// One more generated id: its count + 1, appended with count 1 when new.
inline void add_generated(PenaltyTable& t, int32_t id) {
  const auto it = std::find(t.ids.begin(), t.ids.end(), id);
  if (it != t.ids.end()) {
    ++t.counts[static_cast<size_t>(it - t.ids.begin())];
    return;
  }
  t.ids.push_back(id);
  t.counts.push_back(1);
}

// Sampler::apply_bias_and_penalties' operations per listed id, in its order (repetition first, then presence and
// frequency), with its conditions, in place. Ids outside logits are skipped.
inline void apply_penalties(std::span<float> logits, const PenaltyTable& table, float repetition, float presence,
                            float frequency) {
  const bool rep = repetition != 1.0f, count_based = presence != 0.0f || frequency != 0.0f;
  if (!rep && !count_based) return;
  for (size_t j = 0; j < table.ids.size(); ++j) {
    const int32_t id = table.ids[j];
    if (id < 0 || static_cast<size_t>(id) >= logits.size()) continue;
    float l = logits[static_cast<size_t>(id)];
    if (rep) l = l > 0.0f ? l / repetition : l * repetition;
    if (count_based && table.counts[j] > 0) l -= frequency * static_cast<float>(table.counts[j]) + presence;
    logits[static_cast<size_t>(id)] = l;
  }
}

}  // namespace lily::test
