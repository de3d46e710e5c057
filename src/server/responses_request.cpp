// Responses request -> chat-completions body. The Responses shape is checked here (item types, required
// fields, unsupported options); the rest (sampling ranges, tools' schemas, the template) is checked by
// parse_chat_request on the translated body.
#include "server/responses_api.h"

namespace lily {

namespace {

// Message content: a string, or parts of type input_text / output_text (the text is all this model reads).
MaybeError message_text(const json& content, const std::string& at, std::string& out) {
  if (content.is_string()) {
    out = content.get<std::string>();
    return std::nullopt;
  }
  if (!content.is_array()) return wrong_type_error(at, "a string or an array of content parts", content);
  for (size_t k = 0; k < content.size(); ++k) {
    const json& part = content[k];
    std::string pp = format("%s[%zu]", at.c_str(), k), type, text;
    if (!part.is_object()) return wrong_type_error(pp, "a content part object", part);
    RETURN_IF_API_ERROR(read_required_string(part, "type", pp, type));
    if (type != "input_text" && type != "output_text") {
      return bad_request(
          format("'%s.type': content parts of type `%s` are not supported (this model reads text)",
                 pp.c_str(), type.c_str()),
          pp + ".type", "unsupported_content_type");
    }
    RETURN_IF_API_ERROR(read_required_string(part, "text", pp, text));
    out += text;
  }
  return std::nullopt;
}

// The reasoning text of a reasoning item: its reasoning_text content, else its summary.
std::string reasoning_text(const json& item) {
  std::string text;
  for (const char* key : {"content", "summary"}) {
    const json* parts = field_of(item, key);
    if (parts == nullptr || !parts->is_array()) continue;
    for (const json& p : *parts)
      if (p.is_object() && p.contains("text") && p["text"].is_string()) text += p["text"].get<std::string>();
    if (!text.empty()) break;
  }
  return text;
}

// Input items in order. function_call items join the assistant message before them (or start one);
// a reasoning item's text goes to the next assistant message.
class InputTranslator {
 public:
  explicit InputTranslator(json& messages) : messages_(messages) {}

  MaybeError item(const json& it, const std::string& at) {
    if (!it.is_object()) return wrong_type_error(at, "an input item object", it);
    const json* t = field_of(it, "type");
    if (t != nullptr && !t->is_string()) return wrong_type_error(at + ".type", "a string", *t);
    const std::string type = t != nullptr ? t->get<std::string>() : "message";
    if (type == "message") return message(it, at);
    if (type == "function_call") return function_call(it, at);
    if (type == "function_call_output") return call_output(it, at);
    if (type == "reasoning") {
      reasoning_ += reasoning_text(it);
      return std::nullopt;
    }
    return bad_request(format("'%s.type': input items of type `%s` are not supported; use message, "
                              "function_call, function_call_output or reasoning",
                              at.c_str(), type.c_str()),
                       at + ".type", "unsupported_value");
  }

 private:
  MaybeError message(const json& it, const std::string& at) {
    std::string role, text;
    RETURN_IF_API_ERROR(read_required_string(it, "role", at, role));
    const json* content = field_of(it, "content");
    if (content == nullptr)
      return bad_request(format("'%s.content' is required", at.c_str()), at + ".content");
    RETURN_IF_API_ERROR(message_text(*content, at + ".content", text));
    json msg = {{"role", role}, {"content", text}};
    if (role == "assistant") attach_reasoning(msg);
    messages_.push_back(std::move(msg));
    return std::nullopt;
  }

  MaybeError function_call(const json& it, const std::string& at) {
    std::string call_id, name, arguments;
    RETURN_IF_API_ERROR(read_required_string(it, "call_id", at, call_id));
    RETURN_IF_API_ERROR(read_required_string(it, "name", at, name));
    RETURN_IF_API_ERROR(read_required_string(it, "arguments", at, arguments));
    if (messages_.empty() || messages_.back()["role"] != "assistant" || !reasoning_.empty()) {
      json msg = {{"role", "assistant"}, {"content", nullptr}};
      attach_reasoning(msg);
      messages_.push_back(std::move(msg));
    }
    json& calls = messages_.back()["tool_calls"];
    if (calls.is_null()) calls = json::array();
    calls.push_back(
        {{"id", call_id}, {"type", "function"}, {"function", {{"name", name}, {"arguments", arguments}}}});
    return std::nullopt;
  }

  MaybeError call_output(const json& it, const std::string& at) {
    std::string call_id, text;
    RETURN_IF_API_ERROR(read_required_string(it, "call_id", at, call_id));
    const json* output = field_of(it, "output");
    if (output == nullptr) return bad_request(format("'%s.output' is required", at.c_str()), at + ".output");
    RETURN_IF_API_ERROR(message_text(*output, at + ".output", text));
    messages_.push_back({{"role", "tool"}, {"tool_call_id", call_id}, {"content", text}});
    return std::nullopt;
  }

  void attach_reasoning(json& msg) {
    if (!reasoning_.empty()) msg["reasoning_content"] = std::exchange(reasoning_, std::string());
  }

