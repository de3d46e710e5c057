#include "server/chat_request.h"

#include <algorithm>
#include <cctype>

namespace lily {

namespace {

constexpr size_t kMaxToolNameLength = 64;

ApiError wrong_type(const std::string& param, const char* expected, const json& found) {
  return bad_request(format("'%s': expected %s, got %s", param.c_str(), expected, json_type_name(found)),
                     param, "invalid_type");
}

bool has(const json& obj, const char* key) {
  auto it = obj.find(key);
  return it != obj.end() && !it->is_null();
}

// String content, or an array of text parts {"type": "text", "text": "..."}.
MaybeError check_content(const json& msg, const std::string& at, bool required) {
  auto it = msg.find("content");
  std::string param = at + ".content";
  if (it == msg.end() || it->is_null()) {
    if (required)
      return bad_request(format("'%s' is required", param.c_str()), param, "missing_required_parameter");
    return std::nullopt;
  }
  if (it->is_string()) return std::nullopt;
  if (!it->is_array()) return wrong_type(param, "a string or an array of content parts", *it);
  for (size_t k = 0; k < it->size(); ++k) {
    const json& part = (*it)[k];
    std::string pp = format("%s[%zu]", param.c_str(), k);
    if (!part.is_object()) return wrong_type(pp, "a content part object", part);
    auto type = part.find("type");
    if (type == part.end() || !type->is_string()) {
      return bad_request(format("'%s.type' is required and must be a string", pp.c_str()), pp + ".type");
    }
    if (*type != "text") {
      return bad_request(
          format("'%s.type': content parts of type `%s` are not supported (this model reads text)",
                 pp.c_str(), type->get<std::string>().c_str()),
          pp + ".type", "unsupported_content_type");
    }
    auto text = part.find("text");
    if (text == part.end() || !text->is_string()) {
      return bad_request(format("'%s.text' must be a string", pp.c_str()), pp + ".text");
    }
  }
  return std::nullopt;
}

MaybeError check_tool_calls(const json& msg, const std::string& at) {
  auto it = msg.find("tool_calls");
  if (it == msg.end() || it->is_null()) return std::nullopt;
  std::string param = at + ".tool_calls";
  if (!it->is_array()) return wrong_type(param, "an array", *it);
  for (size_t k = 0; k < it->size(); ++k) {
    const json& call = (*it)[k];
    std::string pp = format("%s[%zu]", param.c_str(), k);
    if (!call.is_object()) return wrong_type(pp, "a tool call object", call);
    auto fn = call.find("function");
    if (fn == call.end() || !fn->is_object())
      return bad_request(format("'%s.function' must be an object", pp.c_str()), pp);
    auto name = fn->find("name");
    if (name == fn->end() || !name->is_string() || name->get<std::string>().empty()) {
      return bad_request(format("'%s.function.name' must be a non-empty string", pp.c_str()),
                         pp + ".function.name");
    }
    auto args = fn->find("arguments");
    if (args == fn->end() || args->is_null()) continue;
    if (args->is_string()) {
      json parsed = json::parse(args->get<std::string>(), nullptr, false);
      if (parsed.is_discarded() || !parsed.is_object()) {
        return bad_request(
            format("'%s.function.arguments' must be a JSON object encoded as a string", pp.c_str()),
            pp + ".function.arguments");
      }
    } else if (!args->is_object()) {
      return wrong_type(pp + ".function.arguments", "a JSON string or an object", *args);
    }
  }
  return std::nullopt;
}

MaybeError check_message(json& msg, size_t i) {
  std::string at = format("messages[%zu]", i);
  if (!msg.is_object()) return wrong_type(at, "a message object", msg);
  auto role = msg.find("role");
  if (role == msg.end() || role->is_null()) {
    return bad_request(format("'%s.role' is required", at.c_str()), at + ".role",
                       "missing_required_parameter");
  }
  if (!role->is_string()) return wrong_type(at + ".role", "a string", *role);
  std::string r = role->get<std::string>();
  if (r == "developer") *role = r = "system";
  if (r != "system" && r != "user" && r != "assistant" && r != "tool") {
    return bad_request(
        format("'%s.role': unknown role `%s`; expected one of system, developer, user, assistant, "
               "tool",
               at.c_str(), r.c_str()),
        at + ".role", "invalid_value");
  }
  RETURN_IF_API_ERROR(check_content(msg, at, r != "assistant"));
  if (r == "assistant") {
    RETURN_IF_API_ERROR(check_tool_calls(msg, at));
    for (const char* key : {"reasoning_content", "reasoning", "thinking"}) {
      if (has(msg, key) && !msg[key].is_string()) return wrong_type(at + "." + key, "a string", msg[key]);
    }
  }
  if (has(msg, "name") && !msg["name"].is_string()) return wrong_type(at + ".name", "a string", msg["name"]);
  return std::nullopt;
}

MaybeError check_messages(const json& body, json& out) {
  auto it = body.find("messages");
  if (it == body.end() || it->is_null()) {
    return bad_request("'messages' is required", "messages", "missing_required_parameter");
  }
  if (!it->is_array()) return wrong_type("messages", "an array", *it);
  if (it->empty())
    return bad_request("'messages' must contain at least one message", "messages", "empty_array");
  out = *it;
  for (size_t i = 0; i < out.size(); ++i) RETURN_IF_API_ERROR(check_message(out[i], i));
  return std::nullopt;
}

bool valid_tool_name(const std::string& name) {
  if (name.empty() || name.size() > kMaxToolNameLength) return false;
  return std::all_of(name.begin(), name.end(),
                     [](unsigned char c) { return std::isalnum(c) || c == '_' || c == '-' || c == '.'; });
}

MaybeError check_tool(const json& tool, size_t i) {
  std::string at = format("tools[%zu]", i);
  if (!tool.is_object()) return wrong_type(at, "a tool object", tool);
  auto type = tool.find("type");
  if (type == tool.end() || *type != "function") {
    return bad_request(format("'%s.type' must be `function`", at.c_str()), at + ".type", "invalid_value");
  }
  auto fn = tool.find("function");
  if (fn == tool.end() || !fn->is_object()) {
    return bad_request(format("'%s.function' must be an object", at.c_str()), at + ".function");
  }
  auto name = fn->find("name");
  if (name == fn->end() || !name->is_string() || !valid_tool_name(name->get<std::string>())) {
    return bad_request(
        format("'%s.function.name' must be 1-64 characters of a-z, A-Z, 0-9, _, - or .", at.c_str()),
        at + ".function.name", "invalid_value");
  }
  if (has(*fn, "description") && !(*fn)["description"].is_string()) {
    return wrong_type(at + ".function.description", "a string", (*fn)["description"]);
  }
  if (!has(*fn, "parameters")) return std::nullopt;
  const json& params = (*fn)["parameters"];
  std::string pp = at + ".function.parameters";
  if (!params.is_object()) return wrong_type(pp, "a JSON Schema object", params);
  if (has(params, "type") && params["type"] != "object") {
    return bad_request(format("Invalid schema for function `%s`: '%s.type' must be `object`",
                              name->get<std::string>().c_str(), pp.c_str()),
                       pp + ".type", "invalid_function_parameters");
  }
  if (has(params, "properties") && !params["properties"].is_object()) {
    return bad_request(format("Invalid schema for function `%s`: 'properties' must be an object",
                              name->get<std::string>().c_str()),
                       pp + ".properties", "invalid_function_parameters");
  }
  if (has(params, "required")) {
    const json& req = params["required"];
    if (!req.is_array() ||
        !std::all_of(req.begin(), req.end(), [](const json& r) { return r.is_string(); })) {
      return bad_request(format("Invalid schema for function `%s`: 'required' must be an array of strings",
                                name->get<std::string>().c_str()),
                         pp + ".required", "invalid_function_parameters");
    }
  }
  return std::nullopt;
}

MaybeError check_tools(const json& body, ChatRequest& out) {
  auto it = body.find("tools");
  if (it != body.end() && !it->is_null()) {
    if (!it->is_array()) return wrong_type("tools", "an array", *it);
    for (size_t i = 0; i < it->size(); ++i) RETURN_IF_API_ERROR(check_tool((*it)[i], i));
    if (!it->empty()) out.tools = *it;
  }
  auto choice = body.find("tool_choice");
  if (choice == body.end() || choice->is_null()) {
    out.tool_choice = ToolChoice::automatic;
    return std::nullopt;
  }
  if (choice->is_string()) {
    const std::string& c = choice->get_ref<const std::string&>();
    if (c == "none")
      out.tool_choice = ToolChoice::none;
    else if (c == "auto")
      out.tool_choice = ToolChoice::automatic;
    else if (c == "required")
      out.tool_choice = ToolChoice::required;
    else
      return bad_request(format("'tool_choice': unknown value `%s`; expected none, auto, required or "
                                "{\"type\": \"function\", \"function\": {\"name\": ...}}",
                                c.c_str()),
                         "tool_choice", "invalid_value");
  } else if (choice->is_object()) {
    auto fn = choice->find("function");
    if (choice->value("type", json()) != "function" || fn == choice->end() || !fn->is_object() ||
        !fn->contains("name") || !(*fn)["name"].is_string()) {
      return bad_request("'tool_choice': expected {\"type\": \"function\", \"function\": {\"name\": ...}}",
                         "tool_choice", "invalid_value");
    }
    out.tool_choice = ToolChoice::named;
    out.tool_name = (*fn)["name"].get<std::string>();
  } else {
    return wrong_type("tool_choice", "a string or an object", *choice);
  }
  bool forced = out.tool_choice == ToolChoice::required || out.tool_choice == ToolChoice::named;
  if (forced && out.tools.is_null()) {
    return bad_request("'tool_choice' requires a function call but no 'tools' were given", "tool_choice");
  }
  if (out.tool_choice == ToolChoice::named) {
    bool found = std::any_of(out.tools.begin(), out.tools.end(),
                             [&](const json& t) { return t["function"]["name"] == out.tool_name; });
    if (!found) {
      return bad_request(format("'tool_choice': no tool named `%s` in 'tools'", out.tool_name.c_str()),
                         "tool_choice", "invalid_value");
    }
  }
  return std::nullopt;
}

bool mentions_json(const json& messages) {
  auto has_word = [](std::string s) {
    std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
    return s.find("json") != std::string::npos;
  };
  for (const json& m : messages) {
    auto c = m.find("content");
    if (c == m.end()) continue;
    if (c->is_string() && has_word(c->get<std::string>())) return true;
    if (c->is_array()) {
      for (const json& part : *c) {
        if (part.contains("text") && has_word(part["text"].get<std::string>())) return true;
      }
    }
  }
  return false;
}

MaybeError check_response_format(const json& body, ChatRequest& out) {
  auto it = body.find("response_format");
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_object() || !it->contains("type") || !(*it)["type"].is_string()) {
    return bad_request("'response_format' must be an object with a string 'type'", "response_format");
  }
  std::string type = (*it)["type"];
  if (type == "text") return std::nullopt;
  if (type != "json_object") {
    return bad_request(
        format("'response_format.type': `%s` is not supported; use text or json_object", type.c_str()),
        "response_format.type", "unsupported_value");
  }
  if (!mentions_json(out.messages)) {  // OpenAI's rule: the model must be told to produce JSON
    return bad_request(
        "'messages' must contain the word 'json' in some form to use 'response_format' of type "
        "'json_object'.",
        "messages");
  }
  out.json_object = true;
  return std::nullopt;
}

MaybeError check_n(const json& body) {
  std::optional<int64_t> n;
  RETURN_IF_API_ERROR(read_int(body, "n", "n", 1, INT32_MAX, n));
  if (n && *n != 1) {
    return bad_request(
        format("'n': only n = 1 is supported (one choice per request), got %lld", static_cast<long long>(*n)),
        "n", "unsupported_value");
  }
  return std::nullopt;
}

// chat_template_kwargs: an object whose known switches are booleans (the template tests `is false` / `is
// true`, so "no" would silently mean thinking on); add_generation_prompt a boolean too.
MaybeError check_template_kwargs(const json& body) {
  if (!has(body, "chat_template_kwargs")) return std::nullopt;
  const json& kwargs = body["chat_template_kwargs"];
  if (!kwargs.is_object()) return wrong_type("chat_template_kwargs", "an object", kwargs);
  for (const char* key : {"enable_thinking", "preserve_thinking", "add_vision_id"}) {
    std::optional<bool> ignored;
    RETURN_IF_API_ERROR(read_bool(kwargs, key, std::string("chat_template_kwargs.") + key, ignored));
  }
  return std::nullopt;
}

// The text a continuation extends: the final message's string content, or its last text part.
std::string final_text(const json& messages) {
  const json& content = messages.back().value("content", json());
  if (content.is_string()) return content.get<std::string>();
  std::string text;
  if (content.is_array()) {
    for (const json& part : content) text = part.value("text", text);
  }
  return text;
}

MaybeError check_continuation(const json& body, ChatRequest& out) {
  std::optional<bool> cont, agp;
  RETURN_IF_API_ERROR(read_bool(body, "continue_final_message", "continue_final_message", cont));
  RETURN_IF_API_ERROR(read_bool(body, "add_generation_prompt", "add_generation_prompt", agp));
  out.continue_final_message = cont.value_or(false);
  if (!out.continue_final_message) return std::nullopt;
  if (agp.value_or(false)) {
    return bad_request("'continue_final_message' and 'add_generation_prompt' cannot both be true",
                       "continue_final_message", "invalid_value");
  }
  if (out.messages.back()["role"] != "assistant") {
    return bad_request("'continue_final_message' needs the last message to be an assistant message",
                       "continue_final_message", "invalid_value");
  }
  if (final_text(out.messages).find_first_not_of(" \t\r\n") == std::string::npos) {
    return bad_request("'continue_final_message': the last message has no text to continue",
                       "continue_final_message", "invalid_value");
  }
  if (out.tool_choice == ToolChoice::required || out.tool_choice == ToolChoice::named) {
    return bad_request("'continue_final_message' cannot be combined with a tool_choice that forces a call",
                       "tool_choice", "invalid_value");
  }
  out.chat.add_generation_prompt = false;
  return std::nullopt;
}

MaybeError check_reasoning_effort(const json& body, ChatRequest& out) {
  if (!has(body, "reasoning_effort")) return std::nullopt;
  bool on = true;
  RETURN_IF_API_ERROR(read_reasoning_effort(body["reasoning_effort"], "reasoning_effort", on));
  const json kwargs = body.value("chat_template_kwargs", json::object());
  if (has(kwargs, "enable_thinking") && kwargs["enable_thinking"].get<bool>() != on) {
    return bad_request(
        "'reasoning_effort' and 'chat_template_kwargs.enable_thinking' disagree; send one of them",
        "reasoning_effort", "invalid_value");
  }
  out.chat.enable_thinking = on;
  return std::nullopt;
}

// transformers' cut: after the last occurrence of the final text (stripped), keeping its trailing
// whitespace only when the template kept it.
Result<std::string> cut_after_final_message(const std::string& rendered, const std::string& final) {
  const char* ws = " \t\r\n\f\v";
  const size_t first = final.find_first_not_of(ws), last = final.find_last_not_of(ws);
  const std::string stripped = final.substr(first, last - first + 1), lstripped = final.substr(first);
  const size_t at = rendered.rfind(stripped);
  if (at == std::string::npos) {
    return invalid_argument("continue_final_message: the final message's text is not in the rendered prompt");
  }
  const bool kept = rendered.compare(at, lstripped.size(), lstripped) == 0;
  return rendered.substr(0, at + (kept ? lstripped.size() : stripped.size()));
}

}  // namespace

