// Engine::generate on the tiny synthetic model (CPU backend): greedy against a hand-written forward/argmax
// loop, seeded sampling, stop tokens, max_tokens, stop strings, cancellation, the context limit, bad
// requests.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>

#include "test_engine_util.h"

namespace lily::test {
namespace {

std::vector<int32_t> text_prompt(const std::string& text) {
  return tiny_model().tokenizer.encode(text);
}

// Prompt forwarded at once, then argmax -> forward one token at a time.
std::vector<int32_t> manual_greedy(const std::vector<int32_t>& prompt, int n) {
  auto backend = tiny_backend();
  auto seq = backend->new_sequence();
  std::vector<float> logits;
  EXPECT_TRUE(backend->forward(*seq, prompt, LogitsRows::last, &logits).ok());
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) {
    int32_t next = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    out.push_back(next);
    EXPECT_TRUE(backend->forward(*seq, std::span<const int32_t>(&next, 1), LogitsRows::last, &logits).ok());
  }
  return out;
}

TEST(Engine, GreedyEqualsManualForwardArgmaxLoop) {
  auto engine = tiny_engine();
  auto prompt = text_prompt("The quick brown fox jumps over the lazy dog. Then it");
  std::string text;
  GenerationResult r = run(*engine, greedy_request(prompt, 12), &text);
  EXPECT_EQ(r.tokens, manual_greedy(prompt, 12));
  EXPECT_EQ(r.finish_reason, "length");
  EXPECT_EQ(r.prompt_tokens, static_cast<int>(prompt.size()));
  EXPECT_EQ(r.completion_tokens, 12);
  EXPECT_EQ(r.cached_tokens, 0);
  EXPECT_EQ(text, tiny_model().tokenizer.decode(r.tokens));
  EXPECT_GT(r.prefill_ms, 0);
  EXPECT_GT(r.decode_ms, 0);
  EXPECT_GE(r.time_to_first_token_ms, r.prefill_ms);
}

TEST(Engine, SameSeedSameTokensOtherSeedOtherTokens) {
  auto engine = tiny_engine();
  GenerationRequest req;
  req.prompt = text_prompt("Once upon a time");
  req.sampling.temperature = 1.0f;
  req.sampling.top_p = 0.95f;
  req.sampling.max_tokens = 16;
  req.sampling.seed = 42;
  GenerationResult a = run(*engine, req);
  GenerationResult b = run(*engine, req);  // the second resumes from the session cache
  EXPECT_GT(b.cached_tokens, 0);
  EXPECT_EQ(a.tokens, b.tokens);
  req.reuse_cache = false;
  EXPECT_EQ(run(*engine, req).tokens, a.tokens);
  req.sampling.seed = 43;
  EXPECT_NE(run(*engine, req).tokens, a.tokens);
  ASSERT_EQ(a.tokens.size(), 16u);
  EXPECT_NE(a.tokens, manual_greedy(req.prompt, 16));  // it did sample
}

TEST(Engine, StopTokenEndsWithStopAndIsExcluded) {
  auto engine = tiny_engine();
  auto prompt = text_prompt("Counting: one, two, three,");
  GenerationResult full = run(*engine, greedy_request(prompt, 10));
  ASSERT_EQ(full.tokens.size(), 10u);
  size_t k = 3;  // the first position >= 3 whose token did not occur before
  while (k < full.tokens.size() &&
         std::find(full.tokens.begin(), full.tokens.begin() + k, full.tokens[k]) != full.tokens.begin() + k)
    ++k;
  ASSERT_LT(k, full.tokens.size());
  GenerationRequest req = greedy_request(prompt, 10);
  req.stop_token_ids = {7, full.tokens[k]};
  GenerationResult r = run(*engine, req);
  EXPECT_EQ(r.finish_reason, "stop");
  EXPECT_EQ(r.tokens, std::vector<int32_t>(full.tokens.begin(), full.tokens.begin() + k));
  EXPECT_EQ(r.completion_tokens, static_cast<int>(k) + 1);
}

// min_tokens bans the stop tokens until that many tokens were made: the greedy run that would stop at the
// k-th token goes on with the next best one, and stops at a stop token only from token min_tokens + 1 on.
TEST(Engine, MinTokensSuppressesStopTokensUntilReached) {
  auto engine = tiny_engine();
  auto prompt = text_prompt("Counting: one, two, three,");
  GenerationResult full = run(*engine, greedy_request(prompt, 8));
  ASSERT_EQ(full.tokens.size(), 8u);
  GenerationRequest req = greedy_request(prompt, 8);
  req.stop_token_ids = {full.tokens[0]};  // greedy would stop at once
  GenerationResult stopped = run(*engine, req);
  EXPECT_EQ(stopped.finish_reason, "stop");
  EXPECT_TRUE(stopped.tokens.empty());
  req.sampling.min_tokens = 4;
  GenerationResult r = run(*engine, req);
  ASSERT_GE(r.tokens.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_NE(r.tokens[i], full.tokens[0]) << "token " << i;
  EXPECT_TRUE(r.finish_reason == "stop" || r.tokens.size() == 8u) << r.finish_reason;
  // Validation: min_tokens beyond max_tokens is refused.
  req.sampling.min_tokens = 9;
  EXPECT_FALSE(engine->generate(req, nullptr).ok());
}

// include_stop_str_in_output keeps the matched stop string at the end of the text; the stop is reported.
TEST(Engine, IncludeStopStringKeepsItAndReportsWhichMatched) {
  auto engine = tiny_engine();
  auto prompt = text_prompt("Hello, my name is");
  const Tokenizer& tok = tiny_model().tokenizer;
  GenerationResult full = run(*engine, greedy_request(prompt, 12));
  const std::string all = tok.decode(full.tokens);
  ASSERT_GT(all.size(), 6u);
  const std::string stop = all.substr(3, 2);
  GenerationRequest req = greedy_request(prompt, 12);
  req.sampling.stop = {"never-there", stop};
  req.sampling.include_stop_str_in_output = true;
  std::string text;
  GenerationResult r = engine
                           ->generate(req,
                                      [&](const GenerationPiece& p) {
                                        text += p.text;
                                        return true;
                                      })
                           .value();
  EXPECT_EQ(r.finish_reason, "stop");
  EXPECT_EQ(r.stop_string, stop);
  EXPECT_EQ(text, all.substr(0, all.find(stop) + stop.size()));
}

TEST(Engine, MaxTokensAndContextLimitEndWithLength) {
  EngineOptions o;
  o.max_context = 20;
  auto engine = tiny_engine(o);
  auto prompt = text_prompt("A short prompt of a few tokens");
  ASSERT_LT(prompt.size(), 15u);
  GenerationResult r = run(*engine, greedy_request(prompt, 3));
  EXPECT_EQ(r.tokens.size(), 3u);
  EXPECT_EQ(r.finish_reason, "length");
  // No max_tokens: generation stops when the sequence holds max_context tokens (the last one sampled only).
  r = run(*engine, greedy_request(prompt, -1));
  EXPECT_EQ(r.finish_reason, "length");
  EXPECT_EQ(r.tokens.size(), 20 - prompt.size() + 1);
  // A prompt longer than the context is refused with a clear error.
  std::vector<int32_t> long_prompt(21, 100);
  auto bad = engine->generate(greedy_request(long_prompt, 1), nullptr);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), ErrorCode::out_of_range);
  EXPECT_NE(bad.status().message().find("21 tokens"), std::string::npos) << bad.status().message();
}

