// The Anthropic Messages API: request translation onto the chat path (and its 400s), content blocks and the
// exact stream event sequence from generated text, error shapes.
#include "compat_test_util.h"
#include "server/anthropic_api.h"

namespace lily {
namespace {

using test::kCompatModel;

json weather_tool() {
  return {{"name", "get_weather"},
          {"description", "Weather of a city"},
          {"input_schema", test::weather_tool_schema()}};
}

json message(json extra = json::object()) {
  json body = {{"model", "tiny"}, {"max_tokens", 64}, {"messages", {{{"role", "user"}, {"content", "Hi"}}}}};
  for (auto& [k, v] : extra.items()) body[k] = v;
  return body;
}

std::pair<ChatRequest, ChatPrompt> translate(const json& body) {
  json chat_body;
  MaybeError e = anthropic_to_chat_body(body, false, chat_body);
  return test::chat_of(e, chat_body);
}

void expect_error(const json& body, const std::string& param, bool count_only = false) {
  json chat_body;
  MaybeError translated = anthropic_to_chat_body(body, count_only, chat_body);
  MaybeError e = test::first_error(translated, chat_body);
  if (e) e = as_messages_error(*e);
  ASSERT_TRUE(e.has_value()) << body.dump();
  EXPECT_EQ(e->status, 400) << e->message;
  EXPECT_EQ(e->param, param) << body.dump() << " -> " << e->message;
  json shape = json::parse(anthropic_error_body(*e));
  EXPECT_EQ(shape["type"], "error");
  EXPECT_EQ(shape["error"]["type"], "invalid_request_error");
  EXPECT_EQ(shape["error"]["message"], e->message);
}

TEST(AnthropicRequest, SystemBlocksToolRoundTripAndThinking) {
  json messages = {{{"role", "user"}, {"content", {{{"type", "text"}, {"text", "Weather in Paris?"}}}}},
                   {{"role", "assistant"},
                    {"content",
                     {{{"type", "thinking"}, {"thinking", "I should call the tool."}, {"signature", "x"}},
                      {{"type", "text"}, {"text", "Let me check."}},
                      {{"type", "tool_use"},
                       {"id", "toolu_1"},
                       {"name", "get_weather"},
                       {"input", {{"city", "Paris"}}}}}}},
                   {{"role", "user"},
                    {"content",
                     {{{"type", "tool_result"}, {"tool_use_id", "toolu_1"}, {"content", "sunny, 21 C"}},
                      {{"type", "text"}, {"text", "And tomorrow?"}}}}}};
  auto [chat, prompt] = translate(message({{"system", {{{"type", "text"}, {"text", "Be brief."}}}},
                                           {"messages", messages},
                                           {"tools", {weather_tool()}},
                                           {"thinking", {{"type", "enabled"}, {"budget_tokens", 1024}}},
                                           {"max_tokens", 2000}}));
  EXPECT_TRUE(prompt.text.starts_with("<|im_start|>system\n")) << prompt.text;
  EXPECT_LT(prompt.text.find("Be brief."), prompt.text.find("<|im_start|>user")) << prompt.text;
  EXPECT_NE(prompt.text.find("<function=get_weather>\n<parameter=city>\nParis"), std::string::npos)
      << prompt.text;
  EXPECT_NE(prompt.text.find("<tool_response>\nsunny, 21 C\n</tool_response>"), std::string::npos)
      << prompt.text;
  EXPECT_NE(prompt.text.find("And tomorrow?"), std::string::npos);
  EXPECT_TRUE(prompt.starts_in_reasoning);
  EXPECT_EQ(chat.sampling.overrides.max_tokens, 2000);
  // Thinking is off unless asked for, as in Anthropic's API.
  EXPECT_FALSE(translate(message()).second.starts_in_reasoning);
  EXPECT_TRUE(translate(message({{"thinking", {{"type", "adaptive"}}}})).second.starts_in_reasoning);
}

TEST(AnthropicRequest, ToolChoiceStopSequencesSamplingAndPrefill) {
  auto [any, any_prompt] =
      translate(message({{"tools", {weather_tool()}}, {"tool_choice", {{"type", "any"}}}}));
  EXPECT_EQ(any.tool_choice, ToolChoice::required);
  auto [named, named_prompt] = translate(
      message({{"tools", {weather_tool()}}, {"tool_choice", {{"type", "tool"}, {"name", "get_weather"}}}}));
  EXPECT_EQ(named.tool_choice, ToolChoice::named);
  EXPECT_TRUE(named_prompt.text.ends_with("<function=get_weather>\n"));
  EXPECT_EQ(translate(message({{"tools", {weather_tool()}}, {"tool_choice", {{"type", "none"}}}}))
                .first.tool_choice,
            ToolChoice::none);
  auto [s, sp] =
      translate(message({{"stop_sequences", {"END", "\n\nHuman:"}}, {"temperature", 0.5}, {"top_k", 5}}));
  EXPECT_EQ(s.sampling.params.stop, (std::vector<std::string>{"END", "\n\nHuman:"}));
  EXPECT_FLOAT_EQ(*s.sampling.overrides.temperature, 0.5f);
  EXPECT_EQ(*s.sampling.overrides.top_k, 5);
  // A final assistant message is a prefill: the reply continues it.
  json prefill = {{{"role", "user"}, {"content", "Say a number"}},
                  {{"role", "assistant"}, {"content", "The number is"}}};
  EXPECT_TRUE(translate(message({{"messages", prefill}})).second.text.ends_with("The number is"));
}

TEST(AnthropicRequest, ShapeErrorsNameTheField) {
  json no_max = message();
  no_max.erase("max_tokens");
  expect_error(no_max, "max_tokens");
  expect_error(message({{"max_tokens", 0}}), "max_tokens");
  expect_error(message({{"messages", json::array()}}), "messages");
  expect_error(message({{"messages", {{{"role", "system"}, {"content", "x"}}}}}), "messages[0].role");
  expect_error(
      message({{"messages", {{{"role", "user"}, {"content", {{{"type", "image"}, {"source", {}}}}}}}}}),
      "messages[0].content[0].type");
  expect_error(message({{"messages", {{{"role", "user"}, {"content", json::array()}}}}}),
               "messages[0].content");
  expect_error(message({{"messages", {{{"role", "user"}, {"content", {{{"type", "tool_result"}}}}}}}}),
               "messages[0].content[0].tool_use_id");
  expect_error(message({{"tools", {{{"type", "web_search_20250305"}, {"name", "web_search"}}}}}),
               "tools[0].type");
  expect_error(message({{"tools", {{{"name", "f"}}}}}), "tools[0].input_schema");
  expect_error(message({{"tool_choice", {{"type", "sometimes"}}}}), "tool_choice.type");
  expect_error(message({{"tool_choice", json::object()}}), "tool_choice");
  expect_error(message({{"tool_choice", "auto"}}), "tool_choice");
  expect_error(message({{"thinking", json::object()}}), "thinking");
  expect_error(message({{"thinking", {{"type", 1}}}}), "thinking");
  expect_error(message({{"tools", {weather_tool()}}, {"tool_choice", {{"type", "tool"}, {"name", "nope"}}}}),
               "tool_choice");
  expect_error(message({{"thinking", {{"type", "enabled"}, {"budget_tokens", 100}}}}),
               "thinking.budget_tokens");
  expect_error(message({{"thinking", {{"type", "enabled"}, {"budget_tokens", 2048}}}}),
               "thinking.budget_tokens");
  expect_error(message({{"thinking", {{"type", "adaptive"}}},
                        {"tools", {weather_tool()}},
                        {"tool_choice", {{"type", "any"}}}}),
               "tool_choice");
  expect_error(message({{"temperature", 1.5}}), "temperature");
  expect_error(message({{"stop_sequences", "END"}}), "stop_sequences");
  expect_error(message({{"stop_sequences", {"END", ""}}}),
               "stop_sequences[1]");  // checked as 'stop', named back
  json chat_body;
  ChatRequest chat;
  ASSERT_FALSE(anthropic_to_chat_body(message({{"model", "claude-sonnet"}}), false, chat_body));
  MaybeError unknown = parse_chat_request(chat_body, kCompatModel, chat);
  ASSERT_TRUE(unknown);
  EXPECT_EQ(json::parse(anthropic_error_body(*unknown))["error"]["type"], "not_found_error");
  json count = message();
  count.erase("max_tokens");
  EXPECT_FALSE(anthropic_to_chat_body(count, /*count_only=*/true, chat_body));  // count_tokens needs none
}

TEST(AnthropicResponse, StreamEventsInAnthropicsOrder) {
  auto [chat, prompt] =
      translate(message({{"tools", {weather_tool()}}, {"thinking", {{"type", "adaptive"}}}}));
  AnthropicResponseBuilder b(chat, prompt, {"msg_1", 0, "tiny", ""}, 20);
  std::string sse = b.stream_start();
  for (const std::string& text : test::reasoning_answer_call_pieces())
    sse += b.stream_piece({text, 1, 0, {}});
  sse += b.stream_finish(test::finished("stop"));
  auto events = test::named_events(sse);
  EXPECT_EQ(test::names_of(events),
            (std::vector<std::string>{"message_start", "content_block_start", "ping", "content_block_delta",
                                      "content_block_delta", "content_block_delta", "content_block_stop",
                                      "content_block_start", "content_block_delta", "content_block_delta",
                                      "content_block_stop", "content_block_start", "content_block_delta",
                                      "content_block_stop", "message_delta", "message_stop"}));
  for (const auto& [name, data] : events) EXPECT_EQ(data["type"], name);
  EXPECT_EQ(events[0].second["message"]["usage"]["input_tokens"], 20);
  EXPECT_EQ(events[1].second["content_block"],
            json({{"type", "thinking"}, {"thinking", ""}, {"signature", ""}}));
  EXPECT_EQ(events[3].second["delta"], json({{"type", "thinking_delta"}, {"thinking", "Let me"}}));
  EXPECT_EQ(events[5].second["delta"]["type"], "signature_delta");
  EXPECT_EQ(events[5].second["delta"]["signature"], thinking_signature("Let me think."));
  EXPECT_EQ(events[7].second["content_block"], json({{"type", "text"}, {"text", ""}}));
  EXPECT_EQ(events[7].second["index"], 1);
  EXPECT_EQ(events[11].second["content_block"]["type"], "tool_use");
  EXPECT_EQ(events[11].second["content_block"]["name"], "get_weather");
  EXPECT_EQ(events[11].second["content_block"]["input"], json::object());
  EXPECT_EQ(events[12].second["delta"]["type"], "input_json_delta");
  EXPECT_EQ(json::parse(events[12].second["delta"]["partial_json"].get<std::string>()),
            json({{"city", "Paris"}, {"days", 3}}));
  const json& md = events[14].second;
  EXPECT_EQ(md["delta"], json({{"stop_reason", "tool_use"}, {"stop_sequence", nullptr}}));
  EXPECT_EQ(md["usage"]["output_tokens"], 8);
  EXPECT_EQ(md["usage"]["input_tokens"], 15);  // without the 5 cached tokens
  EXPECT_EQ(md["usage"]["cache_read_input_tokens"], 5);
}

TEST(AnthropicResponse, MessageBlocksAndStopReasons) {
  auto [chat, prompt] =
      translate(message({{"tools", {weather_tool()}}, {"thinking", {{"type", "adaptive"}}}}));
  AnthropicResponseBuilder b(chat, prompt, {"msg_2", 0, "tiny", ""}, 20);
  for (const std::string& text : test::reasoning_answer_call_pieces()) b.add_piece({text, 1, 0, {}});
  json m = b.response(test::finished("stop"));
  EXPECT_EQ(m["type"], "message");
  EXPECT_EQ(m["role"], "assistant");
  ASSERT_EQ(m["content"].size(), 3u) << m.dump();
  EXPECT_EQ(m["content"][0], json({{"type", "thinking"},
                                   {"thinking", "Let me think."},
                                   {"signature", thinking_signature("Let me think.")}}));
  EXPECT_EQ(m["content"][1], json({{"type", "text"}, {"text", "Checking now."}}));
  EXPECT_EQ(m["content"][2]["input"], json({{"city", "Paris"}, {"days", 3}}));
  EXPECT_EQ(m["stop_reason"], "tool_use");

  auto [plain, plain_prompt] = translate(message());
  auto reason = [&](GenerationResult r) {
    AnthropicResponseBuilder p(plain, plain_prompt, {"msg_3", 0, "tiny", ""}, 20);
    p.add_piece({"Hello", 1, 0, {}});
    json out = p.response(r);
    return std::make_pair(out["stop_reason"], out["stop_sequence"]);
  };
  EXPECT_EQ(reason(test::finished("stop")), std::make_pair(json("end_turn"), json(nullptr)));
  EXPECT_EQ(reason(test::finished("length")), std::make_pair(json("max_tokens"), json(nullptr)));
  GenerationResult by_stop = test::finished("stop");
  by_stop.stop_string = "END";
  EXPECT_EQ(reason(by_stop), std::make_pair(json("stop_sequence"), json("END")));
}

TEST(AnthropicResponse, ErrorShapesAndPaths) {
  auto type_of = [](int status) {
    return json::parse(anthropic_error_body(ApiError{status, "x", "m", "", ""}))["error"]["type"];
  };
  EXPECT_EQ(type_of(400), "invalid_request_error");
  EXPECT_EQ(type_of(401), "authentication_error");
  EXPECT_EQ(type_of(404), "not_found_error");
  EXPECT_EQ(type_of(413), "request_too_large");
  EXPECT_EQ(type_of(429), "rate_limit_error");
  EXPECT_EQ(type_of(500), "api_error");
  EXPECT_EQ(type_of(503), "overloaded_error");
  auto stream = test::named_events(AnthropicResponseBuilder::stream_error(server_error(503, "busy")));
  ASSERT_EQ(stream.size(), 1u);
  EXPECT_EQ(stream[0].first, "error");
  EXPECT_EQ(stream[0].second["error"]["message"], "busy");
  EXPECT_TRUE(is_anthropic_path("/v1/messages"));
  EXPECT_TRUE(is_anthropic_path("/v1/messages/count_tokens"));
  EXPECT_FALSE(is_anthropic_path("/v1/messages_x"));
  EXPECT_FALSE(is_anthropic_path("/v1/chat/completions"));
}

}  // namespace
}  // namespace lily
