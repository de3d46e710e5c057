// Prefix reuse through the session cache on the tiny model: a 5-turn chat rendered with render_chat resumes
// each turn from the previous one (>= 90% of its prompt cached) with the same greedy tokens as without the
// cache; resuming from a grid checkpoint; forks keep the original conversation; LRU eviction under a small
// budget.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "test_engine_util.h"
#include "tokenizer/chat_format.h"

namespace lily::test {
namespace {

using json = nlohmann::ordered_json;

std::vector<int32_t> stop_ids() {
  const Tokenizer& tok = tiny_model().tokenizer;
  return {tok.token_id("<|im_end|>"), tok.token_id("<|endoftext|>")};
}

std::vector<int32_t> render(const json& messages) {
  auto text = render_chat(messages, json(), ChatOptions{});
  EXPECT_TRUE(text.ok()) << text.status().message();
  return tiny_model().tokenizer.encode(text.ok() ? *text : "");
}

GenerationRequest chat_request(const json& messages, bool reuse) {
  GenerationRequest r = greedy_request(render(messages), 6);
  r.stop_token_ids = stop_ids();
  r.reuse_cache = reuse;
  return r;
}

TEST(EngineSessions, FiveTurnChatReusesThePreviousTurnAndMatchesNoReuse) {
  auto engine = tiny_engine();
  json messages = json::array();
  messages.push_back({{"role", "system"},
                      {"content",
                       "You are a helpful assistant. Answer briefly and precisely; when you are unsure, say "
                       "so, and never invent facts. Prefer plain words to jargon and short sentences."}});
  const char* questions[] = {"What is the capital of France?", "And of Italy?", "Which one is larger?",
                             "How far apart are they?", "Thanks! One more: which river runs through Rome?"};
  int previous_prompt = 0;
  for (int turn = 0; turn < 5; ++turn) {
    messages.push_back({{"role", "user"}, {"content", questions[turn]}});
    std::string reply;
    GenerationResult with = run(*engine, chat_request(messages, true), &reply);
    GenerationResult without = run(*engine, chat_request(messages, false));
    EXPECT_EQ(with.tokens, without.tokens) << "turn " << turn + 1;
    EXPECT_EQ(without.cached_tokens, 0);
    if (turn == 0) {
      EXPECT_EQ(with.cached_tokens, 0);
    } else {
      EXPECT_GE(with.cached_tokens, 0.9 * previous_prompt) << "turn " << turn + 1;
      EXPECT_LT(with.cached_tokens, with.prompt_tokens);
    }
    std::printf("turn %d: prompt %d tokens, cached %d (previous prompt %d)\n", turn + 1, with.prompt_tokens,
                with.cached_tokens, previous_prompt);
    previous_prompt = with.prompt_tokens;
    // The reply was generated after "<think>\n": it is reasoning; the template drops it from later turns.
    messages.push_back({{"role", "assistant"}, {"content", "Sure."}, {"reasoning_content", reply}});
  }
  EngineStats s = engine->stats();
  EXPECT_EQ(s.cache_hits, 4u);
  EXPECT_EQ(s.cache_misses, 1u);
  EXPECT_EQ(s.cache_entries, 1u);
  EXPECT_GT(s.cache_bytes, 0u);
}

// The CPU backend, but forward_with_checkpoint takes its checkpoint `lead` tokens before the split (never at
// or before the call's first token), which Backend::forward_with_checkpoint does not allow; every call's start
// position and length is logged.
class EarlyCheckpointBackend final : public Backend {
 public:
  explicit EarlyCheckpointBackend(int64_t lead) : cpu_(tiny_backend()), lead_(lead) {}
  const char* name() const override { return "cpu-early-checkpoint"; }
  const ModelConfig& config() const override { return cpu_->config(); }
  std::unique_ptr<SequenceState> new_sequence() override { return cpu_->new_sequence(); }
  Status forward(SequenceState& seq, std::span<const int32_t> tokens, LogitsRows rows,
                 std::vector<float>* logits) override {
    calls.push_back({seq.n_tokens(), static_cast<int64_t>(tokens.size())});
    return cpu_->forward(seq, tokens, rows, logits);
  }
  Result<std::unique_ptr<Checkpoint>> forward_with_checkpoint(SequenceState& seq,
                                                              std::span<const int32_t> tokens, int64_t split,
                                                              LogitsRows rows,
                                                              std::vector<float>* /*logits*/) override {
    if (split <= 0 || split >= static_cast<int64_t>(tokens.size()))
      return invalid_argument("split %lld", (long long)split);
    if (rows != LogitsRows::none) return invalid_argument("this test backend gives no logits here");
    const int64_t at = std::max<int64_t>(1, split - lead_), start = seq.n_tokens();
    calls.push_back({start, static_cast<int64_t>(tokens.size())});
    RETURN_IF_ERROR(cpu_->forward(seq, tokens.first(static_cast<size_t>(at)), LogitsRows::none, nullptr));
    std::unique_ptr<Checkpoint> cp = seq.checkpoint();
    RETURN_IF_ERROR(cpu_->forward(seq, tokens.subspan(static_cast<size_t>(at)), LogitsRows::none, nullptr));
    fwc_start = start, asked_at = start + split, checkpoint_at = cp->n_tokens();
    return cp;
  }
  struct Call {
    int64_t start, n;
  };
  std::vector<Call> calls;
  int64_t fwc_start = -1, asked_at = -1, checkpoint_at = -1;  // the last forward_with_checkpoint's

