// sample_token (src/cuda/kernels/sample.cu): greedy against a CPU argmax (ties -> lowest id), Gumbel-max against
// softmax(logits / T) empirically, the top_k/top_p/min_p path against a CPU reference of engine/sampler.h
// steps 6-10 (same SplitMix64 draw), determinism in (seed, step).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <set>
#include <vector>

#include "cuda/kernels/sample.cuh"
#include "cuda_test_util.h"

namespace lily::cuda::test {
namespace {

constexpr int kVocab = 248320;

struct Sampling {
  float temperature = 0.0f;
  int top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
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
  cudaError_t launch_on(const Sampling& s, uint64_t seed, cudaStream_t stream, const SampleKnobs* knobs = nullptr) {
    SampleParams p;
    p.knobs = knobs;
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
  cudaStream_t stream;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_CUDA(rig.set_step(1));
  ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  ASSERT_CUDA(rig.launch_on(c.stale, 1, stream, knobs.get()));
  ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
  ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (uint64_t seed : {11ull, 12ull}) {
    const Sampling& r = c.real;
    const int want = cpu_sample_top(l, r, seed, 1);
    ASSERT_CUDA(knobs.upload(std::vector<SampleKnobs>{{r.temperature, r.top_k, r.top_p, r.min_p, seed}}));
    ASSERT_CUDA(cudaGraphLaunch(exec, stream));
    ASSERT_CUDA(cudaStreamSynchronize(stream));
    EXPECT_EQ(rig.out(), want) << "graph replay, seed " << seed;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST(CudaSample, RejectsBadArguments) {
  SKIP_WITHOUT_GPU();
  SampleRig rig(std::vector<float>(10, 0.0f), 2);
  EXPECT_EQ(rig.launch({-1.0f, 0, 1.0f, 0.0f}, 0, 0), cudaErrorInvalidValue);
  EXPECT_EQ(rig.launch({1.0f, 0, 0.0f, 0.0f}, 0, 0), cudaErrorInvalidValue);
  EXPECT_EQ(rig.launch({1.0f, -2, 1.0f, 0.0f}, 0, 0), cudaErrorInvalidValue);
  EXPECT_EQ(rig.launch({NAN, 0, 1.0f, 0.0f}, 0, 0), cudaErrorInvalidValue);
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
