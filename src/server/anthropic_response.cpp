// Output parser deltas -> Anthropic content blocks and stream events (see anthropic_api.h for the order).
#include "server/anthropic_api.h"

namespace lily {

namespace {

json event_json(const char* type) {
  return json{{"type", type}};
}

const char* anthropic_error_type(int status) {
  switch (status) {
    case 400:
    case 405:
    case 411:
    case 431:
      return "invalid_request_error";
    case 401:
      return "authentication_error";
    case 403:
      return "permission_error";
    case 404:
      return "not_found_error";
    case 413:
      return "request_too_large";
    case 429:
      return "rate_limit_error";
    case 503:
      return "overloaded_error";
    default:
      return status < 500 ? "invalid_request_error" : "api_error";
  }
}

}  // namespace

json anthropic_error_json(const ApiError& e) {
  return json{{"type", "error"},
              {"error", {{"type", anthropic_error_type(e.status)}, {"message", e.message}}}};
}

std::string anthropic_error_body(const ApiError& e) {
  return dump_json(anthropic_error_json(e));
}

AnthropicResponseBuilder::AnthropicResponseBuilder(const ChatRequest& request, const ChatPrompt& prompt,
                                                   ResponseMeta meta, int input_tokens)
    : meta_(std::move(meta)), input_tokens_(input_tokens), parser_(chat_output_parser(request, prompt)) {}

std::string AnthropicResponseBuilder::stream_start() {
  json message;
  message["id"] = meta_.id;
  message["type"] = "message";
  message["role"] = "assistant";
  message["model"] = meta_.model;
  message["content"] = json::array();
  message["stop_reason"] = nullptr;
  message["stop_sequence"] = nullptr;
  message["usage"] = {{"input_tokens", input_tokens_}, {"output_tokens", 0}};
  json e = event_json("message_start");
  e["message"] = std::move(message);
  return sse_named("message_start", e);
}

std::string AnthropicResponseBuilder::open(Block kind) {
  if (open_ == kind) return {};
  std::string out = close();
  json block = kind == Block::thinking ? json{{"type", "thinking"}, {"thinking", ""}, {"signature", ""}}
                                       : json{{"type", "text"}, {"text", ""}};
  json e = event_json("content_block_start");
  e["index"] = blocks_.size();
  e["content_block"] = block;
  blocks_.push_back(std::move(block));
  out += sse_named("content_block_start", e);
  if (!pinged_) out += sse_named("ping", event_json("ping"));
  pinged_ = true;
  open_ = kind;
  return out;
}

std::string AnthropicResponseBuilder::close() {
  if (open_ == Block::none) return {};
  std::string out;
  const size_t index = blocks_.size() - 1;
  if (open_ == Block::thinking) {
    std::string signature = thinking_signature(blocks_.back()["thinking"].get<std::string>());
    blocks_.back()["signature"] = signature;
    json e = event_json("content_block_delta");
    e["index"] = index;
    e["delta"] = {{"type", "signature_delta"}, {"signature", signature}};
    out += sse_named("content_block_delta", e);
  }
  json stop = event_json("content_block_stop");
  stop["index"] = index;
  open_ = Block::none;
  return out + sse_named("content_block_stop", stop);
}

std::string AnthropicResponseBuilder::push(const ParsedDelta& d) {
  std::string out;
  auto delta = [&](json body) {
    json e = event_json("content_block_delta");
    e["index"] = blocks_.size() - 1;
    e["delta"] = std::move(body);
    out += sse_named("content_block_delta", e);
  };
  if (!d.reasoning.empty()) {
    out += open(Block::thinking);
    blocks_.back()["thinking"] = blocks_.back()["thinking"].get<std::string>() + d.reasoning;
    delta({{"type", "thinking_delta"}, {"thinking", d.reasoning}});
  }
  if (!d.content.empty()) {
    out += open(Block::text);
    blocks_.back()["text"] = blocks_.back()["text"].get<std::string>() + d.content;
    delta({{"type", "text_delta"}, {"text", d.content}});
  }
  for (const ToolCall& call : d.tool_calls) {
    out += close();
    json start = event_json("content_block_start");
    start["index"] = blocks_.size();
    start["content_block"] = {
        {"type", "tool_use"}, {"id", call.id}, {"name", call.name}, {"input", json::object()}};
    out += sse_named("content_block_start", start);
    if (!pinged_) out += sse_named("ping", event_json("ping"));
    pinged_ = any_tool_use_ = true;
    json input = json::parse(call.arguments_json, nullptr, false);
    blocks_.push_back({{"type", "tool_use"},
                       {"id", call.id},
                       {"name", call.name},
                       {"input", input.is_object() ? input : json::object()}});
    delta({{"type", "input_json_delta"}, {"partial_json", call.arguments_json}});
    json stop = event_json("content_block_stop");
    stop["index"] = blocks_.size() - 1;
    out += sse_named("content_block_stop", stop);
  }
  return out;
}

std::string AnthropicResponseBuilder::stream_piece(const GenerationPiece& piece) {
  return push(parser_.push(piece.text));
}

// Anthropic counts input_tokens without the cached prefix (input + cache_read + cache_creation = prompt).
json AnthropicResponseBuilder::usage(const GenerationResult& result) const {
  return json{{"input_tokens", result.prompt_tokens - result.cached_tokens},
              {"cache_creation_input_tokens", 0},
              {"cache_read_input_tokens", result.cached_tokens},
              {"output_tokens", result.completion_tokens}};
}

std::string AnthropicResponseBuilder::stop_reason(const GenerationResult& result) const {
  if (any_tool_use_) return "tool_use";
  if (result.finish_reason == "length") return "max_tokens";
  if (!result.stop_string.empty()) return "stop_sequence";
  return "end_turn";
}

std::string AnthropicResponseBuilder::stream_finish(const GenerationResult& result) {
  std::string out = push(parser_.finish()) + close();
  if (!pinged_) out += sse_named("ping", event_json("ping"));
  json e = event_json("message_delta");
  const std::string reason = stop_reason(result);
  e["delta"] = {{"stop_reason", reason},
                {"stop_sequence", reason == "stop_sequence" ? json(result.stop_string) : json(nullptr)}};
  e["usage"] = usage(result);
  out += sse_named("message_delta", e);
  return out + sse_named("message_stop", event_json("message_stop"));
}

std::string AnthropicResponseBuilder::stream_error(const ApiError& e) {
  return sse_named("error", anthropic_error_json(e));
}

void AnthropicResponseBuilder::add_piece(const GenerationPiece& piece) {
  push(parser_.push(piece.text));
}

json AnthropicResponseBuilder::response(const GenerationResult& result) {
  push(parser_.finish());
  close();
  const std::string reason = stop_reason(result);
  json m;
  m["id"] = meta_.id;
  m["type"] = "message";
  m["role"] = "assistant";
  m["model"] = meta_.model;
  m["content"] = blocks_;
  m["stop_reason"] = reason;
  m["stop_sequence"] = reason == "stop_sequence" ? json(result.stop_string) : json(nullptr);
  m["usage"] = usage(result);
  return m;
}

}  // namespace lily
