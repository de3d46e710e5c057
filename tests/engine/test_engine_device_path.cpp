// The engine's device-sampling path (Backend::generate_on_device), driven on the CPU: a backend that is the
// CPU backend plus the generate_on_device contract (consume `first`, sample, feed back; the last token
// emitted is not consumed) and a KV capacity below the model's context, as the CUDA backend has. The CUDA
// backend itself is checked against the CPU in tests/cuda; here it is the engine's bookkeeping around the
// call that is tested: prefill of all but the last prompt token, stop handling, the cached token history, the
// host fallback.
#include <gtest/gtest.h>

#include <map>

#include "common/engine_runs.h"
#include "engine/penalties.h"
#include "penalty_reference.h"
#include "test_engine_util.h"

namespace lily::test {
namespace {

class DeviceLoopBackend final : public Backend {
 public:
  explicit DeviceLoopBackend(int64_t capacity) : cpu_(tiny_backend()), capacity_(capacity) {}
  const char* name() const override { return "cpu-device-loop"; }
  const ModelConfig& config() const override { return cpu_->config(); }
  std::unique_ptr<SequenceState> new_sequence() override { return cpu_->new_sequence(); }
  Status forward(SequenceState& seq, std::span<const int32_t> tokens, LogitsRows rows,
                 std::vector<float>* logits) override {
    if (seq.n_tokens() + static_cast<int64_t>(tokens.size()) > capacity_)
      return error(ErrorCode::out_of_range, "KV capacity %lld", (long long)capacity_);
    ++forward_calls;
    return cpu_->forward(seq, tokens, rows, logits);
  }
  int preferred_prefill_tokens() const override { return preferred_prefill; }
  bool has_device_sampling() const override { return true; }
  Status generate_on_device(SequenceState& seq, int32_t first, const DeviceSampling& s, int max_new,
                            const std::function<bool(int32_t)>& on_token) override {
    if (seq.n_tokens() + max_new > capacity_) return error(ErrorCode::out_of_range, "KV capacity");
    ++device_calls;
    return sample_steps(seq, first, s, max_new, on_token);
  }
  // The several-row contract: every row checked before any runs, one token each, drawn as generate_on_device
  // draws it.
  Status decode_batch_on_device(std::span<SequenceState* const> seqs, std::span<const int32_t> tokens,
                                std::span<const DeviceSampling> sampling, std::vector<int32_t>* next) override {
    for (SequenceState* s : seqs)
      if (s->n_tokens() + 1 > capacity_) return error(ErrorCode::out_of_range, "KV capacity");
    ++batch_calls;
    batch_rows += static_cast<int>(seqs.size());
    next->assign(seqs.size(), -1);
    for (size_t i = 0; i < seqs.size(); ++i)
      RETURN_IF_ERROR(sample_steps(*seqs[i], tokens[i], sampling[i], 1, [&](int32_t id) {
        (*next)[i] = id;
        return false;
      }));
    return ok_status();
  }
  // Penalties as the CUDA backend keeps them: a per-sequence table of the history's distinct ids, rebuilt from
  // DeviceSampling::history unless PenaltySync holds it, applied before the choice and updated after it (with
  // the host reference of the device kernel, engine/penalties.h).
  Status sample_steps(SequenceState& seq, int32_t first, const DeviceSampling& s, int max_new,
                      const std::function<bool(int32_t)>& on_token) {
    SequencePenalties* pen = nullptr;
    if (s.has_penalties()) {
      pen = &penalties_[&seq];
      if (!pen->sync.holds(s)) {
        pen->table = PenaltyTable::of(s.history, s.n_prompt);
        pen->sync.set(s);
        ++penalty_uploads;
      }
    }
    std::vector<float> logits;
    int32_t token = first;
    for (int i = 0; i < max_new; ++i) {
      RETURN_IF_ERROR(cpu_->forward(seq, std::span<const int32_t>(&token, 1), LogitsRows::last, &logits));
      if (pen) test::apply_penalties(logits, pen->table, s.repetition_penalty, s.presence_penalty, s.frequency_penalty);
      // The draw is keyed by the position, as the device sampler's: one-token calls give the loop's tokens.
      SamplingParams p;
      p.temperature = s.temperature, p.top_k = s.top_k, p.top_p = s.top_p, p.min_p = s.min_p;
      p.seed = s.seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(seq.n_tokens());
      token = Sampler(p).sample(logits, {})->id;
      if (pen) test::add_generated(pen->table, token), pen->sync.advance();
      if (!on_token(token)) break;
    }
    return ok_status();
  }
  int device_calls = 0, forward_calls = 0, batch_calls = 0, batch_rows = 0;
  int penalty_uploads = 0;  // tables built from a request's history
  int preferred_prefill = 512;