TEST(Engine, StopStringSplitOverTokensIsNeverEmitted) {
  auto engine = tiny_engine();
  auto prompt = text_prompt("Hello, my name is");
  GenerationResult full = run(*engine, greedy_request(prompt, 12));
  ASSERT_EQ(full.tokens.size(), 12u);
  // The stop string: the last byte of one token's text and the first of the next one's (ASCII bytes, so it
  // spans a token boundary); the first such boundary after token 2.
  const Tokenizer& tok = tiny_model().tokenizer;
  const std::string all = tok.decode(full.tokens);
  std::string stop;
  for (size_t k = 3; k < full.tokens.size() && stop.empty(); ++k) {
    std::string head = tok.decode({full.tokens.begin(), full.tokens.begin() + static_cast<ptrdiff_t>(k)});
    if (head.empty() || head.size() >= all.size() || all.compare(0, head.size(), head) != 0) continue;
    unsigned char a = static_cast<unsigned char>(all[head.size() - 1]),
                  b = static_cast<unsigned char>(all[head.size()]);
    if (a < 0x80 && b < 0x80) stop = all.substr(head.size() - 1, 2);
  }
  ASSERT_FALSE(stop.empty()) << "no ASCII token boundary in: " << all;
  GenerationRequest req = greedy_request(prompt, 12);
  req.sampling.stop = {stop};
  std::string text;
  GenerationResult r = engine
                           ->generate(req,
                                      [&](const GenerationPiece& p) {
                                        text += p.text;
                                        EXPECT_EQ(p.text.find(stop), std::string::npos);
                                        return true;
                                      })
                           .value();
  EXPECT_EQ(r.finish_reason, "stop");
  EXPECT_EQ(text, all.substr(0, all.find(stop)));
  // Generation ended with the token that completed the stop string.
  ASSERT_FALSE(r.tokens.empty());
  EXPECT_TRUE(std::equal(r.tokens.begin(), r.tokens.end(), full.tokens.begin()));
  EXPECT_NE(tok.decode(r.tokens).find(stop), std::string::npos);
  EXPECT_EQ(tok.decode({r.tokens.begin(), r.tokens.end() - 1}).find(stop), std::string::npos);
}

