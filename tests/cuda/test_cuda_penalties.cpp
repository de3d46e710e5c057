// End to end: presence / frequency / repetition penalties sampled on the device (generate_on_device,
// decode_batch_on_device, the engine's device path) against the host loop - the CPU Sampler over the same CUDA
// logits, token for token - and against the CPU backend's host loop, on the tiny synthetic model; the device's
// penalty table rebuilt after a restore and for a clone, and kept across one-token calls of one request.
// Skipped without a GPU.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <random>
#include <vector>

#include "common/engine_runs.h"
#include "cpu/cpu_backend.h"
#include "cuda/kernels/cuda_test_util.h"
#include "cuda/cuda_backend.h"
#include "engine/engine.h"
#include "engine/sampler.h"
#include "model/synth.h"

namespace lily {
namespace {


std::shared_ptr<const ModelWeights> tiny_weights() {
  auto w = synth_in_memory("tiny", CheckpointLayout::mlx, 7);
  EXPECT_TRUE(w.ok()) << w.status().message();
  return std::make_shared<const ModelWeights>(std::move(*w));
}

// Random ids with repeats inside the prompt (its second half repeats ids of its first).
std::vector<int32_t> prompt_with_repeats(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> d(0, 150999);
  std::vector<int32_t> p(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) p[i] = i >= n / 2 && i % 3 == 0 ? p[i - n / 2] : d(rng);
  return p;
}

struct Penalties {
  float presence, frequency, repetition;
};

// The tiny model's greedy tokens rarely repeat and its prompt ids are rarely near the top: a repetition below 1
// (favouring the history) and negative presence / frequency are the cases that change its tokens the most.
const Penalties kCases[] = {{1.5f, 0.0f, 1.0f},   {0.0f, 1.2f, 1.0f},  {0.0f, 0.0f, 1.8f},  {0.0f, 0.0f, 0.5f},
                            {-2.0f, -2.0f, 1.0f}, {2.0f, 0.0f, 0.4f},  {0.0f, 2.0f, 0.4f},  {-1.0f, 0.5f, 0.3f}};

DeviceSampling greedy_with(const Penalties& p) {
  DeviceSampling s;
  s.presence_penalty = p.presence, s.frequency_penalty = p.frequency, s.repetition_penalty = p.repetition;
  return s;
}

// The host loop over a backend's logits: forward the last token, Sampler (greedy, the penalties) over prompt +
// generated, as Engine's decode_on_host does. `seq` has consumed all of the prompt but its last token.
std::vector<int32_t> host_loop(Backend& b, SequenceState& seq, const std::vector<int32_t>& prompt, const Penalties& p,
                               int steps) {
  SamplingParams sp;
  sp.temperature = 0.0f;
  sp.presence_penalty = p.presence, sp.frequency_penalty = p.frequency, sp.repetition_penalty = p.repetition;
  Sampler sampler(sp);
  std::vector<int32_t> history = prompt, out;
  std::vector<float> logits;
  int32_t token = prompt.back();
  for (int i = 0; i < steps; ++i) {
    EXPECT_TRUE(b.forward(seq, std::span<const int32_t>(&token, 1), LogitsRows::last, &logits).ok());
    Result<SampleResult> r = sampler.sample(logits, history, prompt.size());
    EXPECT_TRUE(r.ok());
    if (!r.ok()) break;
    token = r->id;
    history.push_back(token);
    out.push_back(token);
  }
  return out;
}

std::unique_ptr<SequenceState> prefilled(Backend& b, const std::vector<int32_t>& prompt) {
  auto seq = b.new_sequence();
  EXPECT_TRUE(seq);
  const std::span<const int32_t> all(prompt);
  EXPECT_TRUE(b.forward(*seq, all.first(all.size() - 1), LogitsRows::none, nullptr).ok());
  return seq;
}

// generate_on_device with the request's history (one call of `steps` tokens).
std::vector<int32_t> device_loop(Backend& b, SequenceState& seq, const std::vector<int32_t>& prompt,
                                 const Penalties& p, int steps, uint64_t history_id = 0) {
  DeviceSampling s = greedy_with(p);
  s.history = prompt, s.n_prompt = prompt.size(), s.history_id = history_id;
  std::vector<int32_t> out;
  Status st = b.generate_on_device(seq, prompt.back(), s, steps, [&](int32_t t) {
    out.push_back(t);
    return true;
  });
  EXPECT_TRUE(st.ok()) << st.message();
  return out;
}

TEST(CudaBackendPenalties, DeviceLoopEqualsTheHostLoopTokenForToken) {
  SKIP_WITHOUT_GPU();
  auto w = tiny_weights();
  auto made = cuda::make_cuda_backend(w, {2048});
  ASSERT_TRUE(made.ok()) << made.status().message();
  Backend& b = **made;
  const std::vector<int32_t> prompt = prompt_with_repeats(40, 3);
  const int kSteps = 24;
  auto plain_seq = prefilled(b, prompt);
  const std::vector<int32_t> unpenalised = host_loop(b, *plain_seq, prompt, {0.0f, 0.0f, 1.0f}, kSteps);
  int differ = 0;
  uint64_t history_id = 100;
  for (const Penalties& p : kCases) {
    auto hs = prefilled(b, prompt);
    const std::vector<int32_t> want = host_loop(b, *hs, prompt, p, kSteps);
    auto ds = prefilled(b, prompt);
    EXPECT_EQ(device_loop(b, *ds, prompt, p, kSteps), want)
        << "presence " << p.presence << " frequency " << p.frequency << " repetition " << p.repetition;
    differ += want != unpenalised;
    // One token a call, as the engine's batched path steps a lone request: the table the device counted stays
    // (the same history_id, the history grown by its tokens).
    auto os = prefilled(b, prompt);
    std::vector<int32_t> history = prompt, got;
    DeviceSampling s = greedy_with(p);
    s.n_prompt = prompt.size(), s.history_id = ++history_id;
    for (int i = 0; i < kSteps; ++i) {
      s.history = history;
      int32_t next = -1;
      ASSERT_TRUE(b.generate_on_device(*os, history.back(), s, 1, [&](int32_t t) {
                     next = t;
                     return false;
                   }).ok());
      history.push_back(next);
      got.push_back(next);
    }
    EXPECT_EQ(got, want) << "one-token calls, presence " << p.presence << " frequency " << p.frequency
                         << " repetition " << p.repetition;
  }
  EXPECT_GE(differ, 3) << "the penalties should change the greedy tokens of several cases";
}

// The table after a restore and in a clone (neither copies it: the next call's history rebuilds it): the same
// request after restoring the checkpoint gets the same tokens again, and clones taken before and after the
// sequence had a table get the original's.
TEST(CudaBackendPenalties, RestoreAndCloneRebuildTheTable) {
  SKIP_WITHOUT_GPU();
  auto w = tiny_weights();
  auto made = cuda::make_cuda_backend(w, {2048});
  ASSERT_TRUE(made.ok()) << made.status().message();
  Backend& b = **made;
  const std::vector<int32_t> prompt = prompt_with_repeats(30, 11);
  const Penalties p{-1.5f, 0.5f, 0.45f};
  auto hs = prefilled(b, prompt);
  const std::vector<int32_t> want = host_loop(b, *hs, prompt, p, 16);
  auto seq = prefilled(b, prompt);
  auto cp = seq->checkpoint();
  ASSERT_TRUE(cp);
  auto copy = seq->clone();
  ASSERT_TRUE(copy);
  EXPECT_EQ(device_loop(b, *seq, prompt, p, 16, 7), want);
  ASSERT_TRUE(seq->restore(*cp).ok());
  EXPECT_EQ(device_loop(b, *seq, prompt, p, 16, 7), want) << "after restore, the same request again";
  EXPECT_EQ(device_loop(b, *copy, prompt, p, 16, 7), want) << "a clone taken before";
  auto copy2 = seq->clone();  // taken after the sequence's table was used
  ASSERT_TRUE(copy2);
  ASSERT_TRUE(copy2->restore(*cp).ok());
  EXPECT_EQ(device_loop(b, *copy2, prompt, p, 16, 8), want) << "a clone of a sequence with a table";
}

// A backend without device sampling: the engine runs its host loop over the inner backend's logits.
class HostSampled final : public Backend {
 public:
  explicit HostSampled(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}
  const char* name() const override { return inner_->name(); }
  const ModelConfig& config() const override { return inner_->config(); }
  std::unique_ptr<SequenceState> new_sequence() override { return inner_->new_sequence(); }
  int64_t max_context() const override { return inner_->max_context(); }
  Status forward(SequenceState& seq, std::span<const int32_t> tokens, LogitsRows rows,
                 std::vector<float>* logits) override {
    return inner_->forward(seq, tokens, rows, logits);
  }
  Status forward_batch(std::span<SequenceState* const> seqs, std::span<const int32_t> tokens,
                       std::vector<float>* logits) override {
    return inner_->forward_batch(seqs, tokens, logits);
  }
  int preferred_prefill_tokens() const override { return inner_->preferred_prefill_tokens(); }
  Result<std::unique_ptr<Checkpoint>> forward_with_checkpoint(SequenceState& seq, std::span<const int32_t> tokens,
                                                              int64_t split, LogitsRows rows,
                                                              std::vector<float>* logits) override {
    return inner_->forward_with_checkpoint(seq, tokens, split, rows, logits);
  }