 private:
  struct SequencePenalties {
    PenaltySync sync;
    PenaltyTable table;
  };
  std::unique_ptr<Backend> cpu_;
  int64_t capacity_;
  std::map<const SequenceState*, SequencePenalties> penalties_;
};

struct DeviceEngine {
  DeviceLoopBackend* backend;
  std::unique_ptr<Engine> engine;
};

DeviceEngine device_engine(int64_t capacity, int preferred_prefill = 512) {
  auto b = std::make_unique<DeviceLoopBackend>(capacity);
  b->preferred_prefill = preferred_prefill;
  DeviceLoopBackend* raw = b.get();
  return {raw, std::make_unique<Engine>(std::move(b), tiny_model().tokenizer, EngineOptions{})};
}

std::vector<int32_t> prompt_of(int n, int salt) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back(500 + 389 * salt + 13 * i);
  return p;
}

// With the default EngineOptions the engine prefills in pieces of the backend's preferred size (the CUDA
// backend's prefill chunk), and the result does not depend on the piece size.
TEST(EngineDevicePath, PrefillPiecesFollowTheBackend) {
  auto dev = device_engine(1 << 20, 7);
  EXPECT_EQ(dev.engine->options().prefill_chunk, 7);
  GenerationRequest req = greedy_request(prompt_of(20, 3), 4);
  req.reuse_cache = false;
  GenerationResult d = run(*dev.engine, req);
  EXPECT_EQ(dev.backend->forward_calls, 3);  // 19 prompt tokens before the device loop: 7 + 7 + 5
  auto one = device_engine(1 << 20, 512);
  GenerationResult o = run(*one.engine, req);
  EXPECT_EQ(one.backend->forward_calls, 1);
  EXPECT_EQ(d.tokens, o.tokens);
}

TEST(EngineDevicePath, GreedyStopsAndCacheMatchTheHostPath) {
  auto dev = device_engine(1 << 20);
  auto host = tiny_engine();
  GenerationRequest req = greedy_request(prompt_of(20, 1), 10);
  GenerationResult h = run(*host, req);
  GenerationResult d = run(*dev.engine, req);
  EXPECT_EQ(dev.backend->device_calls, 1);
  EXPECT_EQ(d.tokens, h.tokens);
  EXPECT_EQ(d.finish_reason, "length");
  // A stop token in the middle, then a prompt extending the first one: it resumes from the cached state,
  // whose history must be exactly what the device loop consumed.
  req.stop_token_ids = {h.tokens[4]};
  GenerationResult stopped = run(*dev.engine, req);
  EXPECT_EQ(stopped.finish_reason, "stop");
  EXPECT_EQ(stopped.tokens, std::vector<int32_t>(h.tokens.begin(), h.tokens.begin() + 4));
  GenerationRequest next = greedy_request(req.prompt, 6);
  next.prompt.insert(next.prompt.end(), h.tokens.begin(), h.tokens.begin() + 5);
  next.prompt.push_back(42);
  GenerationResult dn = run(*dev.engine, next);
  EXPECT_EQ(dn.cached_tokens,
            20 + 4);  // the prompt and 4 sampled tokens were consumed; the stop token was not
  next.reuse_cache = false;
  EXPECT_EQ(dn.tokens, run(*host, next).tokens);
}

TEST(EngineDevicePath, SeededSamplingIsReproducibleAndLogprobsUseTheHost) {
  auto dev = device_engine(1 << 20);
  GenerationRequest req = greedy_request(prompt_of(12, 2), 12);
  req.sampling.temperature = 1.0f;
  req.sampling.top_k = 40;
  req.sampling.seed = 9;
  EXPECT_EQ(run(*dev.engine, req).tokens, run(*dev.engine, req).tokens);
  EXPECT_EQ(dev.backend->device_calls, 2);
  req.sampling.logprobs = true;
  run(*dev.engine, req);
  req.sampling.logprobs = false;
  req.sampling.top_k = 65;  // beyond the device sampler's top-k
  run(*dev.engine, req);
  req.sampling.top_k = 0;
  req.sampling.logit_bias = {{5, 2.0f}};  // the bias runs on the host
  run(*dev.engine, req);
  req.sampling.logit_bias.clear();
  req.sampling.min_tokens = 3;  // the stop-token ban runs on the host
  run(*dev.engine, req);
  EXPECT_EQ(dev.backend->device_calls, 2);
  req.sampling.min_tokens = 0;
  req.sampling.presence_penalty = 0.5f;  // penalties run on the device
  run(*dev.engine, req);
  EXPECT_EQ(dev.backend->device_calls, 3);
}

TEST(EngineDevicePath, ACapacityBelowTheContextFallsBackToTheHostUpToTheLimit) {
  auto dev = device_engine(30);
  GenerationResult r = run(*dev.engine, greedy_request(prompt_of(10, 3), -1));  // until the context is full
  EXPECT_EQ(dev.backend->device_calls, 0);
  EXPECT_EQ(r.finish_reason, "length");
  EXPECT_EQ(r.tokens.size(), 30u - 10u + 1u);  // the last token is sampled, not consumed
  GenerationResult fits = run(*dev.engine, greedy_request(prompt_of(10, 4), 5));
  EXPECT_EQ(dev.backend->device_calls, 1);
  EXPECT_EQ(fits.tokens.size(), 5u);
}

using test::run_together;

// Several device-sampled requests decode together in one decode_batch_on_device call a step (the CUDA backend's
// several-row step); each keeps the tokens it gets alone (greedy and seeded), beside a host-sampled one.
TEST(EngineDevicePath, DeviceRowsShareOneBatchedCallAStep) {
  auto dev = device_engine(1 << 20);
  GenerationRequest greedy = greedy_request(prompt_of(9, 5), 6);
  GenerationRequest seeded = greedy_request(prompt_of(5, 8), 4);
  seeded.sampling.temperature = 0.9f, seeded.sampling.top_k = 30, seeded.sampling.seed = 17;
  GenerationRequest on_host = greedy_request(prompt_of(7, 6), 5);
  on_host.sampling.logprobs = true;
  std::vector<GenerationRequest> reqs = {greedy, seeded, on_host};
  std::vector<GenerationResult> alone;
  for (auto& r : reqs) alone.push_back(run(*dev.engine, r)), r.reuse_cache = false;
  const int device_calls = dev.backend->device_calls;
  std::vector<std::unique_ptr<Generation>> gens = run_together(*dev.engine, reqs);
  ASSERT_EQ(gens.size(), reqs.size());
  // Steps 1-4: both device rows in one call (4 rows x 2); steps 5-6: the greedy one alone, generate_on_device.
  EXPECT_EQ(dev.backend->batch_calls, 4);
  EXPECT_EQ(dev.backend->batch_rows, 8);
  EXPECT_EQ(dev.backend->device_calls, device_calls + 2);
  for (size_t i = 0; i < gens.size(); ++i) {
    auto r = dev.engine->finish(std::move(gens[i]));
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->tokens, alone[i].tokens) << "request " << i;
  }
}