MaybeError read_reasoning_effort(const json& value, const std::string& param, bool& enable_thinking) {
  if (!value.is_string()) return wrong_type(param, "a string", value);
  const std::string& e = value.get_ref<const std::string&>();
  if (e == "none" || e == "minimal") {
    enable_thinking = false;
  } else if (e == "low" || e == "medium" || e == "high" || e == "xhigh" || e == "max") {
    enable_thinking = true;
  } else {
    return bad_request(
        format("'%s': unknown value `%s`; expected none, minimal, low, medium, high, xhigh or max",
               param.c_str(), e.c_str()),
        param, "invalid_value");
  }
  return std::nullopt;
}

MaybeError parse_chat_request(const json& body, const ServedModel& model, ChatRequest& out) {
  RETURN_IF_API_ERROR(check_model(body, model));
  RETURN_IF_API_ERROR(check_messages(body, out.messages));
  RETURN_IF_API_ERROR(check_tools(body, out));
  RETURN_IF_API_ERROR(check_n(body));
  RETURN_IF_API_ERROR(read_sampling(body, model, out.sampling));
  RETURN_IF_API_ERROR(read_stream_options(body, out.stream));
  std::optional<bool> logprobs;
  std::optional<int64_t> top_logprobs;
  RETURN_IF_API_ERROR(read_bool(body, "logprobs", "logprobs", logprobs));
  RETURN_IF_API_ERROR(read_int(body, "top_logprobs", "top_logprobs", 0, 20, top_logprobs));
  if (top_logprobs && *top_logprobs > 0 && !logprobs.value_or(false)) {
    return bad_request("'top_logprobs' requires 'logprobs' to be true", "top_logprobs");
  }
  out.logprobs = logprobs.value_or(false);
  out.top_logprobs = static_cast<int>(top_logprobs.value_or(0));
  RETURN_IF_API_ERROR(check_response_format(body, out));
  RETURN_IF_API_ERROR(check_template_kwargs(body));
  Result<ChatOptions> options = chat_options_from_request(body);
  if (!options.ok()) return from_status(options.status(), "chat_template_kwargs");
  out.chat = *options;
  RETURN_IF_API_ERROR(check_reasoning_effort(body, out));
  return check_continuation(body, out);
}

Result<ChatPrompt> build_chat_prompt(const ChatRequest& request) {
  ChatPrompt prompt;
  ChatOptions options = request.chat;
  const bool forced = request.tool_choice == ToolChoice::required || request.tool_choice == ToolChoice::named;
  if (forced) options.enable_thinking = false;
  const json no_tools;
  const json& tools = request.tool_choice == ToolChoice::none ? no_tools : request.tools;
  ASSIGN_OR_RETURN(prompt.text, render_chat(request.messages, tools, options));
  if (request.continue_final_message) {
    ASSIGN_OR_RETURN(prompt.text, cut_after_final_message(prompt.text, final_text(request.messages)));
  }
  if (forced) {
    prompt.forced_prefix = "<tool_call>\n";
    if (request.tool_choice == ToolChoice::named)
      prompt.forced_prefix += "<function=" + request.tool_name + ">\n";
    prompt.text += prompt.forced_prefix;
  }
  prompt.starts_in_reasoning = !forced && prompt.text.ends_with("<think>\n");
  return prompt;
}

}  // namespace lily
