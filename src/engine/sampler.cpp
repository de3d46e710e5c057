// Sampler: see sampler.h for the specification (order of operations, tie rules, random draws).
#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

#include "util/check.h"

namespace lily {
namespace {

using Candidate = std::pair<float, int32_t>;  // (value, id)

// The one ranking used everywhere: value descending, ties -> lower id first. A strict total order, so
// nth_element / heaps / sorts give the same set and order on every platform.
bool ranks_before(const Candidate& a, const Candidate& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

// The n best (value, id) of `values` by ranks_before, best first, in one pass with an n-element heap whose
// front is the worst kept entry. Ids are scanned in ascending order, so an equal value never displaces the
// front.
void select_top_n(std::span<const float> values, size_t n, std::vector<Candidate>& out) {
  out.clear();
  n = std::min(n, values.size());
  if (n == 0) return;
  out.reserve(n);
  for (size_t i = 0; i < values.size(); ++i) {
    const float v = values[i];
    if (out.size() < n) {
      out.emplace_back(v, static_cast<int32_t>(i));
      std::push_heap(out.begin(), out.end(), ranks_before);
    } else if (v > out.front().first) {
      std::pop_heap(out.begin(), out.end(), ranks_before);
      out.back() = {v, static_cast<int32_t>(i)};
      std::push_heap(out.begin(), out.end(), ranks_before);
    }
  }
  std::sort_heap(out.begin(), out.end(), ranks_before);
}

bool by_id(const Candidate& a, const Candidate& b) { return a.second < b.second; }

bool in_range(float v, float lo, float hi) { return v >= lo && v <= hi; }  // false for NaN

Status validate_logit_bias(const std::unordered_map<int32_t, float>& bias, int32_t vocab_size) {
  std::vector<int32_t> ids;  // report the lowest offending id, whatever the map's order
  for (const auto& [id, value] : bias) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab_size) {
      return invalid_argument("logit_bias: token id %d is outside the vocabulary [0, %d)", id, vocab_size);
    }
    const float value = bias.at(id);
    if (!in_range(value, -100.0f, 100.0f)) {
      return invalid_argument("logit_bias[%d] must be in [-100, 100], got %g", id,
                              static_cast<double>(value));
    }
  }
  return ok_status();
}

}  // namespace

Status SamplingParams::validate(int32_t vocab_size) const {
  if (!in_range(temperature, 0.0f, 2.0f)) {
    return invalid_argument("temperature must be in [0, 2], got %g", static_cast<double>(temperature));
  }
  if (!(top_p > 0.0f && top_p <= 1.0f)) {
    return invalid_argument("top_p must be in (0, 1], got %g", static_cast<double>(top_p));
  }
  if (top_k < 0) return invalid_argument("top_k must be >= 0 (0 disables it), got %d", top_k);
  if (!in_range(min_p, 0.0f, 1.0f)) {
    return invalid_argument("min_p must be in [0, 1], got %g", static_cast<double>(min_p));
  }
  if (!(repetition_penalty > 0.0f) || !std::isfinite(repetition_penalty)) {
    return invalid_argument("repetition_penalty must be > 0 (1 disables it), got %g",
                            static_cast<double>(repetition_penalty));
  }
  if (!in_range(presence_penalty, -2.0f, 2.0f)) {
    return invalid_argument("presence_penalty must be in [-2, 2], got %g",
                            static_cast<double>(presence_penalty));
  }
  if (!in_range(frequency_penalty, -2.0f, 2.0f)) {
    return invalid_argument("frequency_penalty must be in [-2, 2], got %g",
                            static_cast<double>(frequency_penalty));
  }
  if (top_logprobs < 0 || top_logprobs > 20) {
    return invalid_argument("top_logprobs must be in [0, 20], got %d", top_logprobs);
  }
  if (top_logprobs > 0 && !logprobs) {
    return invalid_argument("top_logprobs = %d requires logprobs to be true", top_logprobs);
  }
  if (max_tokens != -1 && max_tokens < 1) {
    return invalid_argument("max_tokens must be >= 1 (or -1 for no limit), got %d", max_tokens);
  }
  if (min_tokens < 0) return invalid_argument("min_tokens must be >= 0, got %d", min_tokens);
  if (max_tokens != -1 && min_tokens > max_tokens) {
    return invalid_argument("min_tokens (%d) must be <= max_tokens (%d)", min_tokens, max_tokens);
  }
  for (size_t i = 0; i < stop.size(); ++i) {
    if (stop[i].empty()) return invalid_argument("stop[%zu] is an empty string", i);
  }
  return validate_logit_bias(logit_bias, vocab_size);
}

