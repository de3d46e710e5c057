// Native port of tests/fixtures/chat-templates/qwen3.6.jinja. The code follows the template's
// order of evaluation step by step (header, last-query scan, message loop, generation prompt), so
// that the same input raises the same error first. Template lines are quoted where they matter.
#include "tokenizer/chat_format.h"

#include <string_view>

namespace lily {

namespace {

using json = nlohmann::ordered_json;

constexpr std::string_view kToolsIntro =
    "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>";
constexpr std::string_view kToolsInstructions =
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n"
    "- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested "
    "within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n"
    "- You may provide optional reasoning for your function call in natural language BEFORE the function call, "
    "but NOT after\n- If there is no function call available, answer the question like normal with your current "
    "knowledge and do not tell the user about function calls\n</IMPORTANT>";
constexpr size_t kMaxDepth = 256;
constexpr std::string_view kImagePlaceholder = "<|vision_start|><|image_pad|><|vision_end|>";
constexpr std::string_view kVideoPlaceholder = "<|vision_start|><|video_pad|><|vision_end|>";

// ---- Python string semantics -------------------------------------------------------------------

// Byte length of the Python whitespace character (str.isspace) starting at s[i], or 0.
size_t space_len_at(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return i + k < s.size() ? static_cast<unsigned char>(s[i + k]) : 0u; };
  const unsigned c0 = b(0);
  if ((c0 >= 0x09 && c0 <= 0x0d) || (c0 >= 0x1c && c0 <= 0x20)) return 1;
  if (c0 == 0xc2 && (b(1) == 0x85 || b(1) == 0xa0)) return 2;                  // U+0085 U+00A0
  if (c0 == 0xe1 && b(1) == 0x9a && b(2) == 0x80) return 3;                   // U+1680
  if (c0 == 0xe2 && b(1) == 0x80 && ((b(2) >= 0x80 && b(2) <= 0x8a) || b(2) == 0xa8 || b(2) == 0xa9 ||
                                     b(2) == 0xaf)) {
    return 3;                                                                 // U+2000-200A 2028 2029 202F
  }
  if (c0 == 0xe2 && b(1) == 0x81 && b(2) == 0x9f) return 3;                   // U+205F
  if (c0 == 0xe3 && b(1) == 0x80 && b(2) == 0x80) return 3;                   // U+3000
  return 0;
}

// Jinja's |trim: Python str.strip() with no argument (Unicode whitespace).
std::string py_strip(std::string_view s) {
  size_t begin = 0;
  while (begin < s.size()) {
    const size_t n = space_len_at(s, begin);
    if (n == 0) break;
    begin += n;
  }
  size_t end = s.size();
  while (end > begin) {
    size_t start = end - 1;  // first byte of the last code point
    while (start > begin && end - start < 4 && (static_cast<unsigned char>(s[start]) & 0xc0) == 0x80) --start;
    if (space_len_at(s, start) != end - start) break;
    end = start;
  }
  return std::string(s.substr(begin, end - begin));
}

std::string_view lstrip_newlines(std::string_view s) {
  while (!s.empty() && s.front() == '\n') s.remove_prefix(1);
  return s;
}

std::string_view rstrip_newlines(std::string_view s) {
  while (!s.empty() && s.back() == '\n') s.remove_suffix(1);
  return s;
}

// ---- JSON values as the template sees them -----------------------------------------------------

// A member as Jinja sees it: nullptr when undefined (not an object, or no such key); null is defined.
const json* member(const json& obj, const char* key) {
  if (!obj.is_object()) return nullptr;
  auto it = obj.find(key);
  return it == obj.end() ? nullptr : &*it;
}

// A message field: transformers drops message keys whose value is None, so null counts as absent.
const json* message_field(const json& message, const char* key) {
  const json* v = member(message, key);
  return (v == nullptr || v->is_null()) ? nullptr : v;
}

bool is_string_equal(const json* v, std::string_view s) {
  return v != nullptr && v->is_string() && v->get_ref<const std::string&>() == s;
}

// Python truthiness; an undefined value is false.
bool truthy(const json* v) {
  if (v == nullptr) return false;
  switch (v->type()) {
    case json::value_t::null: return false;
    case json::value_t::boolean: return v->get<bool>();
    case json::value_t::number_integer: return v->get<int64_t>() != 0;
    case json::value_t::number_unsigned: return v->get<uint64_t>() != 0;
    case json::value_t::number_float: return v->get<double>() != 0.0;
    case json::value_t::string:
    case json::value_t::array:
    case json::value_t::object: return !v->empty();
    default: return false;
  }
}

// Jinja's `needle in container` for a content part: substring of a string, key of a mapping,
// element of a list. Anything else is a TypeError in Python.
Result<bool> jinja_contains(const json& container, std::string_view needle, const std::string& where) {
  if (container.is_string()) return container.get_ref<const std::string&>().find(needle) != std::string::npos;
  if (container.is_object()) return container.contains(needle);
  if (container.is_array()) {
    for (const auto& item : container) {
      if (is_string_equal(&item, needle)) return true;
    }
    return false;
  }
  return invalid_argument("%s: a content part must be an object or a string, got %s", where.c_str(),
                          container.type_name());
}

// out += a + b + ...: piecewise (GCC 12 warns falsely on `"literal" + std::string` under -Werror).
template <typename... Parts>
void append(std::string& out, const Parts&... parts) {
  (out.append(std::string_view(parts)), ...);
}

Status template_error(const char* message) { return invalid_argument("%s", message); }

// ---- The renderer ------------------------------------------------------------------------------

class ChatRenderer {
 public:
  ChatRenderer(const json& messages, const json& tools, const ChatOptions& options)
      : messages_(messages), tools_(tools), options_(options) {}

