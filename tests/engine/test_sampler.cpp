// Sampler tests: semantics of each step of sampler.h checked against hand-computed values, and the sampled
// distributions checked against the expected one with many seeded draws (deterministic, so never flaky).
#include "engine/sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <set>

namespace lily {
namespace {

constexpr int32_t kQwenVocab = 248320;

// Draws n samples (each from a fresh copy of `logits`: sample() edits them in place) and returns frequencies.
std::vector<double> frequencies(Sampler& sampler, const std::vector<float>& logits, int n) {
  std::vector<int> count(logits.size(), 0);
  for (int i = 0; i < n; ++i) {
    std::vector<float> row = logits;
    ++count[static_cast<size_t>(sampler.sample(row, {})->id)];
  }
  std::vector<double> freq;
  for (int c : count) freq.push_back(static_cast<double>(c) / n);
  return freq;
}

// Expects each frequency within 5 standard deviations of its probability (zero probability: never drawn).
void expect_distribution(const std::vector<double>& freq, const std::vector<double>& prob, int n) {
  ASSERT_EQ(freq.size(), prob.size());
  for (size_t i = 0; i < prob.size(); ++i) {
    if (prob[i] == 0.0) {
      EXPECT_EQ(freq[i], 0.0) << "token " << i << " must never be drawn";
      continue;
    }
    const double sd = std::sqrt(prob[i] * (1.0 - prob[i]) / n);
    EXPECT_NEAR(freq[i], prob[i], 5.0 * sd + 1e-12) << "token " << i;
  }
}

std::vector<float> log_of(const std::vector<double>& probs) {
  std::vector<float> out;
  for (double p : probs) out.push_back(static_cast<float>(std::log(p)));
  return out;
}

std::vector<double> softmax(const std::vector<float>& logits, double temperature = 1.0) {
  const double max = *std::max_element(logits.begin(), logits.end());
  std::vector<double> p;
  for (float l : logits) p.push_back(std::exp((l - max) / temperature));
  const double sum = std::accumulate(p.begin(), p.end(), 0.0);
  for (double& x : p) x /= sum;
  return p;
}

std::vector<float> random_logits(size_t n, uint64_t seed, float scale = 3.0f) {
  std::mt19937_64 gen(seed);  // the generator's output is specified by the standard; we avoid distributions
  std::vector<float> out(n);
  for (float& x : out)
    x = scale * static_cast<float>(static_cast<double>(gen() >> 11) * 0x1.0p-53 * 2.0 - 1.0);
  return out;
}

SamplingParams seeded(uint64_t seed) {
  SamplingParams p;
  p.seed = seed;
  return p;
}

TEST(Sampler, GreedyPicksArgmaxTiesToLowestId) {
  SamplingParams p = seeded(1);
  p.temperature = 0.0f;
  Sampler sampler(p);
  std::vector<float> logits = {0.1f, 2.5f, -1.0f, 2.5f, 2.4f};
  EXPECT_EQ(sampler.sample(logits, {})->id, 1);
  for (uint64_t s = 0; s < 20; ++s) {
    auto row = random_logits(5000, s);
    const auto expected = std::max_element(row.begin(), row.end()) - row.begin();
    EXPECT_EQ(sampler.sample(row, {})->id, expected);
  }
}

TEST(Sampler, FullDistributionAtTemperature) {
  const std::vector<float> logits = {1.0f, 0.0f, 2.0f, -0.5f, 1.5f};
  for (float t : {1.0f, 0.6f, 1.8f}) {
    SamplingParams p = seeded(42);
    p.temperature = t;
    Sampler sampler(p);
    const int n = 40000;
    expect_distribution(frequencies(sampler, logits, n), softmax(logits, t), n);
  }
}

TEST(Sampler, TemperatureToZeroConvergesToGreedy) {
  const std::vector<float> logits = {1.0f, 0.99f, 0.5f, 0.995f};  // argmax 0, gap 0.005
  SamplingParams p = seeded(7);
  p.temperature = 1e-4f;  // gap / T = 50: the runner-up has probability ~e^-50
  Sampler cold(p);
  const auto freq = frequencies(cold, logits, 2000);
  EXPECT_EQ(freq[0], 1.0);
  p.temperature = 1.0f;  // and at T = 1 the others are drawn, so the test above can fail
  Sampler warm(p);
  EXPECT_LT(frequencies(warm, logits, 2000)[0], 0.5);
}

TEST(Sampler, TopKOneEqualsGreedy) {
  SamplingParams p = seeded(3);
  p.top_k = 1;
  p.temperature = 1.5f;
  Sampler sampler(p);
  for (uint64_t s = 0; s < 50; ++s) {
    auto row = random_logits(3000, 100 + s, 0.1f);  // nearly flat: without top_k any id could come out
    const auto expected = std::max_element(row.begin(), row.end()) - row.begin();
    EXPECT_EQ(sampler.sample(row, {})->id, expected);
  }
}

TEST(Sampler, TopKKeepsTheKLargestRenormalised) {
  const std::vector<double> probs = {0.05, 0.3, 0.1, 0.25, 0.2, 0.1};
  SamplingParams p = seeded(5);
  p.top_k = 3;  // keeps ids 1, 3, 4 (0.3, 0.25, 0.2)
  Sampler sampler(p);
  const int n = 30000;
  expect_distribution(frequencies(sampler, log_of(probs), n), {0, 0.3 / 0.75, 0, 0.25 / 0.75, 0.2 / 0.75, 0},
                      n);
}

TEST(Sampler, TopPKeepsSmallestSetReachingP) {
  // Sorted: id2 0.5, id4 0.2, id0 0.15, id1 0.1, id3 0.05. top_p 0.8: the mass before id0 is 0.7 < 0.8, kept;
  // before id1 it is 0.85 >= 0.8, dropped. Kept {2, 4, 0}, renormalised over 0.85.
  const std::vector<double> probs = {0.15, 0.1, 0.5, 0.05, 0.2};
  SamplingParams p = seeded(11);
  p.top_p = 0.8f;
  Sampler sampler(p);
  const int n = 40000;
  expect_distribution(frequencies(sampler, log_of(probs), n), {0.15 / 0.85, 0, 0.5 / 0.85, 0, 0.2 / 0.85}, n);

  p.top_p = 0.3f;  // the top token alone already reaches p
  Sampler top_only(p);
  expect_distribution(frequencies(top_only, log_of(probs), 2000), {0, 0, 1, 0, 0}, 2000);
}

TEST(Sampler, TopPAppliesToTheTopKRenormalisedDistribution) {
  // top_k 3 keeps 0.4, 0.3, 0.2 -> renormalised 0.444, 0.333, 0.222. top_p 0.75: the mass before the third
  // is 0.777 >= 0.75, so two are kept. Over the raw distribution it would be 0.7 < 0.75 (three kept).
  const std::vector<double> probs = {0.3, 0.1, 0.4, 0.2};
  SamplingParams p = seeded(13);
  p.top_k = 3;
  p.top_p = 0.75f;
  Sampler sampler(p);
  const int n = 30000;
  expect_distribution(frequencies(sampler, log_of(probs), n), {3.0 / 7, 0, 4.0 / 7, 0}, n);
}

// Equal logits: the ranking breaks ties by lower id, so the nucleus and the top-k set are id prefixes.
// Token 0 has weight e^2 = 7.389, tokens 1..999 weight 1: top_p 0.5 keeps token j while
// 7.389 + (j - 1) < 0.5 * 1006.389, i.e. tokens 0..496. All tied tokens share one bin of the binned top_p,
// so this checks the walk inside a bin.
TEST(Sampler, TopPAndTopKTiesGoToLowerIds) {
  std::vector<float> logits(1000, 0.0f);
  logits[0] = 2.0f;
  SamplingParams p = seeded(43);
  p.top_p = 0.5f;
  Sampler nucleus(p);
  const auto freq = frequencies(nucleus, logits, 20000);
  double mass_near_edge = 0.0;
  for (size_t i = 0; i < freq.size(); ++i) {
    if (i > 496) {
      EXPECT_EQ(freq[i], 0.0) << "token " << i << " is outside the nucleus";
    }
    if (i >= 450 && i <= 496) mass_near_edge += freq[i];
  }
  EXPECT_NEAR(mass_near_edge, 47.0 / 503.389, 0.01);
  EXPECT_NEAR(freq[0], 7.389 / 503.389, 0.005);

  p.top_p = 1.0f;
  p.top_k = 10;
  Sampler top_k(p);
  const auto freq_k = frequencies(top_k, logits, 5000);
  for (size_t i = 10; i < freq_k.size(); ++i) EXPECT_EQ(freq_k[i], 0.0) << "token " << i;
  EXPECT_GT(freq_k[9], 0.0);
}

// Brute-force nucleus over the full vocabulary (full sort), against the sampler's binned selection.
TEST(Sampler, TopPAtFullVocabularyStaysInTheNucleus) {
  auto logits = random_logits(kQwenVocab, 2024, 1.0f);
  for (int i = 0; i < 120; ++i) logits[(i * 7919) % kQwenVocab] += 9.0f + 0.01f * static_cast<float>(i % 10);
  const float temperature = 0.8f, top_p = 0.9f;
  const float max = *std::max_element(logits.begin(), logits.end());
  std::vector<std::pair<float, int32_t>> ranked;
  for (int32_t i = 0; i < kQwenVocab; ++i) ranked.emplace_back((logits[i] - max) / temperature, i);
  std::sort(ranked.begin(), ranked.end(), [](auto& a, auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  });
  double total = 0.0;
  for (auto& [z, id] : ranked) total += std::exp(static_cast<double>(z));
  std::set<int32_t> nucleus;
  double before = 0.0;
  for (auto& [z, id] : ranked) {
    if (before >= top_p * total) break;
    nucleus.insert(id);
    before += std::exp(static_cast<double>(z));
  }
  ASSERT_GT(nucleus.size(), 30u);  // not just the head...
  ASSERT_LT(nucleus.size(), 120u);  // ...and the boosted tokens are not all in

  SamplingParams p = seeded(17);
  p.temperature = temperature;
  p.top_p = top_p;
  Sampler sampler(p);
  std::set<int32_t> seen;
  for (int i = 0; i < 600; ++i) {
    std::vector<float> row = logits;
    const int32_t id = sampler.sample(row, {})->id;
    EXPECT_TRUE(nucleus.count(id)) << "id " << id << " is outside the nucleus";
    seen.insert(id);
  }
  EXPECT_GT(seen.size(), nucleus.size() * 3 / 4);  // and the whole nucleus is sampled, not just its head
}

TEST(Sampler, MinPKeepsTokensAboveFractionOfMax) {
  // p_max 0.4; min_p 0.2 -> threshold 0.08: keeps 0.4, 0.3, 0.2; drops 0.06 and 0.04.
  const std::vector<double> probs = {0.06, 0.4, 0.2, 0.04, 0.3};
  SamplingParams p = seeded(19);
  p.min_p = 0.2f;
  Sampler sampler(p);
  const int n = 30000;
  expect_distribution(frequencies(sampler, log_of(probs), n), {0, 0.4 / 0.9, 0.2 / 0.9, 0, 0.3 / 0.9}, n);
  p.min_p = 0.05f;  // threshold 0.02: everything stays (so the test above can fail)
  Sampler lenient(p);
  const auto freq = frequencies(lenient, log_of(probs), n);
  EXPECT_GT(freq[0], 0.0);
  EXPECT_GT(freq[3], 0.0);
}

TEST(Sampler, PenaltiesChangeLogitsExactly) {
  SamplingParams p = seeded(23);
  p.temperature = 0.0f;
  p.repetition_penalty = 1.5f;
  p.presence_penalty = 0.5f;
  p.frequency_penalty = 0.25f;
  p.logit_bias = {{0, 1.0f}, {3, -0.5f}};
  p.logprobs = true;  // the chosen id's logprob is computed only with logprobs
  Sampler sampler(p);
  std::vector<float> logits = {2.0f, -1.0f, 0.5f, 3.0f, -2.0f, 0.7f};
  const std::vector<int32_t> history = {0, 1, 5, /*generated:*/ 1, 2, 2};
  const SampleResult r = *sampler.sample(logits, history, /*n_prompt=*/3);

  std::vector<float> expected(6);
  expected[0] = (2.0f + 1.0f) / 1.5f;  // bias first, then repetition (prompt only: no presence/frequency)
  expected[1] = -1.0f * 1.5f - (0.25f * 1.0f + 0.5f);  // negative: multiplied; generated once
  expected[2] = 0.5f / 1.5f - (0.25f * 2.0f + 0.5f);   // generated twice
  expected[3] = 3.0f - 0.5f;                            // bias only
  expected[4] = -2.0f;                                  // untouched
  expected[5] = 0.7f / 1.5f;                            // prompt only
  for (size_t i = 0; i < expected.size(); ++i) EXPECT_FLOAT_EQ(logits[i], expected[i]) << "token " << i;
  EXPECT_EQ(r.id, 3);
  const auto probs = softmax(expected);
  EXPECT_NEAR(r.logprob, std::log(probs[3]), 1e-5);
}

TEST(Sampler, PresencePenaltyCountsWholeHistoryWhenNoPromptGiven) {
  SamplingParams p = seeded(29);
  p.temperature = 0.0f;
  p.presence_penalty = 1.0f;
  Sampler sampler(p);
  std::vector<float> logits = {1.0f, 1.0f, 1.0f};
  const std::vector<int32_t> history = {0, 0, 2};
  ASSERT_TRUE(sampler.sample(logits, history).ok());
  EXPECT_FLOAT_EQ(logits[0], 0.0f);
  EXPECT_FLOAT_EQ(logits[1], 1.0f);
  EXPECT_FLOAT_EQ(logits[2], 0.0f);
}

TEST(Sampler, LogitBiasMinus100BansToken) {
  const std::vector<float> logits = {10.0f, 1.0f, 0.5f, 0.0f};  // token 0 has ~99.98% without the bias
  SamplingParams p = seeded(31);
  p.logit_bias = {{0, -100.0f}};
  Sampler sampler(p);
  EXPECT_EQ(frequencies(sampler, logits, 5000)[0], 0.0);
  p.temperature = 0.0f;
  Sampler greedy(p);
  std::vector<float> row = logits;
  EXPECT_EQ(greedy.sample(row, {})->id, 1);
  p.logit_bias = {{3, 100.0f}};  // and +100 forces one
  Sampler forced(p);
  row = logits;
  EXPECT_EQ(forced.sample(row, {})->id, 3);
}

std::vector<int32_t> draw_sequence(uint64_t seed, int n) {
  SamplingParams p = seeded(seed);
  p.top_k = 50;
  p.top_p = 0.95f;
  Sampler sampler(p);
  const auto logits = random_logits(1000, 77, 2.0f);
  std::vector<int32_t> ids;
  for (int i = 0; i < n; ++i) {
    std::vector<float> row = logits;
    ids.push_back(sampler.sample(row, {})->id);
  }
  return ids;
}

TEST(Sampler, SameSeedSameSequenceDifferentSeedsDiffer) {
  const auto a = draw_sequence(1234, 100);
  EXPECT_EQ(a, draw_sequence(1234, 100));
  EXPECT_NE(a, draw_sequence(1235, 100));
  EXPECT_GT(std::set<int32_t>(a.begin(), a.end()).size(), 10u);  // it is really random within the seed
  SamplingParams unseeded;
  EXPECT_NE(Sampler(unseeded).seed(), Sampler(unseeded).seed());  // random_device: equal with prob 2^-64
}

TEST(Sampler, RngIsSplitMix64) {
  // Reference outputs of SplitMix64 (Vigna's splitmix64.c) for seed 0: pins the draws across platforms.
  SplitMix64 rng(0);
  EXPECT_EQ(rng.next(), 0xE220A8397B1DCDAFull);
  EXPECT_EQ(rng.next(), 0x6E789E6AA1B965F4ull);
  EXPECT_EQ(rng.next(), 0x06C45D188009454Full);
  SplitMix64 u(0);
  EXPECT_DOUBLE_EQ(u.next_uniform(), static_cast<double>(0xE220A8397B1DCDAFull >> 11) * 0x1.0p-53);
}

TEST(Sampler, LogprobsAreNormalisedAndIndependentOfTemperature) {
  const auto logits = random_logits(12, 99, 4.0f);
  SamplingParams p = seeded(37);
  p.logprobs = true;
  p.top_logprobs = 12;
  Sampler sampler(p);
  std::vector<float> row = logits;
  const SampleResult r = *sampler.sample(row, {});
  ASSERT_EQ(r.top.size(), 12u);
  double sum = 0.0;
  for (const auto& t : r.top) sum += std::exp(static_cast<double>(t.logprob));
  EXPECT_NEAR(sum, 1.0, 1e-5);
  for (size_t i = 1; i < r.top.size(); ++i) EXPECT_GE(r.top[i - 1].logprob, r.top[i].logprob);
  const auto expected = softmax(logits);
  for (const auto& t : r.top) EXPECT_NEAR(t.logprob, std::log(expected[t.id]), 1e-5);
  EXPECT_NEAR(r.logprob, std::log(expected[r.id]), 1e-5);

  // Temperature and filters change the draw, not the reported logprobs.
  p.temperature = 0.3f;
  p.top_k = 2;
  p.top_logprobs = 3;
  Sampler cold(p);
  row = logits;
  const SampleResult c = *cold.sample(row, {});
  EXPECT_NEAR(c.logprob, std::log(expected[c.id]), 1e-5);
  ASSERT_EQ(c.top.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(c.top[i].id, r.top[i].id);
}

TEST(Sampler, TopLogprobsTiesGoToLowerId) {
  SamplingParams p = seeded(41);
  p.temperature = 0.0f;
  p.logprobs = true;
  p.top_logprobs = 3;
  Sampler sampler(p);
  std::vector<float> logits = {0.0f, 1.0f, 0.0f, 1.0f, 0.0f};
  const SampleResult r = *sampler.sample(logits, {});
  ASSERT_EQ(r.top.size(), 3u);
  EXPECT_EQ(r.top[0].id, 1);
  EXPECT_EQ(r.top[1].id, 3);
  EXPECT_EQ(r.top[2].id, 0);
  EXPECT_FLOAT_EQ(r.top[0].logprob, r.top[1].logprob);
}

void expect_invalid(const SamplingParams& p, const std::string& needle) {
  const Status s = p.validate(1000);
  ASSERT_FALSE(s.ok()) << "expected an error mentioning " << needle;
  EXPECT_EQ(s.code(), ErrorCode::invalid_argument);
  EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
}

TEST(SamplingParams, ValidateNamesTheField) {
  EXPECT_TRUE(SamplingParams{}.validate(1000).ok());
  SamplingParams p;
  p.temperature = 2.5f;
  expect_invalid(p, "temperature must be in [0, 2], got 2.5");
  p = {};
  p.temperature = NAN;
  expect_invalid(p, "temperature");
  p = {};
  p.top_p = 0.0f;
  expect_invalid(p, "top_p must be in (0, 1], got 0");
  p = {};
  p.top_k = -1;
  expect_invalid(p, "top_k must be >= 0");
  p = {};
  p.min_p = 1.5f;
  expect_invalid(p, "min_p");
  p = {};
  p.repetition_penalty = 0.0f;
  expect_invalid(p, "repetition_penalty must be > 0");
  p = {};
  p.presence_penalty = -2.5f;
  expect_invalid(p, "presence_penalty must be in [-2, 2], got -2.5");
  p = {};
  p.frequency_penalty = 3.0f;
  expect_invalid(p, "frequency_penalty");
  p = {};
  p.logprobs = true;
  p.top_logprobs = 21;
  expect_invalid(p, "top_logprobs must be in [0, 20], got 21");
  p = {};
  p.top_logprobs = 2;
  expect_invalid(p, "top_logprobs = 2 requires logprobs");
  p = {};
  p.logit_bias = {{5, 1.0f}, {1000, 1.0f}};
  expect_invalid(p, "logit_bias: token id 1000 is outside the vocabulary [0, 1000)");
  p = {};
  p.logit_bias = {{-3, 1.0f}};
  expect_invalid(p, "token id -3");
  p = {};
  p.logit_bias = {{7, 150.0f}};
  expect_invalid(p, "logit_bias[7] must be in [-100, 100], got 150");
  p = {};
  p.max_tokens = 0;
  expect_invalid(p, "max_tokens");
  p = {};
  p.stop = {"ok", ""};
  expect_invalid(p, "stop[1] is an empty string");

  p = {};  // the edges of every range are valid
  p.temperature = 2.0f;
  p.top_p = 1.0f;
  p.min_p = 1.0f;
  p.presence_penalty = -2.0f;
  p.frequency_penalty = 2.0f;
  p.logprobs = true;
  p.top_logprobs = 20;
  p.logit_bias = {{0, -100.0f}, {999, 100.0f}};
  EXPECT_TRUE(p.validate(1000).ok()) << p.validate(1000).message();
}

// Not a pass/fail figure: prints the cost per call at the real vocabulary size (Release build).
TEST(Sampler, CostAtFullVocabulary) {
  const auto logits = random_logits(kQwenVocab, 555, 8.0f);
  std::vector<int32_t> history(4096);
  for (size_t i = 0; i < history.size(); ++i) history[i] = static_cast<int32_t>((i * 7919) % kQwenVocab);
  struct Case { const char* name; SamplingParams params; };
  std::vector<Case> cases(6);
  cases[0] = {"greedy", seeded(1)};
  cases[0].params.temperature = 0.0f;
  cases[1] = {"T=1 full vocab", seeded(1)};
  cases[2] = {"top_k=20 top_p=0.95 (Qwen)", seeded(1)};
  cases[2].params.top_k = 20;
  cases[2].params.top_p = 0.95f;
  cases[3] = {"top_p=0.95 alone", seeded(1)};
  cases[3].params.top_p = 0.95f;
  cases[4] = {"min_p=0.05 alone", seeded(1)};
  cases[4].params.min_p = 0.05f;
  cases[5] = {"Qwen + penalties, 4K history", cases[2].params};
  cases[5].params.repetition_penalty = 1.1f;
  cases[5].params.presence_penalty = 0.5f;
  for (auto& c : cases) {
    Sampler sampler(c.params);
    const int n = 20;
    std::vector<float> row;
    double seconds = 0.0;
    for (int i = 0; i < n; ++i) {
      row = logits;
      const auto t0 = std::chrono::steady_clock::now();
      const auto id = sampler.sample(row, history, 2048)->id;
      seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      ASSERT_GE(id, 0);
    }
    std::printf("  sample() %-30s %8.3f ms\n", c.name, 1e3 * seconds / n);
  }
}

}  // namespace
// Logits the sampler cannot take are an error for the request, not an abort: a NaN (named), or nothing finite
// after the bias (every token banned to -inf), greedy or not, and through distribution() and logprobs() too.
TEST(Sampler, NanOrNoFiniteLogitIsAnError) {
  for (const float t : {0.0f, 0.7f}) {
    SamplingParams p;
    p.temperature = t;
    Sampler sampler(p);
    std::vector<float> nan_row = {0.5f, NAN, 1.0f};
    Result<SampleResult> r = sampler.sample(nan_row, {});
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), ErrorCode::internal);
    EXPECT_NE(r.status().message().find("logit 1 is NaN"), std::string::npos) << r.status().message();
    std::vector<float> banned = {-INFINITY, -INFINITY};
    EXPECT_FALSE(sampler.sample(banned, {}).ok());
    std::vector<float> probs, row = {0.5f, NAN};
    EXPECT_FALSE(sampler.distribution(row, {}, 0, probs).ok());
    EXPECT_FALSE(sampler.logprobs(std::vector<float>{NAN, 1.0f}, 1).ok());
    std::vector<float> fine = {0.5f, 2.0f, 1.0f};  // the sampler still works afterwards
    ASSERT_TRUE(sampler.sample(fine, {}).ok());
  }
}

}  // namespace lily