TEST(Engine, OnPieceFalseAndCancelFlagStopWithinOneToken) {
  auto engine = tiny_engine();
  auto prompt = text_prompt("Stop me if you can");
  int seen = 0;
  GenerationResult r =
      engine->generate(greedy_request(prompt, 20), [&](const GenerationPiece&) { return ++seen < 3; })
          .value();
  EXPECT_EQ(r.finish_reason, "cancelled");
  EXPECT_EQ(r.tokens.size(), 3u);
  EXPECT_EQ(seen, 3);

  std::atomic<bool> cancel{false};
  GenerationRequest req = greedy_request(prompt, 20);
  req.cancel = &cancel;
  seen = 0;
  r = engine
          ->generate(req,
                     [&](const GenerationPiece&) {
                       if (++seen == 2) cancel = true;
                       return true;
                     })
          .value();
  EXPECT_EQ(r.finish_reason, "cancelled");
  EXPECT_EQ(r.tokens.size(), 2u);

  // Cancelled before it starts: nothing is generated, and the next request still works.
  seen = 0;
  r = engine->generate(req, [&](const GenerationPiece&) { return ++seen > 0; }).value();
  EXPECT_EQ(r.finish_reason, "cancelled");
  EXPECT_TRUE(r.tokens.empty());
  EXPECT_EQ(seen, 0);
  req.cancel = nullptr;
  EXPECT_EQ(run(*engine, req).tokens.size(), 20u);
}

TEST(Engine, PiecesAreValidUtf8AndConcatenateToTheDecodedText) {
  auto engine = tiny_engine();
  GenerationRequest req;
  req.prompt = text_prompt("日本語のテキスト、そして絵文字 🎉");
  req.sampling.temperature = 1.5f;
  req.sampling.seed = 7;
  req.sampling.max_tokens = 40;
  std::string text;
  GenerationResult r =
      engine
          ->generate(req,
                     [&](const GenerationPiece& p) {
                       // No piece ends inside a code point: its last lead byte has all its continuation
                       // bytes.
                       size_t i = p.text.size();
                       while (i > 0 && (static_cast<unsigned char>(p.text[i - 1]) & 0xC0) == 0x80) --i;
                       if (i > 0) {
                         unsigned char lead = static_cast<unsigned char>(p.text[i - 1]);
                         size_t need = lead < 0x80 ? 1 : lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : 2;
                         EXPECT_EQ(p.text.size() - (i - 1), need) << "piece ends inside a code point";
                       }
                       text += p.text;
                       return true;
                     })
          .value();
  EXPECT_EQ(text, tiny_model().tokenizer.decode(r.tokens));
}

TEST(Engine, BadRequestsGetSpecificErrors) {
  auto engine = tiny_engine();
  auto empty = engine->generate(greedy_request({}, 4), nullptr);
  ASSERT_FALSE(empty.ok());
  EXPECT_NE(empty.status().message().find("empty"), std::string::npos);
  auto out_of_vocab = engine->generate(greedy_request({1, 2, 151936}, 4), nullptr);
  ASSERT_FALSE(out_of_vocab.ok());
  EXPECT_NE(out_of_vocab.status().message().find("prompt token 2"), std::string::npos);
  GenerationRequest req = greedy_request({1, 2, 3}, 4);
  req.sampling.temperature = 3;
  auto hot = engine->generate(req, nullptr);
  ASSERT_FALSE(hot.ok());
  EXPECT_NE(hot.status().message().find("temperature"), std::string::npos);
  EXPECT_EQ(run(*engine, greedy_request({1, 2, 3}, 4)).tokens.size(), 4u);  // still fine afterwards
}

TEST(Engine, LogprobsComeWithPiecesWhenAsked) {
  auto engine = tiny_engine();
  GenerationRequest req = greedy_request(text_prompt("Probabilities"), 5);
  req.sampling.logprobs = true;
  req.sampling.top_logprobs = 3;
  int n = 0;
  GenerationResult r =
      engine
          ->generate(req,
                     [&](const GenerationPiece& p) {
                       if (p.token < 0) return true;
                       ++n;
                       EXPECT_LE(p.logprob, 0.0f);
                       EXPECT_EQ(p.top.size(), 3u);
                       if (!p.top.empty()) {
                         EXPECT_EQ(p.top[0].id, p.token);  // greedy picks the most likely token
                         EXPECT_FLOAT_EQ(p.top[0].logprob, p.logprob);
                       }
                       return true;
                     })
          .value();
  EXPECT_EQ(n, 5);
  EXPECT_EQ(r.tokens.size(), 5u);
}

}  // namespace
}  // namespace lily::test
