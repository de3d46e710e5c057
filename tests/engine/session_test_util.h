// Shared by the disk-tier tests (test_session_disk.cpp, test_session_mtp.cpp): saved states, file bytes, a
// two-turn chat conversation on the tiny model, engines with a disk tier.
#pragma once
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "engine/session_disk.h"
#include "engine/session_file.h"
#include "test_engine_util.h"
#include "tokenizer/chat_format.h"

namespace lily::test {

// The saved form of a SequenceState or a Checkpoint.
template <typename Saveable>
std::vector<uint8_t> saved(const Saveable& x) {
  std::vector<uint8_t> out;
  ByteWriter w(out);
  Status st = x.save(w);
  EXPECT_TRUE(st.ok()) << st.message();
  return out;
}

// An entry of `n` tokens on `be` with checkpoints at 8 and 16, as the cache holds it (anchor 16, the recent
// marks given), and its snapshot.
struct Entry {
  std::unique_ptr<CachedSequence> seq;
  SessionSnapshot snap;
};
inline Entry entry(Backend& be, int n, int salt, std::vector<int64_t> marks) {
  Entry e;
  e.seq = std::make_unique<CachedSequence>();
  e.seq->state = be.new_sequence();
  e.seq->tokens = ids(n, salt);
  forward(be, *e.seq->state, std::span(e.seq->tokens).first(8));
  e.seq->checkpoints[8] = e.seq->state->checkpoint();
  forward(be, *e.seq->state, std::span(e.seq->tokens).subspan(8, 8));
  e.seq->checkpoints[16] = e.seq->state->checkpoint();
  forward(be, *e.seq->state, std::span(e.seq->tokens).subspan(16));
  e.seq->anchor = 16;
  e.seq->recent_marks = std::move(marks);
  e.snap.tokens = e.seq->tokens;
  e.snap.anchor = e.seq->anchor;
  e.snap.recent_marks = e.seq->recent_marks;
  e.snap.state = saved(*e.seq->state);
  e.snap.checkpoints = e.seq->checkpoints;
  return e;
}

// The owner of the tiny model's files on the CPU backend; `mtp`: a server with the MTP head on.
inline SessionFileOwner owner(bool mtp = false) {
  return {model_fingerprint(*tiny_model().weights), "cpu", mtp ? mtp_fingerprint(*tiny_model().weights) : ""};
}

inline void write_file(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

inline std::vector<uint8_t> read_bytes(const std::string& path) {
  std::string s = slurp(path);
  return std::vector<uint8_t>(s.begin(), s.end());
}

inline std::vector<int32_t> stop_ids() {
  const Tokenizer& tok = tiny_model().tokenizer;
  return {tok.token_id("<|im_end|>"), tok.token_id("<|endoftext|>")};
}

// A greedy request of `max_tokens` for a chat conversation.
inline GenerationRequest chat(const nlohmann::ordered_json& messages, int max_tokens = 6) {
  auto text = render_chat(messages, nlohmann::ordered_json(), ChatOptions{});
  EXPECT_TRUE(text.ok());
  GenerationRequest r = greedy_request(tiny_model().tokenizer.encode(text.ok() ? *text : ""), max_tokens);
  r.stop_token_ids = stop_ids();
  return r;
}

inline nlohmann::ordered_json turn_one() {
  auto m = nlohmann::ordered_json::array();
  m.push_back(
      {{"role", "system"}, {"content", "You are a helpful assistant. Answer briefly and precisely."}});
  m.push_back({{"role", "user"}, {"content", "What is the capital of France?"}});
  return m;
}

inline nlohmann::ordered_json turn_two(const std::string& reply) {
  nlohmann::ordered_json m = turn_one();
  m.push_back({{"role", "assistant"}, {"content", "Sure."}, {"reasoning_content", reply}});
  m.push_back({{"role", "user"}, {"content", "And of Italy?"}});
  return m;
}

inline EngineOptions with_disk(const std::string& dir, std::vector<std::string>* log, uint64_t budget = 0) {
  EngineOptions o;
  o.disk.dir = dir;
  o.disk.budget_bytes = budget;
  o.disk.log = [log](const std::string& line) { log->push_back(line); };
  o.model_fingerprint = model_fingerprint(*tiny_model().weights);
  o.mtp_fingerprint = mtp_fingerprint(*tiny_model().weights);
  return o;
}

inline size_t session_files(const std::string& dir) {
  size_t n = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) n += e.path().extension() == ".lsess";
  return n;
}

}  // namespace lily::test
