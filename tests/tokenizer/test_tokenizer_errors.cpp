// Malformed or unsupported tokenizer.json files: each gives a Status naming the component, never a
// crash. Built by editing the tiny synthetic tokenizer (tests/fixtures/tokenizer/synthetic.json).
#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "tokenizer/tokenizer.h"

namespace lily {
namespace {

using json = nlohmann::json;

json synthetic() {
  std::ifstream file(std::string(LILY_SOURCE_DIR) + "/tests/fixtures/tokenizer/synthetic.json");
  return json::parse(file)["tokenizer"];
}

// Applies `edit` to the synthetic tokenizer and expects a load error whose message contains `expected`.
void expect_error(const std::function<void(json&)>& edit, const std::string& expected) {
  json doc = synthetic();
  edit(doc);
  Result<Tokenizer> t = Tokenizer::from_json_string(doc.dump());
  ASSERT_FALSE(t.ok()) << "expected an error containing: " << expected;
  EXPECT_NE(t.status().message().find(expected), std::string::npos) << t.status().message();
}

TEST(TokenizerErrors, SyntheticFixtureLoads) {
  EXPECT_TRUE(Tokenizer::from_json_string(synthetic().dump()).ok());
}

TEST(TokenizerErrors, NotJson) {
  for (const char* text : {"", "{", "[1, 2]", "{\"model\": }", "null"}) {
    Result<Tokenizer> t = Tokenizer::from_json_string(text);
    ASSERT_FALSE(t.ok()) << text;
    EXPECT_NE(t.status().message().find("tokenizer.json"), std::string::npos) << t.status().message();
  }
}

TEST(TokenizerErrors, MissingFile) {
  Result<Tokenizer> t = Tokenizer::load("/nonexistent/tokenizer.json");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), ErrorCode::io);
  EXPECT_NE(t.status().message().find("/nonexistent/tokenizer.json"), std::string::npos);
}

TEST(TokenizerErrors, UnsupportedComponents) {
  expect_error([](json& d) { d["model"]["type"] = "Unigram"; }, "model: type \"Unigram\" is unsupported");
  expect_error([](json& d) { d.erase("model"); }, "model: expected an object");
  expect_error([](json& d) { d["model"]["dropout"] = 0.1; }, "model: BPE with dropout");
  expect_error([](json& d) { d["model"]["byte_fallback"] = true; }, "byte_fallback");
  expect_error([](json& d) { d["normalizer"] = {{"type", "NFKC"}}; }, "normalizer: type \"NFKC\"");
  expect_error([](json& d) { d["normalizer"] = {{"type", "Sequence"}, {"normalizers", {{{"type", "Lowercase"}}}}}; },
               "normalizer: type \"Lowercase\"");
  expect_error([](json& d) { d["pre_tokenizer"] = {{"type", "Whitespace"}}; }, "pre_tokenizer: type \"Whitespace\"");
  expect_error([](json& d) { d["pre_tokenizer"] = nullptr; }, "pre_tokenizer: type \"null\"");
  expect_error([](json& d) { d["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Removed"; },
               "Split behavior \"Removed\"");
  expect_error([](json& d) { d["pre_tokenizer"]["pretokenizers"][0]["invert"] = true; }, "invert=true");
  expect_error([](json& d) { d["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {{"String", " "}}; },
               "String patterns");
  expect_error([](json& d) { d["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = true; },
               "add_prefix_space");
  expect_error([](json& d) { d["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(ab"; },
               "pre_tokenizer regex does not compile");
  expect_error([](json& d) { d["decoder"] = {{"type", "WordPiece"}}; }, "decoder: type \"WordPiece\"");
  expect_error([](json& d) { d.erase("decoder"); }, "decoder: type \"null\"");
}

TEST(TokenizerErrors, MalformedVocabMergesAndAddedTokens) {
  expect_error([](json& d) { d["model"]["vocab"] = json::array(); }, "model.vocab: expected an object");
  expect_error([](json& d) { d["model"]["vocab"]["zz"] = "seven"; }, "model.vocab[\"zz\"]: expected an id");
  expect_error([](json& d) { d["model"]["vocab"]["zz"] = -3; }, "model.vocab[\"zz\"]");
  expect_error([](json& d) { d["model"]["vocab"]["zz"] = 5; }, "id 5 is used by both");
  expect_error([](json& d) { d["model"]["merges"].push_back("abc"); }, "model.merges[9]: expected \"a b\"");
  expect_error([](json& d) { d["model"]["merges"].push_back("a b c"); }, "model.merges[9]");
  expect_error([](json& d) { d["model"]["merges"].push_back(json::array({"a"})); }, "model.merges[9]");
  expect_error([](json& d) { d["model"]["merges"].push_back(42); }, "model.merges[9]");
  expect_error([](json& d) { d["model"]["merges"].push_back("zq x"); }, "token \"zq\" is not in model.vocab");
  expect_error([](json& d) { d["model"]["merges"].push_back("a b"); }, "token \"ab\" is not in model.vocab");
  expect_error([](json& d) { d["model"]["merges"] = "h e"; }, "model.merges: expected an array");
  expect_error([](json& d) { d["added_tokens"].push_back({{"id", 7}}); }, "added_tokens[5]");
  expect_error([](json& d) { d["added_tokens"].push_back({{"id", -1}, {"content", "<x>"}}); }, "added_tokens[5]");
  expect_error([](json& d) { d["added_tokens"].push_back({{"id", 300}, {"content", ""}}); }, "added_tokens[5]");
  expect_error([](json& d) { d["added_tokens"][1]["id"] = d["added_tokens"][0]["id"]; }, "duplicate id");
  expect_error([](json& d) { d["added_tokens"] = {{"k", 1}}; }, "added_tokens");
  expect_error([](json& d) { d["added_tokens"][0]["lstrip"] = "yes"; }, "tokenizer.json");
}

}  // namespace
}  // namespace lily