uint64_t SplitMix64::next() {
  state_ += 0x9E3779B97F4A7C15ull;
  uint64_t z = state_;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static uint64_t seed_from(const SamplingParams& params) {
  if (params.seed) return *params.seed;
  std::random_device device;
  return (static_cast<uint64_t>(device()) << 32) ^ static_cast<uint64_t>(device());
}

Sampler::Sampler(const SamplingParams& params) : params_(params), seed_(seed_from(params)), rng_(seed_) {}

void Sampler::apply_bias_and_penalties(std::span<float> logits, std::span<const int32_t> history,
                                       size_t n_prompt) {
  const auto vocab = static_cast<int32_t>(logits.size());
  for (const auto& [id, bias] : params_.logit_bias) {
    CHECK(id >= 0 && id < vocab, "logit_bias id %d outside [0, %d): validate() was not called", id, vocab);
    logits[id] += bias;
  }
  const float rep = params_.repetition_penalty;
  const float presence = params_.presence_penalty;
  const float frequency = params_.frequency_penalty;
  if (rep == 1.0f && presence == 0.0f && frequency == 0.0f) return;
  counts_.resize(logits.size(), 0);  // all zero between calls: every loop below resets what it set
  for (int32_t id : history) CHECK(id >= 0 && id < vocab, "history id %d outside [0, %d)", id, vocab);

  if (rep != 1.0f) {  // once per distinct id in prompt + generated
    for (int32_t id : history) {
      if (counts_[id] != 0) continue;
      counts_[id] = 1;
      logits[id] = logits[id] > 0.0f ? logits[id] / rep : logits[id] * rep;
    }
    for (int32_t id : history) counts_[id] = 0;
  }
  if (presence != 0.0f || frequency != 0.0f) {  // generated ids only
    const auto generated = history.subspan(n_prompt);
    for (int32_t id : generated) ++counts_[id];
    for (int32_t id : generated) {
      if (counts_[id] == 0) continue;  // already applied for this id
      logits[id] -= frequency * static_cast<float>(counts_[id]) + presence;
      counts_[id] = 0;
    }
  }
}

// top_p over candidates_ already ranked (the top_k set): keep token j while the weight before it < limit.
void Sampler::keep_nucleus_of_ranked(double top_p) {
  double total = 0.0;
  for (const auto& [z, id] : candidates_) total += w_[id];
  const double limit = top_p * total;
  double before = 0.0;
  size_t kept = 0;
  while (kept < candidates_.size() && before < limit) before += w_[candidates_[kept++].second];
  candidates_.resize(kept);
}

// top_p over the whole vocabulary without sorting it. Tokens are binned by z into kBins equal-width bins
// below the max (bin order = rank order); the bins before the one where the cumulative weight reaches the
// limit are kept whole, and only that one bin is sorted and walked token by token. The set is the one
// sampler.h defines (up to the rounding of the sums). Zero-weight tokens can never be in a nucleus with p < 1
// and are skipped. Leaves candidates_ in ascending id order.
void Sampler::select_nucleus_binned(double top_p) {
  constexpr int kBins = 4096;
  const size_t vocab = z_.size();
  float z_low = 0.0f;
  double total = 0.0;
  for (size_t i = 0; i < vocab; ++i) {
    if (w_[i] <= 0.0f) continue;
    z_low = std::min(z_low, z_[i]);
    total += w_[i];
  }
  const double limit = top_p * total;
  const float scale = z_low < 0.0f ? kBins / -z_low : 0.0f;
  auto bin_of = [&](float z) { return std::min(kBins - 1, static_cast<int>(-z * scale)); };
  bin_mass_.assign(kBins, 0.0);
  for (size_t i = 0; i < vocab; ++i) {
    if (w_[i] > 0.0f) bin_mass_[static_cast<size_t>(bin_of(z_[i]))] += w_[i];
  }
  int crossing = kBins - 1;
  double before = 0.0;  // weight of all bins ranked before `crossing`
  for (int b = 0; b < kBins; ++b) {
    if (before + bin_mass_[static_cast<size_t>(b)] >= limit) {
      crossing = b;
      break;
    }
    before += bin_mass_[static_cast<size_t>(b)];
  }
  candidates_.clear();
  tail_.clear();
  for (size_t i = 0; i < vocab; ++i) {
    if (w_[i] <= 0.0f) continue;
    const int b = bin_of(z_[i]);
    if (b < crossing) candidates_.emplace_back(z_[i], static_cast<int32_t>(i));
    else if (b == crossing) tail_.emplace_back(z_[i], static_cast<int32_t>(i));
  }
  std::sort(tail_.begin(), tail_.end(), ranks_before);
  size_t kept = 0;
  while (kept < tail_.size() && before < limit) before += w_[tail_[kept++].second];
  tail_.resize(kept);
  std::sort(tail_.begin(), tail_.end(), by_id);
  const auto middle = static_cast<ptrdiff_t>(candidates_.size());
  candidates_.insert(candidates_.end(), tail_.begin(), tail_.end());
  std::inplace_merge(candidates_.begin(), candidates_.begin() + middle, candidates_.end(), by_id);
}

// Draws from the kept weights in ascending id order (sampler.h step 10): candidates_, or every id.
int32_t Sampler::walk(double u, bool whole_vocabulary) const {
  double total = 0.0;
  if (whole_vocabulary) {
    for (float w : w_) total += w;
  } else {
    for (const auto& [z, id] : candidates_) total += w_[id];
  }
  const double target = u * total;
  double sum = 0.0;
  int32_t last_positive = -1;
  auto visit = [&](int32_t id) {
    if (w_[id] <= 0.0f) return false;
    last_positive = id;
    sum += w_[id];
    return sum > target;
  };
  if (whole_vocabulary) {
    for (size_t i = 0; i < w_.size(); ++i) {
      if (visit(static_cast<int32_t>(i))) return last_positive;
    }
  } else {
    for (const auto& [z, id] : candidates_) {
      if (visit(id)) return last_positive;
    }
  }
  CHECK(last_positive >= 0, "no token with positive weight survived the filters");
  return last_positive;
}

// Steps 6-9: z_, w_ and, when a filter is on, candidates_ (the kept ids, ascending); false: every id is kept.
bool Sampler::filter(std::span<const float> logits, float max_logit) {
  const size_t vocab = logits.size();
  const float temperature = params_.temperature;
  z_.resize(vocab);
  w_.resize(vocab);
  for (size_t i = 0; i < vocab; ++i) {
    z_[i] = (logits[i] - max_logit) / temperature;
    w_[i] = std::exp(z_[i]);
  }
  const bool top_k_on = params_.top_k > 0 && static_cast<size_t>(params_.top_k) < vocab;
  const bool top_p_on = params_.top_p < 1.0f;
  const bool min_p_on = params_.min_p > 0.0f;
  const float min_p = params_.min_p;
  if (!top_k_on && !top_p_on && !min_p_on) return false;

  if (top_k_on) {
    select_top_n(z_, static_cast<size_t>(params_.top_k), candidates_);
    if (top_p_on) keep_nucleus_of_ranked(params_.top_p);
    std::sort(candidates_.begin(), candidates_.end(), by_id);
  } else if (top_p_on) {
    select_nucleus_binned(params_.top_p);
  } else {  // min_p alone
    candidates_.clear();
    for (size_t i = 0; i < vocab; ++i) {
      if (w_[i] >= min_p) candidates_.emplace_back(z_[i], static_cast<int32_t>(i));
    }
  }
  if (min_p_on) std::erase_if(candidates_, [&](const Candidate& c) { return w_[c.second] < min_p; });
  return true;
}

int32_t Sampler::draw(std::span<const float> logits, float max_logit) {
  const bool filtered = filter(logits, max_logit);
  const double u = rng_.next_uniform();
  return walk(u, /*whole_vocabulary=*/!filtered);
}

Result<float> Sampler::max_and_check(std::span<const float> logits, int32_t* argmax) {
  Result<int32_t> best = argmax_of_row(logits);
  if (!best.ok()) return best.status();
  if (argmax) *argmax = *best;
  return logits[static_cast<size_t>(*best)];
}

Status Sampler::distribution(std::span<float> logits, std::span<const int32_t> history, size_t n_prompt,
                             std::vector<float>& probs) {
  CHECK(!logits.empty(), "empty logits");
  CHECK(n_prompt <= history.size(), "n_prompt %zu > history size %zu", n_prompt, history.size());
  apply_bias_and_penalties(logits, history, n_prompt);
  int32_t argmax = -1;
  ASSIGN_OR_RETURN(const float max_logit, max_and_check(logits, &argmax));
  probs.assign(logits.size(), 0.0f);
  if (params_.temperature == 0.0f) {
    probs[static_cast<size_t>(argmax)] = 1.0f;
    return ok_status();
  }
  const bool filtered = filter(logits, max_logit);
  double total = 0.0;
  if (filtered) {
    for (const auto& [z, id] : candidates_) total += w_[id];
    for (const auto& [z, id] : candidates_) probs[static_cast<size_t>(id)] = static_cast<float>(w_[id] / total);
  } else {
    for (float w : w_) total += w;
    for (size_t i = 0; i < w_.size(); ++i) probs[i] = static_cast<float>(w_[i] / total);
  }
  return ok_status();
}

Result<SampleResult> Sampler::logprobs(std::span<const float> logits, int32_t id) {
  ASSIGN_OR_RETURN(const float max_logit, max_and_check(logits, nullptr));
  double sum = 0.0;
  for (float l : logits) sum += std::exp(l - max_logit);  // float exp, double sum
  const double log_normaliser = static_cast<double>(max_logit) + std::log(sum);
  auto logprob_of = [&](int32_t i) { return static_cast<float>(logits[i] - log_normaliser); };
  SampleResult result{id, logprob_of(id), {}};
  if (params_.top_logprobs > 0) {
    select_top_n(logits, static_cast<size_t>(params_.top_logprobs), candidates_);
    result.top.reserve(candidates_.size());
    for (const auto& [value, i] : candidates_) result.top.push_back({i, logprob_of(i)});
  }
  return result;
}

Result<SampleResult> Sampler::sample(std::span<float> logits, std::span<const int32_t> history, size_t n_prompt) {
  CHECK(!logits.empty(), "empty logits");
  CHECK(n_prompt <= history.size(), "n_prompt %zu > history size %zu", n_prompt, history.size());
  apply_bias_and_penalties(logits, history, n_prompt);
  int32_t argmax = -1;
  ASSIGN_OR_RETURN(const float max_logit, max_and_check(logits, &argmax));
  SampleResult result;
  result.id = params_.temperature == 0.0f ? argmax : draw(logits, max_logit);
  // The log-normaliser is a pass of exp over the whole vocabulary (~1 ms for 248K logits): only for logprobs.
  if (!params_.logprobs) return result;
  double sum = 0.0;
  for (float l : logits) sum += std::exp(l - max_logit);  // float exp, double sum
  const double log_normaliser = static_cast<double>(max_logit) + std::log(sum);
  auto logprob_of = [&](int32_t id) { return static_cast<float>(logits[id] - log_normaliser); };
  result.logprob = logprob_of(result.id);
  if (params_.top_logprobs > 0) {
    select_top_n(logits, static_cast<size_t>(params_.top_logprobs), candidates_);
    result.top.reserve(candidates_.size());
    for (const auto& [value, id] : candidates_) result.top.push_back({id, logprob_of(id)});
  }
  return result;
}

}  // namespace lily
