// `lily bench --mode ttft` on the tiny model with the CPU backend: it starts `lily serve`, calibrates the prompt to
// the asked token count, times streamed requests to their first content chunk and writes them as JSON; without a
// model, or with a model the server cannot load, it fails with a message and leaves no server behind. The binary
// is $LILY_BIN, else ../lily beside this test's build directory; the tests skip when there is none.
#include <sys/types.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "test_engine_util.h"

namespace lily::test {
namespace {

namespace fs = std::filesystem;

class BenchTtftCli : public ::testing::Test {
 protected:
  void SetUp() override {
    bin_ = lily_binary();
    if (bin_.empty()) GTEST_SKIP() << "no lily binary (set LILY_BIN)";
    dir_ = fs::temp_directory_path() / ("lily_bench_ttft_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  // `lily bench --mode ttft` with `args`; returns the exit status (stderr in dir_/err).
  int bench(const std::string& args) {
    const int port = 20000 + static_cast<int>(::getpid() % 20000);
    const std::string cmd = bin_ + " bench --mode ttft --backend cpu --threads 2 --port " + std::to_string(port) +
                            " " + args + " > " + (dir_ / "out").string() + " 2> " + (dir_ / "err").string();
    return std::system(cmd.c_str());
  }
  std::string bin_;
  fs::path dir_;
};

TEST_F(BenchTtftCli, TimesStreamedRequestsOfTheAskedLength) {
  const fs::path json_path = dir_ / "ttft.json";
  ASSERT_EQ(bench("--model " + tiny_model().dir.string() + " --prompt-tokens 96 --reps 2 --json " +
                  json_path.string()),
            0)
      << slurp(dir_ / "err");
  const auto j = nlohmann::json::parse(slurp(json_path));
  const int tokens = j["prompt_tokens"];
  EXPECT_NEAR(tokens, 96, 3) << "calibrated prompt length";
  ASSERT_EQ(j["ttft_ms"].size(), 2u);
  for (double ms : j["ttft_ms"]) {
    EXPECT_GT(ms, 0.0);
    EXPECT_LT(ms, 60000.0);
  }
  EXPECT_LE(j["ttft_ms_min"].get<double>(), j["ttft_ms_median"].get<double>());
  EXPECT_LE(j["ttft_ms_median"].get<double>(), j["ttft_ms_max"].get<double>());
  EXPECT_NE(slurp(dir_ / "out").find("time to first token through the server"), std::string::npos);
  // The server's own view of the same two requests (its /metrics): the engine's prefill and first token lie
  // within the server's arrival -> first token. (Not compared with the client's figure: the two clocks start and
  // stop at different points of the same exchange, a millisecond apart either way.)
  const double server = j["server_ttft_ms_mean"], engine = j["engine_prefill_ms_mean"];
  EXPECT_GT(engine, 0.0);
  EXPECT_LE(engine, server);
  EXPECT_LT(server, 60000.0);
  EXPECT_NE(slurp(dir_ / "out").find("server side (its /metrics"), std::string::npos);
}

// --decode-tokens: one more streamed answer of at most that many tokens, its rate between the first and the last
// content chunk.
TEST_F(BenchTtftCli, ReportsTheStreamedDecodeRate) {
  const fs::path json_path = dir_ / "ttft.json";
  ASSERT_EQ(bench("--model " + tiny_model().dir.string() + " --prompt-tokens 64 --reps 1 --decode-tokens 24 " +
                  "--decode-field min_tokens=2 --json " + json_path.string()),
            0)
      << slurp(dir_ / "err");
  const auto j = nlohmann::json::parse(slurp(json_path));
  EXPECT_GE(j["decode_tokens"].get<int>(), 2);
  EXPECT_LE(j["decode_tokens"].get<int>(), 24);
  EXPECT_GT(j["decode_tok_per_s"].get<double>(), 0.0);
  EXPECT_NE(slurp(dir_ / "out").find("decode through the server"), std::string::npos);
  EXPECT_NE(bench("--model " + tiny_model().dir.string() + " --decode-tokens 8 --decode-field min_tokens"), 0);
  EXPECT_NE(slurp(dir_ / "err").find("--decode-field takes KEY=JSON"), std::string::npos) << slurp(dir_ / "err");
}

// --streams 1,3: the same answers streamed by 1 and then 3 clients at once, per stream and in aggregate; and
// --busy-streams 2: a new prompt's first token while two answers stream.
TEST_F(BenchTtftCli, ReportsConcurrentStreams) {
  const fs::path json_path = dir_ / "ttft.json";
  ASSERT_EQ(bench("--model " + tiny_model().dir.string() + " --prompt-tokens 32 --reps 1 --decode-tokens 12 " +
                  "--streams 1,3 --busy-streams 2 --parallel 4 --json " + json_path.string()),
            0)
      << slurp(dir_ / "err");
  const auto j = nlohmann::json::parse(slurp(json_path));
  ASSERT_EQ(j["streams"].size(), 2u) << j.dump();
  EXPECT_EQ(j["streams"][1]["streams"].get<int>(), 3);
  EXPECT_GE(j["streams"][1]["tokens"].get<int>(), 3 * 2);
  EXPECT_GT(j["streams"][1]["aggregate_tok_per_s"].get<double>(), 0.0);
  EXPECT_GT(j["ttft_ms_while_busy"].get<double>(), 0.0);
  EXPECT_NE(bench("--model " + tiny_model().dir.string() + " --streams 2"), 0);
  EXPECT_NE(slurp(dir_ / "err").find("need --decode-tokens"), std::string::npos) << slurp(dir_ / "err");
}

TEST_F(BenchTtftCli, RefusesWithoutAModelAndReportsAServerThatCannotLoad) {
  EXPECT_NE(bench(""), 0);
  EXPECT_NE(slurp(dir_ / "err").find("--mode ttft needs --model DIR"), std::string::npos) << slurp(dir_ / "err");
  EXPECT_NE(bench("--model " + (dir_ / "missing").string()), 0);  // refused before any server starts
  EXPECT_NE(slurp(dir_ / "err").find("missing: no such directory"), std::string::npos) << slurp(dir_ / "err");
  std::filesystem::create_directories(dir_ / "not_a_model");  // exists, so the server starts and cannot load it
  EXPECT_NE(bench("--model " + (dir_ / "not_a_model").string()), 0);
  EXPECT_NE(slurp(dir_ / "err").find("exited (code 1) before it was ready"), std::string::npos) << slurp(dir_ / "err");
  EXPECT_NE(bench("--model " + tiny_model().dir.string() + " --prompt-tokens 4"), 0);
  EXPECT_NE(slurp(dir_ / "err").find("--prompt-tokens must be >= 16"), std::string::npos) << slurp(dir_ / "err");
}

}  // namespace
}  // namespace lily::test
