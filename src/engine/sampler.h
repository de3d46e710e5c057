// Sampler: turns one row of logits into the next token id, on the CPU. The CUDA backend samples on the
// device with the SAME semantics; this header is the specification both follow.
//
// Order of operations for one call of sample(logits, history, n_prompt). V = logits.size(), l = logits.
//  1. logit_bias      l[i] += logit_bias[i]                          (OpenAI; -100 effectively bans a token)
//  2. repetition      for each DISTINCT id i in history (prompt + generated), HF/CTRL style:
//                       l[i] = l[i] > 0 ? l[i] / repetition_penalty : l[i] * repetition_penalty
//  3. presence/freq   over the GENERATED ids only (history[n_prompt:]), c[i] = occurrences of i there:
//                       l[i] -= frequency_penalty * c[i] + presence_penalty * (c[i] > 0)    (OpenAI, vLLM)
//     Steps 1-3 write into `logits` in place.
//  4. logprobs        lp = log_softmax(l) of these processed logits, at temperature 1, before any filter.
//                     SampleResult::logprob = lp[id]; SampleResult::top = the top_logprobs largest lp
//                     (ties -> lower id first). So logprobs describe "the model after the request's bias and
//                     penalties", do not depend on temperature/top_k/top_p/min_p, and sum to 1 over V.
//  5. temperature 0   greedy: id = argmax l (ties -> lowest id). Steps 6-10 are skipped; no draw is used.
//  6. temperature > 0 z[i] = (l[i] - max(l)) / temperature, w[i] = exp(z[i])   (both float; w is the
//                     unnormalised probability; tokens with w == 0 are never drawn)
//  7. top_k  (k > 0)  keep the k largest z (ranking: z descending, ties -> lower id first).
//  8. top_p  (p < 1)  over the survivors of 7, renormalised: rank by (z desc, id asc) and keep token j iff
//                     the summed weight of the tokens ranked before it is < p * (total weight of the
//                     survivors) (sums in double): the smallest prefix whose cumulative probability >= p; the
//                     top token always stays. Same set as HF TopPLogitsWarper / vLLM (remove where the
//                     ascending cumsum <= 1 - p), applied after top_k as both do.
//  9. min_p  (m > 0)  keep token i iff w[i] >= m (p_i >= m * p_max; the ratio does not change under
//                     renormalisation, so this equals HF MinPLogitsWarper applied after top_p).
// 10. draw            u = next_uniform() in [0, 1) (below); walk the kept tokens in ASCENDING ID order
//                     summing w (double); the result is the first token whose running sum exceeds
//                     u * (sum of kept w).
//
// Random numbers: SplitMix64 (Steele, Lea, Flood 2014), a counter-based generator: the n-th draw
// (n = 0, 1, ...) of a sampler seeded with s is mix(s + (n + 1) * 0x9E3779B97F4A7C15), and
// u = (mix >> 11) * 2^-53. Every platform (and a GPU kernel given s and n) computes the same u. Exactly one
// draw is consumed per non-greedy sample() call; greedy consumes none. Without params.seed the seed comes
// from std::random_device.
// Reproducibility: the same seed gives the same ids run after run on one build. The selection rules and u
// are platform-independent; exp() comes from the platform's libm (or CUDA's expf), so another platform can
// pick a neighbouring token only when u falls within rounding (~1e-7 relative) of the edge between two.
//
// Cost at V = 248,320 (single passes over V unless stated): bias O(|logit_bias|); penalties O(history), none
// when neutral; max + log-normaliser; for temperature > 0 one pass computing z and w. top_k: one pass with
// a k-element heap. top_p without top_k: no sort of V: tokens are binned by z into 4096 bins (bin order =
// rank order); bins above the one where the cumulative weight reaches p are kept whole and only that bin is
// sorted (ties in z share a bin; the degenerate case of the whole vocabulary tied sorts it all).
// top_logprobs: one pass with an n-element heap.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "util/status.h"

namespace lily {

struct SamplingParams {
  float temperature = 1.0f;  // 0 = greedy
  int top_k = 0;             // 0 = off
  float top_p = 1.0f;        // 1 = off
  float min_p = 0.0f;        // 0 = off
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  float repetition_penalty = 1.0f;  // 1 = off
  std::unordered_map<int32_t, float> logit_bias;
  std::optional<uint64_t> seed;
  int max_tokens = -1;  // -1: until the end of the context
  std::vector<std::string> stop;
  bool include_stop_str_in_output = false;  // a matched stop string stays at the end of the text (vLLM)
  // No stop token and no stop string ends generation before this many tokens (vLLM's min_tokens): the
  // generation loop bans the stop tokens from the logits until then (engine.cpp), so it runs on the host.
  int min_tokens = 0;
  int top_logprobs = 0;
  bool logprobs = false;

