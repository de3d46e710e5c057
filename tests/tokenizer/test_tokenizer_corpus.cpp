// Id-exact comparison with the Hugging Face `tokenizers` library over the committed corpus
// (tests/fixtures/tokenizer/corpus.jsonl, written by tools/reference/tokenizer_ids.py), for the
// Qwen3 tokenizer.json and for the same file with the Qwen3.6 Split regex; round trips, streaming
// decode, concurrent encoding and a one-thread throughput figure.
#include <gtest/gtest.h>

#include <chrono>
#include <ctime>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "tokenizer/pretokenize.h"
#include "tokenizer/pretokenize_utf8.h"
#include "tokenizer/tokenizer.h"

namespace lily {
namespace {

using json = nlohmann::json;

const std::string kTokenizerPath = std::string(LILY_FIXTURES_DIR) + "/qwen3-tokenizer/tokenizer.json";
const std::string kCorpusPath = std::string(LILY_SOURCE_DIR) + "/tests/fixtures/tokenizer/corpus.jsonl";

// docs/MODEL.md section 3; the same string as QWEN36_REGEX in tools/reference/tokenizer_ids.py.
const std::string kQwen36Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

struct CorpusCase {
  std::string kind;
  std::string input;  // what encode() gets: the text, or the raw bytes of an invalid_utf8 case
  std::string text;   // valid UTF-8 text that `tokenizers` encoded
  std::vector<int32_t> ids, ids_qwen36;
};

std::string from_hex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) out += static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16));
  return out;
}

const std::vector<CorpusCase>& corpus() {
  static const std::vector<CorpusCase> cases = [] {
    std::vector<CorpusCase> out;
    std::ifstream file(kCorpusPath);
    std::string line;
    while (std::getline(file, line)) {
      json j = json::parse(line);
      CorpusCase c;
      c.kind = j["kind"];
      c.text = j["text"];
      c.input = j.contains("bytes_hex") ? from_hex(j["bytes_hex"]) : c.text;
      c.ids = j["ids"].get<std::vector<int32_t>>();
      c.ids_qwen36 = j["ids_qwen36"].get<std::vector<int32_t>>();
      out.push_back(std::move(c));
    }
    return out;
  }();
  return cases;
}

std::string read_file(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  std::stringstream buffer;
  buffer << file.rdbuf();
  return buffer.str();
}

const Tokenizer& qwen3() {
  static const Tokenizer tokenizer = [] {
    Result<Tokenizer> t = Tokenizer::load(kTokenizerPath);
    if (!t.ok()) ADD_FAILURE() << t.status().message();
    return std::move(t).value();
  }();
  return tokenizer;
}

// The Qwen3 file with its Split regex replaced, as the Python script does it.
Tokenizer qwen36_from(const std::string& tokenizer_json) {
  json doc = json::parse(tokenizer_json);
  json& pattern = doc["pre_tokenizer"]["pretokenizers"][0]["pattern"];
  EXPECT_EQ(pattern["Regex"].get<std::string>().find("\\p{M}"), std::string::npos);
  pattern["Regex"] = kQwen36Regex;
  Result<Tokenizer> t = Tokenizer::from_json_string(doc.dump());
  if (!t.ok()) ADD_FAILURE() << t.status().message();
  return std::move(t).value();
}

const Tokenizer& qwen36() {
  static const Tokenizer tokenizer = qwen36_from(read_file(kTokenizerPath));
  return tokenizer;
}

std::string ids_str(const std::vector<int32_t>& ids) { return json(ids).dump(); }

void expect_id_exact(const Tokenizer& tokenizer, bool use_qwen36) {
  ASSERT_GE(corpus().size(), 2000u);
  int n_mismatch = 0;
  for (const CorpusCase& c : corpus()) {
    const std::vector<int32_t>& expected = use_qwen36 ? c.ids_qwen36 : c.ids;
    std::vector<int32_t> got = tokenizer.encode(c.input);
    if (got != expected && ++n_mismatch <= 10) {
      ADD_FAILURE() << c.kind << " " << json(c.text).dump() << "\n  expected " << ids_str(expected) << "\n  got      "
                    << ids_str(got);
    }
  }
  EXPECT_EQ(n_mismatch, 0) << "of " << corpus().size() << " cases";
}

TEST(TokenizerCorpus, Qwen3IdExact) { expect_id_exact(qwen3(), false); }

TEST(TokenizerCorpus, Qwen36IdExact) { expect_id_exact(qwen36(), true); }