  Result<std::string> render() {
    RETURN_IF_ERROR(check_shapes());
    RETURN_IF_ERROR(render_header());
    RETURN_IF_ERROR(find_last_query());
    for (size_t i = 0; i < messages_.size(); ++i) RETURN_IF_ERROR(render_message(i));
    if (options_.add_generation_prompt) {
      out_ += "<|im_start|>assistant\n";
      out_ += options_.enable_thinking ? "<think>\n" : "<think>\n\n</think>\n\n";
    }
    return std::move(out_);
  }

 private:
  static std::string where(size_t i, const char* rest = "") { return format("messages[%zu]%s", i, rest); }

  Status check_shapes() const {
    if (!messages_.is_array()) return invalid_argument("messages: expected an array, got %s", messages_.type_name());
    for (size_t i = 0; i < messages_.size(); ++i) {
      if (!messages_[i].is_object()) {
        return invalid_argument("%s: expected an object, got %s", where(i).c_str(), messages_[i].type_name());
      }
    }
    if (messages_.empty()) return template_error("No messages provided.");
    // Python's json.dumps gives up near 1000 levels; past this limit lily's recursive walks could too.
    if (!json_depth_within(messages_, kMaxDepth) || !json_depth_within(tools_, kMaxDepth)) {
      return invalid_argument("messages/tools: JSON nested deeper than %zu levels", kMaxDepth);
    }
    if (!tools_.is_null() && !tools_.is_array()) {
      return invalid_argument("tools: expected an array, got %s", tools_.type_name());
    }
    for (size_t i = 0; i < (tools_.is_array() ? tools_.size() : 0); ++i) {
      if (!tools_[i].is_object()) return invalid_argument("tools[%zu]: expected an object, got %s", i,
                                                          tools_[i].type_name());
    }
    return ok_status();
  }

  // {%- macro render_content(content, do_vision_count, is_system_content=false) %}
  Result<std::string> render_content(size_t i, bool do_vision_count, bool is_system) {
    const json* content = message_field(messages_[i], "content");
    if (content == nullptr) return std::string();
    if (content->is_string()) return content->get<std::string>();
    if (!content->is_array()) return Status(template_error("Unexpected content type."));
    std::string out;
    for (size_t k = 0; k < content->size(); ++k) {
      RETURN_IF_ERROR(render_part((*content)[k], where(i, format(".content[%zu]", k).c_str()), do_vision_count,
                                  is_system, out));
    }
    return out;
  }

