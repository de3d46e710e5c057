// No body makes the Anthropic or Responses path throw: every value of a full request, at every depth, is
// replaced in turn by values of every JSON type, and the translation, validation, rendering and a response
// built from it must end in a result or an ApiError.
#include <functional>

#include "compat_test_util.h"
#include "server/anthropic_api.h"
#include "server/responses_api.h"

namespace lily {
namespace {

const std::vector<json>& junk() {
  static const std::vector<json> values = {nullptr,
                                           0,
                                           -1,
                                           1.5,
                                           true,
                                           "",
                                           "x",
                                           json::array(),
                                           json::array({1}),
                                           json::object(),
                                           json{{"type", 1}},
                                           json{{"type", "text"}}};
  return values;
}

// Calls fn with every copy of `body` in which one value (at any depth) is replaced by one of junk().
void for_each_mutation(const json& body, const std::function<void(const json&)>& fn) {
  std::function<void(json&, json&)> walk = [&](json& root, json& node) {
    auto mutate = [&](json& slot) {
      const json saved = slot;
      for (const json& j : junk()) {
        slot = j;
        fn(root);
      }
      slot = saved;
      walk(root, slot);
    };
    if (node.is_object()) {
      for (auto& [key, value] : node.items()) mutate(value);
    } else if (node.is_array()) {
      for (json& value : node) mutate(value);
    }
  };
  json copy = body;
  walk(copy, copy);
}

GenerationResult done() {
  return test::finished("stop");
}

void run_messages(const json& body) {
  json chat_body;
  ChatRequest chat;
  if (anthropic_to_chat_body(body, false, chat_body)) return;
  if (parse_chat_request(chat_body, test::kCompatModel, chat)) return;
  Result<ChatPrompt> prompt = build_chat_prompt(chat);
  if (!prompt.ok()) return;
  AnthropicResponseBuilder b(chat, *prompt, {"msg_1", 0, "tiny", ""}, 10);
  std::string out = b.stream_start();
  for (const std::string& text : test::reasoning_answer_call_pieces())
    out += b.stream_piece({text, 1, 0, {}});
  out += b.stream_finish(done());
  EXPECT_FALSE(out.empty());
}

void run_responses(const json& body) {
  json chat_body;
  ChatRequest chat;
  if (responses_to_chat_body(body, chat_body)) return;
  if (parse_chat_request(chat_body, test::kCompatModel, chat)) return;
  Result<ChatPrompt> prompt = build_chat_prompt(chat);
  if (!prompt.ok()) return;
  ResponsesBuilder b(chat, *prompt, body, {"resp_1", 0, "tiny", ""});
  for (const std::string& text : test::reasoning_answer_call_pieces()) b.add_piece({text, 1, 0, {}});
  EXPECT_TRUE(b.response(done()).is_object());
}

TEST(CompatRobustness, NoMessagesBodyThrows) {
  json body = {
      {"model", "tiny"},
      {"max_tokens", 64},
      {"system", {{{"type", "text"}, {"text", "Be brief."}}}},
      {"messages",
       {{{"role", "user"}, {"content", {{{"type", "text"}, {"text", "Weather?"}}}}},
        {{"role", "assistant"},
         {"content",
          {{{"type", "thinking"}, {"thinking", "call it"}, {"signature", "s"}},
           {{"type", "tool_use"}, {"id", "t1"}, {"name", "get_weather"}, {"input", {{"city", "Paris"}}}}}}},
        {{"role", "user"},
         {"content",
          {{{"type", "tool_result"}, {"tool_use_id", "t1"}, {"content", "sunny"}, {"is_error", false}}}}}}},
      {"tools",
       {{{"name", "get_weather"}, {"description", "d"}, {"input_schema", test::weather_tool_schema()}}}},
      {"tool_choice", {{"type", "auto"}}},
      {"thinking", {{"type", "enabled"}, {"budget_tokens", 1024}}},
      {"stop_sequences", {"END"}},
      {"temperature", 0.5},
      {"metadata", {{"user_id", "u"}}}};
  body["max_tokens"] = 2048;
  size_t n = 0;
  for_each_mutation(body, [&](const json& b) {
    ++n;
    EXPECT_NO_THROW(run_messages(b)) << b.dump();
  });
  EXPECT_GT(n, 500u);
}

TEST(CompatRobustness, NoResponsesBodyThrows) {
  json body = {
      {"model", "tiny"},
      {"instructions", "Be brief."},
      {"input",
       {{{"type", "message"},
         {"role", "user"},
         {"content", {{{"type", "input_text"}, {"text", "Weather?"}}}}},
        {{"type", "reasoning"},
         {"content", {{{"type", "reasoning_text"}, {"text", "call it"}}}},
         {"summary", json::array()}},
        {{"type", "function_call"},
         {"call_id", "c1"},
         {"name", "get_weather"},
         {"arguments", "{\"city\":\"Paris\"}"}},
        {{"type", "function_call_output"}, {"call_id", "c1"}, {"output", "sunny"}}}},
      {"tools",
       {{{"type", "function"}, {"name", "get_weather"}, {"parameters", test::weather_tool_schema()}}}},
      {"tool_choice", {{"type", "function"}, {"name", "get_weather"}}},
      {"reasoning", {{"effort", "low"}}},
      {"text", {{"format", {{"type", "text"}}}}},
      {"max_output_tokens", 64},
      {"store", false},
      {"parallel_tool_calls", true},
      {"metadata", {{"k", "v"}}}};
  size_t n = 0;
  for_each_mutation(body, [&](const json& b) {
    ++n;
    EXPECT_NO_THROW(run_responses(b)) << b.dump();
  });
  EXPECT_GT(n, 500u);
}

TEST(CompatRobustness, NoChatBodyWithTheVllmFieldsThrows) {
  json body = {
      {"model", "tiny"},
      {"messages", {{{"role", "user"}, {"content", "Hi"}}, {{"role", "assistant"}, {"content", "The"}}}},
      {"continue_final_message", true},
      {"add_generation_prompt", false},
      {"min_tokens", 2},
      {"max_tokens", 8},
      {"stop_token_ids", {1, 2}},
      {"stop", {"END"}},
      {"include_stop_str_in_output", true},
      {"reasoning_effort", "low"},
      {"chat_template_kwargs", {{"enable_thinking", true}, {"preserve_thinking", false}}}};
  size_t n = 0;
  for_each_mutation(body, [&](const json& b) {
    ++n;
    EXPECT_NO_THROW({
      ChatRequest chat;
      if (!parse_chat_request(b, test::kCompatModel, chat)) (void)build_chat_prompt(chat);
    }) << b.dump();
  });
  EXPECT_GT(n, 200u);
}

}  // namespace
}  // namespace lily
