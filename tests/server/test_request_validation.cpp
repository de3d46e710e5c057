// Request validation: every bad input gets a 400 (or 404) naming the field, good inputs parse into what the
// engine needs, and tool_choice shapes the rendered prompt as documented.
#include <gtest/gtest.h>

#include "server/chat_request.h"
#include "chat_test_util.h"
#include "tokenizer/pretokenize_utf8.h"

namespace lily {
namespace {

const ServedModel& kModel = test::kChatModel;

json chat(json extra = json::object()) { return test::chat_body(extra); }

MaybeError parse(const json& body, ChatRequest* out = nullptr) {
  ChatRequest r;
  MaybeError e = parse_chat_request(body, kModel, r);
  if (out) *out = r;
  return e;
}

void expect_error(const json& body, int status, const std::string& param, const std::string& code = "") {
  MaybeError e = parse(body);
  ASSERT_TRUE(e.has_value()) << body.dump();
  EXPECT_EQ(e->status, status) << body.dump() << " -> " << e->message;
  EXPECT_EQ(e->param, param) << body.dump() << " -> " << e->message;
  EXPECT_EQ(e->type, "invalid_request_error");
  if (!code.empty()) {
    EXPECT_EQ(e->code, code) << e->message;
  }
  EXPECT_FALSE(e->message.empty());
}

TEST(ChatRequestValidation, GoodMinimalRequest) {
  ChatRequest r;
  ASSERT_FALSE(parse(chat(), &r));
  EXPECT_EQ(r.messages.size(), 1u);
  EXPECT_FALSE(r.stream.stream);
  EXPECT_TRUE(r.stream.reuse_cache);
  EXPECT_EQ(r.tool_choice, ToolChoice::automatic);
  EXPECT_TRUE(r.chat.enable_thinking);
}

TEST(ChatRequestValidation, ModelAndMessages) {
  expect_error(json{{"messages", chat()["messages"]}}, 400, "model", "missing_required_parameter");
  expect_error(chat({{"model", 7}}), 400, "model", "invalid_type");
  expect_error(chat({{"model", "gpt-4o"}}), 404, "model", "model_not_found");
  expect_error(json{{"model", "tiny"}}, 400, "messages", "missing_required_parameter");
  expect_error(chat({{"messages", json::array()}}), 400, "messages");
  expect_error(chat({{"messages", "hi"}}), 400, "messages", "invalid_type");
  expect_error(chat({{"messages", {42}}}), 400, "messages[0]", "invalid_type");
  expect_error(chat({{"messages", {{{"content", "x"}}}}}), 400, "messages[0].role");
  expect_error(chat({{"messages", {{{"role", "wizard"}, {"content", "x"}}}}}), 400, "messages[0].role",
               "invalid_value");
  expect_error(chat({{"messages", {{{"role", "user"}}}}}), 400, "messages[0].content");
  expect_error(chat({{"messages", {{{"role", "user"}, {"content", 5}}}}}), 400, "messages[0].content");
  json image = {{{"role", "user"}, {"content", {{{"type", "image_url"}, {"image_url", {{"url", "x"}}}}}}}};
  expect_error(chat({{"messages", image}}), 400, "messages[0].content[0].type", "unsupported_content_type");
  json bad_call = {
      {{"role", "user"}, {"content", "x"}},
      {{"role", "assistant"}, {"tool_calls", {{{"function", {{"name", "f"}, {"arguments", "[1]"}}}}}}}};
  expect_error(chat({{"messages", bad_call}}), 400, "messages[1].tool_calls[0].function.arguments");
}

TEST(ChatRequestValidation, EveryRoleAndTextParts) {
  json messages = {
      {{"role", "developer"}, {"content", "Be brief."}},
      {{"role", "user"},
       {"content", {{{"type", "text"}, {"text", "What is "}}, {{"type", "text"}, {"text", "2+2?"}}}}},
      {{"role", "assistant"},
       {"content", nullptr},
       {"reasoning_content", "add"},
       {"tool_calls",
        {{{"id", "c1"},
          {"type", "function"},
          {"function", {{"name", "add"}, {"arguments", "{\"a\": 2, \"b\": 2}"}}}}}}},
      {{"role", "tool"}, {"tool_call_id", "c1"}, {"content", "4"}},
  };
  ChatRequest r;
  ASSERT_FALSE(parse(chat({{"messages", messages}}), &r));
  EXPECT_EQ(r.messages[0]["role"], "system");  // developer reads as system
  Result<ChatPrompt> p = build_chat_prompt(r);
  ASSERT_TRUE(p.ok()) << p.status().message();
  EXPECT_TRUE(p->text.starts_with("<|im_start|>system\nBe brief.<|im_end|>\n")) << p->text;
  EXPECT_NE(p->text.find("What is 2+2?"), std::string::npos);
  EXPECT_NE(p->text.find("<tool_response>\n4\n</tool_response>"), std::string::npos) << p->text;
  EXPECT_TRUE(p->starts_in_reasoning);
}

TEST(ChatRequestValidation, SamplingRangesAndTypes) {
  expect_error(chat({{"temperature", 2.5}}), 400, "temperature", "invalid_value");
  expect_error(chat({{"temperature", -0.1}}), 400, "temperature", "invalid_value");
  expect_error(chat({{"temperature", "hot"}}), 400, "temperature", "invalid_type");
  expect_error(chat({{"top_p", 0}}), 400, "top_p", "invalid_value");
  expect_error(chat({{"top_p", 1.5}}), 400, "top_p");
  expect_error(chat({{"top_k", 1.5}}), 400, "top_k", "invalid_type");
  expect_error(chat({{"top_k", -2}}), 400, "top_k");
  expect_error(chat({{"min_p", 2}}), 400, "min_p");
  expect_error(chat({{"presence_penalty", 3}}), 400, "presence_penalty");
  expect_error(chat({{"frequency_penalty", -2.5}}), 400, "frequency_penalty");
  expect_error(chat({{"max_tokens", -5}}), 400, "max_tokens", "invalid_value");
  expect_error(chat({{"max_tokens", 0}}), 400, "max_tokens");
  expect_error(chat({{"max_completion_tokens", "10"}}), 400, "max_completion_tokens", "invalid_type");
  expect_error(chat({{"seed", "abc"}}), 400, "seed");
  expect_error(chat({{"stop", 5}}), 400, "stop");
  expect_error(chat({{"stop", {"ok", ""}}}), 400, "stop[1]");
  expect_error(chat({{"logit_bias", {{"abc", 1}}}}), 400, "logit_bias");
  expect_error(chat({{"logit_bias", {{"999999999", 1}}}}), 400, "logit_bias");
  expect_error(chat({{"logit_bias", {{"5", 101}}}}), 400, "logit_bias.5");
  expect_error(chat({{"n", 2}}), 400, "n", "unsupported_value");
  expect_error(chat({{"logprobs", "yes"}}), 400, "logprobs");
  expect_error(chat({{"top_logprobs", 3}}), 400, "top_logprobs");
  expect_error(chat({{"logprobs", true}, {"top_logprobs", 21}}), 400, "top_logprobs");
  expect_error(chat({{"stream", 1}}), 400, "stream");
  expect_error(chat({{"stream_options", {{"include_usage", true}}}}), 400, "stream_options");
}

TEST(ChatRequestValidation, SamplingFieldsReachTheRequest) {
  ChatRequest r;
  ASSERT_FALSE(parse(chat({{"temperature", 0},
                           {"top_p", 0.5},
                           {"top_k", 7},
                           {"min_p", 0.1},
                           {"seed", 42},
                           {"presence_penalty", 0.5},
                           {"frequency_penalty", -0.5},
                           {"stop", "END"},
                           {"max_tokens", 10},
                           {"max_completion_tokens", 12},
                           {"logprobs", true},
                           {"top_logprobs", 3},
                           {"logit_bias", {{"17", -100}}},
                           {"n", 1},
                           {"stream", true},
                           {"stream_options", {{"include_usage", true}}},
                           {"cache_prompt", false},
                           {"chat_template_kwargs", {{"enable_thinking", false}}}}),
                     &r));
  const SamplingRequest& s = r.sampling;
  EXPECT_EQ(*s.overrides.temperature, 0.0f);
  EXPECT_EQ(*s.overrides.top_p, 0.5f);
  EXPECT_EQ(*s.overrides.top_k, 7);
  EXPECT_FLOAT_EQ(*s.overrides.min_p, 0.1f);
  EXPECT_EQ(*s.overrides.max_tokens, 12);  // max_completion_tokens wins
  EXPECT_EQ(*s.params.seed, 42u);
  EXPECT_EQ(s.params.presence_penalty, 0.5f);
  EXPECT_EQ(s.params.frequency_penalty, -0.5f);
  EXPECT_EQ(s.params.stop, std::vector<std::string>{"END"});
  EXPECT_EQ(s.params.logit_bias.at(17), -100.0f);
  EXPECT_TRUE(r.logprobs);
  EXPECT_EQ(r.top_logprobs, 3);
  EXPECT_TRUE(r.stream.stream && r.stream.include_usage);
  EXPECT_FALSE(r.stream.reuse_cache);
  EXPECT_FALSE(r.chat.enable_thinking);
  ChatRequest nulls;  // null means absent
  ASSERT_FALSE(parse(chat({{"temperature", nullptr}, {"stop", nullptr}, {"tools", nullptr}}), &nulls));
  EXPECT_FALSE(nulls.sampling.overrides.temperature.has_value());
}

json weather_tool(json params = {{"type", "object"},
                                 {"properties", {{"city", {{"type", "string"}}}}},
                                 {"required", {"city"}}}) {
  return {{"type", "function"},
          {"function", {{"name", "get_weather"}, {"description", "Weather"}, {"parameters", params}}}};
}

TEST(ChatRequestValidation, ToolsAndToolChoice) {
  expect_error(chat({{"tools", "x"}}), 400, "tools", "invalid_type");
  expect_error(chat({{"tools", {{{"type", "retrieval"}}}}}), 400, "tools[0].type");
  expect_error(chat({{"tools", {{{"type", "function"}, {"function", {{"name", "bad name!"}}}}}}}), 400,
               "tools[0].function.name");
  expect_error(chat({{"tools", {weather_tool({{"type", "string"}})}}}), 400,
               "tools[0].function.parameters.type", "invalid_function_parameters");
  expect_error(chat({{"tools", {weather_tool({{"type", "object"}, {"properties", {1, 2}}})}}}), 400,
               "tools[0].function.parameters.properties");
  expect_error(chat({{"tools", {weather_tool({{"type", "object"}, {"required", "city"}})}}}), 400,
               "tools[0].function.parameters.required");
  expect_error(chat({{"tools", {weather_tool(json::array())}}}), 400, "tools[0].function.parameters");
  expect_error(chat({{"tool_choice", "required"}}), 400, "tool_choice");
  expect_error(chat({{"tools", {weather_tool()}}, {"tool_choice", "sometimes"}}), 400, "tool_choice");
  expect_error(chat({{"tools", {weather_tool()}},
                     {"tool_choice", {{"type", "function"}, {"function", {{"name", "nope"}}}}}}),
               400, "tool_choice");

  ChatRequest r;
  ASSERT_FALSE(parse(chat({{"tools", {weather_tool()}}}), &r));
  Result<ChatPrompt> automatic = build_chat_prompt(r);
  ASSERT_TRUE(automatic.ok());
  EXPECT_NE(automatic->text.find("<tools>"), std::string::npos);
  EXPECT_NE(automatic->text.find("\"name\": \"get_weather\""), std::string::npos) << automatic->text;
  EXPECT_TRUE(automatic->forced_prefix.empty());

  ASSERT_FALSE(parse(chat({{"tools", {weather_tool()}}, {"tool_choice", "none"}}), &r));
  Result<ChatPrompt> none = build_chat_prompt(r);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->text.find("<tools>"), std::string::npos);

