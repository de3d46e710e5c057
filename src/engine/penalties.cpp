// engine/penalties.h: the distinct-id table of a request's history and its host reference.
#include "engine/penalties.h"

#include <algorithm>
#include <unordered_map>

#include "engine/backend.h"

namespace lily {

PenaltyTable PenaltyTable::of(std::span<const int32_t> history, size_t n_prompt) {
  n_prompt = std::min(n_prompt, history.size());
  PenaltyTable t;
  std::unordered_map<int32_t, size_t> slot;
  slot.reserve(history.size());
  for (size_t i = 0; i < history.size(); ++i) {
    const auto [it, inserted] = slot.try_emplace(history[i], t.ids.size());
    if (inserted) {
      t.ids.push_back(history[i]);
      t.counts.push_back(0);
    }
    if (i >= n_prompt) ++t.counts[it->second];
  }
  return t;
}

void PenaltyTable::add(int32_t id) {
  const auto it = std::find(ids.begin(), ids.end(), id);
  if (it != ids.end()) {
    ++counts[static_cast<size_t>(it - ids.begin())];
    return;
  }
  ids.push_back(id);
  counts.push_back(1);
}

// Sampler::apply_bias_and_penalties' operations per element, in its order (repetition first, then presence and
// frequency), with its conditions.
void apply_penalties(std::span<float> logits, const PenaltyTable& table, float repetition, float presence,
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

bool PenaltySync::holds(const DeviceSampling& s) const {
  return history_id != 0 && s.history_id == history_id && s.history.size() == length;
}

void PenaltySync::set(const DeviceSampling& s) {
  history_id = s.history_id;
  length = s.history.size();
}

}  // namespace lily
