// Output parser deltas -> Responses output items and stream events (see responses_api.h for the order).
#include "server/responses_api.h"

namespace lily {

namespace {

json usage_of(const GenerationResult& r, int reasoning_tokens) {
  json u;
  u["input_tokens"] = r.prompt_tokens;
  u["input_tokens_details"] = {{"cached_tokens", r.cached_tokens}};
  u["output_tokens"] = r.completion_tokens;
  u["output_tokens_details"] = {{"reasoning_tokens", std::min(reasoning_tokens, r.completion_tokens)}};
  u["total_tokens"] = r.prompt_tokens + r.completion_tokens;
  return u;
}

// obj[key] when obj is an object holding a non-null key, else the fallback (any request shape reads safely).
json member_or(const json& obj, const char* key, json fallback) {
  const json* v = obj.is_object() ? field_of(obj, key) : nullptr;
  return v != nullptr ? *v : std::move(fallback);
}

// The request's settings as the response object reports them; tools in the Responses shape, as sent.
json echo_of(const json& body) {
  json e;
  e["instructions"] = member_or(body, "instructions", nullptr);
  e["max_output_tokens"] = member_or(body, "max_output_tokens", nullptr);
  e["parallel_tool_calls"] = member_or(body, "parallel_tool_calls", true);
  e["previous_response_id"] = nullptr;
  e["reasoning"] = {{"effort", member_or(member_or(body, "reasoning", nullptr), "effort", nullptr)},
                    {"summary", nullptr}};
  e["store"] = false;  // nothing is stored (responses_api.h)
  e["temperature"] = member_or(body, "temperature", nullptr);
  e["text"] = {{"format", member_or(member_or(body, "text", nullptr), "format", json{{"type", "text"}})}};
  e["tool_choice"] = member_or(body, "tool_choice", "auto");
  e["tools"] = member_or(body, "tools", json::array());
  e["top_p"] = member_or(body, "top_p", nullptr);
  e["truncation"] = "disabled";
  e["metadata"] = member_or(body, "metadata", json::object());
  return e;
}

}  // namespace

ResponsesBuilder::ResponsesBuilder(const ChatRequest& request, const ChatPrompt& prompt, const json& body,
                                   ResponseMeta meta)
    : meta_(std::move(meta)),
      echo_(echo_of(body)),
      parser_(chat_output_parser(request, prompt)),
      in_reasoning_(prompt.starts_in_reasoning) {}

json ResponsesBuilder::response_object(const GenerationResult* result) const {
  json r;
  r["id"] = meta_.id;
  r["object"] = "response";
  r["created_at"] = meta_.created;
  const bool incomplete = result != nullptr && result->finish_reason == "length";
  r["status"] = result == nullptr ? "in_progress" : incomplete ? "incomplete" : "completed";
  r["error"] = nullptr;
  r["incomplete_details"] = incomplete ? json{{"reason", "max_output_tokens"}} : json(nullptr);
  r["model"] = meta_.model;
  r["output"] = result == nullptr ? json::array() : output_;
  for (const auto& [key, value] : echo_.items()) r[key] = value;
  r["usage"] = result == nullptr ? json(nullptr) : usage_of(*result, reasoning_tokens_);
  return r;
}

std::string ResponsesBuilder::event(const char* type, json fields) {
  json e;
  e["type"] = type;
  e["sequence_number"] = sequence_++;
  for (auto& [key, value] : fields.items()) e[key] = std::move(value);
  return sse_named(type, e);
}

std::string ResponsesBuilder::stream_start() {
  std::string out = event("response.created", {{"response", response_object(nullptr)}});
  return out + event("response.in_progress", {{"response", response_object(nullptr)}});
}

std::string ResponsesBuilder::open(Item kind) {
  if (open_ == kind) return {};
  std::string out = close();
  const bool reasoning = kind == Item::reasoning;
  json item = reasoning ? json{{"id", new_id("rs_")},
                               {"type", "reasoning"},
                               {"summary", json::array()},
                               {"content", json::array()},
                               {"status", "in_progress"}}
                        : json{{"id", new_id("msg_")},
                               {"type", "message"},
                               {"status", "in_progress"},
                               {"role", "assistant"},
                               {"content", json::array()}};
  json part = reasoning ? json{{"type", "reasoning_text"}, {"text", ""}}
                        : json{{"type", "output_text"},
                               {"text", ""},
                               {"annotations", json::array()},
                               {"logprobs", json::array()}};
  const size_t index = output_.size();
  out += event("response.output_item.added", {{"output_index", index}, {"item", item}});
  out += event("response.content_part.added",
               {{"item_id", item["id"]}, {"output_index", index}, {"content_index", 0}, {"part", part}});
  item["content"].push_back(std::move(part));
  output_.push_back(std::move(item));
  open_ = kind;
  return out;
}

std::string ResponsesBuilder::close(const char* status) {
  if (open_ == Item::none) return {};
  json& item = output_.back();
  const size_t index = output_.size() - 1;
  const json& part = item["content"][0];
  const json where = {{"item_id", item["id"]}, {"output_index", index}, {"content_index", 0}};
  json done = where;
  done["text"] = part["text"];
  if (open_ == Item::message) done["logprobs"] = json::array();
  std::string out =
      event(open_ == Item::reasoning ? "response.reasoning_text.done" : "response.output_text.done", done);
  json part_done = where;
  part_done["part"] = part;
  out += event("response.content_part.done", part_done);
  item["status"] = open_ == Item::message ? status : "completed";
  out += event("response.output_item.done", {{"output_index", index}, {"item", item}});
  open_ = Item::none;
  return out;
}

std::string ResponsesBuilder::add_call(const ToolCall& call) {
  std::string out = close();
  const size_t index = output_.size();
  json item = {{"id", new_id("fc_")}, {"type", "function_call"}, {"status", "in_progress"},
               {"call_id", call.id},  {"name", call.name},       {"arguments", ""}};
  out += event("response.output_item.added", {{"output_index", index}, {"item", item}});
  const json where = {{"item_id", item["id"]}, {"output_index", index}};
  json delta = where, done = where;
  delta["delta"] = call.arguments_json;
  out += event("response.function_call_arguments.delta", delta);
  done["name"] = call.name;
  done["arguments"] = call.arguments_json;
  out += event("response.function_call_arguments.done", done);
  item["arguments"] = call.arguments_json;
  item["status"] = "completed";
  out += event("response.output_item.done", {{"output_index", index}, {"item", item}});
  output_.push_back(std::move(item));
  return out;
}

std::string ResponsesBuilder::push(const ParsedDelta& d) {
  std::string out;
  auto append = [&](Item kind, const std::string& text, const char* type) {
    out += open(kind);
    json& t = output_.back()["content"][0]["text"];
    t = t.get<std::string>() + text;
    json e = {{"item_id", output_.back()["id"]},
              {"output_index", output_.size() - 1},
              {"content_index", 0},
              {"delta", text}};
    if (kind == Item::message) e["logprobs"] = json::array();
    out += event(type, std::move(e));
  };
  if (!d.reasoning.empty()) append(Item::reasoning, d.reasoning, "response.reasoning_text.delta");
  if (!d.content.empty()) append(Item::message, d.content, "response.output_text.delta");
  for (const ToolCall& call : d.tool_calls) out += add_call(call);
  return out;
}

std::string ResponsesBuilder::push_piece(const GenerationPiece& piece) {
  ParsedDelta d = parser_.push(piece.text);
  if (!d.content.empty() || !d.tool_calls.empty()) in_reasoning_ = false;
  if (in_reasoning_ && piece.token >= 0) ++reasoning_tokens_;
  return push(d);
}

std::string ResponsesBuilder::stream_piece(const GenerationPiece& piece) {
  return push_piece(piece);
}

std::string ResponsesBuilder::stream_finish(const GenerationResult& result) {
  const bool incomplete = result.finish_reason == "length";
  std::string out = push(parser_.finish()) + close(incomplete ? "incomplete" : "completed");
  return out + event(incomplete ? "response.incomplete" : "response.completed",
                     {{"response", response_object(&result)}});
}

std::string ResponsesBuilder::stream_error(const ApiError& e) {
  return event("error", {{"code", e.code.empty() ? json(nullptr) : json(e.code)},
                         {"message", e.message},
                         {"param", e.param.empty() ? json(nullptr) : json(e.param)}});
}

void ResponsesBuilder::add_piece(const GenerationPiece& piece) {
  push_piece(piece);
}

json ResponsesBuilder::response(const GenerationResult& result) {
  push(parser_.finish());
  close(result.finish_reason == "length" ? "incomplete" : "completed");
  return response_object(&result);
}

}  // namespace lily
