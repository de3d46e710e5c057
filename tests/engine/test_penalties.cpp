// engine/penalties.h: the distinct-id table a device sampler keeps (built from a history, updated per token) and
// its host reference, bit-equal to Sampler's penalised logits; PenaltySync's rule for keeping a device table.
#include "engine/penalties.h"
#include "penalty_reference.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "engine/backend.h"
#include "engine/sampler.h"

namespace lily {
namespace {

std::vector<float> random_logits(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 4.0f);
  std::vector<float> l(n);
  for (float& x : l) x = d(rng);
  return l;
}

// Prompt and generated ids drawn from a small range so that ids repeat, some appear only in the prompt and some
// only among the generated.
std::vector<int32_t> random_history(size_t n, int32_t range, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> d(0, range - 1);
  std::vector<int32_t> h(n);
  for (int32_t& x : h) x = d(rng);
  return h;
}

uint32_t bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

TEST(PenaltyTable, OfListsDistinctIdsInOrderAndCountsOnlyTheGenerated) {
  // prompt: 5 7 5 9; generated: 7 11 7 7 12
  const std::vector<int32_t> history = {5, 7, 5, 9, 7, 11, 7, 7, 12};
  const PenaltyTable t = PenaltyTable::of(history, 4);
  EXPECT_EQ(t.ids, (std::vector<int32_t>{5, 7, 9, 11, 12}));
  EXPECT_EQ(t.counts, (std::vector<int32_t>{0, 3, 0, 1, 1}));  // 5 and 9: prompt only
  const PenaltyTable all = PenaltyTable::of(history, 0);       // everything generated
  EXPECT_EQ(all.counts, (std::vector<int32_t>{2, 4, 1, 1, 1}));
  const PenaltyTable prompt_only = PenaltyTable::of(history, 100);  // n_prompt past the end: clamped
  EXPECT_EQ(prompt_only.ids, t.ids);
  EXPECT_EQ(prompt_only.counts, (std::vector<int32_t>(5, 0)));
  EXPECT_EQ(PenaltyTable::of({}, 0).size(), 0u);
}

// add_generated() after each generated token keeps the table equal to the one rebuilt from the grown history (what the
// device's update after a choice must do, tests/cuda/kernels/test_sample.cpp checks the kernel against it).
TEST(PenaltyTable, AddEqualsRebuildingFromTheHistory) {
  std::vector<int32_t> history = random_history(30, 40, 1);
  const size_t n_prompt = history.size();
  PenaltyTable t = PenaltyTable::of(history, n_prompt);
  const std::vector<int32_t> generated = random_history(60, 50, 2);  // new ids (40..49) and repeats
  for (int32_t id : generated) {
    test::add_generated(t, id);
    history.push_back(id);
    const PenaltyTable want = PenaltyTable::of(history, n_prompt);
    ASSERT_EQ(t.ids, want.ids) << "after " << history.size() - n_prompt << " generated";
    ASSERT_EQ(t.counts, want.counts) << "after " << history.size() - n_prompt << " generated";
  }
}

// apply_penalties on the table gives the logits Sampler::sample leaves after steps 1-3, to the bit, for each
// penalty alone and together, on positive and negative logits, and leaves ids outside the history alone.
TEST(PenaltyTable, ApplyIsBitEqualToTheSampler) {
  constexpr size_t kVocab = 5000;
  struct Case {
    float presence, frequency, repetition;
  };
  const Case cases[] = {{0.0f, 0.0f, 1.3f}, {0.7f, 0.0f, 1.0f},  {0.0f, 0.45f, 1.0f},
                        {-1.5f, 0.0f, 1.0f}, {0.0f, -0.3f, 1.0f}, {1.1f, 0.35f, 1.17f},
                        {2.0f, 2.0f, 0.8f},  {-0.6f, 1.9f, 3.0f}};
  uint32_t seed = 10;
  for (const Case& c : cases) {
    for (size_t n_prompt : {0ul, 25ul, 60ul}) {
      const std::vector<float> logits = random_logits(kVocab, ++seed);
      const std::vector<int32_t> history = random_history(60 + n_prompt % 7, 90, ++seed);
      SamplingParams p;
      p.temperature = 0.0f;
      p.presence_penalty = c.presence, p.frequency_penalty = c.frequency, p.repetition_penalty = c.repetition;
      std::vector<float> host = logits, table_side = logits;
      Result<SampleResult> r = Sampler(p).sample(host, history, n_prompt);
      ASSERT_TRUE(r.ok());
      test::apply_penalties(table_side, PenaltyTable::of(history, n_prompt), c.repetition, c.presence, c.frequency);
      size_t changed = 0;
      for (size_t i = 0; i < kVocab; ++i) {
        ASSERT_EQ(bits(table_side[i]), bits(host[i]))
            << "id " << i << " presence " << c.presence << " frequency " << c.frequency << " repetition "
            << c.repetition << " n_prompt " << n_prompt;
        changed += host[i] != logits[i];
        if (i >= 90) {
          ASSERT_EQ(bits(host[i]), bits(logits[i])) << "id " << i << " is not in the history";
        }
      }
      EXPECT_GT(changed, 0u) << "the case must change some logit";
      ASSERT_TRUE(argmax_of_row(table_side).ok());
      EXPECT_EQ(*argmax_of_row(table_side), r->id);
    }
  }
}

TEST(PenaltyTable, NeutralPenaltiesChangeNothing) {
  const std::vector<float> logits = random_logits(300, 3);
  std::vector<float> l = logits;
  test::apply_penalties(l, PenaltyTable::of(random_history(80, 300, 4), 20), 1.0f, 0.0f, 0.0f);
  for (size_t i = 0; i < l.size(); ++i) EXPECT_EQ(bits(l[i]), bits(logits[i])) << i;
  // Ids outside the logits are skipped, not written.
  PenaltyTable t;
  t.ids = {-1, 1000};
  t.counts = {1, 1};
  test::apply_penalties(l, t, 2.0f, 1.0f, 1.0f);
  for (size_t i = 0; i < l.size(); ++i) EXPECT_EQ(bits(l[i]), bits(logits[i])) << i;
}

TEST(PenaltySync, HoldsOnlyTheSameRequestGrownByTheSampledTokens) {
  std::vector<int32_t> history = {1, 2, 3};
  DeviceSampling s;
  s.repetition_penalty = 1.2f;
  s.history = history;
  s.history_id = 7;
  PenaltySync sync;
  EXPECT_FALSE(sync.holds(s));  // nothing uploaded yet
  sync.set(s);
  EXPECT_TRUE(sync.holds(s));
  history.push_back(4);  // one token sampled on the device and taken by the engine
  s.history = history;
  EXPECT_FALSE(sync.holds(s)) << "the device has not counted it";
  sync.advance();
  EXPECT_TRUE(sync.holds(s));
  DeviceSampling other = s;
  other.history_id = 8;  // another request with a history of the same length
  EXPECT_FALSE(sync.holds(other));
  DeviceSampling anonymous = s;
  anonymous.history_id = 0;
  EXPECT_FALSE(sync.holds(anonymous)) << "history_id 0 is rebuilt every call";
  sync.clear();
  EXPECT_FALSE(sync.holds(s));
}

}  // namespace
}  // namespace lily