  ASSERT_FALSE(parse(chat({{"tools", {weather_tool()}}, {"tool_choice", "required"}}), &r));
  Result<ChatPrompt> required = build_chat_prompt(r);
  ASSERT_TRUE(required.ok());
  EXPECT_TRUE(required->text.ends_with("<think>\n\n</think>\n\n<tool_call>\n")) << required->text;
  EXPECT_FALSE(required->starts_in_reasoning);

  ASSERT_FALSE(parse(chat({{"tools", {weather_tool()}},
                           {"tool_choice", {{"type", "function"}, {"function", {{"name", "get_weather"}}}}}}),
                     &r));
  Result<ChatPrompt> named = build_chat_prompt(r);
  ASSERT_TRUE(named.ok());
  EXPECT_TRUE(named->text.ends_with("<tool_call>\n<function=get_weather>\n")) << named->text;
}

TEST(ChatRequestValidation, ResponseFormat) {
  expect_error(chat({{"response_format", {{"type", "json_object"}}}}), 400, "messages");  // no "json" said
  expect_error(chat({{"response_format", {{"type", "json_schema"}}}}), 400, "response_format.type");
  expect_error(chat({{"response_format", "json"}}), 400, "response_format");
  ChatRequest r;
  json messages = {{{"role", "user"}, {"content", "Answer in JSON."}}};
  ASSERT_FALSE(parse(chat({{"messages", messages}, {"response_format", {{"type", "json_object"}}}}), &r));
  EXPECT_TRUE(r.json_object);
}

TEST(ChatRequestValidation, TemplateErrorsComeFromRendering) {
  ChatRequest r;
  json messages = {{{"role", "user"}, {"content", "a"}}, {{"role", "system"}, {"content", "late"}}};
  ASSERT_FALSE(parse(chat({{"messages", messages}}), &r));
  Result<ChatPrompt> p = build_chat_prompt(r);
  ASSERT_FALSE(p.ok());
  ApiError e = from_status(p.status(), "messages");
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(e.param, "messages");
  EXPECT_NE(e.message.find("System message must be at the beginning."), std::string::npos) << e.message;
}

TEST(JsonBody, Utf8SyntaxShapeDepth) {
  json out;
  MaybeError e = parse_json_body("{\"model\": \"a\xff\"}", out);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->code, "invalid_utf8");
  e = parse_json_body("{\"model\": ", out);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->code, "invalid_json");
  e = parse_json_body("[1, 2]", out);
  ASSERT_TRUE(e);
  EXPECT_NE(e->message.find("must be a JSON object"), std::string::npos);
  std::string deep = "{\"a\":" + std::string(100000, '[') + std::string(100000, ']') + "}";
  e = parse_json_body(deep, out);
  ASSERT_TRUE(e);
  EXPECT_NE(e->message.find("nests deeper"), std::string::npos);
  EXPECT_FALSE(parse_json_body("{\"s\": \"h\xc3\xa9llo \xf0\x9f\x98\x80\"}", out));
}

