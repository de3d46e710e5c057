// The vLLM / OpenAI fields of /v1/chat/completions that change generation: min_tokens, stop_token_ids,
// include_stop_str_in_output, continue_final_message, reasoning_effort; the constrained-decoding fields that
// are refused; and the types of chat_template_kwargs.
#include <gtest/gtest.h>

#include "server/chat_request.h"
#include "chat_test_util.h"

namespace lily {
namespace {

const ServedModel& kModel = test::kChatModel;

json chat(json extra = json::object()) { return test::chat_body(extra); }

ChatRequest parsed(const json& body) {
  ChatRequest r;
  MaybeError e = parse_chat_request(body, kModel, r);
  EXPECT_FALSE(e) << body.dump() << " -> " << (e ? e->message : "");
  return r;
}

void expect_error(const json& body, const std::string& param, const std::string& code = "") {
  ChatRequest r;
  MaybeError e = parse_chat_request(body, kModel, r);
  ASSERT_TRUE(e.has_value()) << body.dump();
  EXPECT_EQ(e->status, 400) << e->message;
  EXPECT_EQ(e->param, param) << body.dump() << " -> " << e->message;
  if (!code.empty()) {
    EXPECT_EQ(e->code, code) << e->message;
  }
}

TEST(ChatFields, MinTokensStopTokenIdsAndIncludeStopReachTheSampling) {
  ChatRequest r = parsed(chat({{"min_tokens", 3},
                               {"max_tokens", 8},
                               {"stop_token_ids", {7, 151935}},
                               {"stop", "END"},
                               {"include_stop_str_in_output", true}}));
  EXPECT_EQ(r.sampling.params.min_tokens, 3);
  EXPECT_EQ(r.sampling.stop_token_ids, (std::vector<int32_t>{7, 151935}));
  EXPECT_TRUE(r.sampling.params.include_stop_str_in_output);
  ChatRequest plain = parsed(chat());
  EXPECT_EQ(plain.sampling.params.min_tokens, 0);
  EXPECT_FALSE(plain.sampling.params.include_stop_str_in_output);
  EXPECT_TRUE(plain.sampling.stop_token_ids.empty());

  expect_error(chat({{"min_tokens", -1}}), "min_tokens", "invalid_value");
  expect_error(chat({{"min_tokens", "3"}}), "min_tokens", "invalid_type");
  expect_error(chat({{"min_tokens", 9}, {"max_tokens", 8}}), "min_tokens", "invalid_value");
  expect_error(chat({{"stop_token_ids", 7}}), "stop_token_ids", "invalid_type");
  expect_error(chat({{"stop_token_ids", {1, 151936}}}), "stop_token_ids[1]", "invalid_value");
  expect_error(chat({{"stop_token_ids", {-1}}}), "stop_token_ids[0]", "invalid_value");
  expect_error(chat({{"stop_token_ids", {"7"}}}), "stop_token_ids[0]", "invalid_type");
  expect_error(chat({{"include_stop_str_in_output", "yes"}}), "include_stop_str_in_output", "invalid_type");
}

TEST(ChatFields, ConstrainedDecodingFieldsAreRefusedNotIgnored) {
  for (const char* key : {"grammar", "json_schema", "guided_json", "guided_regex", "guided_choice",
                          "guided_grammar", "guided_decoding_backend", "structured_outputs"}) {
    expect_error(chat({{key, "x"}}), key, "unsupported_parameter");
  }
  parsed(chat({{"guided_json", nullptr}}));  // null reads as absent, as everywhere
}

TEST(ChatFields, TemplateKwargsMustBeBooleans) {
  expect_error(chat({{"chat_template_kwargs", {{"enable_thinking", "no"}}}}),
               "chat_template_kwargs.enable_thinking", "invalid_type");
  expect_error(chat({{"chat_template_kwargs", {{"enable_thinking", 0}}}}),
               "chat_template_kwargs.enable_thinking", "invalid_type");
  expect_error(chat({{"chat_template_kwargs", {{"preserve_thinking", "true"}}}}),
               "chat_template_kwargs.preserve_thinking", "invalid_type");
  expect_error(chat({{"chat_template_kwargs", "x"}}), "chat_template_kwargs", "invalid_type");
  expect_error(chat({{"add_generation_prompt", 1}}), "add_generation_prompt", "invalid_type");
  EXPECT_FALSE(parsed(chat({{"chat_template_kwargs", {{"enable_thinking", false}}}})).chat.enable_thinking);
}

TEST(ChatFields, ReasoningEffortSwitchesThinking) {
  for (const char* off : {"none", "minimal"}) {
    ChatRequest r = parsed(chat({{"reasoning_effort", off}}));
    EXPECT_FALSE(r.chat.enable_thinking) << off;
    Result<ChatPrompt> p = build_chat_prompt(r);
    ASSERT_TRUE(p.ok());
    EXPECT_TRUE(p->text.ends_with("<think>\n\n</think>\n\n")) << p->text;
    EXPECT_FALSE(p->starts_in_reasoning);
  }
  for (const char* on : {"low", "medium", "high", "xhigh", "max"}) {
    ChatRequest r = parsed(chat({{"reasoning_effort", on}}));
    EXPECT_TRUE(r.chat.enable_thinking) << on;
    EXPECT_TRUE(build_chat_prompt(r)->starts_in_reasoning);
  }
  expect_error(chat({{"reasoning_effort", "extreme"}}), "reasoning_effort", "invalid_value");
  expect_error(chat({{"reasoning_effort", 2}}), "reasoning_effort", "invalid_type");
  expect_error(chat({{"reasoning_effort", "high"}, {"chat_template_kwargs", {{"enable_thinking", false}}}}),
               "reasoning_effort", "invalid_value");
  parsed(chat({{"reasoning_effort", "none"}, {"chat_template_kwargs", {{"enable_thinking", false}}}}));
}

TEST(ChatFields, ContinueFinalMessageLeavesTheTurnOpen) {
  json messages = {{{"role", "user"}, {"content", "Write a haiku"}},
                   {{"role", "assistant"}, {"content", "Autumn moonlight,"}}};
  ChatRequest r = parsed(chat({{"messages", messages}, {"continue_final_message", true}}));
  EXPECT_FALSE(r.chat.add_generation_prompt);
  Result<ChatPrompt> p = build_chat_prompt(r);
  ASSERT_TRUE(p.ok()) << p.status().message();
  EXPECT_TRUE(p->text.ends_with("Autumn moonlight,")) << p->text;
  EXPECT_EQ(p->text.find("<|im_end|>", p->text.rfind("<|im_start|>assistant")), std::string::npos) << p->text;
  EXPECT_FALSE(p->starts_in_reasoning);
  // The closed turn, for comparison, ends the assistant message.
  ChatRequest closed = parsed(chat({{"messages", messages}, {"add_generation_prompt", false}}));
  EXPECT_TRUE(build_chat_prompt(closed)->text.ends_with("Autumn moonlight,<|im_end|>\n"));
  // Text parts: the last one is continued; a trailing space the template trims is not put back (as
  // transformers does).
  messages[1]["content"] = json::array({{{"type", "text"}, {"text", "Autumn "}}});
  ChatRequest parts = parsed(chat({{"messages", messages}, {"continue_final_message", true}}));
  std::string text = build_chat_prompt(parts)->text;
  EXPECT_TRUE(text.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\nAutumn")) << text;

  expect_error(chat({{"continue_final_message", true}}), "continue_final_message", "invalid_value");
  expect_error(
      chat({{"messages", messages}, {"continue_final_message", true}, {"add_generation_prompt", true}}),
      "continue_final_message", "invalid_value");
  messages[1]["content"] = "  ";
  expect_error(chat({{"messages", messages}, {"continue_final_message", true}}), "continue_final_message");
  expect_error(chat({{"continue_final_message", "yes"}}), "continue_final_message", "invalid_type");
}

}  // namespace
}  // namespace lily