  // Ranges as in the OpenAI API: temperature [0, 2], top_p (0, 1], presence/frequency_penalty [-2, 2],
  // top_logprobs [0, 20] (and > 0 only with logprobs), logit_bias ids in [0, vocab_size) with values in
  // [-100, 100]; plus repetition_penalty > 0, min_p [0, 1], top_k >= 0, max_tokens -1 or >= 1, stop strings
  // non-empty, min_tokens >= 0 and <= max_tokens when that is set. NaN fails every range. The message names
  // the field and the value.
  Status validate(int32_t vocab_size) const;
};

struct TokenLogprob {
  int32_t id;
  float logprob;
};

struct SampleResult {
  int32_t id = -1;
  float logprob = 0.0f;           // log_softmax of the processed logits (step 4), at the chosen id (with logprobs)
  std::vector<TokenLogprob> top;  // params.top_logprobs entries, logprob descending, ties -> lower id
};

// SplitMix64 as described above: a counter, so draw n is a pure function of (seed, n).
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t next();
  double next_uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1), 53 bits

 private:
  uint64_t state_;
};

// Step 5's greedy choice: the first maximum of a row of logits (ties -> lowest id); a NaN, or no finite maximum,
// is an error (Sampler's calls and Backend's argmax calls return it: the request fails, the process goes on).
inline Result<int32_t> argmax_of_row(std::span<const float> row) {
  int32_t best = -1;
  float max = -INFINITY;
  for (size_t i = 0; i < row.size(); ++i) {
    if (std::isnan(row[i])) return error(ErrorCode::internal, "logit %zu is NaN", i);
    if (row[i] > max) max = row[i], best = static_cast<int32_t>(i);
  }
  if (best < 0 || !std::isfinite(max))
    return error(ErrorCode::internal, "no finite logit to sample from (max %g)", double(max));
  return best;
}

// One sampler per request: it owns the RNG stream and scratch buffers, so it is not shared between threads.
class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);  // expects params.validate() to have passed

  // logits: one row [V], modified in place (steps 1-3). history: prompt + generated ids, all < V;
  // history[n_prompt:] are the generated ones counted by presence/frequency (n_prompt = 0: all of them).
  // Logits with a NaN, or with no finite maximum after steps 1-3, are an internal error (no token).
  Result<SampleResult> sample(std::span<float> logits, std::span<const int32_t> history, size_t n_prompt = 0);

  // For speculative decoding (engine/speculative.h), which draws its own numbers: steps 1-3 in place, then the
  // distribution step 10 would draw from (steps 6-9, normalised; zero outside the kept set) in `probs`;
  // temperature 0: one-hot at the argmax. No random draw is consumed.
  // The same errors as sample().
  Status distribution(std::span<float> logits, std::span<const int32_t> history, size_t n_prompt,
                      std::vector<float>& probs);
  // Step 4 for a token chosen elsewhere, from logits distribution() has already processed.
  Result<SampleResult> logprobs(std::span<const float> logits, int32_t id);

  const SamplingParams& params() const { return params_; }
  uint64_t seed() const { return seed_; }

 private:
  Result<float> max_and_check(std::span<const float> logits, int32_t* argmax);
  bool filter(std::span<const float> logits, float max_logit);
  void apply_bias_and_penalties(std::span<float> logits, std::span<const int32_t> history, size_t n_prompt);
  int32_t draw(std::span<const float> logits, float max_logit);
  void keep_nucleus_of_ranked(double top_p);
  void select_nucleus_binned(double top_p);
  int32_t walk(double u, bool whole_vocabulary) const;

  SamplingParams params_;
  uint64_t seed_;
  SplitMix64 rng_;
  std::vector<std::pair<float, int32_t>> candidates_;  // (z, id) scratch, reused
  std::vector<int32_t> counts_;                         // per-id scratch for penalties, kept zeroed
  std::vector<std::pair<float, int32_t>> tail_;        // the top_p crossing bin
  std::vector<float> z_;                                // (l - max) / temperature
  std::vector<float> w_;                                // exp(z): unnormalised probabilities
  std::vector<double> bin_mass_;                        // top_p bins
};

}  // namespace lily