 private:
  std::unique_ptr<Backend> cpu_;
  int64_t lead_;
};

// The checkpoint forward_with_checkpoint returns must be at the split (engine/backend.h): one taken elsewhere is
// an internal error naming the backend, never a session resumed at the wrong position.
TEST(EngineSessions, AnchorCheckpointOffTheSplitIsRefused) {
  auto owned = std::make_unique<EarlyCheckpointBackend>(5);
  EarlyCheckpointBackend& b = *owned;
  Engine engine(std::move(owned), tiny_model().tokenizer, EngineOptions{});
  json messages = json::array();
  messages.push_back({{"role", "system"}, {"content", "You are terse; answer in a few words, never more."}});
  messages.push_back({{"role", "user"}, {"content", "Name a large river in Europe."}});
  GenerationRequest r = chat_request(messages, true);
  auto res = engine.generate(r, [](const GenerationPiece&) { return true; });
  ASSERT_FALSE(res.ok());
  EXPECT_EQ(res.status().code(), ErrorCode::internal);
  EXPECT_NE(res.status().message().find("cpu-early-checkpoint backend: the checkpoint for"), std::string::npos)
      << res.status().message();
  EXPECT_EQ(b.checkpoint_at, b.asked_at - 5);
  EXPECT_EQ(engine.stats().cache_entries, 0u);
}

// The tiny CPU backend whose logits turn NaN while `poison` is set (a broken checkpoint or kernel): the request
// fails with the sampler's error, the process and the engine go on.
class NanLogitsBackend final : public Backend {
 public:
  NanLogitsBackend() : cpu_(tiny_backend()) {}
  const char* name() const override { return "cpu-nan-logits"; }
  const ModelConfig& config() const override { return cpu_->config(); }
  std::unique_ptr<SequenceState> new_sequence() override { return cpu_->new_sequence(); }
  Status forward(SequenceState& seq, std::span<const int32_t> tokens, LogitsRows rows,
                 std::vector<float>* logits) override {
    RETURN_IF_ERROR(cpu_->forward(seq, tokens, rows, logits));
    if (poison && logits && !logits->empty()) (*logits)[logits->size() / 2] = NAN;
    return ok_status();
  }
  bool poison = true;

