// The repetition / presence / frequency penalties (engine/sampler.h steps 2-3) in the form a device sampler
// keeps them between tokens, so that it never reads a vocabulary-sized array per token: the DISTINCT ids of the
// request's prompt + generated tokens in order of first occurrence, each with its count among the generated ones.
// Per element the same float operations in the same order as Sampler::apply_bias_and_penalties, so the penalised
// logits are bit-equal:
//   l = l > 0 ? l / repetition : l * repetition          (every listed id; only when repetition != 1)
//   l -= frequency * float(count) + presence             (listed ids with count > 0; only when either != 0)
// The CUDA backend builds a table from the host history once per request (PenaltyTable::of), uploads it, and
// appends each token it samples on the device itself (sample.cuh PenaltyState; the tests' host reference of both
// steps is tests/engine/penalty_reference.h);
// PenaltySync says whether a sequence's device table still holds the history the engine passes.
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace lily {

struct DeviceSampling;

struct PenaltyTable {
  std::vector<int32_t> ids;     // distinct ids of prompt + generated, in order of first occurrence
  std::vector<int32_t> counts;  // counts[j]: occurrences of ids[j] among the generated ids (history[n_prompt:])

  // The table of history (prompt + generated, ids >= 0) with history[n_prompt:] generated (n_prompt is clamped to
  // history.size()). O(history): a hash of the ids seen.
  static PenaltyTable of(std::span<const int32_t> history, size_t n_prompt);
  size_t size() const { return ids.size(); }
};

// What a sequence's device penalty table holds: the history of DeviceSampling::history_id up to `length` ids.
// A backend rebuilds the table unless holds() (the same request, its history grown by exactly the tokens the
// device sampled since), so a request's table is uploaded once, not once per token, and anything else (another
// request, a restored or cloned sequence, a token sampled on the host) rebuilds it.
struct PenaltySync {
  uint64_t history_id = 0;  // 0: holds nothing
  size_t length = 0;
  bool holds(const DeviceSampling& s) const;
  void set(const DeviceSampling& s);  // after a rebuild from s.history
  void advance() { ++length; }        // after the device sampled (and counted) one more token
  void clear() { history_id = 0, length = 0; }
};

}  // namespace lily
