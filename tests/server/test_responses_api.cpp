// The OpenAI Responses API: input items onto the chat path (and the 400s), output items and the exact stream
// event sequence (with sequence numbers) from generated text.
#include "compat_test_util.h"
#include "server/responses_api.h"

namespace lily {
namespace {

using test::kCompatModel;

json weather_tool() {
  return {{"type", "function"},
          {"name", "get_weather"},
          {"description", "Weather of a city"},
          {"parameters", test::weather_tool_schema()}};
}

json request(json extra = json::object()) {
  json body = {{"model", "tiny"}, {"input", "Hi"}};
  for (auto& [k, v] : extra.items()) body[k] = v;
  return body;
}

std::pair<ChatRequest, ChatPrompt> translate(const json& body) {
  json chat_body;
  MaybeError e = responses_to_chat_body(body, chat_body);
  return test::chat_of(e, chat_body);
}

void expect_error(const json& body, const std::string& param, const std::string& code = "") {
  json chat_body;
  MaybeError translated = responses_to_chat_body(body, chat_body);
  MaybeError e = test::first_error(translated, chat_body);
  if (e) e = as_responses_error(*e);
  ASSERT_TRUE(e.has_value()) << body.dump();
  EXPECT_EQ(e->status, 400) << e->message;
  EXPECT_EQ(e->param, param) << body.dump() << " -> " << e->message;
  if (!code.empty()) {
    EXPECT_EQ(e->code, code) << e->message;
  }
}

TEST(ResponsesRequest, InputItemsInstructionsAndAFunctionRoundTrip) {
  json input = {{{"type", "message"},
                 {"role", "user"},
                 {"content", {{{"type", "input_text"}, {"text", "Weather in Paris?"}}}}},
                {{"type", "reasoning"},
                 {"id", "rs_1"},
                 {"summary", json::array()},
                 {"content", {{{"type", "reasoning_text"}, {"text", "Call the tool."}}}}},
                {{"type", "function_call"},
                 {"call_id", "call_1"},
                 {"name", "get_weather"},
                 {"arguments", "{\"city\":\"Paris\"}"}},
                {{"type", "function_call_output"}, {"call_id", "call_1"}, {"output", "sunny, 21 C"}},
                {{"role", "user"}, {"content", "Thanks"}}};
  auto [chat, prompt] = translate(request({{"input", input},
                                           {"instructions", "Be brief."},
                                           {"tools", {weather_tool()}},
                                           {"max_output_tokens", 50},
                                           {"temperature", 0.2}}));
  EXPECT_LT(prompt.text.find("Be brief."), prompt.text.find("<|im_start|>user")) << prompt.text;
  EXPECT_NE(prompt.text.find("<function=get_weather>\n<parameter=city>\nParis"), std::string::npos)
      << prompt.text;
  EXPECT_NE(prompt.text.find("<tool_response>\nsunny, 21 C\n</tool_response>"), std::string::npos)
      << prompt.text;
  EXPECT_EQ(chat.messages[2]["reasoning_content"], "Call the tool.");  // after the system and user messages
  EXPECT_EQ(chat.sampling.overrides.max_tokens, 50);
  EXPECT_TRUE(prompt.starts_in_reasoning);  // reasoning on unless the effort says none
  EXPECT_FALSE(translate(request({{"reasoning", {{"effort", "minimal"}}}})).second.starts_in_reasoning);
  EXPECT_TRUE(translate(request({{"reasoning", {{"effort", "high"}}}})).second.starts_in_reasoning);
  auto [named, named_prompt] = translate(request(
      {{"tools", {weather_tool()}}, {"tool_choice", {{"type", "function"}, {"name", "get_weather"}}}}));
  EXPECT_EQ(named.tool_choice, ToolChoice::named);
  EXPECT_EQ(translate(request({{"tools", {weather_tool()}}, {"tool_choice", "required"}})).first.tool_choice,
            ToolChoice::required);
}

TEST(ResponsesRequest, RefusedAndMalformed) {
  expect_error(request({{"previous_response_id", "resp_1"}}), "previous_response_id",
               "unsupported_parameter");
  expect_error(request({{"conversation", "conv_1"}}), "conversation", "unsupported_parameter");
  expect_error(request({{"background", true}}), "background", "unsupported_parameter");
  json no_input = request();
  no_input.erase("input");
  expect_error(no_input, "input", "missing_required_parameter");
  expect_error(request({{"input", 3}}), "input", "invalid_type");
  expect_error(request({{"input", json::array()}}), "input");
  expect_error(request({{"input", {{{"type", "item_reference"}, {"id", "x"}}}}}), "input[0].type",
               "unsupported_value");
  expect_error(
      request(
          {{"input", {{{"role", "user"}, {"content", {{{"type", "input_image"}, {"image_url", "u"}}}}}}}}),
      "input[0].content[0].type", "unsupported_content_type");
  expect_error(request({{"input", {{{"type", "function_call"}, {"name", "f"}, {"arguments", "{}"}}}}}),
               "input[0].call_id");
  expect_error(request({{"tools", {{{"type", "web_search"}}}}}), "tools[0].type", "unsupported_value");
  expect_error(request({{"tools", {{{"type", "function"}}}}}), "tools[0].name");
  expect_error(request({{"reasoning", {{"effort", "extreme"}}}}), "reasoning.effort", "invalid_value");
  expect_error(request({{"max_output_tokens", 0}}), "max_output_tokens");
  expect_error(
      request({{"text", {{"format", {{"type", "json_schema"}, {"name", "x"}, {"schema", json::object()}}}}}}),
      "text.format.type");
}

TEST(ResponsesResponse, StreamEventsAndSequenceNumbers) {
  auto [chat, prompt] = translate(request({{"tools", {weather_tool()}}}));
  ResponsesBuilder b(chat, prompt, request({{"tools", {weather_tool()}}}), {"resp_1", 7, "tiny", ""});
  std::string sse = b.stream_start();
  for (const std::string& text : test::reasoning_answer_call_pieces())
    sse += b.stream_piece({text, 1, 0, {}});
  sse += b.stream_finish(test::finished("stop"));
  auto events = test::named_events(sse);
  EXPECT_EQ(test::names_of(events), (std::vector<std::string>{"response.created",
                                                              "response.in_progress",
                                                              "response.output_item.added",
                                                              "response.content_part.added",
                                                              "response.reasoning_text.delta",
                                                              "response.reasoning_text.delta",
                                                              "response.reasoning_text.done",
                                                              "response.content_part.done",
                                                              "response.output_item.done",
                                                              "response.output_item.added",
                                                              "response.content_part.added",
                                                              "response.output_text.delta",
                                                              "response.output_text.delta",
                                                              "response.output_text.done",
                                                              "response.content_part.done",
                                                              "response.output_item.done",
                                                              "response.output_item.added",
                                                              "response.function_call_arguments.delta",
                                                              "response.function_call_arguments.done",
                                                              "response.output_item.done",
                                                              "response.completed"}));
  for (size_t i = 0; i < events.size(); ++i) {
    EXPECT_EQ(events[i].second["type"], events[i].first);
    EXPECT_EQ(events[i].second["sequence_number"], i);
  }
  EXPECT_EQ(events[0].second["response"]["status"], "in_progress");
  EXPECT_EQ(events[3].second["part"], json({{"type", "reasoning_text"}, {"text", ""}}));
  EXPECT_EQ(events[6].second["text"], "Let me think.");
  EXPECT_EQ(events[11].second["delta"], "Checking");
  EXPECT_EQ(events[13].second["text"], "Checking now.");
  EXPECT_EQ(events[16].second["item"]["type"], "function_call");
  EXPECT_EQ(events[16].second["output_index"], 2);
  EXPECT_EQ(json::parse(events[18].second["arguments"].get<std::string>()),
            json({{"city", "Paris"}, {"days", 3}}));
  const json& done = events.back().second["response"];
  EXPECT_EQ(done["status"], "completed");
  ASSERT_EQ(done["output"].size(), 3u);
  EXPECT_EQ(done["output"][0]["type"], "reasoning");
  EXPECT_EQ(done["output"][1]["content"][0]["text"], "Checking now.");
  EXPECT_EQ(done["output"][2]["name"], "get_weather");
  EXPECT_EQ(done["usage"]["input_tokens"], 20);
  EXPECT_EQ(done["usage"]["input_tokens_details"]["cached_tokens"], 5);
  EXPECT_EQ(done["usage"]["output_tokens_details"]["reasoning_tokens"], 3);  // up to the piece with </think>
  EXPECT_EQ(done["tools"][0]["name"], "get_weather");                        // echoed as sent
  EXPECT_EQ(done["store"], false);
}

TEST(ResponsesResponse, IncompleteAtTheTokenLimitAndErrorEvent) {
  auto [chat, prompt] = translate(request({{"reasoning", {{"effort", "none"}}}}));
  ResponsesBuilder b(chat, prompt, request(), {"resp_2", 7, "tiny", ""});
  b.add_piece({"Hello", 1, 0, {}});
  json r = b.response(test::finished("length"));
  EXPECT_EQ(r["status"], "incomplete");
  EXPECT_EQ(r["incomplete_details"], json({{"reason", "max_output_tokens"}}));
  ASSERT_EQ(r["output"].size(), 1u);
  EXPECT_EQ(r["output"][0]["status"], "incomplete");
  EXPECT_EQ(r["output"][0]["content"][0]["text"], "Hello");
  EXPECT_EQ(r["usage"]["output_tokens_details"]["reasoning_tokens"], 0);

  ResponsesBuilder s(chat, prompt, request(), {"resp_3", 7, "tiny", ""});
  std::string sse =
      s.stream_start() + s.stream_piece({"Hi", 1, 0, {}}) + s.stream_finish(test::finished("length"));
  EXPECT_EQ(test::named_events(sse).back().first, "response.incomplete");
  auto err = test::named_events(s.stream_error(server_error(503, "shutting down", "shutting_down")));
  ASSERT_EQ(err.size(), 1u);
  EXPECT_EQ(err[0].first, "error");
  EXPECT_EQ(err[0].second["code"], "shutting_down");
  EXPECT_EQ(err[0].second["message"], "shutting down");
}

}  // namespace
}  // namespace lily