// A device row at the backend's limit fails the batched call before any row ran (out_of_range): the rows then
// step one at a time, the one at the limit on the host up to it, and the other keeps its tokens.
TEST(EngineDevicePath, ABatchedRowAtTheLimitStepsTheRowsOneAtATime) {
  auto dev = device_engine(24);
  GenerationRequest near_limit = greedy_request(prompt_of(20, 3), 10);
  GenerationRequest roomy = greedy_request(prompt_of(4, 9), 8);
  GenerationResult roomy_alone = run(*dev.engine, roomy);
  near_limit.reuse_cache = roomy.reuse_cache = false;
  std::vector<std::unique_ptr<Generation>> gens = run_together(*dev.engine, {near_limit, roomy});
  ASSERT_EQ(gens.size(), 2u);
  auto a = dev.engine->finish(std::move(gens[0]));
  auto b = dev.engine->finish(std::move(gens[1]));
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->finish_reason, "length");
  EXPECT_EQ(a->tokens.size(), 24u - 20u + 1u);  // up to the capacity; the last token sampled, not consumed
  EXPECT_EQ(b->tokens, roomy_alone.tokens);
}

// Beside host-sampled requests, a lone device-sampled one steps one token per generate_on_device call (the device
// keys its draws by position, so these are the tokens of its uninterrupted loop); host-sampled ones go through
// forward_batch (the default loop here). Both keep the tokens they get alone.
TEST(EngineDevicePath, BatchedStepsKeepEachRequestsTokens) {
  auto dev = device_engine(1 << 20);
  GenerationRequest on_device = greedy_request(prompt_of(9, 5), 6);
  GenerationRequest on_host = greedy_request(prompt_of(7, 6), 6);
  on_host.sampling.logprobs = true;
  const GenerationResult device_alone = run(*dev.engine, on_device), host_alone = run(*dev.engine, on_host);
  const int calls = dev.backend->device_calls;
  on_device.reuse_cache = on_host.reuse_cache = false;
  auto a = dev.engine->begin(on_device, {});
  auto b = dev.engine->begin(on_host, {});
  ASSERT_TRUE(a.ok() && b.ok());
  while ((*a)->prefilling()) dev.engine->prefill_step(**a);
  while ((*b)->prefilling()) dev.engine->prefill_step(**b);
  Generation* both[] = {a->get(), b->get()};
  while (!(*a)->done() || !(*b)->done()) {
    std::vector<Generation*> decoding;
    for (Generation* g : both)
      if (!g->done()) decoding.push_back(g);
    dev.engine->decode_step(decoding);
  }
  EXPECT_EQ(dev.backend->device_calls, calls + 6);  // one per token of the device-sampled request
  auto ra = dev.engine->finish(std::move(*a));
  auto rb = dev.engine->finish(std::move(*b));
  ASSERT_TRUE(ra.ok() && rb.ok());
  EXPECT_EQ(ra->tokens, device_alone.tokens);
  EXPECT_EQ(rb->tokens, host_alone.tokens);
}