TEST(TokenizerCorpus, CorpusCoversBothRegexesAndInvalidUtf8) {
  int n_differ = 0, n_invalid = 0;
  for (const CorpusCase& c : corpus()) {
    n_differ += c.ids != c.ids_qwen36;
    n_invalid += c.kind == "invalid_utf8";
  }
  EXPECT_GT(n_differ, 20);  // the \p{M} change must be exercised
  EXPECT_GT(n_invalid, 20);
}

TEST(TokenizerCorpus, DecodeEncodeIsNfc) {
  int n_bad = 0;
  for (const CorpusCase& c : corpus()) {
    const std::string expected = nfc_normalize(c.text);  // c.text: the input with U+FFFD repairs
    const std::string round_trip = qwen3().decode(qwen3().encode(c.input));
    const std::string from_reference = qwen3().decode(c.ids);
    if ((round_trip != expected || from_reference != expected) && ++n_bad <= 10) {
      ADD_FAILURE() << json(c.text).dump() << "\n  decode(encode) " << json(round_trip).dump()
                    << "\n  decode(ref ids) " << json(from_reference).dump();
    }
  }
  EXPECT_EQ(n_bad, 0);
}

TEST(TokenizerCorpus, StreamDecoderEmitsWholeCodePoints) {
  int n_bad = 0;
  for (const CorpusCase& c : corpus()) {
    StreamDecoder stream(qwen3());
    std::string streamed;
    bool pieces_valid = true;
    for (int32_t id : c.ids) {
      std::string piece = stream.push(id);
      pieces_valid = pieces_valid && is_valid_utf8(piece);
      streamed += piece;
    }
    std::string rest = stream.flush();
    pieces_valid = pieces_valid && is_valid_utf8(rest);
    streamed += rest;
    if ((!pieces_valid || streamed != qwen3().decode(c.ids)) && ++n_bad <= 10) {
      ADD_FAILURE() << json(c.text).dump() << " valid pieces: " << pieces_valid;
    }
  }
  EXPECT_EQ(n_bad, 0);
}

TEST(TokenizerCorpus, ConcurrentEncodeMatchesSerial) {
  // A fresh tokenizer (cold cache), four threads each encoding the whole corpus.
  Result<Tokenizer> fresh = Tokenizer::load(kTokenizerPath);
  ASSERT_TRUE(fresh.ok()) << fresh.status().message();
  const Tokenizer tokenizer = fresh.value();
  std::vector<int> mismatches(4, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (size_t i = 0; i < corpus().size(); ++i) {
        const CorpusCase& c = corpus()[(i * 7 + static_cast<size_t>(t) * 613) % corpus().size()];
        mismatches[t] += tokenizer.encode(c.input) != c.ids;
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (int t = 0; t < 4; ++t) EXPECT_EQ(mismatches[t], 0) << "thread " << t;
}

// Prints MB/s (per wall second and per CPU second: the build machine is shared, so the wall clock
// also counts time spent waiting for a core); asserts nothing about speed. Same texts as the
// Python script's benchmark.
TEST(TokenizerBench, EncodeThroughputOneThread) {
  Result<Tokenizer> fresh = Tokenizer::load(kTokenizerPath);
  ASSERT_TRUE(fresh.ok()) << fresh.status().message();
  const Tokenizer tokenizer = fresh.value();
  std::vector<std::string> texts;
  for (const CorpusCase& c : corpus()) texts.push_back(c.text);
  std::string joined;
  for (size_t i = 0; i < texts.size(); ++i) joined += (i > 0 ? "\n" : "") + texts[i];
  size_t n_tokens = 0;
  auto measure = [&](const char* label, const std::vector<std::string>& inputs, int reps) {
    size_t n_bytes = 0;
    for (const std::string& text : inputs) n_bytes += text.size();
    const std::clock_t cpu0 = std::clock();
    const auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < reps; ++r) {
      for (const std::string& text : inputs) n_tokens += tokenizer.encode(text).size();
    }
    const std::chrono::duration<double> wall = std::chrono::steady_clock::now() - t0;
    const double cpu = static_cast<double>(std::clock() - cpu0) / CLOCKS_PER_SEC;
    const double mb = static_cast<double>(n_bytes) * reps / 1e6;
    std::printf("[bench] lily encode, 1 thread, %s: %.2f MB/s wall, %.2f MB/s CPU (%zu bytes x %d)\n", label,
                mb / wall.count(), mb / cpu, n_bytes, reps);
  };
  measure("per line, first pass (cold cache)", texts, 1);
  measure("per line, warm, 5 passes", texts, 5);
  measure("corpus as one string, 5 passes", {joined}, 5);
  EXPECT_GT(n_tokens, 0u);
}

}  // namespace
}  // namespace lily
