// Shared by the engine tests: the tiny synthetic model (written once per test binary into a temp dir, with
// the Qwen3 tokenizer fixture), CPU engines over it, and small helpers.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "cpu/cpu_backend.h"
#include "engine/engine.h"
#include "model/synth.h"

namespace lily::test {

struct TinyModel {
  std::filesystem::path dir;
  std::shared_ptr<const ModelWeights> weights;
  Tokenizer tokenizer;
  ~TinyModel() {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
};

inline const TinyModel& tiny_model() {
  static const std::unique_ptr<TinyModel> model = [] {
    auto dir = std::filesystem::temp_directory_path() / ("lily_test_engine_" + std::to_string(::getpid()));
    SynthOptions o;
    o.preset = "tiny";
    o.layout = CheckpointLayout::mlx;
    o.out_dir = dir.string();
    o.tokenizer_dir = LILY_FIXTURES_DIR "/qwen3-tokenizer";
    Status st = synth_write(o);
    if (!st.ok()) ADD_FAILURE() << st.message();
    auto w = ModelWeights::load(dir.string());
    if (!w.ok()) ADD_FAILURE() << w.status().message();
    auto tok = Tokenizer::load((dir / "tokenizer.json").string());
    if (!tok.ok()) ADD_FAILURE() << tok.status().message();
    return std::unique_ptr<TinyModel>(
        new TinyModel{dir, std::make_shared<const ModelWeights>(std::move(*w)), *tok});
  }();
  return *model;
}

inline std::unique_ptr<Backend> tiny_backend() {
  CpuBackendOptions o;
  o.n_threads = 2;
  return std::make_unique<CpuBackend>(tiny_model().weights, o);
}

inline std::unique_ptr<Engine> tiny_engine(EngineOptions options = {}) {
  return std::make_unique<Engine>(tiny_backend(), tiny_model().tokenizer, options);
}

inline GenerationRequest greedy_request(std::vector<int32_t> prompt, int max_tokens) {
  GenerationRequest r;
  r.prompt = std::move(prompt);
  r.sampling.temperature = 0;
  r.sampling.max_tokens = max_tokens;
  return r;
}

// Runs a request; the concatenated piece text goes to *text when given.
inline GenerationResult run(Engine& engine, const GenerationRequest& request, std::string* text = nullptr) {
  auto r = engine.generate(request, [&](const GenerationPiece& p) {
    if (text) *text += p.text;
    return true;
  });
  EXPECT_TRUE(r.ok()) << r.status().message();
  return r.ok() ? *r : GenerationResult{};
}

// The lily binary the CLI tests run: $LILY_BIN, else <build>/lily beside <build>/tests/<this test>; "" if none.
inline std::string lily_binary() {
  if (const char* env = std::getenv("LILY_BIN")) return env;
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return "";
  const std::filesystem::path candidate = self.parent_path().parent_path() / "lily";
  return std::filesystem::exists(candidate, ec) ? candidate.string() : "";
}

// n token ids, different for each salt (the session-cache tests' prompts).
inline std::vector<int32_t> ids(int n, int salt) {
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i)
    t.push_back(static_cast<int32_t>((salt * 7919 + 131 * i * i + 17 * i) % 150000));
  return t;
}

// Every row's logits of forward(tokens).
inline std::vector<float> forward(Backend& be, SequenceState& seq, std::span<const int32_t> tokens) {
  std::vector<float> logits;
  Status st = be.forward(seq, tokens, LogitsRows::all, &logits);
  EXPECT_TRUE(st.ok()) << st.message();
  return logits;
}

// A whole file's bytes ("" if it cannot be read).
inline std::string slurp(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace lily::test
