// Speculative decoding with the MTP head (engine/speculative.h) on the tiny synthetic model and the CPU backend:
// the acceptance rule (fixed draws, and a statistical check of the output distribution that a wrong rule
// fails), forward_verify + accept_verified restoring the state after a rejection at every position, the engine's
// greedy output token for token the plain loop's for K = 1..3 (with stop tokens, stop strings, max_tokens,
// min_tokens, logprobs, cancellation and the session cache), seeded sampling reproducible, and the errors: a
// checkpoint without the head, bad --speculative values.
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "engine/model_loader.h"
#include "engine/speculative.h"
#include "test_engine_util.h"

namespace lily::test {
namespace {

namespace fs = std::filesystem;

std::unique_ptr<Backend> mtp_backend() {
  auto b = tiny_backend();
  Status st = b->enable_mtp();
  EXPECT_TRUE(st.ok()) << st.message();
  return b;
}

std::unique_ptr<Engine> spec_engine(int k) {
  EngineOptions o;
  o.speculative_tokens = k;
  return std::make_unique<Engine>(mtp_backend(), tiny_model().tokenizer, o);
}

int32_t argmax(std::span<const float> v) {
  return static_cast<int32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

TEST(SpeculativeParse, AcceptsMtpOneToThreeAndOff) {
  EXPECT_EQ(*parse_speculative(""), 0);
  EXPECT_EQ(*parse_speculative("off"), 0);
  for (int k = 1; k <= 3; ++k) EXPECT_EQ(*parse_speculative("mtp:" + std::to_string(k)), k);
  for (const char* bad : {"mtp:0", "mtp:4", "mtp:", "mtp:-1", "mtp:2x", "mtp: 2", "eagle:2", "2", "MTP:2", "mtp:+2"}) {
    Result<int> r = parse_speculative(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find(std::string("`") + bad + "`"), std::string::npos) << r.status().message();
    EXPECT_NE(r.status().message().find("expected mtp:K, K from 1 to 3"), std::string::npos) << r.status().message();
  }
}

// The projection lily bench --mode verify prints: tokens a round (1 - a^(K+1)) / (1 - a), the speed-up against
// plain decoding, and the acceptance that breaks even (docs/BENCHMARKS.md's worked figures).
TEST(SpeculativeProjection, TokensSpeedupAndBreakEven) {
  const SpeculativeProjection one = speculative_projection(1, 0.88, 1.0, 0.1, 1.1);
  EXPECT_NEAR(one.tokens_per_round, 1.88, 1e-12);
  EXPECT_NEAR(one.speedup, 1.88 / 1.2, 1e-12);
  const SpeculativeProjection two = speculative_projection(2, 0.815, 1.0, 0.1, 1.15);
  EXPECT_NEAR(two.tokens_per_round, 1 + 0.815 + 0.815 * 0.815, 1e-12);
  EXPECT_NEAR(two.speedup, two.tokens_per_round / 1.35, 1e-12);
  EXPECT_NEAR(break_even_acceptance(1, 1.0, 0.1, 1.1), 0.2, 1e-9);  // 1 + a = 1.2
  // K = 2, costs 1.35 decode steps: 1 + a + a^2 = 1.35 at a = (sqrt(2.4) - 1) / 2.
  EXPECT_NEAR(break_even_acceptance(2, 1.0, 0.1, 1.15), (std::sqrt(2.4) - 1) / 2, 1e-9);
  // Verification costing 6 decode steps (a forward on a prefill path): not even a = 1 wins with one draft.
  EXPECT_EQ(break_even_acceptance(1, 1.0, 0.1, 6.0), 1.0);
  EXPECT_LT(speculative_projection(1, 1.0, 1.0, 0.1, 6.0).speedup, 1.0);
}

TEST(SpeculativeRule, FixedDrawsFollowTheRatioAndTheResidual) {
  const std::vector<float> p = {0.6f, 0.4f, 0.0f}, q = {0.3f, 0.7f, 0.0f};
  // Draft 0: p/q = 2, always kept.
  EXPECT_TRUE(accept_or_resample(p, q, 0, 0.999, 0.5).accepted);
  // Draft 1: p/q = 4/7 = 0.571: kept below that, else drawn from norm(max(0, p - q)) = token 0 only.
  DraftVerdict keep = accept_or_resample(p, q, 1, 0.57, 0.5);
  EXPECT_TRUE(keep.accepted);
  EXPECT_EQ(keep.token, 1);
  for (double u : {0.572, 0.9}) {
    DraftVerdict v = accept_or_resample(p, q, 1, u, 0.99);
    EXPECT_FALSE(v.accepted) << u;
    EXPECT_EQ(v.token, 0) << "the residual puts all mass on token 0";
  }
  // draw_from walks ascending ids: 0.6 of the mass is token 0.
  EXPECT_EQ(draw_from(p, 0.0), 0);
  EXPECT_EQ(draw_from(p, 0.599), 0);
  EXPECT_EQ(draw_from(p, 0.601), 1);
  EXPECT_EQ(draw_from(p, 0.999999), 1) << "a zero-probability id is never drawn";
}

// Draft x ~ q, then the rule: the emitted token must be distributed as p (whatever q), and drafts are kept
// with probability sum_i min(p_i, q_i). Resampling from p instead of the residual, or accepting with q/p, fails.
TEST(SpeculativeRule, EmittedTokensAreDistributedAsTheTarget) {
  const std::vector<float> p = {0.5f, 0.2f, 0.15f, 0.1f, 0.05f, 0.0f};
  const std::vector<float> q = {0.1f, 0.4f, 0.1f, 0.0f, 0.3f, 0.1f};
  SplitMix64 rng(20240601);
  const int N = 200000;
  std::vector<int> count(p.size(), 0);
  int accepted = 0;
  for (int n = 0; n < N; ++n) {
    const int32_t d = draw_from(q, rng.next_uniform());
    const double u1 = rng.next_uniform(), u2 = rng.next_uniform();
    DraftVerdict v = accept_or_resample(p, q, d, u1, u2);
    ++count[static_cast<size_t>(v.token)];
    accepted += v.accepted;
  }
  for (size_t i = 0; i < p.size(); ++i)
    EXPECT_NEAR(count[i] / double(N), p[i], 0.005) << "token " << i;  // ~4.5 sigma at N = 200,000
  double overlap = 0;
  for (size_t i = 0; i < p.size(); ++i) overlap += std::min(p[i], q[i]);
  EXPECT_NEAR(accepted / double(N), overlap, 0.005);
}

// A plain greedy decode of n tokens after `prompt`: the ids and the logits each came from.
struct Reference {
  std::vector<int32_t> ids;
  std::vector<std::vector<float>> logits;
};
Reference greedy_reference(Backend& backend, const std::vector<int32_t>& prompt, int n) {
  Reference r;
  auto seq = backend.new_sequence();
  std::vector<float> logits;
  EXPECT_TRUE(backend.forward(*seq, prompt, LogitsRows::last, &logits).ok());
  for (int i = 0; i < n; ++i) {
    r.logits.push_back(logits);
    r.ids.push_back(argmax(logits));
    if (i + 1 == n) break;
    EXPECT_TRUE(backend.forward(*seq, std::span<const int32_t>(&r.ids.back(), 1), LogitsRows::last, &logits).ok());
  }
  return r;
}

// Verify [t, d1..dK] where the first j drafts are the true greedy tokens and the rest wrong, keep j+1 rows, and
// decode on: every row and every later step has exactly the plain loop's logits. With and without the MTP head
// enabled (and drafted from, which must not disturb the main state).
TEST(SpeculativeVerify, RejectionAtEveryPositionContinuesExactlyAsWithoutSpeculation) {
  const std::vector<int32_t> prompt = {151644, 872, 198, 9707, 11, 1879};
  const int K = 3, n = K + 8;
  for (bool mtp : {false, true}) {
    auto backend = mtp ? mtp_backend() : tiny_backend();
    const Reference ref = greedy_reference(*backend, prompt, n + 2);
    const int32_t V = backend->config().vocab_size;
    for (int j = 0; j <= K; ++j) {
      SCOPED_TRACE("mtp " + std::to_string(mtp) + ", drafts right: " + std::to_string(j));
      auto seq = backend->new_sequence();
      std::vector<float> logits;
      ASSERT_TRUE(backend->forward(*seq, prompt, LogitsRows::last, &logits).ok());
      ASSERT_EQ(argmax(logits), ref.ids[0]);
      std::vector<int32_t> rows = {ref.ids[0]};
      for (int i = 1; i <= K; ++i) rows.push_back(i <= j ? ref.ids[i] : (ref.ids[i] + 1) % V);
      if (mtp) {
        int32_t t = rows[0];
        for (int i = 0; i < K; ++i) {
          ASSERT_TRUE(backend->mtp_draft(*seq, t, &logits).ok());
          t = argmax(logits);
        }
      }
      std::vector<float> all;
      ASSERT_TRUE(backend->forward_verify(*seq, rows, &all).ok());
      ASSERT_EQ(all.size(), static_cast<size_t>(K + 1) * V);
      for (int i = 0; i <= j; ++i) {  // rows whose inputs are all the true tokens
        std::span<const float> row(all.data() + static_cast<size_t>(i) * V, static_cast<size_t>(V));
        ASSERT_TRUE(std::equal(row.begin(), row.end(), ref.logits[static_cast<size_t>(i) + 1].begin()))
            << "row " << i << " differs from decoding";
      }
      ASSERT_TRUE(backend->accept_verified(*seq, j + 1).ok());
      EXPECT_EQ(seq->n_tokens(), static_cast<int64_t>(prompt.size()) + j + 1);
      for (int s = j + 1; s < n; ++s) {  // decode on from the token row j predicted
        ASSERT_TRUE(backend->forward(*seq, std::span<const int32_t>(&ref.ids[s], 1), LogitsRows::last, &logits).ok());
        ASSERT_EQ(logits, ref.logits[static_cast<size_t>(s) + 1]) << "step " << s;
      }
    }
    // Misuse is an error, not a corrupted state.
    auto seq = backend->new_sequence();
    std::vector<float> all;
    EXPECT_FALSE(backend->accept_verified(*seq, 1).ok());
    ASSERT_TRUE(backend->forward_verify(*seq, prompt, &all).ok());
    EXPECT_FALSE(backend->accept_verified(*seq, 0).ok());
    EXPECT_FALSE(backend->accept_verified(*seq, static_cast<int64_t>(prompt.size()) + 1).ok());
    EXPECT_FALSE(backend->forward(*seq, prompt, LogitsRows::none, nullptr).ok()) << "accept first";
    EXPECT_TRUE(backend->accept_verified(*seq, 2).ok());
    EXPECT_EQ(seq->n_tokens(), 2);
  }
}

// Pieces as the server sees them: token, text, logprob, top.
struct Collected {
  GenerationResult result;
  std::vector<GenerationPiece> pieces;
  std::string text;
};
Collected run_collect(Engine& engine, const GenerationRequest& request, int stop_after = -1) {
  Collected out;
  auto r = engine.generate(request, [&](const GenerationPiece& p) {
    out.pieces.push_back(p);
    out.text += p.text;
    return stop_after < 0 || static_cast<int>(out.pieces.size()) < stop_after;
  });
  EXPECT_TRUE(r.ok()) << r.status().message();
  if (r.ok()) out.result = *r;
  return out;
}

void expect_same(const Collected& plain, const Collected& spec) {
  EXPECT_EQ(spec.result.tokens, plain.result.tokens);
  EXPECT_EQ(spec.result.finish_reason, plain.result.finish_reason);
  EXPECT_EQ(spec.result.stop_string, plain.result.stop_string);
  EXPECT_EQ(spec.result.completion_tokens, plain.result.completion_tokens);
  EXPECT_EQ(spec.text, plain.text);
  ASSERT_EQ(spec.pieces.size(), plain.pieces.size());
  for (size_t i = 0; i < plain.pieces.size(); ++i) {
    EXPECT_EQ(spec.pieces[i].token, plain.pieces[i].token) << i;
    EXPECT_EQ(spec.pieces[i].logprob, plain.pieces[i].logprob) << i;
    ASSERT_EQ(spec.pieces[i].top.size(), plain.pieces[i].top.size()) << i;
    for (size_t j = 0; j < plain.pieces[i].top.size(); ++j) {
      EXPECT_EQ(spec.pieces[i].top[j].id, plain.pieces[i].top[j].id);
      EXPECT_EQ(spec.pieces[i].top[j].logprob, plain.pieces[i].top[j].logprob);
    }
  }
}

TEST(SpeculativeEngine, GreedyOutputIsTokenIdenticalForK1To3) {
  auto plain = tiny_engine();
  std::vector<std::unique_ptr<Engine>> spec;
  for (int k = 1; k <= 3; ++k) spec.push_back(spec_engine(k));
  const std::vector<std::vector<int32_t>> prompts = {
      {151644, 872, 198, 9707, 11, 1879}, {1, 2, 3, 4, 5, 6, 7, 8}, tiny_model().tokenizer.encode("The quick brown fox")};
  for (const auto& prompt : prompts) {
    GenerationRequest req = greedy_request(prompt, 64);
    req.reuse_cache = false;
    Collected a = run_collect(*plain, req);
    ASSERT_EQ(a.result.tokens.size(), 64u);
    for (int k = 1; k <= 3; ++k) {
      SCOPED_TRACE("mtp:" + std::to_string(k));
      Collected b = run_collect(*spec[static_cast<size_t>(k - 1)], req);
      expect_same(a, b);
      EXPECT_GT(b.result.drafted_tokens, 0);
      std::printf("[speculative] mtp:%d, prompt of %zu: %lld drafted, %lld accepted over %lld steps\n", k,
                  prompt.size(), (long long)b.result.drafted_tokens, (long long)b.result.accepted_tokens,
                  (long long)b.result.speculative_steps);
    }
  }
  for (const auto& e : spec) {
    EngineStats st = e->stats();
    EXPECT_GT(st.drafted_tokens, 0u);
    EXPECT_LE(st.accepted_tokens, st.drafted_tokens);
  }
}

// A logit_bias of +100 on one token makes the target and the head agree: every draft is accepted, so stops,
// budgets, logprobs and cancellation land inside accepted runs of drafts.
TEST(SpeculativeEngine, AcceptedDraftsEndWhereThePlainLoopEnds) {
  auto plain = tiny_engine();
  auto spec = spec_engine(3);
  const int32_t x = tiny_model().tokenizer.encode("a").at(0);
  const std::vector<int32_t> prompt = {151644, 872, 198, 9707, 11, 1879};
  auto base = [&](int max_tokens) {
    GenerationRequest r = greedy_request(prompt, max_tokens);
    r.sampling.logit_bias[x] = 100;
    r.reuse_cache = false;
    return r;
  };
  for (int max_tokens : {1, 2, 4, 5, 6, 9}) {
    SCOPED_TRACE("max_tokens " + std::to_string(max_tokens));
    GenerationRequest r = base(max_tokens);
    Collected a = run_collect(*plain, r), b = run_collect(*spec, r);
    expect_same(a, b);
    EXPECT_EQ(b.result.tokens.size(), static_cast<size_t>(max_tokens));
    EXPECT_EQ(b.result.accepted_tokens, b.result.drafted_tokens) << "the biased token is always drafted";
  }
  {
    GenerationRequest r = base(20);  // a stop string inside an accepted run
    r.sampling.stop = {"aaaaa"};
    Collected a = run_collect(*plain, r), b = run_collect(*spec, r);
    expect_same(a, b);
    EXPECT_EQ(b.result.finish_reason, "stop");
    EXPECT_GT(b.result.accepted_tokens, 0);
  }
  {
    GenerationRequest r = base(20);  // the biased token is a stop token, banned for the first 5
    r.stop_token_ids = {x};
    r.sampling.min_tokens = 5;
    Collected a = run_collect(*plain, r), b = run_collect(*spec, r);
    expect_same(a, b);
    EXPECT_EQ(b.result.finish_reason, "stop");
    EXPECT_EQ(b.result.completion_tokens, 6);
  }
  {
    GenerationRequest r = base(20);  // logprobs of accepted drafts are the rows' own
    r.sampling.logprobs = true;
    r.sampling.top_logprobs = 3;
    Collected a = run_collect(*plain, r), b = run_collect(*spec, r);
    expect_same(a, b);
  }
  for (int stop_after : {1, 3, 6}) {  // the client stops listening inside an accepted run
    GenerationRequest r = base(20);
    r.reuse_cache = true;
    Collected a = run_collect(*plain, r, stop_after), b = run_collect(*spec, r, stop_after);
    expect_same(a, b);
    EXPECT_EQ(b.result.finish_reason, "cancelled");
  }
}

// The second turn resumes from the session cache (checkpoint + restore carry the head's state).
TEST(SpeculativeEngine, SecondTurnFromTheSessionCacheMatches) {
  auto plain = tiny_engine();
  auto spec = spec_engine(2);
  const int32_t im_start = tiny_model().tokenizer.token_id("<|im_start|>");
  std::vector<int32_t> prompt = {im_start, 872, 198, 9707, 11, 1879, im_start, 77091, 198};
  Collected a1 = run_collect(*plain, greedy_request(prompt, 12)), b1 = run_collect(*spec, greedy_request(prompt, 12));
  expect_same(a1, b1);
  prompt.insert(prompt.end(), a1.result.tokens.begin(), a1.result.tokens.end());
  for (int32_t t : {im_start, 872, 198, 3838, im_start, 77091, 198}) prompt.push_back(t);
  Collected a2 = run_collect(*plain, greedy_request(prompt, 24)), b2 = run_collect(*spec, greedy_request(prompt, 24));
  EXPECT_GT(b2.result.cached_tokens, 0);
  EXPECT_EQ(b2.result.cached_tokens, a2.result.cached_tokens);
  expect_same(a2, b2);
}

// Two tokens biased far above the rest: p and q are both close to a mixture of the two, so drafts are often
// accepted and often rejected, and every emitted token must be one of them.
TEST(SpeculativeEngine, SeededSamplingIsReproducibleAndStaysInTheSupport) {
  auto spec = spec_engine(2);
  const int32_t x = tiny_model().tokenizer.encode("a").at(0), y = tiny_model().tokenizer.encode("b").at(0);
  GenerationRequest r;
  r.prompt = {151644, 872, 198, 9707, 11, 1879};
  r.sampling.temperature = 2.0f;
  r.sampling.logit_bias = {{x, 100.0f}, {y, 100.0f}};
  r.sampling.seed = 42;
  r.sampling.max_tokens = 40;
  r.reuse_cache = false;
  Collected a = run_collect(*spec, r), b = run_collect(*spec, r);
  EXPECT_EQ(a.result.tokens, b.result.tokens);
  ASSERT_EQ(a.result.tokens.size(), 40u);
  for (int32_t t : a.result.tokens) EXPECT_TRUE(t == x || t == y) << t;
  EXPECT_GT(a.result.accepted_tokens, 0);
  EXPECT_LT(a.result.accepted_tokens, a.result.drafted_tokens);
  std::printf("[speculative] sampling on two biased tokens: %lld of %lld drafts accepted\n",
              (long long)a.result.accepted_tokens, (long long)a.result.drafted_tokens);
  r.sampling.seed = 43;
  Collected c = run_collect(*spec, r);
  EXPECT_NE(c.result.tokens, a.result.tokens);
}

// The scheduler's path: run_alone handing the thread back at every chance (between rounds), then called again.
// The loop resumes from the request's history, sampler and RNG, so the tokens are those of one uninterrupted run.
GenerationResult stepped(Engine& engine, const GenerationRequest& request) {
  auto g = engine.begin(request, nullptr);
  EXPECT_TRUE(g.ok()) << g.status().message();
  if (!g.ok()) return {};
  while ((*g)->prefilling()) engine.prefill_step(**g);
  while (!(*g)->done()) engine.run_alone(**g, [] { return true; });
  auto r = engine.finish(std::move(*g));
  EXPECT_TRUE(r.ok()) << r.status().message();
  return r.ok() ? *r : GenerationResult{};
}

TEST(SpeculativeEngine, RunAloneResumedAfterEveryRoundMatchesOneRun) {
  auto spec = spec_engine(3);
  const int32_t x = tiny_model().tokenizer.encode("a").at(0), y = tiny_model().tokenizer.encode("b").at(0);
  GenerationRequest greedy = greedy_request({151644, 872, 198, 9707, 11, 1879}, 20);
  greedy.reuse_cache = false;
  GenerationRequest biased = greedy;
  biased.sampling.logit_bias[x] = 100;
  GenerationRequest sampled = greedy;
  sampled.sampling.temperature = 2.0f;
  sampled.sampling.logit_bias = {{x, 100.0f}, {y, 100.0f}};
  sampled.sampling.seed = 7;
  for (const GenerationRequest* r : {&greedy, &biased, &sampled}) {
    GenerationResult one = run(*spec, *r), many = stepped(*spec, *r);
    EXPECT_EQ(many.tokens, one.tokens);
    EXPECT_EQ(many.finish_reason, one.finish_reason);
    EXPECT_EQ(many.tokens.size(), 20u);
  }
}

// Backend::argmax_of_row: Sampler's greedy choice (the first maximum), and a clear error where there is none.
TEST(SpeculativeArgmax, FirstMaximumAndErrors) {
  const float inf = INFINITY, nan = NAN;
  EXPECT_EQ(*argmax_of_row(std::vector<float>{1, 3, 3, 2}), 1);
  EXPECT_EQ(*argmax_of_row(std::vector<float>{-inf, -5, -inf}), 1);
  for (const std::vector<float>& bad : {std::vector<float>{1, nan, 2}, std::vector<float>{-inf, -inf},
                                        std::vector<float>{inf, 0}, std::vector<float>{}}) {  // as Sampler
    Result<int32_t> r = argmax_of_row(bad);
    EXPECT_FALSE(r.ok());
  }
  EXPECT_NE(argmax_of_row(std::vector<float>{1, nan}).status().message().find("logit 1 is NaN"), std::string::npos);
}

// The CPU backend with the MTP head, counting the speculative calls, optionally biasing one token in every row it
// returns (so that the head's drafts are accepted) and answering the argmax calls itself (use_argmax: from the
// same biased rows, as a backend that searches where its logits are) or by Backend's defaults (which call its
// logits calls).
class CountingMtpBackend final : public Backend {
 public:
  CountingMtpBackend() : cpu_(mtp_backend()) {}
  const char* name() const override { return "cpu-counting"; }
  const ModelConfig& config() const override { return cpu_->config(); }
  std::unique_ptr<SequenceState> new_sequence() override { return cpu_->new_sequence(); }
  bool has_mtp() const override { return true; }
  Status forward(SequenceState& seq, std::span<const int32_t> tokens, LogitsRows rows,
                 std::vector<float>* logits) override {
    RETURN_IF_ERROR(cpu_->forward(seq, tokens, rows, logits));
    if (logits) bias(*logits);
    return ok_status();
  }
  Status mtp_draft(SequenceState& seq, int32_t token, std::vector<float>* logits) override {
    ++logits_calls;
    return draft(seq, token, logits);
  }
  Status forward_verify(SequenceState& seq, std::span<const int32_t> tokens, std::vector<float>* logits) override {
    ++logits_calls;
    return verify(seq, tokens, logits);
  }
  Status accept_verified(SequenceState& seq, int64_t n_keep) override { return cpu_->accept_verified(seq, n_keep); }
  Status mtp_draft_argmax(SequenceState& seq, int32_t token, int32_t* id) override {
    if (!use_argmax) return Backend::mtp_draft_argmax(seq, token, id);
    ++argmax_calls;
    std::vector<float> logits;
    RETURN_IF_ERROR(draft(seq, token, &logits));
    ASSIGN_OR_RETURN(*id, argmax_of_row(logits));
    return ok_status();
  }
  Status forward_verify_argmax(SequenceState& seq, std::span<const int32_t> tokens,
                               std::vector<int32_t>* ids) override {
    if (!use_argmax) return Backend::forward_verify_argmax(seq, tokens, ids);
    ++argmax_calls;
    std::vector<float> logits;
    RETURN_IF_ERROR(verify(seq, tokens, &logits));
    const size_t V = static_cast<size_t>(config().vocab_size);
    ids->resize(tokens.size());
    for (size_t r = 0; r < tokens.size(); ++r) {
      ASSIGN_OR_RETURN((*ids)[r], argmax_of_row(std::span<const float>(logits.data() + r * V, V)));
    }
    return ok_status();
  }
  bool use_argmax = true;
  int32_t biased = -1;
  int logits_calls = 0, argmax_calls = 0;

 private:
  void bias(std::vector<float>& logits) const {
    const size_t V = static_cast<size_t>(config().vocab_size);
    if (biased >= 0)
      for (size_t i = static_cast<size_t>(biased); i < logits.size(); i += V) logits[i] += 100.0f;
  }
  Status draft(SequenceState& seq, int32_t token, std::vector<float>* logits) {
    RETURN_IF_ERROR(cpu_->mtp_draft(seq, token, logits));
    bias(*logits);
    return ok_status();
  }
  Status verify(SequenceState& seq, std::span<const int32_t> tokens, std::vector<float>* logits) {
    RETURN_IF_ERROR(cpu_->forward_verify(seq, tokens, logits));
    bias(*logits);
    return ok_status();
  }
  std::unique_ptr<Backend> cpu_;
};

struct LoopRun {
  std::vector<int32_t> tokens;
  SpeculativeCounts counts;
  int logits_calls = 0, argmax_calls = 0;
};

LoopRun run_loop(bool use_argmax, int32_t biased, int k, const SamplingParams& params,
                 std::span<const int32_t> stops) {
  CountingMtpBackend b;
  b.use_argmax = use_argmax, b.biased = biased;
  const std::vector<int32_t> prompt = {151644, 872, 198, 9707, 11, 1879};
  auto seq = b.new_sequence();
  EXPECT_TRUE(b.forward(*seq, std::span<const int32_t>(prompt.data(), prompt.size() - 1), LogitsRows::none,
                        nullptr).ok());
  std::vector<int32_t> history = prompt;
  SpeculativeRequest r{&history, prompt.size(), stops, 0, 24, k, {}};
  Sampler target(params);
  SplitMix64 rng(speculative_seed(target.seed()));
  LoopRun out;
  Status st = speculative_decode(b, *seq, target, rng, r,
                                 [&](int32_t id, float, std::vector<TokenLogprob>) {
                                   history.push_back(id);
                                   out.tokens.push_back(id);
                                   // the engine's sink ends at a stop token and at the budget
                                   return !std::count(stops.begin(), stops.end(), id) &&
                                          static_cast<int64_t>(out.tokens.size()) < r.budget;
                                 },
                                 out.counts);
  EXPECT_TRUE(st.ok()) << st.message();
  out.logits_calls = b.logits_calls, out.argmax_calls = b.argmax_calls;
  return out;
}

// Plain greedy rounds (no bias, penalties or logprobs; min_tokens reached) take the argmax calls, with the same
// tokens and acceptances as the logits path, also inside accepted runs (a biased token) and with min_tokens
// (its first rounds need the logits for the stop-token ban).
TEST(SpeculativeLoop, PlainGreedyRoundsTakeTheArgmaxCallsWithTheSameTokens) {
  const int32_t x = tiny_model().tokenizer.encode("a").at(0);
  for (int k = 1; k <= 3; ++k) {
    for (int32_t biased : {-1, x}) {
      for (int min_tokens : {0, 5}) {
        SCOPED_TRACE("k " + std::to_string(k) + " biased " + std::to_string(biased) + " min_tokens " +
                     std::to_string(min_tokens));
        SamplingParams p;
        p.temperature = 0.0f;
        p.min_tokens = min_tokens;
        const std::vector<int32_t> stops = min_tokens > 0 && biased >= 0 ? std::vector<int32_t>{x}
                                                                          : std::vector<int32_t>{};
        const LoopRun a = run_loop(false, biased, k, p, stops), b = run_loop(true, biased, k, p, stops);
        EXPECT_EQ(b.tokens, a.tokens);
        EXPECT_EQ(b.counts.steps, a.counts.steps);
        EXPECT_EQ(b.counts.accepted, a.counts.accepted);
        EXPECT_EQ(a.argmax_calls, 0);
        EXPECT_GT(b.argmax_calls, 0);
        if (min_tokens == 0) {
          EXPECT_EQ(b.logits_calls, 0) << "no logits to the host in plain greedy rounds";
        } else {
          EXPECT_GT(b.logits_calls, 0) << "the ban of min_tokens needs the logits";
        }
        if (biased >= 0) {
          EXPECT_GT(b.counts.accepted, 0);
        }
        if (!stops.empty()) {
          EXPECT_EQ(b.tokens.size(), static_cast<size_t>(min_tokens) + 1);
        }
      }
    }
  }
  SamplingParams p;  // anything done to the logits keeps the logits path
  p.temperature = 0.0f;
  p.logit_bias[x] = 1.0f;
  EXPECT_EQ(run_loop(true, -1, 2, p, {}).argmax_calls, 0);
  p.logit_bias.clear();
  p.logprobs = true;
  EXPECT_EQ(run_loop(true, -1, 2, p, {}).argmax_calls, 0);
  p.logprobs = false;
  p.repetition_penalty = 1.1f;
  EXPECT_EQ(run_loop(true, -1, 2, p, {}).argmax_calls, 0);
}

TEST(SpeculativeErrors, ACheckpointWithoutTheHeadIsRefusedClearly) {
  const fs::path dir = tiny_model().dir / "no_mtp";
  SynthOptions o;
  o.preset = "tiny";
  o.out_dir = dir.string();
  o.mtp = false;
  ASSERT_TRUE(synth_write(o).ok());
  auto w = ModelWeights::load(dir.string());
  ASSERT_TRUE(w.ok()) << w.status().message();
  EXPECT_FALSE(w->mtp.has_value());
  CpuBackend backend(std::make_shared<const ModelWeights>(std::move(*w)));
  EXPECT_FALSE(backend.has_mtp());
  Status st = backend.enable_mtp();
  EXPECT_EQ(st.code(), ErrorCode::not_found);
  EXPECT_NE(st.message().find("no multi-token-prediction head"), std::string::npos) << st.message();
  auto seq = backend.new_sequence();
  std::vector<float> logits;
  EXPECT_FALSE(backend.mtp_draft(*seq, 1, &logits).ok());

  ModelLoadOptions lo;
  lo.model_dir = dir.string();
  lo.backend.kind = BackendKind::cpu;
  lo.engine.speculative_tokens = 2;
  Result<LoadedModel> m = load_model(lo);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("--speculative mtp:2"), std::string::npos) << m.status().message();
  EXPECT_NE(m.status().message().find("--mtp-from"), std::string::npos) << m.status().message();
  // The head from the full checkpoint beside it fixes that.
  auto w2 = ModelWeights::load(dir.string());
  ASSERT_TRUE(w2.ok());
  ASSERT_TRUE(w2->attach_mtp(tiny_model().dir.string()).ok());
  EXPECT_TRUE(w2->mtp.has_value());
  Status again = w2->attach_mtp(tiny_model().dir.string());
  EXPECT_FALSE(again.ok()) << "a second head";
}

TEST(SpeculativeCli, GenerateTakesTheFlagAndRefusesBadValues) {
  const std::string bin = lily_binary();
  if (bin.empty()) GTEST_SKIP() << "no lily binary (set LILY_BIN)";
  const fs::path out = tiny_model().dir / "cli_spec";
  fs::create_directories(out);
  const std::string gen = bin + " generate --model " + tiny_model().dir.string() +
                          " --backend cpu --threads 2 --prompt-ids 151644,872,198,9707 --max-tokens 20";
  ASSERT_EQ(std::system((gen + " > " + (out / "plain").string() + " 2>/dev/null").c_str()), 0);
  for (const char* k : {"mtp:1", "mtp:3"}) {
    const fs::path o = out / k, e = out / (std::string(k) + ".err");
    ASSERT_EQ(std::system((gen + " --speculative " + k + " > " + o.string() + " 2> " + e.string()).c_str()), 0);
    EXPECT_EQ(slurp(o), slurp(out / "plain")) << k;
    EXPECT_NE(slurp(e).find(std::string("speculative ") + k + ": "), std::string::npos) << slurp(e);
    EXPECT_NE(slurp(e).find("accepted"), std::string::npos) << slurp(e);
  }
  // The verification cost table on the same model (a tiny context, one call each).
  const fs::path table = out / "verify_table";
  ASSERT_EQ(std::system((bin + " bench --mode verify --model " + tiny_model().dir.string() +
                         " --backend cpu --threads 2 --contexts 16 --rows 1,3 --reps 1 > " + table.string() + " 2>&1")
                            .c_str()),
            0)
      << slurp(table);
  for (const char* row : {"decode", "verify 1", "verify 3", "verify 3 argmax", "mtp draft", "mtp draft argmax",
                          "projection, greedy", "measured draft", "break-even"})
    EXPECT_NE(slurp(table).find(row), std::string::npos) << row << " in\n" << slurp(table);
  for (const char* bad : {"mtp:0", "mtp:9", "medusa"}) {
    const fs::path e = out / "bad.err";
    ASSERT_NE(std::system((gen + " --speculative " + bad + " > /dev/null 2> " + e.string()).c_str()), 0) << bad;
    EXPECT_NE(slurp(e).find("expected mtp:K"), std::string::npos) << slurp(e);
  }
}

}  // namespace
}  // namespace lily::test