 private:
  std::unique_ptr<Backend> inner_;
};

Tokenizer qwen_tokenizer() {
  auto t = Tokenizer::load(LILY_FIXTURES_DIR "/qwen3-tokenizer/tokenizer.json");
  EXPECT_TRUE(t.ok()) << t.status().message();
  return std::move(*t);
}

GenerationRequest penalised_request(std::vector<int32_t> prompt, const Penalties& p, int max_tokens) {
  GenerationRequest r;
  r.prompt = std::move(prompt);
  r.sampling.temperature = 0.0f;
  r.sampling.max_tokens = max_tokens;
  r.sampling.presence_penalty = p.presence, r.sampling.frequency_penalty = p.frequency;
  r.sampling.repetition_penalty = p.repetition;
  return r;
}

std::vector<int32_t> tokens_of(Engine& e, const GenerationRequest& r, int* cached = nullptr) {
  auto out = e.generate(r, [](const GenerationPiece&) { return true; });
  EXPECT_TRUE(out.ok()) << out.status().message();
  if (cached) *cached = out.ok() ? out->cached_tokens : -1;
  return out.ok() ? out->tokens : std::vector<int32_t>{};
}

// Through the engine: a penalised greedy request decodes on the device (generate_on_device) with the host loop's
// tokens (the same CUDA logits, the CPU Sampler; the CPU backend's are printed beside them); the next turn of a cached conversation
// and requests decoding side by side (decode_batch_on_device) too.
TEST(CudaBackendPenalties, EngineDevicePathEqualsTheHostLoop) {
  SKIP_WITHOUT_GPU();
  auto w = tiny_weights();
  const Tokenizer tok = qwen_tokenizer();
  auto dev_backend = cuda::make_cuda_backend(w, {2048});
  auto host_backend = cuda::make_cuda_backend(w, {2048});
  ASSERT_TRUE(dev_backend.ok() && host_backend.ok());
  Engine dev(std::move(*dev_backend), tok, {});
  Engine host(std::make_unique<HostSampled>(std::move(*host_backend)), tok, {});
  Engine cpu(std::make_unique<CpuBackend>(w), tok, {});
  const std::vector<int32_t> prompt = prompt_with_repeats(36, 21);
  for (const Penalties& p : kCases) {
    GenerationRequest r = penalised_request(prompt, p, 20);
    r.reuse_cache = false;
    const std::vector<int32_t> d = tokens_of(dev, r), h = tokens_of(host, r), c = tokens_of(cpu, r);
    EXPECT_EQ(d, h) << "presence " << p.presence << " frequency " << p.frequency << " repetition " << p.repetition;
    int first_diff = -1;
    for (size_t i = 0; i < std::min(d.size(), c.size()) && first_diff < 0; ++i)
      if (d[i] != c[i]) first_diff = static_cast<int>(i);
    // Printed, not asserted: the CPU backend's logits differ from the GPU's at the fp32 rounding level, so a near
    // tie may pick another token (measured on the H200: repetition 0.5 diverged at token 13 while the device loop
    // equalled the CUDA host loop). What the penalties must do is asserted above, on the same logits.
    std::printf("[tiny] penalties %g/%g/%g: device vs CPU backend, first difference at %d (-1 = none)\n", p.presence,
                p.frequency, p.repetition, first_diff);
  }
  // The next turn resumes from the cached sequence; its table is built from its own prompt.
  const Penalties p{1.0f, 0.5f, 0.5f};
  GenerationRequest turn1 = penalised_request(prompt, p, 12);
  const std::vector<int32_t> t1 = tokens_of(dev, turn1);
  GenerationRequest turn2 = penalised_request(prompt, {-1.0f, 1.0f, 0.6f}, 12);
  turn2.prompt.insert(turn2.prompt.end(), t1.begin(), t1.end());
  turn2.prompt.push_back(42);
  int cached = 0;
  const std::vector<int32_t> t2 = tokens_of(dev, turn2, &cached);
  EXPECT_GT(cached, 0);
  turn2.reuse_cache = false;
  EXPECT_EQ(t2, tokens_of(host, turn2)) << "the cached turn";
  // Side by side: three penalised requests (one seeded) in several-row steps, each with its tokens alone.
  std::vector<GenerationRequest> reqs = {penalised_request(prompt_with_repeats(20, 1), kCases[3], 10),
                                         penalised_request(prompt_with_repeats(28, 2), kCases[5], 14),
                                         penalised_request(prompt_with_repeats(12, 4), kCases[7], 8)};
  reqs[2].sampling.temperature = 0.9f, reqs[2].sampling.top_k = 30, reqs[2].sampling.seed = 5;
  std::vector<std::vector<int32_t>> alone;
  for (auto& r : reqs) r.reuse_cache = false, alone.push_back(tokens_of(dev, r));
  EXPECT_EQ(alone[0], tokens_of(host, reqs[0]));
  std::vector<std::unique_ptr<Generation>> gens = test::run_together(dev, reqs);
  ASSERT_EQ(gens.size(), reqs.size());
  for (size_t i = 0; i < gens.size(); ++i) {
    auto r = dev.finish(std::move(gens[i]));
    ASSERT_TRUE(r.ok()) << r.status().message();
    EXPECT_EQ(r->tokens, alone[i]) << "request " << i << " beside the others";
  }
}

// Bad penalty input through the backend's public call is an error, never a crash: values the sampler cannot
// use, n_prompt past the history, history ids outside the vocabulary.
TEST(CudaBackendPenalties, BadPenaltyInputIsAnError) {
  SKIP_WITHOUT_GPU();
  auto w = tiny_weights();
  auto made = cuda::make_cuda_backend(w, {256});
  ASSERT_TRUE(made.ok()) << made.status().message();
  Backend& b = **made;
  const std::vector<int32_t> prompt = prompt_with_repeats(10, 5);
  auto seq = prefilled(b, prompt);
  auto call = [&](DeviceSampling s) {
    return b.generate_on_device(*seq, prompt.back(), s, 2, [](int32_t) { return true; });
  };
  DeviceSampling s = greedy_with({0.5f, 0.0f, 1.0f});
  s.history = prompt, s.n_prompt = prompt.size();
  DeviceSampling bad = s;
  bad.repetition_penalty = 0.0f;
  EXPECT_EQ(call(bad).code(), ErrorCode::invalid_argument);
  bad = s, bad.presence_penalty = NAN;
  EXPECT_EQ(call(bad).code(), ErrorCode::invalid_argument);
  bad = s, bad.n_prompt = prompt.size() + 1;
  EXPECT_EQ(call(bad).code(), ErrorCode::invalid_argument);
  std::vector<int32_t> outside = prompt;
  outside[3] = w->config.vocab_size;
  bad = s, bad.history = outside;
  EXPECT_EQ(call(bad).code(), ErrorCode::invalid_argument);
  EXPECT_EQ(seq->n_tokens(), static_cast<int64_t>(prompt.size()) - 1) << "nothing ran";
  EXPECT_TRUE(call(s).ok());
}

}  // namespace
}  // namespace lily
