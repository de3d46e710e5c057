// The Qwen3.6 chat format, rendered natively: byte-identical to the official Jinja template
// (tests/fixtures/chat-templates/qwen3.6.jinja, docs/MODEL.md section 4) as transformers renders
// it (apply_chat_template: trim_blocks, lstrip_blocks, tojson = json.dumps(ensure_ascii=False)).
//
// Input is the OpenAI chat-completions shape. Beyond the template, three things happen first, as
// transformers and OpenAI-compatible servers do them:
//   - a message key whose value is null counts as absent (transformers drops them);
//   - reasoning is read from `reasoning_content`, else `thinking`, else `reasoning` (first non-null);
//   - a tool call's `function.arguments` given as a JSON string (what OpenAI clients send) is parsed;
//     it must hold a JSON object.
// Errors the template raises (raise_exception) come back as invalid_argument with the template's
// exact text, e.g. "System message must be at the beginning."; inputs on which the Python side would
// fail with a TypeError get a specific message naming the field.
#pragma once
#include <nlohmann/json.hpp>
#include <string>

#include "tokenizer/json_dump.h"
#include "util/status.h"

namespace lily {

struct ChatOptions {
  bool add_generation_prompt = true;
  bool enable_thinking = true;     // false: the prompt ends in "<think>\n\n</think>\n\n"
  bool preserve_thinking = false;  // true: every assistant turn keeps its <think> block
  bool add_vision_id = false;      // "Picture N: " / "Video N: " before vision placeholders
};

// messages: array of {role, content, ...}; tools: null or an array of tool objects.
Result<std::string> render_chat(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                                const ChatOptions& options);

// Options of an OpenAI chat-completions request: add_generation_prompt (default true; Python
// truthiness), chat_template_kwargs.enable_thinking (off only when exactly false),
// chat_template_kwargs.preserve_thinking (on only when exactly true), chat_template_kwargs.add_vision_id.
Result<ChatOptions> chat_options_from_request(const nlohmann::ordered_json& request);

// The whole request: messages, tools and the options above.
Result<std::string> render_chat_request(const nlohmann::ordered_json& request);

}  // namespace lily
