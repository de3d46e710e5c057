// The native Qwen3.6 chat format against transformers' rendering of the official Jinja template:
// every request under tests/fixtures/chat/ (written by tools/reference/render_chat.py) must render
// byte for byte, or fail with the template's exact error text.
#include "tokenizer/chat_format.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace lily {
namespace {

using json = nlohmann::ordered_json;
namespace fs = std::filesystem;

const fs::path kFixtureDir = fs::path(LILY_SOURCE_DIR) / "tests" / "fixtures" / "chat";

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<std::string> fixture_names() {
  std::vector<std::string> names;
  if (!fs::is_directory(kFixtureDir)) return names;
  for (const auto& entry : fs::directory_iterator(kFixtureDir)) {
    if (entry.path().extension() == ".json") names.push_back(entry.path().stem().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

TEST(ChatFixtures, AtLeastFortyCases) {
  const auto names = fixture_names();
  EXPECT_GE(names.size(), 40u) << "fixtures missing under " << kFixtureDir;
  size_t n_errors = 0;
  for (const auto& name : names) n_errors += fs::exists(kFixtureDir / (name + ".error.txt"));
  EXPECT_GE(n_errors, 6u);
}

class ChatFixture : public ::testing::TestWithParam<std::string> {};

TEST_P(ChatFixture, MatchesTransformers) {
  const std::string& name = GetParam();
  const json request = json::parse(read_file(kFixtureDir / (name + ".json")));
  Result<std::string> rendered = render_chat_request(request);
  const fs::path prompt_path = kFixtureDir / (name + ".prompt.txt");
  const fs::path error_path = kFixtureDir / (name + ".error.txt");
  if (fs::exists(prompt_path)) {
    ASSERT_TRUE(rendered.ok()) << rendered.status().message();
    EXPECT_EQ(rendered.value(), read_file(prompt_path));
  } else {
    ASSERT_TRUE(fs::exists(error_path)) << "no expected output for " << name;
    ASSERT_FALSE(rendered.ok()) << "expected an error, rendered:\n" << rendered.value();
    EXPECT_EQ(rendered.status().code(), ErrorCode::invalid_argument);
    EXPECT_EQ(rendered.status().message(), read_file(error_path));
  }
}

INSTANTIATE_TEST_SUITE_P(Qwen36, ChatFixture, ::testing::ValuesIn(fixture_names()),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

// ---- hf_tojson and friends (json.dumps(ensure_ascii=False) values checked in Python) ------------

TEST(HfToJson, FloatsAsPythonRepr) {
  EXPECT_EQ(python_float_repr(1.0), "1.0");
  EXPECT_EQ(python_float_repr(1e-06), "1e-06");
  EXPECT_EQ(python_float_repr(0.1), "0.1");
  EXPECT_EQ(python_float_repr(0.0001), "0.0001");
  EXPECT_EQ(python_float_repr(0.00001), "1e-05");
  EXPECT_EQ(python_float_repr(1e15), "1000000000000000.0");
  EXPECT_EQ(python_float_repr(1e16), "1e+16");
  EXPECT_EQ(python_float_repr(123456789012345678.0), "1.2345678901234568e+17");
  EXPECT_EQ(python_float_repr(-0.0), "-0.0");
  EXPECT_EQ(python_float_repr(1.5e-7), "1.5e-07");
  EXPECT_EQ(python_float_repr(2.5e300), "2.5e+300");
  EXPECT_EQ(python_float_repr(5e-324), "5e-324");
  EXPECT_EQ(python_float_repr(-1234.5), "-1234.5");
  EXPECT_EQ(python_float_repr(100.0), "100.0");
}

TEST(HfToJson, SeparatorsOrderAndEscapes) {
  const json v = json::parse(R"({"z": 1, "a": [true, null, 2.5, "x"], "s": "q\"b\\n\n\t\u0001\u007f é 😀", "e": {}})");
  EXPECT_EQ(hf_tojson(v),
            "{\"z\": 1, \"a\": [true, null, 2.5, \"x\"], \"s\": \"q\\\"b\\\\n\\n\\t\\u0001\x7f é 😀\", \"e\": {}}");
  EXPECT_EQ(hf_tojson(json::array()), "[]");
  EXPECT_EQ(hf_tojson(json(18446744073709551615ull)), "18446744073709551615");
  EXPECT_EQ(hf_tojson(json(-7)), "-7");
}

TEST(HfToJson, PythonStrOfValues) {
  EXPECT_EQ(python_str(json(nullptr)), "None");
  EXPECT_EQ(python_str(json(true)), "True");
  EXPECT_EQ(python_str(json("raw 'text'")), "raw 'text'");
  EXPECT_EQ(python_str(json::parse(R"({"k": "v'q", "n": [1, 2.5, false], "d": "a\"b'c\n"})")),
            R"({'k': "v'q", 'n': [1, 2.5, False], 'd': 'a"b\'c\n'})");
}

// ---- Direct API and errors that transformers reports before the template runs -----------------

json user_message(const std::string& text) { return json{{"role", "user"}, {"content", text}}; }

TEST(RenderChat, OptionsStruct) {
  const json messages = json::array({user_message("Hi")});
  ChatOptions options;
  EXPECT_EQ(render_chat(messages, nullptr, options).value(),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n");
  options.enable_thinking = false;
  EXPECT_EQ(render_chat(messages, nullptr, options).value(),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
  options.add_generation_prompt = false;
  EXPECT_EQ(render_chat(messages, json::array(), options).value(), "<|im_start|>user\nHi<|im_end|>\n");
}

TEST(RenderChat, NoMessages) {
  auto r = render_chat(json::array(), nullptr, ChatOptions{});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), "No messages provided.");
}

TEST(RenderChat, BadShapesAreErrors) {
  EXPECT_FALSE(render_chat(json::object(), nullptr, ChatOptions{}).ok());
  EXPECT_FALSE(render_chat(json::array({"not an object"}), nullptr, ChatOptions{}).ok());
  EXPECT_FALSE(render_chat(json::array({user_message("x")}), json::object(), ChatOptions{}).ok());
  EXPECT_FALSE(render_chat(json::array({user_message("x")}), json::array({"tool"}), ChatOptions{}).ok());
  EXPECT_FALSE(render_chat_request(json::parse(R"({"model": "m"})")).ok());
  EXPECT_FALSE(render_chat_request(json::parse(R"({"messages": [], "chat_template_kwargs": 3})")).ok());
  EXPECT_FALSE(render_chat_request(json::parse(R"([1])")).ok());
}

Result<std::string> render_with_call(const json& tool_call) {
  json messages = json::array({user_message("q")});
  messages.push_back(json{{"role", "assistant"}, {"content", nullptr}, {"tool_calls", json::array({tool_call})}});
  return render_chat(messages, nullptr, ChatOptions{});
}

TEST(RenderChat, ArgumentsStringMustHoldAnObject) {
  for (const char* bad : {"[1, 2]", "\"text\"", "{\"a\": ", "", "42"}) {
    auto r = render_with_call(json{{"function", {{"name", "f"}, {"arguments", bad}}}});
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find("messages[1].tool_calls[0].function.arguments"), std::string::npos)
        << r.status().message();
  }
  auto ok = render_with_call(json{{"function", {{"name", "f"}, {"arguments", "{\"b\": 2, \"a\": \"x\"}"}}}});
  ASSERT_TRUE(ok.ok()) << ok.status().message();
  EXPECT_NE(ok.value().find("<parameter=b>\n2\n</parameter>\n<parameter=a>\nx\n</parameter>\n"), std::string::npos);
}

TEST(RenderChat, ToolCallNeedsStringName) {
  EXPECT_FALSE(render_with_call(json{{"function", {{"arguments", json::object()}}}}).ok());
  EXPECT_FALSE(render_with_call(json{{"function", {{"name", 5}}}}).ok());
  EXPECT_FALSE(render_with_call(json{{"function", nullptr}, {"name", "f"}}).ok());
  EXPECT_FALSE(render_with_call(json{{"function", {{"name", "f"}, {"arguments", nullptr}}}}).ok());
  EXPECT_FALSE(render_with_call(json("just a string")).ok());
}

TEST(RenderChat, DeepNestingIsAnErrorNotACrash) {
  const std::string deep = std::string(5000, '[') + std::string(5000, ']');
  json messages = json::array({json{{"role", "user"}, {"content", "q"}, {"extra", json::parse(deep)}}});
  EXPECT_FALSE(render_chat(messages, nullptr, ChatOptions{}).ok());
  EXPECT_FALSE(render_chat(json::array({user_message("q")}), json::array({json::parse(deep)}), ChatOptions{}).ok());
  auto r = render_with_call(json{{"function", {{"name", "f"}, {"arguments", "{\"a\": " + deep + "}"}}}});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("nested deeper"), std::string::npos) << r.status().message();
  EXPECT_TRUE(json_depth_within(json::parse("[[1], {\"a\": [2]}]"), 3));
  EXPECT_FALSE(json_depth_within(json::parse("[[1], {\"a\": [2]}]"), 2));
  EXPECT_TRUE(json_depth_within(json(5), 0));
}

TEST(RenderChat, NonIterableContentPartIsAnError) {
  const json messages = json::array({json{{"role", "user"}, {"content", json::array({5})}}});
  auto r = render_chat(messages, nullptr, ChatOptions{});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("messages[0].content[0]"), std::string::npos) << r.status().message();
}

}  // namespace
}  // namespace lily
