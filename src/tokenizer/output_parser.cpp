// Incremental reasoning / content / tool-call parser (behaviour documented in output_parser.h).
#include "tokenizer/output_parser.h"

#include <algorithm>
#include <unordered_set>
#include <utility>

#include "tokenizer/json_dump.h"

namespace lily {

namespace {

using json = nlohmann::ordered_json;

constexpr std::string_view kThinkEnd = "</think>";
constexpr std::string_view kCallOpen = "<tool_call>";
constexpr std::string_view kCallClose = "</tool_call>";
constexpr std::string_view kFunctionOpen = "<function=";
constexpr std::string_view kFunctionClose = "</function>";
constexpr std::string_view kParamOpen = "<parameter=";
constexpr std::string_view kParamClose = "</parameter>";
constexpr size_t kMaxValueDepth = 128;  // deeper JSON stays a string (keeps every later walk shallow)

// Length of the longest proper prefix of `marker` that `buf` ends with: text to hold back.
size_t held_marker_prefix(std::string_view buf, std::string_view marker) {
  for (size_t n = std::min(buf.size(), marker.size() - 1); n > 0; --n) {
    if (buf.substr(buf.size() - n) == marker.substr(0, n)) return n;
  }
  return 0;
}

bool is_space(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

std::string_view trim(std::string_view s) {
  while (!s.empty() && is_space(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_space(s.back())) s.remove_suffix(1);
  return s;
}

// Where a parameter value ends: the first </parameter>, or (lenient) <parameter= or </function>.
// One pass over the '<'s, so a long body with many parameters stays linear.
size_t value_end_in(std::string_view rest) {
  for (size_t at = rest.find('<'); at != std::string_view::npos; at = rest.find('<', at + 1)) {
    const std::string_view tail = rest.substr(at);
    if (tail.starts_with(kParamClose) || tail.starts_with(kParamOpen) || tail.starts_with(kFunctionClose)) return at;
  }
  return std::string_view::npos;
}

bool valid_name(std::string_view name) {
  return !name.empty() && name.find_first_of("<>\n") == std::string_view::npos;
}

// A parsed JSON value, or discarded when the text is not JSON, is a JSON string (strings stay raw
// text) or nests deeper than kMaxValueDepth.
json parse_non_string(const std::string& text) {
  size_t depth = 0, max_depth = 0;
  for (char c : text) {  // brackets inside strings over-count, which only errs towards "too deep"
    if (c == '[' || c == '{') max_depth = std::max(max_depth, ++depth);
    if ((c == ']' || c == '}') && depth > 0) --depth;
  }
  if (max_depth > kMaxValueDepth) return json(json::value_t::discarded);
  json v = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (v.is_string()) return json(json::value_t::discarded);
  return v;
}

// The JSON-schema type names a schema allows: "type" (string or list), anyOf/oneOf members, enum values.
void collect_types(const json& schema, std::unordered_set<std::string>& types, int depth = 0) {
  if (!schema.is_object() || depth > 4) return;
  if (auto it = schema.find("type"); it != schema.end()) {
    if (it->is_string()) types.insert(it->get<std::string>());
    if (it->is_array()) {
      for (const auto& t : *it) {
        if (t.is_string()) types.insert(t.get<std::string>());
      }
    }
  }
  for (const char* key : {"anyOf", "oneOf"}) {
    if (auto it = schema.find(key); it != schema.end() && it->is_array()) {
      for (const auto& member : *it) collect_types(member, types, depth + 1);
    }
  }
  if (auto it = schema.find("enum"); it != schema.end() && it->is_array() && !schema.contains("type")) {
    for (const auto& value : *it) {
      if (value.is_string()) types.insert("string");
      if (value.is_number()) types.insert("number");
      if (value.is_boolean()) types.insert("boolean");
      if (value.is_null()) types.insert("null");
    }
  }
}

bool type_allowed(const json& v, const std::unordered_set<std::string>& types) {
  switch (v.type()) {
    case json::value_t::null: return types.count("null") > 0;
    case json::value_t::boolean: return types.count("boolean") > 0;
    case json::value_t::number_integer:
    case json::value_t::number_unsigned: return types.count("integer") > 0 || types.count("number") > 0;
    case json::value_t::number_float: return types.count("number") > 0 || types.count("integer") > 0;
    case json::value_t::array: return types.count("array") > 0;
    case json::value_t::object: return types.count("object") > 0;
    default: return false;
  }
}

}  // namespace

OutputParser::OutputParser(bool starts_in_reasoning, const nlohmann::ordered_json& tools)
    : mode_(starts_in_reasoning ? Mode::reasoning : Mode::content),
      strip_leading_newlines_(starts_in_reasoning),
      rng_(std::random_device{}()) {
  if (!tools.is_array()) return;
  for (const auto& tool : tools) {
    if (!tool.is_object() || !json_depth_within(tool, 2 * kMaxValueDepth)) continue;  // copied below
    auto fn_it = tool.find("function");
    const json& fn = (fn_it != tool.end() && fn_it->is_object()) ? *fn_it : tool;
    auto name = fn.find("name");
    auto params = fn.find("parameters");
    if (name == fn.end() || !name->is_string() || params == fn.end() || !params->is_object()) continue;
    auto props = params->find("properties");
    if (props != params->end() && props->is_object()) param_schemas_[name->get<std::string>()] = *props;
  }
}

ParsedDelta OutputParser::push(std::string_view text) {
  ParsedDelta out;
  buf_.append(text);
  for (bool more = true; more;) {
    if (mode_ == Mode::reasoning) {
      step_reasoning(out, false);
      more = mode_ != Mode::reasoning;
    } else if (mode_ == Mode::content) {
      step_content(out, false);
      more = mode_ != Mode::content;
    } else {
      more = step_tool_call(out);
    }
  }
  return out;
}

ParsedDelta OutputParser::finish() {
  ParsedDelta out = push("");
  if (mode_ == Mode::tool_call) {  // a call still open is text
    release_pending_newlines(out);
    out.content.append(kCallOpen).append(buf_);
    buf_.clear();
    mode_ = Mode::content;
  }
  if (mode_ == Mode::reasoning) {
    step_reasoning(out, true);
  } else {
    step_content(out, true);
  }
  return out;
}

void OutputParser::step_reasoning(ParsedDelta& out, bool at_end) {
  const size_t end = buf_.find(kThinkEnd);
  if (end != std::string::npos) {
    emit(std::string_view(buf_).substr(0, end), out.reasoning);
    pending_newlines_ = 0;  // reasoning.rstrip('\n')
    buf_.erase(0, end + kThinkEnd.size());
    mode_ = Mode::content;
    strip_leading_newlines_ = true;  // content.lstrip('\n')
    return;
  }
  const size_t keep = at_end ? 0 : held_marker_prefix(buf_, kThinkEnd);
  emit(std::string_view(buf_).substr(0, buf_.size() - keep), out.reasoning);
  buf_.erase(0, buf_.size() - keep);
  if (at_end) release_pending_newlines(out);
}

void OutputParser::step_content(ParsedDelta& out, bool at_end) {
  const size_t open = buf_.find(kCallOpen);
  if (open != std::string::npos) {
    emit(std::string_view(buf_).substr(0, open), out.content);
    buf_.erase(0, open + kCallOpen.size());
    mode_ = Mode::tool_call;
    call_scan_from_ = 0;
    return;
  }
  const size_t keep = at_end ? 0 : held_marker_prefix(buf_, kCallOpen);
  emit(std::string_view(buf_).substr(0, buf_.size() - keep), out.content);
  buf_.erase(0, buf_.size() - keep);
  if (at_end) release_pending_newlines(out);
}

bool OutputParser::step_tool_call(ParsedDelta& out) {
  const size_t close = buf_.find(kCallClose, call_scan_from_);
  if (close == std::string::npos) {
    call_scan_from_ = buf_.size() >= kCallClose.size() ? buf_.size() - kCallClose.size() + 1 : 0;
    return false;
  }
  ToolCall call;
  if (parse_call(std::string_view(buf_).substr(0, close), call)) {
    pending_newlines_ = 0;  // the "\n\n" / "\n" the template puts before a call
    out.tool_calls.push_back(std::move(call));
    strip_leading_newlines_ = true;
  } else {
    release_pending_newlines(out);
    out.content.append(kCallOpen).append(buf_, 0, close).append(kCallClose);
    strip_leading_newlines_ = false;
  }
  buf_.erase(0, close + kCallClose.size());
  mode_ = Mode::content;
  return true;
}

// Reasoning and content share the newline rules: leading '\n's dropped when strip_leading_newlines_,
// trailing '\n's held in pending_newlines_ until more text shows they were not trailing.
void OutputParser::emit(std::string_view text, std::string& sink) {
  if (strip_leading_newlines_) {
    while (!text.empty() && text.front() == '\n') text.remove_prefix(1);
    if (text.empty()) return;
    strip_leading_newlines_ = false;
  }
  size_t trailing = 0;
  while (trailing < text.size() && text[text.size() - 1 - trailing] == '\n') ++trailing;
  if (trailing == text.size()) {
    pending_newlines_ += trailing;
    return;
  }
  sink.append(pending_newlines_, '\n').append(text.substr(0, text.size() - trailing));
  pending_newlines_ = trailing;
}

void OutputParser::release_pending_newlines(ParsedDelta& out) {
  std::string& sink = mode_ == Mode::reasoning ? out.reasoning : out.content;
  sink.append(pending_newlines_, '\n');
  pending_newlines_ = 0;
}

bool OutputParser::parse_call(std::string_view body, ToolCall& call) {
  body = trim(body);
  if (!body.empty() && body.front() == '{') {  // Hermes style: {"name": ..., "arguments": {...}}
    json v = parse_non_string(std::string(body));
    if (!v.is_object() || !v.contains("name") || !v["name"].is_string()) return false;
    json args = v.contains("arguments") ? v["arguments"] : json::object();
    if (args.is_string()) args = parse_non_string(args.get<std::string>());
    if (!args.is_object() || !valid_name(v["name"].get<std::string>())) return false;
    call.name = v["name"].get<std::string>();
    call.arguments_json = hf_tojson(args);
    call.id = new_call_id();
    return true;
  }
  if (!body.starts_with(kFunctionOpen)) return false;
  const size_t name_end = body.find('>');
  if (name_end == std::string_view::npos) return false;
  const std::string_view name = trim(body.substr(kFunctionOpen.size(), name_end - kFunctionOpen.size()));
  if (!valid_name(name)) return false;
  call.name = std::string(name);
  // Arguments in order; a repeated name keeps its first place and its last value (as a Python dict
  // would). Not an ordered_json: its object lookup is linear, which made many parameters quadratic.
  std::vector<std::pair<std::string, json>> args;
  std::unordered_map<std::string, size_t> arg_index;
  std::string_view rest = body.substr(name_end + 1);
  for (;;) {
    rest = trim(rest);
    if (rest == kFunctionClose) break;
    if (!rest.starts_with(kParamOpen)) return false;
    const size_t key_end = rest.find('>');
    if (key_end == std::string_view::npos) return false;
    const std::string_view key = trim(rest.substr(kParamOpen.size(), key_end - kParamOpen.size()));
    if (!valid_name(key)) return false;
    rest.remove_prefix(key_end + 1);
    const size_t value_end = value_end_in(rest);
    if (value_end == std::string_view::npos) return false;
    std::string_view value = rest.substr(0, value_end);
    if (value.starts_with('\n')) value.remove_prefix(1);  // the template writes "\nVALUE\n"
    if (value.ends_with('\n')) value.remove_suffix(1);
    json typed = typed_value(call.name, std::string(key), std::string(value));
    auto [it, inserted] = arg_index.emplace(std::string(key), args.size());
    if (inserted) {
      args.emplace_back(std::string(key), std::move(typed));
    } else {
      args[it->second].second = std::move(typed);
    }
    rest.remove_prefix(value_end);
    if (rest.starts_with(kParamClose)) rest.remove_prefix(kParamClose.size());
  }
  call.arguments_json = "{";
  for (size_t i = 0; i < args.size(); ++i) {
    if (i > 0) call.arguments_json += ", ";
    call.arguments_json.append(hf_tojson(json(args[i].first))).append(": ").append(hf_tojson(args[i].second));
  }
  call.arguments_json += "}";
  call.id = new_call_id();
  return true;
}

nlohmann::ordered_json OutputParser::typed_value(const std::string& function, const std::string& param,
                                                 const std::string& text) const {
  std::unordered_set<std::string> types;
  if (auto fn = param_schemas_.find(function); fn != param_schemas_.end()) {
    if (auto schema = fn->second.find(param); schema != fn->second.end()) collect_types(*schema, types);
  }
  if (types.size() == 1 && types.count("string")) return text;
  const json parsed = parse_non_string(text);
  const bool ok = !parsed.is_discarded();
  if (types.empty()) return ok ? parsed : json(text);
  if (ok && type_allowed(parsed, types)) return parsed;
  if (types.count("string")) return text;
  return ok ? parsed : json(text);
}

std::string OutputParser::new_call_id() {
  static constexpr std::string_view kAlphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  std::string id = "call_";
  for (int i = 0; i < 24; ++i) id += kAlphabet[rng_() % kAlphabet.size()];
  return id;
}

}  // namespace lily
