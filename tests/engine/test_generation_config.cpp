// generation_config.json tests: files written to a temporary model directory and read back.
#include "engine/generation_config.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

namespace lily {
namespace {

namespace fs = std::filesystem;

// A fresh model directory per test, removed afterwards.
class GenerationConfigTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("lily_gencfg_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  void write(const std::string& text) { std::ofstream(dir_ / "generation_config.json") << text; }
  Result<SamplingDefaults> load() { return load_generation_config(dir_.string()); }
  void expect_error(const std::string& text, const std::string& needle) {
    write(text);
    const auto r = load();
    ASSERT_FALSE(r.ok()) << "expected an error for " << text;
    EXPECT_EQ(r.status().code(), ErrorCode::format);
    EXPECT_NE(r.status().message().find("generation_config.json"), std::string::npos) << r.status().message();
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().message();
  }
  fs::path dir_;
};

TEST_F(GenerationConfigTest, MissingFileGivesDefaults) {
  auto r = load();
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_FALSE(r->from_file);
  EXPECT_EQ(r->temperature, 1.0f);
  EXPECT_EQ(r->top_k, 0);
  EXPECT_EQ(r->top_p, 1.0f);
  EXPECT_EQ(r->min_p, 0.0f);
  EXPECT_EQ(r->repetition_penalty, 1.0f);
  EXPECT_TRUE(r->eos_token_ids.empty());
  EXPECT_TRUE(load_generation_config((dir_ / "no_such_model").string()).ok());
}

TEST_F(GenerationConfigTest, QwenFileWithEosList) {
  // As shipped for the Qwen3.5/3.6 family (docs/MODEL.md 1.1).
  write(R"({
    "bos_token_id": 248044, "do_sample": true, "eos_token_id": [248046, 248044], "pad_token_id": 248044,
    "temperature": 1.0, "top_k": 20, "top_p": 0.95, "transformers_version": "4.57.0.dev0"
  })");
  auto r = load();
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_TRUE(r->from_file);
  EXPECT_EQ(r->eos_token_ids, (std::vector<int32_t>{248046, 248044}));
  EXPECT_EQ(r->bos_token_id, 248044);
  EXPECT_EQ(r->pad_token_id, 248044);
  EXPECT_EQ(r->temperature, 1.0f);
  EXPECT_EQ(r->top_k, 20);
  EXPECT_FLOAT_EQ(r->top_p, 0.95f);
  EXPECT_EQ(r->min_p, 0.0f);
  EXPECT_FALSE(r->max_new_tokens.has_value());
}

TEST_F(GenerationConfigTest, EosAsIntAndNullsAsMissing) {
  write(R"({"eos_token_id": 151645, "pad_token_id": null, "bos_token_id": null, "temperature": 0.7,
            "repetition_penalty": 1.05, "min_p": 0.1, "top_k": -1, "max_new_tokens": 2048})");
  auto r = load();
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->eos_token_ids, (std::vector<int32_t>{151645}));
  EXPECT_FALSE(r->pad_token_id.has_value());
  EXPECT_FALSE(r->bos_token_id.has_value());
  EXPECT_FLOAT_EQ(r->temperature, 0.7f);
  EXPECT_FLOAT_EQ(r->repetition_penalty, 1.05f);
  EXPECT_FLOAT_EQ(r->min_p, 0.1f);
  EXPECT_EQ(r->top_k, 0);  // -1 is vLLM's "off"
  EXPECT_EQ(r->max_new_tokens, 2048);
}

TEST_F(GenerationConfigTest, MalformedFilesNameFileAndField) {
  expect_error("{\"temperature\": 0.7,", "invalid JSON");
  expect_error("[1, 2]", "top level");
  expect_error(R"({"top_k": "20"})", "field `top_k` must be an integer, got \"20\"");
  expect_error(R"({"top_k": 2.5})", "`top_k`");
  expect_error(R"({"temperature": "hot"})", "field `temperature` must be a number");
  expect_error(R"({"temperature": -0.5})", "field `temperature` = -0.5 is out of range");
  expect_error(R"({"top_p": 1.5})", "field `top_p` = 1.5 is out of range (0, 1]");
  expect_error(R"({"top_p": 0})", "`top_p`");
  expect_error(R"({"repetition_penalty": 0})", "`repetition_penalty`");
  expect_error(R"({"min_p": 2})", "`min_p`");
  expect_error(R"({"eos_token_id": "<|im_end|>"})", "field `eos_token_id` must be an integer or a list");
  expect_error(R"({"eos_token_id": [248046, "x"]})", "field `eos_token_id`[1] must be a token id");
  expect_error(R"({"eos_token_id": [-1]})", "`eos_token_id`[0]");
  expect_error(R"({"pad_token_id": -5})", "`pad_token_id`");
  expect_error(R"({"max_new_tokens": 0})", "`max_new_tokens`");
}

TEST_F(GenerationConfigTest, RequestValuesWinOverFileOverBuiltIn) {
  write(R"({"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_new_tokens": 512})");
  auto defaults = load();
  ASSERT_TRUE(defaults.ok());

  SamplingParams params;
  params.presence_penalty = 1.5f;  // request-only fields are left alone
  RequestOverrides request;
  request.temperature = 0.0f;  // an explicit 0 (greedy) is a value, not "unset"
  request.top_p = 0.5f;
  apply_defaults(params, *defaults, request);
  EXPECT_EQ(params.temperature, 0.0f);  // request
  EXPECT_EQ(params.top_p, 0.5f);        // request
  EXPECT_EQ(params.top_k, 20);          // file
  EXPECT_EQ(params.max_tokens, 512);    // file
  EXPECT_EQ(params.min_p, 0.0f);        // built-in
  EXPECT_EQ(params.repetition_penalty, 1.0f);
  EXPECT_EQ(params.presence_penalty, 1.5f);
  EXPECT_TRUE(params.validate(248320).ok());

  SamplingParams plain;
  apply_defaults(plain, SamplingDefaults{}, RequestOverrides{});
  EXPECT_EQ(plain.temperature, 1.0f);
  EXPECT_EQ(plain.top_k, 0);
  EXPECT_EQ(plain.top_p, 1.0f);
  EXPECT_EQ(plain.max_tokens, -1);
}

}  // namespace
}  // namespace lily