TEST(JsonBody, Utf8Validator) {
  EXPECT_TRUE(is_valid_utf8(""));
  EXPECT_TRUE(is_valid_utf8("plain ascii"));
  EXPECT_TRUE(is_valid_utf8("\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\xf4\x8f\xbf\xbf"));
  EXPECT_FALSE(is_valid_utf8("\xc0\xaf"));          // overlong '/'
  EXPECT_FALSE(is_valid_utf8("\xe0\x80\xaf"));      // overlong
  EXPECT_FALSE(is_valid_utf8("\xed\xa0\x80"));      // surrogate
  EXPECT_FALSE(is_valid_utf8("\xf4\x90\x80\x80"));  // > U+10FFFF
  EXPECT_FALSE(is_valid_utf8("\xe2\x82"));          // truncated
  EXPECT_FALSE(is_valid_utf8("\x80"));              // lone continuation
  EXPECT_FALSE(is_valid_utf8(std::string("a\xc3", 2)));
}

TEST(CompletionRequestValidation, PromptForms) {
  auto parse_c = [](json body, CompletionRequest* out = nullptr) {
    body["model"] = "tiny";
    CompletionRequest r;
    MaybeError e = parse_completion_request(body, kModel, r);
    if (out) *out = r;
    return e;
  };
  CompletionRequest r;
  ASSERT_FALSE(parse_c({{"prompt", "Once upon"}}, &r));
  EXPECT_EQ(r.prompt_text, "Once upon");
  EXPECT_FALSE(r.prompt_is_ids);
  ASSERT_FALSE(parse_c({{"prompt", {1, 2, 3}}, {"logprobs", 2}}, &r));
  EXPECT_TRUE(r.prompt_is_ids);
  EXPECT_EQ(r.prompt_ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(r.logprobs, 2);
  ASSERT_FALSE(parse_c({{"prompt", {"one"}}}, &r));
  EXPECT_EQ(r.prompt_text, "one");
  ASSERT_FALSE(parse_c({{"prompt", {{5, 6}}}}, &r));
  EXPECT_EQ(r.prompt_ids, (std::vector<int32_t>{5, 6}));
  EXPECT_EQ(parse_c({{"prompt", {"a", "b"}}})->param, "prompt");
  EXPECT_EQ(parse_c({{"prompt", {1, -2}}})->param, "prompt");
  EXPECT_EQ(parse_c({{"prompt", {1, 200000}}})->param, "prompt");
  EXPECT_EQ(parse_c({{"prompt", ""}})->param, "prompt");
  EXPECT_EQ(parse_c(json::object())->param, "prompt");
  EXPECT_EQ(parse_c({{"prompt", "x"}, {"echo", true}})->param, "echo");
  EXPECT_EQ(parse_c({{"prompt", "x"}, {"n", 3}})->param, "n");
  EXPECT_EQ(parse_c({{"prompt", "x"}, {"logprobs", 30}})->param, "logprobs");
}

TEST(ApiErrorJson, Shape) {
  EXPECT_EQ(
      error_body(bad_request("bad", "temperature", "invalid_value")),
      R"({"error":{"message":"bad","type":"invalid_request_error","param":"temperature","code":"invalid_value"}})");
  EXPECT_EQ(error_body(server_error(503, "busy")),
            R"({"error":{"message":"busy","type":"server_error","param":null,"code":null}})");
  EXPECT_EQ(error_body(bad_request("x\xff")),
            "{\"error\":{\"message\":\"x\xef\xbf\xbd\",\"type\":\"invalid_request_error\",\"param\":null,"
            "\"code\":null}}");
}

}  // namespace
}  // namespace lily