  Status render_part(const json& item, const std::string& at, bool do_vision_count, bool is_system,
                     std::string& out) {
    ASSIGN_OR_RETURN(bool has_image, jinja_contains(item, "image", at));
    ASSIGN_OR_RETURN(bool has_image_url, jinja_contains(item, "image_url", at));
    if (has_image || has_image_url || is_string_equal(member(item, "type"), "image")) {
      if (is_system) return template_error("System message cannot contain images.");
      if (do_vision_count) ++image_count_;
      if (options_.add_vision_id) out += format("Picture %d: ", image_count_);
      out += kImagePlaceholder;
      return ok_status();
    }
    ASSIGN_OR_RETURN(bool has_video, jinja_contains(item, "video", at));
    if (has_video || is_string_equal(member(item, "type"), "video")) {
      if (is_system) return template_error("System message cannot contain videos.");
      if (do_vision_count) ++video_count_;
      if (options_.add_vision_id) out += format("Video %d: ", video_count_);
      out += kVideoPlaceholder;
      return ok_status();
    }
    ASSIGN_OR_RETURN(bool has_text, jinja_contains(item, "text", at));
    if (!has_text) return template_error("Unexpected item type in content.");
    // `{{- item.text }}`: only a mapping has the attribute; for a string or list part it is undefined.
    if (const json* text = member(item, "text")) out += python_str(*text);
    return ok_status();
  }

  Status render_header() {
    const json& first = messages_[0];
    const bool first_is_system = is_string_equal(message_field(first, "role"), "system");
    if (truthy(&tools_)) {
      out_ += kToolsIntro;
      for (const auto& tool : tools_) append(out_, "\n", hf_tojson(tool));
      out_ += kToolsInstructions;
      if (first_is_system) {
        ASSIGN_OR_RETURN(std::string raw, render_content(0, false, true));
        const std::string content = py_strip(raw);
        if (!content.empty()) append(out_, "\n\n", content);
      }
      out_ += "<|im_end|>\n";
    } else if (first_is_system) {
      ASSIGN_OR_RETURN(std::string raw, render_content(0, false, true));
      append(out_, "<|im_start|>system\n", py_strip(raw), "<|im_end|>\n");
    }
    return ok_status();
  }

  // The last user message that is not only a <tool_response> block: assistant turns after it
  // keep their reasoning.
  Status find_last_query() {
    for (size_t k = messages_.size(); k-- > 0;) {
      if (!is_string_equal(message_field(messages_[k], "role"), "user")) continue;
      ASSIGN_OR_RETURN(std::string raw, render_content(k, false, false));
      const std::string content = py_strip(raw);
      const bool tool_response = content.starts_with("<tool_response>") && content.ends_with("</tool_response>");
      if (!tool_response) {
        last_query_index_ = k;
        return ok_status();
      }
    }
    return template_error("No user query found in messages.");
  }

  Status render_message(size_t i) {
    ASSIGN_OR_RETURN(std::string raw, render_content(i, true, false));
    std::string content = py_strip(raw);
    const json* role = message_field(messages_[i], "role");
    if (is_string_equal(role, "system")) {
      if (i != 0) return template_error("System message must be at the beginning.");
    } else if (is_string_equal(role, "user")) {
      append(out_, "<|im_start|>user\n", content, "<|im_end|>\n");
    } else if (is_string_equal(role, "assistant")) {
      return render_assistant(i, std::move(content));
    } else if (is_string_equal(role, "tool")) {
      render_tool_response(i, content);
    } else {
      return template_error("Unexpected message role.");
    }
    return ok_status();
  }

  Status render_assistant(size_t i, std::string content) {
    const json& message = messages_[i];
    // transformers aliases reasoning_content from the first non-null of these fields.
    const json* reasoning_field = message_field(message, "reasoning_content");
    if (reasoning_field == nullptr) reasoning_field = message_field(message, "thinking");
    if (reasoning_field == nullptr) reasoning_field = message_field(message, "reasoning");
    std::string reasoning;
    if (reasoning_field != nullptr && reasoning_field->is_string()) {
      reasoning = reasoning_field->get<std::string>();
    } else if (content.find("</think>") != std::string::npos) {
      // content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n')
      std::string_view before = rstrip_newlines(std::string_view(content).substr(0, content.find("</think>")));
      const size_t open = before.rfind("<think>");
      if (open != std::string_view::npos) before.remove_prefix(open + 7);
      reasoning = std::string(lstrip_newlines(before));
      // content.split('</think>')[-1].lstrip('\n')
      content = std::string(lstrip_newlines(std::string_view(content).substr(content.rfind("</think>") + 8)));
    }
    reasoning = py_strip(reasoning);
    if (options_.preserve_thinking || i > last_query_index_) {
      append(out_, "<|im_start|>assistant\n<think>\n", reasoning, "\n</think>\n\n", content);
    } else {
      append(out_, "<|im_start|>assistant\n", content);
    }
    const json* calls = message_field(message, "tool_calls");
    if (truthy(calls) && calls->is_string()) {
      return invalid_argument("%s: expected an array, got a string", where(i, ".tool_calls").c_str());
    }
    if (truthy(calls) && calls->is_array()) {
      for (size_t k = 0; k < calls->size(); ++k) {
        RETURN_IF_ERROR(render_tool_call((*calls)[k], where(i, format(".tool_calls[%zu]", k).c_str()), k == 0,
                                         !py_strip(content).empty()));
      }
    }
    out_ += "<|im_end|>\n";
    return ok_status();
  }

