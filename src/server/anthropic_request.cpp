// Anthropic Messages request -> chat-completions body. Only the Anthropic shape is checked here (block types,
// required fields, Anthropic's ranges); everything the two APIs share (sampling ranges, tools' schemas, the
// template) is then checked by parse_chat_request on the translated body.
#include <cstdio>

#include "server/anthropic_api.h"

namespace lily {

namespace {

constexpr int kMinThinkingBudget = 1024;  // Anthropic's minimum budget_tokens

// A string, or an array of text blocks (joined): system prompts and tool results.
MaybeError read_text(const json& value, const std::string& param, std::string& out) {
  if (value.is_string()) {
    out = value.get<std::string>();
    return std::nullopt;
  }
  if (!value.is_array()) return wrong_type_error(param, "a string or an array of text blocks", value);
  for (size_t k = 0; k < value.size(); ++k) {
    const json& block = value[k];
    std::string at = format("%s[%zu]", param.c_str(), k);
    if (!block.is_object() || block.value("type", json()) != "text") {
      return bad_request(format("'%s': only text blocks are supported here", at.c_str()), at + ".type",
                         "unsupported_content_type");
    }
    const json* text = field_of(block, "text");
    if (text == nullptr || !text->is_string())
      return bad_request(format("'%s.text' must be a string", at.c_str()), at + ".text");
    if (!out.empty()) out += "\n";
    out += text->get<std::string>();
  }
  return std::nullopt;
}

MaybeError block_type(const json& block, const std::string& at, std::string& type) {
  if (!block.is_object()) return wrong_type_error(at, "a content block object", block);
  const json* t = field_of(block, "type");
  if (t == nullptr || !t->is_string()) {
    return bad_request(format("'%s.type' is required and must be a string", at.c_str()), at + ".type");
  }
  type = t->get<std::string>();
  return std::nullopt;
}

ApiError unsupported_block(const std::string& at, const std::string& type) {
  return bad_request(
      format("'%s.type': content blocks of type `%s` are not supported here", at.c_str(), type.c_str()),
      at + ".type", "unsupported_content_type");
}

// A user turn: text blocks become one user message; each tool_result a tool message, in order.
MaybeError translate_user(const json& content, const std::string& at, json& out) {
  if (content.is_string()) {
    out.push_back({{"role", "user"}, {"content", content}});
    return std::nullopt;
  }
  if (content.empty()) return bad_request(format("'%s' must not be empty", at.c_str()), at);
  json parts = json::array();
  auto flush = [&] {
    if (!parts.empty()) out.push_back({{"role", "user"}, {"content", std::exchange(parts, json::array())}});
  };
  for (size_t k = 0; k < content.size(); ++k) {
    const json& block = content[k];
    std::string bt, pp = format("%s[%zu]", at.c_str(), k);
    RETURN_IF_API_ERROR(block_type(block, pp, bt));
    if (bt == "text") {
      const json* text = field_of(block, "text");
      if (text == nullptr || !text->is_string())
        return bad_request(format("'%s.text' must be a string", pp.c_str()), pp + ".text");
      parts.push_back({{"type", "text"}, {"text", *text}});
    } else if (bt == "tool_result") {
      std::string id, text;
      RETURN_IF_API_ERROR(read_required_string(block, "tool_use_id", pp, id));
      if (const json* c = field_of(block, "content"))
        RETURN_IF_API_ERROR(read_text(*c, pp + ".content", text));
      const json* is_error = field_of(block, "is_error");
      if (is_error != nullptr && !is_error->is_boolean())
        return wrong_type_error(pp + ".is_error", "a boolean", *is_error);
      if (is_error != nullptr && is_error->get<bool>()) text = "Error: " + text;
      flush();
      out.push_back({{"role", "tool"}, {"tool_call_id", id}, {"content", text}});
    } else {
      return unsupported_block(pp, bt);
    }
  }
  flush();
  return std::nullopt;
}

// An assistant turn: text -> content, thinking -> reasoning_content, tool_use -> tool_calls.
MaybeError translate_assistant(const json& content, const std::string& at, json& out) {
  json msg = {{"role", "assistant"}};
  if (content.is_string()) {
    msg["content"] = content;
    out.push_back(std::move(msg));
    return std::nullopt;
  }
  std::string text, thinking;
  json calls = json::array();
  for (size_t k = 0; k < content.size(); ++k) {
    const json& block = content[k];
    std::string bt, pp = format("%s[%zu]", at.c_str(), k);
    RETURN_IF_API_ERROR(block_type(block, pp, bt));
    if (bt == "text" || bt == "thinking") {
      const char* key = bt == "text" ? "text" : "thinking";
      const json* v = field_of(block, key);
      if (v == nullptr || !v->is_string())
        return bad_request(format("'%s.%s' must be a string", pp.c_str(), key), pp + "." + key);
      (bt == "text" ? text : thinking) += v->get<std::string>();
    } else if (bt == "redacted_thinking") {
      continue;  // encrypted by another provider: nothing this model can read
    } else if (bt == "tool_use") {
      std::string id, name;
      RETURN_IF_API_ERROR(read_required_string(block, "id", pp, id));
      RETURN_IF_API_ERROR(read_required_string(block, "name", pp, name));
      const json* input = field_of(block, "input");
      if (input == nullptr || !input->is_object())
        return bad_request(format("'%s.input' must be an object", pp.c_str()), pp + ".input");
      calls.push_back(
          {{"id", id}, {"type", "function"}, {"function", {{"name", name}, {"arguments", *input}}}});
    } else {
      return unsupported_block(pp, bt);
    }
  }
  msg["content"] = text.empty() && !calls.empty() ? json(nullptr) : json(text);
  if (!thinking.empty()) msg["reasoning_content"] = thinking;
  if (!calls.empty()) msg["tool_calls"] = std::move(calls);
  out.push_back(std::move(msg));
  return std::nullopt;
}

MaybeError translate_messages(const json& body, json& out) {
  const json* messages = field_of(body, "messages");
  if (messages == nullptr)
    return bad_request("'messages' is required", "messages", "missing_required_parameter");
  if (!messages->is_array()) return wrong_type_error("messages", "an array", *messages);
  if (messages->empty()) return bad_request("'messages' must contain at least one message", "messages");
  for (size_t i = 0; i < messages->size(); ++i) {
    const json& m = (*messages)[i];
    std::string at = format("messages[%zu]", i);
    if (!m.is_object()) return wrong_type_error(at, "a message object", m);
    const json role = m.value("role", json());
    const json* content = field_of(m, "content");
    if (content == nullptr)
      return bad_request(format("'%s.content' is required", at.c_str()), at + ".content");
    if (!content->is_string() && !content->is_array())
      return wrong_type_error(at + ".content", "a string or an array of content blocks", *content);
    if (role == "user") {
      RETURN_IF_API_ERROR(translate_user(*content, at + ".content", out));
    } else if (role == "assistant") {
      RETURN_IF_API_ERROR(translate_assistant(*content, at + ".content", out));
    } else {
      return bad_request(
          format("'%s.role' must be `user` or `assistant` (the system prompt goes in 'system')", at.c_str()),
          at + ".role", "invalid_value");
    }
  }
  return std::nullopt;
}

MaybeError translate_tools(const json& body, json& chat) {
  json tools = json::array();
  RETURN_IF_API_ERROR(for_each_object(body, "tools", [&](const json& t, const std::string& at) -> MaybeError {
    std::string name;
    if (const json* type = field_of(t, "type"); type != nullptr && *type != "custom") {
      return bad_request(format("'%s.type': server tools (`%s`) are not available; define a client tool "
                                "with name, description and input_schema",
                                at.c_str(), type->dump().c_str()),
                         at + ".type", "unsupported_value");
    }
    RETURN_IF_API_ERROR(read_required_string(t, "name", at, name));
    const json* schema = field_of(t, "input_schema");
    if (schema == nullptr)
      return bad_request(format("'%s.input_schema' is required", at.c_str()), at + ".input_schema");
    json fn = {{"name", name}, {"parameters", *schema}};
    if (const json* d = field_of(t, "description")) fn["description"] = *d;
    tools.push_back({{"type", "function"}, {"function", std::move(fn)}});
    return std::nullopt;
  }));
  if (!tools.empty()) chat["tools"] = std::move(tools);
  const json* choice = field_of(body, "tool_choice");
  if (choice == nullptr) return std::nullopt;
  const json type_value = choice->is_object() ? choice->value("type", json()) : json();
  if (!type_value.is_string())
    return bad_request("'tool_choice' must be an object with a string 'type'", "tool_choice");
  const std::string type = type_value.get<std::string>();
  if (type == "auto" || type == "none") {
    chat["tool_choice"] = type;
  } else if (type == "any") {
    chat["tool_choice"] = "required";
  } else if (type == "tool") {
    std::string name;
    RETURN_IF_API_ERROR(read_required_string(*choice, "name", "tool_choice", name));
    chat["tool_choice"] = {{"type", "function"}, {"function", {{"name", name}}}};
  } else {
    return bad_request(
        format("'tool_choice.type': unknown value `%s`; expected auto, any, tool or none", type.c_str()),
        "tool_choice.type", "invalid_value");
  }
  if (const json* p = field_of(*choice, "disable_parallel_tool_use"); p != nullptr && !p->is_boolean())
    return wrong_type_error("tool_choice.disable_parallel_tool_use", "a boolean", *p);
  return std::nullopt;
}

// thinking {type: enabled, budget_tokens} | {type: disabled} | {type: adaptive}; off when absent, as in
// Anthropic's API. budget_tokens is checked as Anthropic does (>= 1024, < max_tokens) but not enforced:
// reasoning ends when the model closes it and counts against max_tokens (src/server/README.md).
MaybeError translate_thinking(const json& body, bool count_only, json& chat) {
  bool on = false;
  if (const json* t = field_of(body, "thinking")) {
    const json type_value = t->is_object() ? t->value("type", json()) : json();
    if (!type_value.is_string())
      return bad_request("'thinking' must be an object with a string 'type'", "thinking");
    const std::string type = type_value.get<std::string>();
    if (type == "enabled") {
      std::optional<int64_t> budget;
      RETURN_IF_API_ERROR(
          read_int(*t, "budget_tokens", "thinking.budget_tokens", kMinThinkingBudget, INT32_MAX, budget));
      if (!budget) return bad_request("'thinking.budget_tokens' is required", "thinking.budget_tokens");
      const json* max = field_of(body, "max_tokens");
      if (!count_only && max != nullptr && max->is_number_integer() && *budget >= max->get<int64_t>()) {
        return bad_request("'max_tokens' must be greater than 'thinking.budget_tokens'",
                           "thinking.budget_tokens");
      }
      on = true;
    } else if (type == "adaptive") {
      on = true;
    } else if (type != "disabled") {
      return bad_request(
          format("'thinking.type': unknown value `%s`; expected enabled, disabled or adaptive", type.c_str()),
          "thinking.type", "invalid_value");
    }
  }
  const json choice = chat.value("tool_choice", json());
  if (on && (choice == "required" || choice.is_object())) {
    return bad_request("Thinking may not be enabled when tool_choice forces tool use.", "tool_choice");
  }
  chat["chat_template_kwargs"] = {{"enable_thinking", on}};
  return std::nullopt;
}

MaybeError translate_sampling(const json& body, bool count_only, json& chat) {
  std::optional<int64_t> max_tokens;
  RETURN_IF_API_ERROR(read_int(body, "max_tokens", "max_tokens", 1, INT32_MAX, max_tokens));
  if (!count_only && !max_tokens)
    return bad_request("'max_tokens' is required", "max_tokens", "missing_required_parameter");
  if (max_tokens) chat["max_tokens"] = *max_tokens;
  std::optional<double> temperature;
  RETURN_IF_API_ERROR(
      read_number(body, "temperature", "temperature", {0, 1}, temperature));  // Anthropic: [0, 1]
  for (const char* key : {"temperature", "top_p", "top_k", "stream"})
    if (const json* v = field_of(body, key)) chat[key] = *v;
  if (const json* stops = field_of(body, "stop_sequences")) {
    if (!stops->is_array()) return wrong_type_error("stop_sequences", "an array of strings", *stops);
    chat["stop"] = *stops;
  }
  if (const json* m = field_of(body, "metadata"); m != nullptr && !m->is_object())
    return wrong_type_error("metadata", "an object", *m);
  return std::nullopt;
}

}  // namespace

bool is_anthropic_path(std::string_view path) {
  return path == "/v1/messages" || path.starts_with("/v1/messages/");
}

MaybeError anthropic_to_chat_body(const json& body, bool count_only, json& chat) {
  chat = json::object();
  if (const json* model = field_of(body, "model")) chat["model"] = *model;
  json messages = json::array();
  if (const json* system = field_of(body, "system")) {
    std::string text;
    RETURN_IF_API_ERROR(read_text(*system, "system", text));
    messages.push_back({{"role", "system"}, {"content", text}});
  }
  RETURN_IF_API_ERROR(translate_messages(body, messages));
  // A final assistant turn is a prefill: the reply continues it (Anthropic's semantics).
  const json& last = messages.back();
  const bool prefill = last["role"] == "assistant" && last["content"].is_string() &&
                       last["content"].get<std::string>().find_first_not_of(" \t\r\n") != std::string::npos;
  chat["messages"] = std::move(messages);
  if (prefill) chat["continue_final_message"] = true;
  RETURN_IF_API_ERROR(translate_tools(body, chat));
  RETURN_IF_API_ERROR(translate_thinking(body, count_only, chat));
  return translate_sampling(body, count_only, chat);
}

ApiError as_messages_error(ApiError e) {
  return rename_param(std::move(e), {{"stop", "stop_sequences"}});
}

std::string thinking_signature(std::string_view thinking) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a 64
  for (unsigned char c : thinking) h = (h ^ c) * 0x100000001b3ull;
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
  return std::string("lily1:") + hex;
}

}  // namespace lily
