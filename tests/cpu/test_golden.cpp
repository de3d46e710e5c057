// Golden tests: the CPU reference engine against fixtures no one here computed by hand —
// transformers' own Qwen3_5MoeForCausalLM (bf16 checkpoint, fp32 run) and mlx-lm's own 4-bit conversion and run
// (tools/reference/make_golden.py, docs/GOLDEN.md). The criteria: max |dlogit| <= 1e-3 * std(logits) at
// every position, identical greedy tokens.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cpu/cpu_backend.h"

namespace lily {
namespace {

struct Golden {
  std::vector<int32_t> prompt, greedy, tokens;
  int64_t vocab = 0, n_positions = 0;
  std::vector<float> logits;  // [n_positions, vocab]
};

Golden load_golden(const std::string& dir) {
  std::ifstream f(dir + "/golden.json");
  std::stringstream ss;
  ss << f.rdbuf();
  auto j = nlohmann::json::parse(ss.str());
  Golden g;
  g.prompt = j["prompt_ids"].get<std::vector<int32_t>>();
  g.greedy = j["greedy_ids"].get<std::vector<int32_t>>();
  g.tokens = j["token_ids"].get<std::vector<int32_t>>();
  g.vocab = j["vocab_size"].get<int64_t>();
  g.n_positions = j["n_positions"].get<int64_t>();
  g.logits.resize(static_cast<size_t>(g.vocab * g.n_positions));
  std::ifstream lf(dir + "/" + j["logits_file"].get<std::string>(), std::ios::binary);
  lf.read(reinterpret_cast<char*>(g.logits.data()), static_cast<std::streamsize>(g.logits.size() * 4));
  EXPECT_TRUE(lf.good()) << "reading logits of " << dir;
  return g;
}

double stddev(const std::vector<float>& v) {
  double m = 0, s = 0;
  for (float x : v) m += x;
  m /= v.size();
  for (float x : v) s += (x - m) * (x - m);
  return std::sqrt(s / v.size());
}

void check_against_golden(const std::string& name, const std::string& layout) {
  const std::string dir = std::string(LILY_SOURCE_DIR) + "/tests/fixtures/golden/" + name;
  Golden g = load_golden(dir);
  auto w = ModelWeights::load(dir);
  ASSERT_TRUE(w.ok()) << w.status().message();
  EXPECT_STREQ(layout_name(w->layout), layout.c_str());
  CpuBackend backend(std::make_shared<const ModelWeights>(std::move(*w)));
  const double tol = 1e-3 * stddev(g.logits);

  // Teacher-forced: all 80 positions in one prefill.
  auto seq = backend.new_sequence();
  std::vector<float> logits;
  ASSERT_TRUE(backend.forward(*seq, g.tokens, LogitsRows::all, &logits).ok());
  ASSERT_EQ(logits.size(), g.logits.size());
  double max_diff = 0;
  for (size_t i = 0; i < logits.size(); ++i) max_diff = std::max(max_diff, (double)std::abs(logits[i] - g.logits[i]));
  std::printf("[%s] max |dlogit| = %.3g (tolerance %.3g = 1e-3 * std)\n", name.c_str(), max_diff, tol);
  EXPECT_LE(max_diff, tol);

  // Greedy: prompt prefill, then 16 steps one token at a time.
  auto gen = backend.new_sequence();
  ASSERT_TRUE(backend.forward(*gen, g.prompt, LogitsRows::last, &logits).ok());
  std::vector<int32_t> out;
  for (size_t i = 0; i < g.greedy.size(); ++i) {
    int32_t next = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    out.push_back(next);
    ASSERT_TRUE(backend.forward(*gen, std::span<const int32_t>(&next, 1), LogitsRows::last, &logits).ok());
  }
  EXPECT_EQ(out, g.greedy);
}

TEST(Golden, TransformersBf16Checkpoint) { check_against_golden("hf_small", "hf"); }
TEST(Golden, MlxLm4BitConversion) { check_against_golden("mlx_small", "mlx"); }

}  // namespace
}  // namespace lily
