// Validated OpenAI requests: the bodies of POST /v1/chat/completions and POST /v1/completions turned into
// what the engine needs, or an ApiError naming the field at fault. Rendering the chat prompt (and how
// tool_choice shapes it) is here too, so the HTTP handlers only glue.
#pragma once
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "server/api_error.h"
#include "server/request_fields.h"
#include "tokenizer/chat_format.h"

namespace lily {

enum class ToolChoice { none, automatic, required, named };

struct ChatRequest {
  json messages;  // as given, except role "developer" reads as "system"
  json tools;     // null, or the validated tools array
  ToolChoice tool_choice = ToolChoice::automatic;
  std::string tool_name;                // ToolChoice::named
  ChatOptions chat;                     // chat_template_kwargs (enable_thinking, ...), reasoning_effort
  bool continue_final_message = false;  // the last (assistant) message is continued, not closed (vLLM)
  SamplingRequest sampling;
  StreamOptions stream;
  bool logprobs = false;
  int top_logprobs = 0;
  bool json_object = false;  // response_format {"type": "json_object"}
};

MaybeError parse_chat_request(const json& body, const ServedModel& model, ChatRequest& out);

// reasoning_effort (OpenAI) onto the model's one reasoning switch: none / minimal -> thinking off; low /
// medium / high / xhigh / max -> on (Qwen3.6 has no graded effort). Any other value: 400 naming `param`.
MaybeError read_reasoning_effort(const json& value, const std::string& param, bool& enable_thinking);

struct CompletionRequest {
  std::string prompt_text;          // when the prompt is a string
  std::vector<int32_t> prompt_ids;  // when the prompt is token ids
  bool prompt_is_ids = false;
  SamplingRequest sampling;
  StreamOptions stream;
  int logprobs = -1;  // legacy `logprobs: N` (top N alternatives); -1: none
};

// An unset max_tokens means 16 there, as in OpenAI's legacy endpoint (kDefaultCompletionTokens).
constexpr int kDefaultCompletionTokens = 16;
MaybeError parse_completion_request(const json& body, const ServedModel& model, CompletionRequest& out);

// The prompt text of a chat request and what the output parser must know about it.
struct ChatPrompt {
  std::string text;                  // rendered by the Qwen3.6 template, plus forced_prefix
  std::string forced_prefix;         // generation already begun by us (tool_choice required/named)
  bool starts_in_reasoning = false;  // the prompt ends inside <think>
};

// tool_choice none: tools are left out of the prompt. required / named: the prompt is rendered with thinking
// off and ends in `<tool_call>\n` (required) or `<tool_call>\n<function=NAME>\n` (named), so the model can
// only continue a call (see src/server/README.md). continue_final_message: rendered without a generation
// prompt and cut right after the final message's text, as transformers' apply_chat_template does.
Result<ChatPrompt> build_chat_prompt(const ChatRequest& request);

}  // namespace lily