  json& messages_;
  std::string reasoning_;
};

MaybeError translate_input(const json& body, json& chat) {
  json messages = json::array();
  if (const json* instructions = field_of(body, "instructions")) {
    if (!instructions->is_string()) return wrong_type_error("instructions", "a string", *instructions);
    messages.push_back({{"role", "system"}, {"content", *instructions}});
  }
  const json* input = field_of(body, "input");
  if (input == nullptr) return bad_request("'input' is required", "input", "missing_required_parameter");
  if (input->is_string()) {
    messages.push_back({{"role", "user"}, {"content", *input}});
  } else if (input->is_array()) {
    if (input->empty()) return bad_request("'input' must contain at least one item", "input");
    InputTranslator t(messages);
    for (size_t i = 0; i < input->size(); ++i)
      RETURN_IF_API_ERROR(t.item((*input)[i], format("input[%zu]", i)));
  } else {
    return wrong_type_error("input", "a string or an array of input items", *input);
  }
  chat["messages"] = std::move(messages);
  return std::nullopt;
}

MaybeError translate_tools(const json& body, json& chat) {
  json tools = json::array();
  RETURN_IF_API_ERROR(for_each_object(body, "tools", [&](const json& t, const std::string& at) -> MaybeError {
    std::string type, name;
    RETURN_IF_API_ERROR(read_required_string(t, "type", at, type));
    if (type != "function") {
      return bad_request(format("'%s.type': tools of type `%s` are not available; only function tools are",
                                at.c_str(), type.c_str()),
                         at + ".type", "unsupported_value");
    }
    RETURN_IF_API_ERROR(read_required_string(t, "name", at, name));
    json fn = {{"name", name}};
    for (const char* key : {"description", "parameters"})
      if (const json* v = field_of(t, key)) fn[key] = *v;
    tools.push_back({{"type", "function"}, {"function", std::move(fn)}});
    return std::nullopt;
  }));
  if (!tools.empty()) chat["tools"] = std::move(tools);
  if (const json* choice = field_of(body, "tool_choice")) {
    if (choice->is_object() && choice->value("type", json()) == "function" && choice->contains("name")) {
      chat["tool_choice"] = {{"type", "function"}, {"function", {{"name", (*choice)["name"]}}}};
    } else {
      chat["tool_choice"] = *choice;  // "auto" / "none" / "required"; anything else fails validation
    }
  }
  return std::nullopt;
}

MaybeError refuse_state(const json& body) {
  for (const char* key : {"previous_response_id", "conversation"}) {
    if (field_of(body, key) != nullptr) {
      return bad_request(
          format("'%s' is not supported: this server stores no responses or conversations; send "
                 "the whole conversation in 'input'",
                 key),
          key, "unsupported_parameter");
    }
  }
  if (const json* b = field_of(body, "background"); b != nullptr && (!b->is_boolean() || b->get<bool>()))
    return bad_request("'background': background responses are not supported", "background",
                       "unsupported_parameter");
  if (const json* s = field_of(body, "store"); s != nullptr && !s->is_boolean())
    return wrong_type_error("store", "a boolean", *s);
  return std::nullopt;
}

MaybeError translate_options(const json& body, json& chat) {
  if (const json* max = field_of(body, "max_output_tokens")) chat["max_tokens"] = *max;
  for (const char* key : {"temperature", "top_p", "stream"})
    if (const json* v = field_of(body, key)) chat[key] = *v;
  if (const json* reasoning = field_of(body, "reasoning")) {
    if (!reasoning->is_object()) return wrong_type_error("reasoning", "an object", *reasoning);
    if (const json* effort = field_of(*reasoning, "effort")) {
      bool on = true;
      RETURN_IF_API_ERROR(read_reasoning_effort(*effort, "reasoning.effort", on));
      chat["reasoning_effort"] = *effort;
    }
  }
  if (const json* text = field_of(body, "text")) {
    if (!text->is_object()) return wrong_type_error("text", "an object", *text);
    if (const json* fmt = field_of(*text, "format")) chat["response_format"] = *fmt;  // text / json_object
  }
  if (const json* p = field_of(body, "parallel_tool_calls"); p != nullptr && !p->is_boolean())
    return wrong_type_error("parallel_tool_calls", "a boolean", *p);
  return std::nullopt;
}

}  // namespace

MaybeError responses_to_chat_body(const json& body, json& chat) {
  chat = json::object();
  if (const json* model = field_of(body, "model")) chat["model"] = *model;
  RETURN_IF_API_ERROR(refuse_state(body));
  RETURN_IF_API_ERROR(translate_input(body, chat));
  RETURN_IF_API_ERROR(translate_tools(body, chat));
  return translate_options(body, chat);
}

ApiError as_responses_error(ApiError e) {
  return rename_param(std::move(e), {{"max_tokens", "max_output_tokens"},
                                     {"response_format", "text.format"},
                                     {"reasoning_effort", "reasoning.effort"}});
}

}  // namespace lily