// Presence, frequency and repetition penalties run on the device: greedy tokens equal the host loop's (CPU
// Sampler over the same logits), each penalty alone and together, and the table is built once per request.
TEST(EngineDevicePath, PenalisedRequestsRunOnTheDeviceAsOnTheHost) {
  auto dev = device_engine(1 << 20);
  auto host = tiny_engine();
  GenerationRequest plain = greedy_request(prompt_of(12, 7), 16);
  plain.reuse_cache = false;
  const GenerationResult unpenalised = run(*host, plain);
  struct Case {
    float presence, frequency, repetition;
  };
  // The tiny model's greedy tokens do not repeat and its prompt ids are not near the top: a repetition below 1
  // (which favours the history, the prompt's ids too) is what changes them; with presence / frequency beside it
  // the tokens also depend on which ids count as generated (n_prompt).
  const Case cases[] = {{1.5f, 0.0f, 1.0f}, {0.0f, 1.2f, 1.0f}, {0.0f, 0.0f, 1.8f}, {0.8f, 0.6f, 1.3f},
                        {-2.0f, -2.0f, 1.0f}, {0.0f, 0.0f, 0.5f}, {2.0f, 0.0f, 0.4f}, {0.0f, 2.0f, 0.4f},
                        {-1.0f, 0.5f, 0.3f}};
  int differ = 0;
  for (const Case& c : cases) {
    GenerationRequest req = plain;
    req.sampling.presence_penalty = c.presence;
    req.sampling.frequency_penalty = c.frequency;
    req.sampling.repetition_penalty = c.repetition;
    const int calls = dev.backend->device_calls, uploads = dev.backend->penalty_uploads;
    const GenerationResult h = run(*host, req), d = run(*dev.engine, req);
    EXPECT_EQ(d.tokens, h.tokens) << "presence " << c.presence << " frequency " << c.frequency << " repetition "
                                  << c.repetition;
    EXPECT_EQ(dev.backend->device_calls, calls + 1) << "the request decodes on the device";
    EXPECT_EQ(dev.backend->penalty_uploads, uploads + 1) << "one table per request";
    differ += h.tokens != unpenalised.tokens;
  }
  EXPECT_GE(differ, 3) << "the penalties should change the greedy tokens of most cases";
}

