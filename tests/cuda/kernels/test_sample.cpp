// sample_token (src/cuda/kernels/sample.cu): greedy against a CPU argmax (ties -> lowest id), Gumbel-max against
// softmax(logits / T) empirically, the top_k/top_p/min_p path against a CPU reference of engine/sampler.h
// steps 6-10 (same SplitMix64 draw), determinism in (seed, step); with penalties (SampleParams::penalties) the
// penalised logits bit-equal to Sampler's (engine/sampler.h steps 2-3), the choice made from them, and the table
// counting each chosen id (as tests/engine/penalty_reference.h add_generated) over several steps.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "cuda/kernels/sample.cuh"
#include "cuda_test_util.h"
#include "engine/penalties.h"
#include "engine/sampler.h"

namespace lily::cuda::test {
namespace {

constexpr int kVocab = 248320;

struct Sampling {
  float temperature = 0.0f;
  int top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
};

struct Penalties {
  float presence = 0.0f, frequency = 0.0f, repetition = 1.0f;
};

// Device state for sample_token: logits, scratch, counter, step, output slot and a ring.
class SampleRig {
 public:
  SampleRig(const std::vector<float>& logits, int ring_size)
      : logits_(logits), scratch_(2 * 1024 * 64), counter_(1), step_(1), out_(1), ring_(ring_size),
        vocab_(static_cast<int>(logits.size())), ring_size_(ring_size) {
    EXPECT_EQ(counter_.zero(), cudaSuccess);
  }
  cudaError_t launch(const Sampling& s, uint64_t seed, int step) {
    CUDA_TRY(step_.upload(std::vector<int>{step}));
    return launch_on(s, seed, nullptr);
  }
  // Launches on `stream` with the step already on the device; with `knobs`, the kernel reads its numbers from
  // that device copy and `s`, `seed` only choose the kernel.
  cudaError_t launch_on(const Sampling& s, uint64_t seed, cudaStream_t stream, const SampleKnobs* knobs = nullptr,
                        const PenaltyState* table = nullptr, Penalties pen = {}) {
    SampleParams p;
    p.knobs = knobs;
    if (table) p.penalties = *table;
    p.presence_penalty = pen.presence, p.frequency_penalty = pen.frequency, p.repetition_penalty = pen.repetition;
    p.logits = logits_.get();
    p.vocab = vocab_;
    p.temperature = s.temperature;
    p.top_k = s.top_k;
    p.top_p = s.top_p;
    p.min_p = s.min_p;
    p.seed = seed;
    p.step = step_.get();
    p.scratch = scratch_.get();
    p.counter = counter_.get();
    p.out_token = out_.get();
    p.ring = ring_.get();
    p.ring_size = ring_size_;
    return sample_token(p, stream);
  }
  int sample(const Sampling& s, uint64_t seed, int step) {
    EXPECT_EQ(launch(s, seed, step), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const int token = out_.download()[0];
    EXPECT_EQ(ring_.download()[step % ring_size_], token) << "ring slot of step " << step;
    EXPECT_EQ(counter_.download()[0], 0u) << "counter left non-zero";
    return token;
  }
  // One step with penalties from `table` (the kernel penalises the logits in place and counts its choice).
  int sample_penalised(const Sampling& s, uint64_t seed, int step, const PenaltyState& table, Penalties pen) {
    EXPECT_EQ(set_step(step), cudaSuccess);
    EXPECT_EQ(launch_on(s, seed, nullptr, nullptr, &table, pen), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return out();
  }
  cudaError_t set_logits(const std::vector<float>& l) { return logits_.upload(l); }
  std::vector<float> logits() const { return logits_.download(); }
  std::vector<int> ring() const { return ring_.download(); }
  int out() const { return out_.download()[0]; }
  cudaError_t set_step(int step) { return step_.upload(std::vector<int>{step}); }

 private:
  DeviceBuffer<float> logits_, scratch_;
  DeviceBuffer<unsigned> counter_;
  DeviceBuffer<int> step_, out_, ring_;
  int vocab_, ring_size_;
};

int cpu_argmax(const std::vector<float>& l) {
  return static_cast<int>(std::max_element(l.begin(), l.end()) - l.begin());  // first maximum
}

double splitmix_uniform(uint64_t seed, uint64_t n) {
  uint64_t z = seed + (n + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return static_cast<double>((z ^ (z >> 31)) >> 11) * 0x1.0p-53;
}

// engine/sampler.h steps 6-10 for top_k in 1..64 (where the GPU candidate set is exact), draw number n.
int cpu_sample_top(const std::vector<float>& l, const Sampling& s, uint64_t seed, uint64_t n) {
  const float mx = *std::max_element(l.begin(), l.end());
  std::vector<float> z(l.size()), w(l.size());
  for (size_t i = 0; i < l.size(); ++i) z[i] = (l[i] - mx) / s.temperature, w[i] = std::exp(z[i]);
  std::vector<int> ids(l.size());
  std::iota(ids.begin(), ids.end(), 0);
  const size_t k = std::min<size_t>(s.top_k, l.size());
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(),
                    [&](int a, int b) { return z[a] > z[b] || (z[a] == z[b] && a < b); });
  ids.resize(k);
  if (s.top_p < 1.0f) {
    double total = 0, before = 0;
    for (int id : ids) total += w[id];
    size_t kept = 0;
    while (kept < ids.size() && before < s.top_p * total) before += w[ids[kept++]];
    ids.resize(kept);
  }
  if (s.min_p > 0.0f) std::erase_if(ids, [&](int id) { return w[id] < s.min_p; });
  std::sort(ids.begin(), ids.end());
  double total = 0, sum = 0;
  for (int id : ids) total += w[id];
  const double target = splitmix_uniform(seed, n) * total;
  for (int id : ids) {
    sum += w[id];
    if (sum > target) return id;
  }
  return ids.back();
}

TEST(CudaSample, GreedyIsArgmaxWithTiesToLowestId) {
  SKIP_WITHOUT_GPU();
  std::vector<float> l = random_vector(kVocab, 1, 3.0f);
  {
    SampleRig rig(l, 4);
    EXPECT_EQ(rig.sample({}, 0, 0), cpu_argmax(l));
  }
  l[200000] = 50.0f, l[7] = 50.0f, l[123456] = 50.0f;  // ties in different blocks
  {
    SampleRig rig(l, 4);
    EXPECT_EQ(rig.sample({}, 0, 1), 7);
  }
  for (float& v : l) v = -1e30f;  // all equal, negative
  {
    SampleRig rig(l, 4);
    EXPECT_EQ(rig.sample({}, 0, 2), 0);
  }
  std::vector<float> small = {-INFINITY, -3.0f, 2.5f, 2.5f, 1.0f};  // vocab below one float4 quad multiple
  SampleRig rig(small, 3);
  EXPECT_EQ(rig.sample({}, 0, 5), 2);
}

TEST(CudaSample, TopKOneEqualsGreedy) {
  SKIP_WITHOUT_GPU();
  std::vector<float> l = random_vector(kVocab, 2, 3.0f);
  l[99999] = l[99998] = 40.0f;
  SampleRig rig(l, 8);
  for (int step = 0; step < 4; ++step) EXPECT_EQ(rig.sample({1.3f, 1, 1.0f, 0.0f}, 77 + step, step), 99998);
}

TEST(CudaSample, SameSeedAndStepSameToken) {
  SKIP_WITHOUT_GPU();
  const std::vector<float> l(kVocab, 0.0f);  // uniform: the token is all noise
  SampleRig rig(l, 16);
  std::set<int> seen;
  for (const Sampling& s : {Sampling{1.0f, 0, 1.0f, 0.0f}, Sampling{1.0f, 0, 0.9f, 0.0f}}) {
    for (int step = 0; step < 6; ++step) {
      const int a = rig.sample(s, 1234, step), b = rig.sample(s, 1234, step);
      EXPECT_EQ(a, b) << "step " << step;
      seen.insert(a);
      seen.insert(rig.sample(s, 999, step));
    }
  }
  EXPECT_GE(seen.size(), 15u) << "different (seed, step) should give different tokens on a flat distribution";
}

TEST(CudaSample, GumbelMatchesSoftmaxDistribution) {
  SKIP_WITHOUT_GPU();
  const std::vector<float> l = {0.0f, 1.0f, 2.0f, -1.0f, 0.5f, 3.0f, -2.0f, 1.5f, -0.3f};
  const float temperature = 0.7f;
  const int n = 20000;
  SampleRig rig(l, n);
  for (int step = 0; step < n; ++step) ASSERT_EQ(rig.launch({temperature, 0, 1.0f, 0.0f}, 42, step), cudaSuccess);
  ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<int> tokens = rig.ring();
  std::vector<double> count(l.size(), 0.0), p(l.size());
  for (int t : tokens) {
    ASSERT_GE(t, 0);
    ASSERT_LT(t, static_cast<int>(l.size()));
    count[t] += 1;
  }
  double total = 0;
  for (size_t i = 0; i < l.size(); ++i) total += (p[i] = std::exp(l[i] / temperature));
  for (size_t i = 0; i < l.size(); ++i) {
    p[i] /= total;
    // Binomial: 5 standard deviations (the RNG is deterministic, so this either always passes or never).
    EXPECT_NEAR(count[i] / n, p[i], 5 * std::sqrt(p[i] * (1 - p[i]) / n) + 1e-3) << "token " << i;
  }
}

TEST(CudaSample, TopKTopPMinPMatchCpuReference) {
  SKIP_WITHOUT_GPU();
  const std::vector<float> l = random_vector(kVocab, 3, 2.0f);
  SampleRig rig(l, 64);
  const Sampling cases[] = {{0.8f, 20, 1.0f, 0.0f}, {1.0f, 50, 0.9f, 0.0f}, {1.2f, 64, 1.0f, 0.05f},
                            {0.7f, 10, 0.5f, 0.1f}, {1.0f, 3, 1.0f, 0.0f}};
  for (const Sampling& s : cases) {
    std::set<int> distinct;
    for (uint64_t seed = 1; seed <= 8; ++seed) {
      for (int step = 0; step < 4; ++step) {
        const int want = cpu_sample_top(l, s, seed, step);
        EXPECT_EQ(rig.sample(s, seed, step), want) << "T " << s.temperature << " top_k " << s.top_k << " top_p "
                                                   << s.top_p << " min_p " << s.min_p << " seed " << seed;
        distinct.insert(want);
      }
    }
    EXPECT_GT(distinct.size(), 1u) << "the draws should not all pick one token";
  }
}

// SampleParams::knobs: the numbers come from device memory, the host fields only pick the kernel. Each case is
// launched with other numbers of the same mode on the host (what a graph captured for an earlier request holds)
// and must draw what the direct launch draws; then one captured graph replayed after rewriting the knobs.
TEST(CudaSample, KnobsFromDeviceMatchTheDirectLaunch) {
  SKIP_WITHOUT_GPU();
  const std::vector<float> l = random_vector(kVocab, 5, 2.0f);
  SampleRig rig(l, 64);
  struct Case {
    Sampling real, stale;  // same sample_mode
  };
  const Case cases[] = {{{0.0f, 0, 1.0f, 0.0f}, {0.0f, 0, 1.0f, 0.0f}},
                        {{0.7f, 0, 1.0f, 0.0f}, {1.9f, 0, 1.0f, 0.0f}},
                        {{0.8f, 20, 1.0f, 0.0f}, {1.5f, 64, 0.3f, 0.2f}},
                        {{1.0f, 50, 0.9f, 0.0f}, {0.5f, 2, 1.0f, 0.0f}},
                        {{0.7f, 10, 0.5f, 0.1f}, {1.0f, 0, 0.99f, 0.0f}}};
  DeviceBuffer<SampleKnobs> knobs(1);
  for (const Case& c : cases) {
    const Sampling& r = c.real;
    ASSERT_EQ(sample_mode(r.temperature, r.top_k, r.top_p, r.min_p),
              sample_mode(c.stale.temperature, c.stale.top_k, c.stale.top_p, c.stale.min_p));
    for (uint64_t seed = 3; seed <= 5; ++seed) {
      for (int step = 0; step < 3; ++step) {
        const int want = rig.sample(r, seed, step);
        ASSERT_CUDA(knobs.upload(std::vector<SampleKnobs>{{r.temperature, r.top_k, r.top_p, r.min_p, seed}}));
        ASSERT_CUDA(rig.set_step(step));
        ASSERT_CUDA(rig.launch_on(c.stale, seed + 100, nullptr, knobs.get()));
        ASSERT_CUDA(cudaDeviceSynchronize());
        EXPECT_EQ(rig.out(), want) << "T " << r.temperature << " top_k " << r.top_k << " top_p " << r.top_p
                                   << " min_p " << r.min_p << " seed " << seed << " step " << step;
      }
    }
  }
  // One graph, captured with the stale numbers, replayed for two requests.
  const Case& c = cases[2];
  ASSERT_CUDA(rig.set_step(1));
  CapturedGraph graph;
  ASSERT_CUDA(graph.capture([&](cudaStream_t stream) { return rig.launch_on(c.stale, 1, stream, knobs.get()); }));
  for (uint64_t seed : {11ull, 12ull}) {
    const Sampling& r = c.real;
    const int want = cpu_sample_top(l, r, seed, 1);
    ASSERT_CUDA(knobs.upload(std::vector<SampleKnobs>{{r.temperature, r.top_k, r.top_p, r.min_p, seed}}));
    ASSERT_CUDA(graph.replay());
    EXPECT_EQ(rig.out(), want) << "graph replay, seed " << seed;
  }
}

TEST(CudaSample, RejectsBadArguments) {
  SKIP_WITHOUT_GPU();
  SampleRig rig(std::vector<float>(10, 0.0f), 2);
  EXPECT_EQ(rig.launch({-1.0f, 0, 1.0f, 0.0f}, 0, 0), cudaErrorInvalidValue);
  EXPECT_EQ(rig.launch({1.0f, 0, 0.0f, 0.0f}, 0, 0), cudaErrorInvalidValue);
  EXPECT_EQ(rig.launch({1.0f, -2, 1.0f, 0.0f}, 0, 0), cudaErrorInvalidValue);
  EXPECT_EQ(rig.launch({NAN, 0, 1.0f, 0.0f}, 0, 0), cudaErrorInvalidValue);
}

// ---- penalties ------------------------------------------------------------------------------------------------

// A sequence's penalty table on the device (sample.cuh PenaltyState), loaded with the backend's loader.
class PenaltyRig {
 public:
  PenaltyRig(int vocab, int capacity)
      : ids_(capacity), counts_(capacity), n_(1), slot_(std::vector<int>(vocab, -1)), vocab_(vocab) {
    EXPECT_EQ(ids_.zero(), cudaSuccess);
    EXPECT_EQ(counts_.zero(), cudaSuccess);
    EXPECT_EQ(n_.zero(), cudaSuccess);
    st_.ids = ids_.get(), st_.counts = counts_.get(), st_.n = n_.get(), st_.slot = slot_.get();
    st_.capacity = capacity, st_.vocab = vocab;
  }
  cudaError_t load(const PenaltyTable& t) {
    const cudaError_t e = penalty_state_load(st_, t.ids.data(), t.counts.data(), static_cast<int>(t.size()), nullptr);
    return e != cudaSuccess ? e : cudaDeviceSynchronize();
  }
  // The table as the device holds it; its index must list exactly the table's ids.
  PenaltyTable table() const {
    const int n = n_.download()[0];
    const std::vector<int> ids = ids_.download(), counts = counts_.download(), slot = slot_.download();
    PenaltyTable t;
    t.ids.assign(ids.begin(), ids.begin() + n);
    t.counts.assign(counts.begin(), counts.begin() + n);
    int indexed = 0;
    for (int id = 0; id < vocab_; ++id) {
      if (slot[id] < 0) continue;
      ++indexed;
      EXPECT_TRUE(slot[id] < n && ids[slot[id]] == id) << "index of id " << id << " says " << slot[id];
    }
    EXPECT_EQ(indexed, n) << "the index lists ids outside the table";
    return t;
  }
  const PenaltyState& state() const { return st_; }

 private:
  DeviceBuffer<int> ids_, counts_, n_, slot_;
  int vocab_;
  PenaltyState st_;
};

uint32_t float_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

// Sampler's steps 1-3 (and its greedy choice) on a copy of `logits`: the host side every penalty test compares
// with.
std::vector<float> host_penalised(const std::vector<float>& logits, const std::vector<int32_t>& history,
                                  size_t n_prompt, Penalties pen, int* greedy = nullptr) {
  SamplingParams p;
  p.temperature = 0.0f;
  p.presence_penalty = pen.presence, p.frequency_penalty = pen.frequency, p.repetition_penalty = pen.repetition;
  std::vector<float> l = logits;
  Result<SampleResult> r = Sampler(p).sample(l, history, n_prompt);
  EXPECT_TRUE(r.ok());
  if (greedy) *greedy = r.ok() ? r->id : -1;
  return l;
}

// A history with repeats, ids only in the prompt, ids only among the generated and both, the vocabulary's ends.
std::vector<int32_t> mixed_history(size_t n_prompt, size_t n_generated, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> prompt_id(0, 2999), generated_id(1500, 4499);
  std::vector<int32_t> h;
  for (size_t i = 0; i < n_prompt; ++i) h.push_back(i == 0 ? 0 : prompt_id(rng));
  for (size_t i = 0; i < n_generated; ++i) h.push_back(i == 1 ? kVocab - 1 : generated_id(rng));
  return h;
}

// Logits whose largest values sit on history ids, just above the rest (N(0, 1): ~4.6 at most over the vocabulary),
// so the penalties decide the choice (positive and negative logits throughout).
std::vector<float> logits_favouring(const std::vector<int32_t>& history, uint32_t seed) {
  std::vector<float> l = random_vector(kVocab, seed, 1.0f);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> boost(3.5f, 6.5f);
  for (int32_t id : history) l[id] = boost(rng) * (rng() % 4 == 0 ? -1.0f : 1.0f);
  return l;
}

void expect_bits_equal(const std::vector<float>& got, const std::vector<float>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  size_t differ = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (float_bits(got[i]) != float_bits(want[i]) && differ++ == 0) first = i;
  }
  EXPECT_EQ(differ, 0u) << what << ": " << differ << " logits differ from the Sampler's, the first at id " << first
                        << " (" << got[first] << " vs " << want[first] << ")";
}

const Penalties kPenaltyCases[] = {{0.0f, 0.0f, 1.3f},  {0.0f, 0.0f, 0.6f},  {0.9f, 0.0f, 1.0f},
                                   {-1.2f, 0.0f, 1.0f}, {0.0f, 0.7f, 1.0f},  {0.0f, -0.45f, 1.0f},
                                   {1.1f, 0.35f, 1.17f}, {2.0f, 2.0f, 2.5f}, {-0.6f, 1.9f, 0.8f}};

// The logits after the kernel's penalties equal Sampler::apply_bias_and_penalties' to the bit (every id of the
// vocabulary), the greedy token is the host's argmax of them, and the chosen id is counted into the table.
TEST(CudaSamplePenalties, LogitsBitEqualToTheSamplerAndGreedyIsTheirArgmax) {
  SKIP_WITHOUT_GPU();
  uint32_t seed = 40;
  int changed_choice = 0;
  for (const Penalties& pen : kPenaltyCases) {
    for (size_t n_prompt : {0ul, 300ul}) {
      const std::vector<int32_t> history = mixed_history(n_prompt, 120, ++seed);
      const std::vector<float> logits = logits_favouring(history, ++seed);
      int want_token = -1;
      const std::vector<float> want = host_penalised(logits, history, n_prompt, pen, &want_token);
      SampleRig rig(logits, 8);
      PenaltyRig table(kVocab, 4096);
      ASSERT_CUDA(table.load(PenaltyTable::of(history, n_prompt)));
      const int token = rig.sample_penalised({}, 0, 3, table.state(), pen);
      char what[160];
      std::snprintf(what, sizeof what, "presence %g frequency %g repetition %g n_prompt %zu", pen.presence,
                    pen.frequency, pen.repetition, n_prompt);
      expect_bits_equal(rig.logits(), want, what);
      EXPECT_EQ(token, want_token) << what;
      changed_choice += token != cpu_argmax(logits);
      std::vector<int32_t> grown = history;
      grown.push_back(token);
      const PenaltyTable after = table.table(), rebuilt = PenaltyTable::of(grown, n_prompt);
      EXPECT_EQ(after.ids, rebuilt.ids) << what;
      EXPECT_EQ(after.counts, rebuilt.counts) << what;
    }
  }
  EXPECT_GE(changed_choice, 6) << "the penalties should move the argmax in many cases (8 of 18 on the host)";
}

// Several greedy steps: each step's logits are new, the table is the device's own (loaded once, then counted by
// the kernel), and every step's penalised logits, token and table equal the host's for the grown history.
TEST(CudaSamplePenalties, TableCountsEachChoiceOverSteps) {
  SKIP_WITHOUT_GPU();
  const size_t n_prompt = 50;
  std::vector<int32_t> history = mixed_history(n_prompt, 0, 7);
  const Penalties pen{0.4f, 0.6f, 1.2f};
  SampleRig rig(std::vector<float>(kVocab, 0.0f), 64);
  PenaltyRig table(kVocab, 1024);
  ASSERT_CUDA(table.load(PenaltyTable::of(history, n_prompt)));
  std::set<int> chosen;
  for (int step = 0; step < 24; ++step) {
    // Few candidates, mostly already generated ones: repeats happen and the counts decide.
    std::vector<float> logits = random_vector(kVocab, 100 + step, 1.0f);
    for (size_t i = n_prompt; i < history.size(); ++i) logits[history[i]] = 9.0f + 0.01f * static_cast<float>(i % 5);
    logits[5000 + step % 3] = 9.5f;
    int want_token = -1;
    const std::vector<float> want = host_penalised(logits, history, n_prompt, pen, &want_token);
    ASSERT_CUDA(rig.set_logits(logits));
    const int token = rig.sample_penalised({}, 0, step, table.state(), pen);
    expect_bits_equal(rig.logits(), want, "step");
    ASSERT_EQ(token, want_token) << "step " << step;
    history.push_back(token);
    chosen.insert(token);
    const PenaltyTable after = table.table(), rebuilt = PenaltyTable::of(history, n_prompt);
    ASSERT_EQ(after.ids, rebuilt.ids) << "step " << step;
    ASSERT_EQ(after.counts, rebuilt.counts) << "step " << step;
  }
  EXPECT_GE(chosen.size(), 3u) << "the counts should rotate the choice among the candidates";
  EXPECT_LT(chosen.size(), 24u) << "some ids should be chosen again (counts > 1)";
}

// The sampled paths (Gumbel-max, top-k/top-p) read the penalised logits too: the top-k draw equals the CPU
// reference on the host's penalised logits, and both count their choice.
TEST(CudaSamplePenalties, SampledPathsDrawFromThePenalisedLogits) {
  SKIP_WITHOUT_GPU();
  const size_t n_prompt = 80;
  const Penalties pen{0.8f, 0.3f, 1.4f};
  const Sampling top{0.9f, 20, 0.95f, 0.0f}, gumbel{0.8f, 0, 1.0f, 0.0f};
  for (const Sampling& s : {top, gumbel}) {
    std::vector<int32_t> history = mixed_history(n_prompt, 40, 21);
    SampleRig rig(std::vector<float>(kVocab, 0.0f), 64);
    PenaltyRig table(kVocab, 1024);
    ASSERT_CUDA(table.load(PenaltyTable::of(history, n_prompt)));
    for (int step = 0; step < 8; ++step) {
      const std::vector<float> logits = logits_favouring(history, 300 + step);
      const std::vector<float> want = host_penalised(logits, history, n_prompt, pen);
      ASSERT_CUDA(rig.set_logits(logits));
      const int token = rig.sample_penalised(s, 91, step, table.state(), pen);
      expect_bits_equal(rig.logits(), want, s.top_k ? "top-k step" : "Gumbel step");
      if (s.top_k) {
        EXPECT_EQ(token, cpu_sample_top(want, s, 91, step)) << "step " << step;
      }
      ASSERT_GE(token, 0);
      history.push_back(token);
      const PenaltyTable after = table.table(), rebuilt = PenaltyTable::of(history, n_prompt);
      ASSERT_EQ(after.ids, rebuilt.ids) << "step " << step;
      ASSERT_EQ(after.counts, rebuilt.counts) << "step " << step;
    }
  }
}

// Neutral values leave every logit as it was (the table is still counted); a second load replaces the table and
// clears the index of the ids it no longer holds.
TEST(CudaSamplePenalties, NeutralValuesChangeNothingAndLoadsReplaceTheTable) {
  SKIP_WITHOUT_GPU();
  const std::vector<int32_t> history = mixed_history(60, 30, 5);
  const std::vector<float> logits = logits_favouring(history, 6);
  SampleRig rig(logits, 8);
  PenaltyRig table(kVocab, 512);
  ASSERT_CUDA(table.load(PenaltyTable::of(history, 60)));
  const int token = rig.sample_penalised({}, 0, 0, table.state(), Penalties{});
  expect_bits_equal(rig.logits(), logits, "neutral penalties");
  EXPECT_EQ(token, cpu_argmax(logits));
  std::vector<int32_t> grown = history;
  grown.push_back(token);
  EXPECT_EQ(table.table().counts, PenaltyTable::of(grown, 60).counts);
  const std::vector<int32_t> other = {7, 8, 7, 9};
  ASSERT_CUDA(table.load(PenaltyTable::of(other, 1)));
  const PenaltyTable t = table.table();  // also checks the index lists only 7, 8, 9
  EXPECT_EQ(t.ids, (std::vector<int32_t>{7, 8, 9}));
  EXPECT_EQ(t.counts, (std::vector<int32_t>{1, 1, 1}));
  ASSERT_CUDA(table.load(PenaltyTable{}));
  EXPECT_EQ(table.table().size(), 0u);
}

// The penalty values come from the device knobs like the others: one graph captured with stale values serves two
// requests with their own penalties (the table and logits reloaded between them, as the backend does).
TEST(CudaSamplePenalties, KnobsFromDeviceServeEveryRequestFromOneGraph) {
  SKIP_WITHOUT_GPU();
  const size_t n_prompt = 100;
  const std::vector<int32_t> history = mixed_history(n_prompt, 50, 9);
  const std::vector<float> logits = logits_favouring(history, 10);
  SampleRig rig(logits, 8);
  PenaltyRig table(kVocab, 1024);
  DeviceBuffer<SampleKnobs> knobs(1);
  ASSERT_CUDA(rig.set_step(2));
  CapturedGraph graph;
  ASSERT_CUDA(graph.capture([&](cudaStream_t stream) {
    return rig.launch_on({}, 0, stream, knobs.get(), &table.state(), Penalties{1.9f, 1.9f, 1.9f});
  }));
  for (const Penalties& pen : {Penalties{0.5f, 0.25f, 1.3f}, Penalties{-1.0f, 0.0f, 0.7f}}) {
    SampleKnobs k;
    k.presence_penalty = pen.presence, k.frequency_penalty = pen.frequency, k.repetition_penalty = pen.repetition;
    ASSERT_CUDA(knobs.upload(std::vector<SampleKnobs>{k}));
    ASSERT_CUDA(table.load(PenaltyTable::of(history, n_prompt)));
    ASSERT_CUDA(rig.set_logits(logits));
    // The uploads above are on the legacy stream, and a pageable cudaMemcpy may return before its DMA lands: the
    // graph runs on a non-blocking stream, so wait for them (without this the last logits raced the kernel).
    ASSERT_CUDA(cudaDeviceSynchronize());
    ASSERT_CUDA(graph.replay());
    int want_token = -1;
    expect_bits_equal(rig.logits(), host_penalised(logits, history, n_prompt, pen, &want_token), "graph replay");
    EXPECT_EQ(rig.out(), want_token) << "presence " << pen.presence;
  }
}

TEST(CudaSamplePenalties, RejectsBadArguments) {
  SKIP_WITHOUT_GPU();
  SampleRig rig(std::vector<float>(10, 0.0f), 2);
  PenaltyRig table(10, 4);
  EXPECT_EQ(rig.launch_on({}, 0, nullptr, nullptr, &table.state(), {0.0f, 0.0f, 0.0f}), cudaErrorInvalidValue);
  EXPECT_EQ(rig.launch_on({}, 0, nullptr, nullptr, &table.state(), {0.0f, 0.0f, -1.0f}), cudaErrorInvalidValue);
  EXPECT_EQ(rig.launch_on({}, 0, nullptr, nullptr, &table.state(), {NAN, 0.0f, 1.0f}), cudaErrorInvalidValue);
  EXPECT_EQ(rig.launch_on({}, 0, nullptr, nullptr, &table.state(), {0.0f, INFINITY, 1.0f}), cudaErrorInvalidValue);
  PenaltyState no_index = table.state();
  no_index.slot = nullptr;
  EXPECT_EQ(rig.launch_on({}, 0, nullptr, nullptr, &no_index, {0.5f, 0.0f, 1.0f}), cudaErrorInvalidValue);
  PenaltyState other_vocab = table.state();
  other_vocab.vocab = 11;
  EXPECT_EQ(rig.launch_on({}, 0, nullptr, nullptr, &other_vocab, {0.5f, 0.0f, 1.0f}), cudaErrorInvalidValue);
  PenaltyTable too_many;
  too_many.ids = {0, 1, 2, 3, 4};
  too_many.counts = {1, 1, 1, 1, 1};
  EXPECT_EQ(table.load(too_many), cudaErrorInvalidValue);
  PenaltyTable outside;
  outside.ids = {3, 10};
  outside.counts = {0, 1};
  EXPECT_EQ(table.load(outside), cudaErrorInvalidValue);
  EXPECT_EQ(table.table().size(), 0u) << "a refused load changes nothing";
  ASSERT_CUDA(rig.set_step(0));
  EXPECT_EQ(rig.launch_on({}, 0, nullptr, nullptr, &table.state(), {0.5f, 0.0f, 1.0f}), cudaSuccess);
  ASSERT_CUDA(cudaDeviceSynchronize());
  EXPECT_EQ(table.table().counts, (std::vector<int32_t>{1})) << "the valid launch counted its choice";
}

// Device time per greedy token with penalties, tables of 2K and 16K distinct ids (what a 4K / 32K context
// holds at most of distinct ids, about), against plain greedy: the cost of the two penalty kernels.
TEST(CudaSampleBench, PenalisedFullVocabulary) {
  SKIP_WITHOUT_GPU();
  SampleRig rig(random_vector(kVocab, 4, 2.0f), 128);
  std::printf("\n");
  ASSERT_EQ(rig.launch({}, 5, 0), cudaSuccess);
  ASSERT_CUDA(cudaDeviceSynchronize());
  print_bandwidth("sample greedy (248320)", graph_time_us([&](int, cudaStream_t st) { return rig.launch_on({}, 5, st); }, 100),
                  4.0 * kVocab);
  for (int distinct : {2048, 16384}) {
    std::vector<int32_t> history(static_cast<size_t>(distinct));
    std::iota(history.begin(), history.end(), 1000);
    PenaltyRig table(kVocab, 32768);
    ASSERT_CUDA(table.load(PenaltyTable::of(history, static_cast<size_t>(distinct / 2))));
    char name[96];
    std::snprintf(name, sizeof name, "sample greedy + penalties, %d ids (248320)", distinct);
    const Penalties pen{0.5f, 0.5f, 1.1f};
    print_bandwidth(name,
                    graph_time_us([&](int, cudaStream_t st) {
                      return rig.launch_on({}, 5, st, nullptr, &table.state(), pen);
                    }, 100),
                    4.0 * kVocab + 16.0 * distinct);
  }
}

// Device time per sampled token at the model's vocabulary (logits stay in L2: 1 MB), CUDA-graph replay.
TEST(CudaSampleBench, FullVocabulary) {
  SKIP_WITHOUT_GPU();
  SampleRig rig(random_vector(kVocab, 4, 2.0f), 128);
  const double bytes = 4.0 * kVocab;
  std::printf("\n");
  const std::pair<const char*, Sampling> cases[] = {{"sample greedy (248320)", {0.0f, 0, 1.0f, 0.0f}},
                                                    {"sample Gumbel T=0.8 (248320)", {0.8f, 0, 1.0f, 0.0f}},
                                                    {"sample top_k 20 top_p 0.95 (248320)", {1.0f, 20, 0.95f, 0.0f}}};
  for (const auto& [name, s] : cases) {
    ASSERT_EQ(rig.launch(s, 5, 0), cudaSuccess);  // uploads the step before capture
    ASSERT_CUDA(cudaDeviceSynchronize());
    print_bandwidth(name, graph_time_us([&](int, cudaStream_t st) { return rig.launch_on(s, 5, st); }, 100), bytes);
  }
}

}  // namespace
}  // namespace lily::cuda::test