  Status render_tool_call(const json& tool_call, const std::string& at, bool first, bool has_content) {
    const json* function = member(tool_call, "function");
    const json& call = function != nullptr ? *function : tool_call;
    const json* name = member(call, "name");
    if (name == nullptr || !name->is_string()) {
      return invalid_argument("%s: a tool call needs a string function.name", at.c_str());
    }
    if (!first) {
      out_ += "\n<tool_call>\n<function=";
    } else {
      out_ += has_content ? "\n\n<tool_call>\n<function=" : "<tool_call>\n<function=";
    }
    append(out_, name->get_ref<const std::string&>(), ">\n");
    if (const json* arguments = member(call, "arguments")) {
      json parsed;
      if (arguments->is_string()) {  // OpenAI clients send the arguments as a JSON string
        parsed = json::parse(arguments->get<std::string>(), nullptr, /*allow_exceptions=*/false);
        arguments = &parsed;
      }
      if (!json_depth_within(*arguments, kMaxDepth)) {
        return invalid_argument("%s.function.arguments: nested deeper than %zu levels", at.c_str(), kMaxDepth);
      }
      if (!arguments->is_object()) {
        return invalid_argument("%s.function.arguments: expected a JSON object (or a string holding one)",
                                at.c_str());
      }
      for (const auto& [key, value] : arguments->items()) {
        append(out_, "<parameter=", key, ">\n");
        out_ += value.is_string() ? value.get<std::string>() : hf_tojson(value);
        out_ += "\n</parameter>\n";
      }
    }
    out_ += "</function>\n</tool_call>";
    return ok_status();
  }

  // Consecutive tool messages fold into one user turn.
  void render_tool_response(size_t i, const std::string& content) {
    if (i > 0 && !is_string_equal(message_field(messages_[i - 1], "role"), "tool")) out_ += "<|im_start|>user";
    append(out_, "\n<tool_response>\n", content, "\n</tool_response>");
    const bool last = i + 1 == messages_.size();
    if (last || !is_string_equal(message_field(messages_[i + 1], "role"), "tool")) out_ += "<|im_end|>\n";
  }

  const json& messages_;
  const json& tools_;
  ChatOptions options_;
  std::string out_;
  int image_count_ = 0;
  int video_count_ = 0;
  size_t last_query_index_ = 0;
};

}  // namespace

Result<std::string> render_chat(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                                const ChatOptions& options) {
  return ChatRenderer(messages, tools, options).render();
}

Result<ChatOptions> chat_options_from_request(const nlohmann::ordered_json& request) {
  if (!request.is_object()) return invalid_argument("request: expected a JSON object, got %s", request.type_name());
  ChatOptions options;
  if (const json* agp = member(request, "add_generation_prompt")) options.add_generation_prompt = truthy(agp);
  const json* kwargs = member(request, "chat_template_kwargs");
  if (kwargs != nullptr && !kwargs->is_null()) {
    if (!kwargs->is_object()) {
      return invalid_argument("chat_template_kwargs: expected an object, got %s", kwargs->type_name());
    }
    // The template tests `enable_thinking is false` and `preserve_thinking is true`: only booleans count.
    const json* enable = member(*kwargs, "enable_thinking");
    options.enable_thinking = !(enable != nullptr && enable->is_boolean() && !enable->get<bool>());
    const json* preserve = member(*kwargs, "preserve_thinking");
    options.preserve_thinking = preserve != nullptr && preserve->is_boolean() && preserve->get<bool>();
    options.add_vision_id = truthy(member(*kwargs, "add_vision_id"));
  }
  return options;
}

Result<std::string> render_chat_request(const nlohmann::ordered_json& request) {
  ASSIGN_OR_RETURN(ChatOptions options, chat_options_from_request(request));
  const json* messages = member(request, "messages");
  if (messages == nullptr) return invalid_argument("request: missing \"messages\"");
  const json* tools = member(request, "tools");
  static const json kNoTools;
  return render_chat(*messages, tools != nullptr ? *tools : kNoTools, options);
}

}  // namespace lily