// The table follows a request through one-token and several-row steps (no rebuild: the device counted each token
// it sampled) and is rebuilt for the next request on a cached sequence: its counts are that request's generated
// tokens only, its repetition set its prompt + generated.
TEST(EngineDevicePath, PenaltiesFollowTheRequestThroughBatchedStepsAndTheCache) {
  auto dev = device_engine(1 << 20);
  auto host = tiny_engine();
  GenerationRequest a = greedy_request(prompt_of(9, 5), 8);
  a.sampling.presence_penalty = 2.0f, a.sampling.repetition_penalty = 0.4f;
  GenerationRequest b = greedy_request(prompt_of(6, 8), 10);
  b.sampling.frequency_penalty = 2.0f, b.sampling.repetition_penalty = 0.5f;
  GenerationRequest seeded = greedy_request(prompt_of(5, 2), 6);
  seeded.sampling.temperature = 0.9f, seeded.sampling.top_k = 30, seeded.sampling.seed = 17;
  seeded.sampling.presence_penalty = -0.7f, seeded.sampling.repetition_penalty = 0.6f;
  std::vector<GenerationRequest> reqs = {a, b, seeded};
  std::vector<GenerationResult> alone;
  for (auto& r : reqs) r.reuse_cache = false, alone.push_back(run(*dev.engine, r));
  EXPECT_EQ(alone[0].tokens, run(*host, reqs[0]).tokens);
  EXPECT_EQ(alone[1].tokens, run(*host, reqs[1]).tokens);
  GenerationRequest a_plain = reqs[0];
  a_plain.sampling.presence_penalty = 0, a_plain.sampling.repetition_penalty = 1;  // no penalties
  EXPECT_NE(alone[0].tokens, run(*host, a_plain).tokens) << "the penalties should change the tokens";
  const int uploads = dev.backend->penalty_uploads, batch_calls = dev.backend->batch_calls;
  std::vector<std::unique_ptr<Generation>> gens = run_together(*dev.engine, reqs);
  ASSERT_EQ(gens.size(), reqs.size());
  EXPECT_GT(dev.backend->batch_calls, batch_calls);
  EXPECT_EQ(dev.backend->penalty_uploads, uploads + 3) << "one table per request, kept across its steps";
  for (size_t i = 0; i < gens.size(); ++i) {
    auto r = dev.engine->finish(std::move(gens[i]));
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->tokens, alone[i].tokens) << "request " << i;
  }
  // Through the session cache: the first turn, then a prompt extending it resumes from its cached sequence.
  GenerationRequest first = a;
  first.reuse_cache = true;
  const GenerationResult turn1 = run(*dev.engine, first);
  GenerationRequest next = greedy_request(first.prompt, 8);
  next.prompt.insert(next.prompt.end(), turn1.tokens.begin(), turn1.tokens.end());
  next.prompt.push_back(42);
  next.sampling.frequency_penalty = 1.5f, next.sampling.repetition_penalty = 0.45f;
  const GenerationResult turn2 = run(*dev.engine, next);
  EXPECT_GT(turn2.cached_tokens, 0);
  next.reuse_cache = false;
  EXPECT_EQ(turn2.tokens, run(*host, next).tokens);
}

}  // namespace
}  // namespace lily::test
