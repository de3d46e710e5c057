// `lily score` on the tiny model: the teacher-forced log-probs, top-1 ids and raw logits it writes match a CPU
// backend forward in this process, and bad inputs (ids outside the vocabulary, non-numbers, fewer than 2 ids, a
// missing file) fail with a message. The binary is $LILY_BIN, else ../lily beside this test's build directory;
// the tests skip when there is none.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "test_engine_util.h"

namespace lily::test {
namespace {

namespace fs = std::filesystem;

class ScoreCli : public ::testing::Test {
 protected:
  void SetUp() override {
    bin_ = lily_binary();
    if (bin_.empty()) GTEST_SKIP() << "no lily binary (set LILY_BIN)";
    dir_ = tiny_model().dir / ("score_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  // Runs `lily score` on the tiny model with `ids_text` as the ids file; returns the exit status.
  int score(const std::string& ids_text, const std::string& extra = "") {
    std::ofstream(dir_ / "ids.txt") << ids_text;
    std::string cmd = bin_ + " score --model " + tiny_model().dir.string() + " --ids-file " +
                      (dir_ / "ids.txt").string() + " --backend cpu --threads 2 " + extra + " > " +
                      (dir_ / "out").string() + " 2> " + (dir_ / "err").string();
    return std::system(cmd.c_str());
  }
  std::string bin_;
  fs::path dir_;
};

TEST_F(ScoreCli, MatchesAnInProcessForward) {
  const int32_t vocab = tiny_model().weights->config.vocab_size;
  std::mt19937 rng(5);
  std::vector<int32_t> ids(40);
  std::string text;
  for (size_t i = 0; i < ids.size(); ++i) {
    ids[i] = static_cast<int32_t>(rng() % vocab);
    text += std::to_string(ids[i]) + (i % 7 == 6 ? ",\n" : " ");
  }
  const fs::path json_path = dir_ / "s.json", logits_path = dir_ / "s.f32";
  ASSERT_EQ(score(text, "--json " + json_path.string() + " --logits " + logits_path.string()), 0)
      << slurp(dir_ / "err");

  auto backend = tiny_backend();
  auto seq = backend->new_sequence();
  std::vector<float> logits;
  ASSERT_TRUE(backend->forward(*seq, ids, LogitsRows::all, &logits).ok());
  const std::string raw = slurp(logits_path);
  ASSERT_EQ(raw.size(), logits.size() * sizeof(float));
  std::vector<float> written(logits.size());
  std::memcpy(written.data(), raw.data(), raw.size());
  double max_diff = 0;
  for (size_t i = 0; i < logits.size(); ++i) max_diff = std::max(max_diff, std::fabs(double(written[i]) - logits[i]));
  EXPECT_LE(max_diff, 1e-4);

  auto j = nlohmann::json::parse(slurp(json_path));
  ASSERT_EQ(j["n_positions"].get<int>(), static_cast<int>(ids.size()) - 1);
  double sum = 0;
  for (size_t t = 0; t + 1 < ids.size(); ++t) {
    const float* row = logits.data() + t * vocab;
    const float* best = std::max_element(row, row + vocab);
    double z = 0;
    for (int32_t v = 0; v < vocab; ++v) z += std::exp(double(row[v]) - *best);
    const double lp = row[ids[t + 1]] - *best - std::log(z);
    sum += lp;
    EXPECT_EQ(j["top1"][t].get<int32_t>(), best - row) << "position " << t;
    EXPECT_NEAR(j["logprob"][t].get<double>(), lp, 1e-4) << "position " << t;
  }
  EXPECT_NEAR(j["perplexity"].get<double>(), std::exp(-sum / double(ids.size() - 1)),
              1e-5 * j["perplexity"].get<double>());
}

TEST_F(ScoreCli, RejectsBadInput) {
  const int32_t vocab = tiny_model().weights->config.vocab_size;
  EXPECT_NE(score("1 2 " + std::to_string(vocab)), 0);
  EXPECT_NE(slurp(dir_ / "err").find("outside the vocabulary"), std::string::npos) << slurp(dir_ / "err");
  EXPECT_NE(score("1 -2 3"), 0);
  EXPECT_NE(slurp(dir_ / "err").find("outside the vocabulary"), std::string::npos) << slurp(dir_ / "err");
  EXPECT_NE(score("1 2x 3"), 0);
  EXPECT_NE(slurp(dir_ / "err").find("is not a token id"), std::string::npos) << slurp(dir_ / "err");
  EXPECT_NE(score("7"), 0);
  EXPECT_NE(slurp(dir_ / "err").find("at least 2"), std::string::npos) << slurp(dir_ / "err");
  EXPECT_NE(score(""), 0);
  EXPECT_NE(slurp(dir_ / "err").find("at least 2"), std::string::npos) << slurp(dir_ / "err");
  std::string cmd = bin_ + " score --model " + tiny_model().dir.string() + " --ids-file " +
                    (dir_ / "missing.txt").string() + " --backend cpu 2> " + (dir_ / "err").string();
  EXPECT_NE(std::system(cmd.c_str()), 0);
  EXPECT_NE(slurp(dir_ / "err").find("cannot open"), std::string::npos) << slurp(dir_ / "err");
}

}  // namespace
}  // namespace lily::test
