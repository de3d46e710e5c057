// engine/penalties.h: the distinct-id table of a request's history and what the backend keeps of it.
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

bool PenaltySync::holds(const DeviceSampling& s) const {
  return history_id != 0 && s.history_id == history_id && s.history.size() == length;
}

void PenaltySync::set(const DeviceSampling& s) {
  history_id = s.history_id;
  length = s.history.size();
}

}  // namespace lily