 private:
  std::unique_ptr<Backend> cpu_;
};

TEST(EngineSessions, NanLogitsFailTheRequestNotTheProcess) {
  auto owned = std::make_unique<NanLogitsBackend>();
  NanLogitsBackend& b = *owned;
  Engine engine(std::move(owned), tiny_model().tokenizer, EngineOptions{});
  std::vector<int32_t> prompt;
  for (int i = 0; i < 12; ++i) prompt.push_back(300 + 7 * i);
  for (const float temperature : {0.0f, 0.8f}) {
    GenerationRequest r = greedy_request(prompt, 4);
    r.sampling.temperature = temperature;
    auto res = engine.generate(r, [](const GenerationPiece&) { return true; });
    ASSERT_FALSE(res.ok());
    EXPECT_EQ(res.status().code(), ErrorCode::internal);
    EXPECT_NE(res.status().message().find("is NaN"), std::string::npos) << res.status().message();
  }
  b.poison = false;  // the same engine serves the next request
  auto res = engine.generate(greedy_request(prompt, 4), [](const GenerationPiece&) { return true; });
  ASSERT_TRUE(res.ok()) << res.status().message();
  EXPECT_EQ(res->completion_tokens, 4);
}

TEST(EngineSessions, ResumesFromTheLatestGridCheckpointInsideTheSharedPrefix) {
  EngineOptions o;
  o.checkpoint_interval = 16;
  o.prefill_chunk = 8;
  auto engine = tiny_engine(o);
  std::vector<int32_t> a, b;
  for (int i = 0; i < 60; ++i) a.push_back(1000 + 37 * i);
  b = a;
  b.resize(41);  // shares 41 tokens with a: the checkpoints at 16 and 32 are inside, 48 is not
  for (int i = 0; i < 10; ++i) b.push_back(5000 + 11 * i);
  run(*engine, greedy_request(a, 4));
  GenerationResult with = run(*engine, greedy_request(b, 8));
  EXPECT_EQ(with.cached_tokens, 32);
  GenerationRequest fresh = greedy_request(b, 8);
  fresh.reuse_cache = false;
  EXPECT_EQ(with.tokens, run(*engine, fresh).tokens);
  // The state's own end is a resume point too: a prompt that extends everything the entry consumed.
  std::vector<int32_t> c = b;
  c.insert(c.end(), with.tokens.begin(), with.tokens.end());
  c.push_back(77);
  GenerationResult cont = run(*engine, greedy_request(c, 4));
  EXPECT_EQ(cont.cached_tokens, static_cast<int>(b.size() + with.tokens.size() - 1));
  GenerationRequest cont_fresh = greedy_request(c, 4);
  cont_fresh.reuse_cache = false;
  EXPECT_EQ(cont.tokens, run(*engine, cont_fresh).tokens);
}

TEST(EngineSessions, DefaultCheckpointGridFollowsTheBackendChunk) {
  EngineOptions o;
  o.prefill_chunk = 4096;  // as the CUDA backend prefers: the grid is 4,096, not 2,048
  auto engine = tiny_engine(o);
  EXPECT_EQ(engine->options().checkpoint_interval, 4096);
  std::vector<int32_t> a;
  for (int i = 0; i < 4200; ++i) a.push_back(1000 + (37 * i) % 3000);
  std::vector<int32_t> b(a.begin(), a.begin() + 4150);
  b.push_back(7);
  run(*engine, greedy_request(a, 1));
  EXPECT_EQ(run(*engine, greedy_request(b, 1)).cached_tokens, 4096);
  EngineOptions small;
  small.prefill_chunk = 512;  // the CPU backend's: the grid stays at 2,048
  EXPECT_EQ(tiny_engine(small)->options().checkpoint_interval, 2048);
}

TEST(EngineSessions, AnEarlierDivergenceForksAndKeepsTheConversation) {
  EngineOptions o;
  o.checkpoint_interval = 16;
  auto engine = tiny_engine(o);
  json conv =
      json::array({{{"role", "system"}, {"content", "You are terse. Reply in one short sentence, no more."}},
                   {{"role", "user"}, {"content", "Tell me something about the moon and the tides."}}});
  GenerationResult t1 = run(*engine, chat_request(conv, true));
  // Another conversation with the same system prompt: diverges before this one's anchor, so it forks.
  json other =
      json::array({conv[0], {{"role", "user"}, {"content", "Something else entirely, about bees."}}});
  GenerationResult o1 = run(*engine, chat_request(other, true));
  EXPECT_GT(o1.cached_tokens, 0);
  EXPECT_EQ(engine->stats().cache_entries, 2u);
  // The first conversation continues from its own entry, untouched by the fork.
  conv.push_back({{"role", "assistant"}, {"content", "Fine."}});
  conv.push_back({{"role", "user"}, {"content", "More?"}});
  GenerationResult t2 = run(*engine, chat_request(conv, true));
  // Resumed at turn 1's anchor: the generation prompt's <|im_start|>, its last 5 tokens being
  // "<|im_start|>", "assistant", "\n", "<think>", "\n".
  EXPECT_EQ(t2.cached_tokens, t1.prompt_tokens - 5);
  EXPECT_EQ(t2.tokens, run(*engine, chat_request(conv, false)).tokens);
  EXPECT_EQ(o1.tokens, run(*engine, chat_request(other, false)).tokens);
}

TEST(EngineSessions, LruEvictsUnderASmallBudgetAndOptOutLeavesTheCacheAlone) {
  auto prompt = [](int k) {
    std::vector<int32_t> p;
    for (int i = 0; i < 24; ++i) p.push_back(300 + 1000 * k + 7 * i);
    return p;
  };
  size_t one_entry = 0;
  {
    auto probe = tiny_engine();
    run(*probe, greedy_request(prompt(0), 4));
    one_entry = probe->stats().cache_bytes;
    ASSERT_GT(one_entry, 0u);
  }
  EngineOptions o;
  o.session_cache_bytes = one_entry * 5 / 2;  // room for two entries of this size
  auto engine = tiny_engine(o);
  for (int k = 0; k < 3; ++k) run(*engine, greedy_request(prompt(k), 4));
  EngineStats s = engine->stats();
  EXPECT_EQ(s.cache_entries, 2u);
  EXPECT_EQ(s.cache_evictions, 1u);
  EXPECT_LE(s.cache_bytes, o.session_cache_bytes);
  EXPECT_EQ(run(*engine, greedy_request(prompt(0), 4)).cached_tokens, 0);  // the oldest was evicted
  EXPECT_GT(run(*engine, greedy_request(prompt(2), 4)).cached_tokens, 0);  // the newest was kept

  GenerationRequest off = greedy_request(prompt(5), 4);
  off.reuse_cache = false;
  EngineStats before = engine->stats();
  run(*engine, off);
  EngineStats after = engine->stats();
  EXPECT_EQ(after.cache_hits + after.cache_misses, before.cache_hits + before.cache_misses);
  EXPECT_EQ(after.cache_entries, before.cache_entries);

  EngineOptions tiny_budget;
  tiny_budget.session_cache_bytes = one_entry / 2;  // no entry fits: nothing is kept
  auto none = tiny_engine(tiny_budget);
  run(*none, greedy_request(prompt(0), 4));
  EXPECT_EQ(none->stats().cache_entries, 0u);
  EXPECT_EQ(run(*none, greedy_request(prompt(0), 4)).cached_tokens, 0);
  engine->clear_cache();
  EXPECT_EQ(engine->stats().cache_entries, 0u);
  EXPECT_EQ(engine->stats().cache_bytes, 0u);
}

}  // namespace
}  // namespace lily::test
