// The engine's step calls as the server's scheduler makes them (several requests at once: prefill pieces
// between batched decode steps): every request's tokens, text, logprobs and finish are exactly those it gets
// alone through generate(), greedy and seeded, whatever it runs beside and whenever it joins; cancelling one
// leaves the others alone. Also the CPU backend's forward_batch: rows equal lone forwards, bad input consumes
// nothing.
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "test_engine_util.h"

namespace lily::test {
namespace {

std::vector<int32_t> prompt_of(int n, int salt) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back(700 + 211 * salt + 17 * i);
  return p;
}

struct Outcome {
  GenerationResult result;
  std::string text;
  std::vector<float> logprobs;
  std::vector<std::vector<TokenLogprob>> top;
};

void expect_same(const Outcome& a, const Outcome& b, size_t i) {
  EXPECT_EQ(a.result.tokens, b.result.tokens) << "request " << i;
  EXPECT_EQ(a.text, b.text) << "request " << i;
  EXPECT_EQ(a.result.finish_reason, b.result.finish_reason) << "request " << i;
  EXPECT_EQ(a.result.stop_string, b.result.stop_string) << "request " << i;
  EXPECT_EQ(a.result.completion_tokens, b.result.completion_tokens) << "request " << i;
  ASSERT_EQ(a.logprobs.size(), b.logprobs.size()) << "request " << i;
  for (size_t t = 0; t < a.logprobs.size(); ++t) {
    EXPECT_EQ(a.logprobs[t], b.logprobs[t]) << "request " << i << " token " << t;  // bit for bit
    ASSERT_EQ(a.top[t].size(), b.top[t].size());
    for (size_t k = 0; k < a.top[t].size(); ++k) {
      EXPECT_EQ(a.top[t][k].id, b.top[t][k].id);
      EXPECT_EQ(a.top[t][k].logprob, b.top[t][k].logprob);
    }
  }
}

std::function<bool(const GenerationPiece&)> collect(Outcome& o) {
  return [&o](const GenerationPiece& p) {
    o.text += p.text;
    if (p.token >= 0) {
      o.logprobs.push_back(p.logprob);
      o.top.push_back(p.top);
    }
    return true;
  };
}

Outcome alone(Engine& engine, const GenerationRequest& request) {
  Outcome o;
  auto r = engine.generate(request, collect(o));
  EXPECT_TRUE(r.ok()) << r.status().message();
  if (r.ok()) o.result = *r;
  return o;
}

// Request i begins at step joins[i]; each step gives one prefilling generation (round-robin) one piece and
// decodes every generation past its prompt in one decode_step, as src/server/scheduler.cpp does.
// on_step(outcomes so far) is called before each step (to cancel one, say).
std::vector<Outcome> together(Engine& engine, const std::vector<GenerationRequest>& requests,
                              const std::vector<int>& joins,
                              const std::function<void(const std::vector<Outcome>&)>& on_step = {}) {
  std::vector<Outcome> out(requests.size());
  std::vector<std::unique_ptr<Generation>> gens(requests.size());
  std::vector<bool> finished(requests.size(), false);
  size_t turn = 0;
  for (int step = 0;; ++step) {
    bool any = false;
    for (size_t i = 0; i < requests.size(); ++i) {
      if (joins[i] == step) {
        auto g = engine.begin(requests[i], collect(out[i]));
        EXPECT_TRUE(g.ok()) << g.status().message();
        gens[i] = std::move(*g);
      }
      any = any || !finished[i];
    }
    if (!any) break;
    if (on_step) on_step(out);
    std::vector<size_t> prefilling;
    std::vector<Generation*> decoding;
    for (size_t i = 0; i < requests.size(); ++i) {
      if (!gens[i] || finished[i] || gens[i]->done()) continue;
      if (gens[i]->prefilling())
        prefilling.push_back(i);
      else
        decoding.push_back(gens[i].get());
    }
    if (!prefilling.empty()) engine.prefill_step(*gens[prefilling[turn++ % prefilling.size()]]);
    if (!decoding.empty()) engine.decode_step(decoding);
    for (size_t i = 0; i < requests.size(); ++i) {
      if (gens[i] && !finished[i] && gens[i]->done()) {
        auto r = engine.finish(std::move(gens[i]));
        EXPECT_TRUE(r.ok()) << r.status().message();
        if (r.ok()) out[i].result = *r;
        finished[i] = true;
      }
    }
  }
  return out;
}

// Different prompts, budgets, penalties and stops. No two prompts share a prefix: a request that resumes
// from another's cached entry prefills in other pieces, which may move its logits by rounding (alone or not).
std::vector<GenerationRequest> mixed_requests(bool sampled) {
  std::vector<GenerationRequest> reqs;
  const int max_tokens[] = {9, 3, 12, 6, 1};
  for (int i = 0; i < 5; ++i) {
    GenerationRequest r = greedy_request(prompt_of(6 + 5 * i, i), max_tokens[i]);
    r.sampling.logprobs = true;
    r.sampling.top_logprobs = 2;
    if (sampled) {
      r.sampling.temperature = 0.9f;
      r.sampling.top_p = 0.95f;
      r.sampling.top_k = 50;
      r.sampling.seed = 100 + i;
    }
    reqs.push_back(std::move(r));
  }
  reqs[3].sampling.min_tokens = 2;
  reqs[2].sampling.presence_penalty = 0.5f;
  return reqs;
}

EngineOptions small_pieces() {
  EngineOptions o;
  o.prefill_chunk = 4;  // several pieces per prompt, so prompts and decoding interleave
  return o;
}

TEST(EngineBatch, GreedyRequestsTogetherEqualEachAlone) {
  auto reference = tiny_engine(small_pieces());
  auto engine = tiny_engine(small_pieces());
  std::vector<GenerationRequest> reqs = mixed_requests(false);
  std::vector<Outcome> expected;
  for (const auto& r : reqs) expected.push_back(alone(*reference, r));
  std::vector<Outcome> got = together(*engine, reqs, {0, 0, 0, 0, 0});
  for (size_t i = 0; i < reqs.size(); ++i) expect_same(got[i], expected[i], i);
  // Joining at different steps, some while others decode.
  got = together(*engine, reqs, {0, 3, 3, 7, 12});
  for (size_t i = 0; i < reqs.size(); ++i) expect_same(got[i], expected[i], i);
}

TEST(EngineBatch, SeededRequestsTogetherEqualEachAlone) {
  auto reference = tiny_engine(small_pieces());
  auto engine = tiny_engine(small_pieces());
  std::vector<GenerationRequest> reqs = mixed_requests(true);
  std::vector<Outcome> expected;
  for (const auto& r : reqs) expected.push_back(alone(*reference, r));
  EXPECT_NE(expected[0].result.tokens, alone(*reference, greedy_request(reqs[0].prompt, 9)).result.tokens);
  std::vector<Outcome> got = together(*engine, reqs, {0, 1, 2, 3, 4});
  for (size_t i = 0; i < reqs.size(); ++i) expect_same(got[i], expected[i], i);
}

TEST(EngineBatch, StopStringsAndStopTokensEndOneRowOnly) {
  auto reference = tiny_engine(small_pieces());
  auto engine = tiny_engine(small_pieces());
  std::vector<GenerationRequest> reqs = mixed_requests(false);
  Outcome full = alone(*reference, reqs[2]);
  ASSERT_GE(full.result.tokens.size(), 6u);
  reqs[0].stop_token_ids = {alone(*reference, reqs[0]).result.tokens[3]};
  reqs[2].sampling.stop = {full.text.substr(full.text.size() / 2, 2)};
  std::vector<Outcome> expected;
  for (const auto& r : reqs) expected.push_back(alone(*reference, r));
  EXPECT_EQ(expected[0].result.finish_reason, "stop");
  EXPECT_EQ(expected[2].result.finish_reason, "stop");
  std::vector<Outcome> got = together(*engine, reqs, {0, 0, 0, 1, 1});
  for (size_t i = 0; i < reqs.size(); ++i) expect_same(got[i], expected[i], i);
}

TEST(EngineBatch, CancellingOneLeavesTheOthersAlone) {
  auto reference = tiny_engine(small_pieces());
  auto engine = tiny_engine(small_pieces());
  std::vector<GenerationRequest> reqs = mixed_requests(false);
  std::vector<Outcome> expected;
  for (const auto& r : reqs) expected.push_back(alone(*reference, r));
  std::atomic<bool> cancel{false};
  reqs[2].cancel = &cancel;
  std::vector<Outcome> got =
      together(*engine, reqs, {0, 0, 0, 0, 0}, [&](const std::vector<Outcome>& so_far) {
        if (so_far[2].logprobs.size() == 3) cancel.store(true);
      });
  EXPECT_EQ(got[2].result.finish_reason, "cancelled");
  EXPECT_LT(got[2].result.tokens.size(), expected[2].result.tokens.size());
  EXPECT_EQ(got[2].result.tokens.size(), 3u);  // cancelled before its next step
  for (size_t t = 0; t < got[2].result.tokens.size(); ++t)
    EXPECT_EQ(got[2].result.tokens[t], expected[2].result.tokens[t]);
  for (size_t i : {0, 1, 3, 4}) expect_same(got[i], expected[i], i);
}

// A generation begun alone on the single-request path, which makes way after a few tokens (as the scheduler
// asks when another request arrives) and continues in batched steps, then alone again.
TEST(EngineBatch, RunAloneYieldsAndResumesWithTheSameTokens) {
  auto reference = tiny_engine(small_pieces());
  auto engine = tiny_engine(small_pieces());
  std::vector<GenerationRequest> reqs = mixed_requests(true);
  const Outcome a_alone = alone(*reference, reqs[2]), b_alone = alone(*reference, reqs[1]);
  Outcome a, b;
  auto ga = engine->begin(reqs[2], collect(a));
  ASSERT_TRUE(ga.ok());
  while ((*ga)->prefilling()) engine->prefill_step(**ga);
  int tokens = 0;
  engine->run_alone(**ga, [&] { return ++tokens == 4; });
  EXPECT_FALSE((*ga)->done());
  auto gb = engine->begin(reqs[1], collect(b));
  ASSERT_TRUE(gb.ok());
  while ((*gb)->prefilling()) {
    engine->prefill_step(**gb);
    Generation* one[] = {ga->get()};
    engine->decode_step(one);
  }
  while (!(*gb)->done()) {
    Generation* both[] = {ga->get(), gb->get()};
    engine->decode_step(both);
  }
  auto rb = engine->finish(std::move(*gb));
  ASSERT_TRUE(rb.ok());
  b.result = *rb;
  engine->run_alone(**ga, [] { return false; });
  auto ra = engine->finish(std::move(*ga));
  ASSERT_TRUE(ra.ok());
  a.result = *ra;
  expect_same(a, a_alone, 0);
  expect_same(b, b_alone, 1);
}

TEST(CpuForwardBatch, RowsEqualLoneForwardsAndBadInputConsumesNothing) {
  auto backend = tiny_backend();
  const size_t V = static_cast<size_t>(backend->config().vocab_size);
  std::vector<std::unique_ptr<SequenceState>> seqs, lone;
  for (int i = 0; i < 3; ++i) {
    for (auto* v : {&seqs, &lone}) {
      v->push_back(backend->new_sequence());
      ASSERT_TRUE(backend->forward(*v->back(), prompt_of(3 + i, i), LogitsRows::none, nullptr).ok());
    }
  }
  std::vector<SequenceState*> rows = {seqs[0].get(), seqs[1].get(), seqs[2].get()};
  const std::vector<int32_t> tokens = {11, 22, 33};
  std::vector<float> logits, one;
  ASSERT_TRUE(backend->forward_batch(rows, tokens, &logits).ok());
  ASSERT_EQ(logits.size(), 3 * V);
  for (size_t i = 0; i < 3; ++i) {
    ASSERT_TRUE(
        backend->forward(*lone[i], std::span<const int32_t>(&tokens[i], 1), LogitsRows::last, &one).ok());
    EXPECT_EQ(std::vector<float>(logits.begin() + i * V, logits.begin() + (i + 1) * V), one) << "row " << i;
  }
  const int64_t n0 = seqs[0]->n_tokens();
  const std::vector<int32_t> bad = {11, static_cast<int32_t>(V), 33};
  Status st = backend->forward_batch(rows, bad, &logits);
  EXPECT_EQ(st.code(), ErrorCode::invalid_argument);
  EXPECT_NE(st.message().find("row 1"), std::string::npos) << st.message();
  EXPECT_EQ(seqs[0]->n_tokens(), n0);  // checked before any row ran
  std::vector<SequenceState*> twice = {seqs[0].get(), seqs[0].get()};
  EXPECT_EQ(backend->forward_batch(twice, std::vector<int32_t>{1, 2}, &logits).code(),
            ErrorCode::invalid_argument);
  EXPECT_EQ(backend->forward_batch(rows, std::vector<int32_t>{1}, &logits).code(),
            ErrorCode::invalid_argument);
  EXPECT_EQ(seqs[0]->n_tokens(), n0);
}

}  // namespace
}  // namespace lily::test
