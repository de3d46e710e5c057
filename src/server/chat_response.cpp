#include "server/chat_response.h"

#include <cmath>
#include <random>

namespace lily {

namespace {

// OpenAI reports -9999.0 where a probability underflows; JSON has no -Infinity.
double finite_logprob(float lp) {
  return std::isfinite(lp) ? static_cast<double>(lp) : -9999.0;
}

json token_entry(const Tokenizer& tokenizer, int32_t id, float logprob) {
  std::string_view raw = tokenizer.token_bytes(id);
  json bytes = json::array();
  for (unsigned char c : raw) bytes.push_back(static_cast<int>(c));
  json e;
  e["token"] = std::string(raw);  // a token may be part of a code point: dump_json replaces what is invalid
  e["logprob"] = finite_logprob(logprob);
  e["bytes"] = std::move(bytes);
  return e;
}

json tool_call_json(const ToolCall& call, size_t index, bool with_index) {
  json j;
  if (with_index) j["index"] = index;
  j["id"] = call.id;
  j["type"] = "function";
  j["function"] = {{"name", call.name}, {"arguments", call.arguments_json}};
  return j;
}

}  // namespace

std::string new_id(const char* prefix) {
  static thread_local std::mt19937_64 rng(std::random_device{}());
  static const char kAlphabet[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  std::string id = prefix;
  for (int i = 0; i < 24; ++i) id += kAlphabet[rng() % (sizeof(kAlphabet) - 1)];
  return id;
}

OutputParser chat_output_parser(const ChatRequest& request, const ChatPrompt& prompt) {
  OutputParser parser(prompt.starts_in_reasoning,
                      request.tool_choice == ToolChoice::none ? json() : request.tools);
  if (!prompt.forced_prefix.empty()) parser.push(prompt.forced_prefix);  // opens the call: yields nothing
  return parser;
}

json usage_json(const GenerationResult& result) {
  json u;
  u["prompt_tokens"] = result.prompt_tokens;
  u["completion_tokens"] = result.completion_tokens;
  u["total_tokens"] = result.prompt_tokens + result.completion_tokens;
  u["prompt_tokens_details"] = {{"cached_tokens", result.cached_tokens}};
  return u;
}

json token_logprob_json(const Tokenizer& tokenizer, int32_t id, float logprob,
                        const std::vector<TokenLogprob>& top, bool with_top) {
  json e = token_entry(tokenizer, id, logprob);
  json alternatives = json::array();
  if (with_top) {
    for (const TokenLogprob& t : top) alternatives.push_back(token_entry(tokenizer, t.id, t.logprob));
  }
  e["top_logprobs"] = std::move(alternatives);
  return e;
}

ChatResponseBuilder::ChatResponseBuilder(const ChatRequest& request, const ChatPrompt& prompt,
                                         const Tokenizer& tokenizer, ResponseMeta meta)
    : tokenizer_(tokenizer),
      meta_(std::move(meta)),
      include_usage_(request.stream.include_usage),
      logprobs_(request.logprobs),
      with_top_(request.top_logprobs > 0),
      parser_(chat_output_parser(request, prompt)) {}

json ChatResponseBuilder::chunk(json delta, json logprobs, json finish_reason) const {
  json c;
  c["id"] = meta_.id;
  c["object"] = "chat.completion.chunk";
  c["created"] = meta_.created;
  c["model"] = meta_.model;
  c["system_fingerprint"] = meta_.system_fingerprint;
  json choice;
  choice["index"] = 0;
  choice["delta"] = std::move(delta);
  choice["logprobs"] = std::move(logprobs);
  choice["finish_reason"] = std::move(finish_reason);
  c["choices"] = json::array({std::move(choice)});
  if (include_usage_) c["usage"] = nullptr;
  return c;
}

void ChatResponseBuilder::accumulate(const ParsedDelta& d) {
  reasoning_ += d.reasoning;
  content_ += d.content;
  tool_calls_.insert(tool_calls_.end(), d.tool_calls.begin(), d.tool_calls.end());
}

json ChatResponseBuilder::piece_logprobs(const GenerationPiece& piece) {
  if (!logprobs_ || piece.token < 0) return nullptr;
  json entry = token_logprob_json(tokenizer_, piece.token, piece.logprob, piece.top, with_top_);
  logprob_entries_.push_back(entry);
  return json{{"content", json::array({std::move(entry)})}};
}

std::string ChatResponseBuilder::stream_start() {
  return sse_json(chunk(json{{"role", "assistant"}, {"content", ""}}, nullptr, nullptr));
}

std::string ChatResponseBuilder::stream_delta(const ParsedDelta& d, json logprobs) {
  size_t first_call = tool_calls_.size();
  accumulate(d);
  std::string out;
  auto emit = [&](json delta) {
    out += sse_json(chunk(std::move(delta), std::move(logprobs), nullptr));
    logprobs = nullptr;  // logprobs ride on the first chunk only
  };
  if (!d.reasoning.empty()) emit(json{{"reasoning_content", d.reasoning}});
  if (!d.content.empty()) emit(json{{"content", d.content}});
  for (size_t k = 0; k < d.tool_calls.size(); ++k) {
    emit(json{{"tool_calls", json::array({tool_call_json(d.tool_calls[k], first_call + k, true)})}});
  }
  if (!logprobs.is_null()) emit(json::object());
  return out;
}

std::string ChatResponseBuilder::stream_piece(const GenerationPiece& piece) {
  json logprobs = piece_logprobs(piece);
  return stream_delta(parser_.push(piece.text), std::move(logprobs));
}

std::string ChatResponseBuilder::stream_finish(const GenerationResult& result) {
  std::string out = stream_delta(parser_.finish(), nullptr);
  out += sse_json(chunk(json::object(), nullptr, finish_reason(result)));
  if (include_usage_) {
    json last = chunk(json::object(), nullptr, nullptr);
    last["choices"] = json::array();
    last["usage"] = usage_json(result);
    out += sse_json(last);
  }
  out += sse_done();
  return out;
}

void ChatResponseBuilder::add_piece(const GenerationPiece& piece) {
  piece_logprobs(piece);
  accumulate(parser_.push(piece.text));
}

std::string ChatResponseBuilder::finish_reason(const GenerationResult& result) const {
  if (!tool_calls_.empty()) return "tool_calls";
  return result.finish_reason;
}

json ChatResponseBuilder::response(const GenerationResult& result) {
  accumulate(parser_.finish());
  json message;
  message["role"] = "assistant";
  message["content"] = content_.empty() && !tool_calls_.empty() ? json(nullptr) : json(content_);
  message["reasoning_content"] = reasoning_.empty() ? json(nullptr) : json(reasoning_);
  if (!tool_calls_.empty()) {
    json calls = json::array();
    for (size_t k = 0; k < tool_calls_.size(); ++k) calls.push_back(tool_call_json(tool_calls_[k], k, false));
    message["tool_calls"] = std::move(calls);
  }
  json choice;
  choice["index"] = 0;
  choice["message"] = std::move(message);
  choice["logprobs"] = logprobs_ ? json{{"content", logprob_entries_}} : json(nullptr);
  choice["finish_reason"] = finish_reason(result);
  json r;
  r["id"] = meta_.id;
  r["object"] = "chat.completion";
  r["created"] = meta_.created;
  r["model"] = meta_.model;
  r["system_fingerprint"] = meta_.system_fingerprint;
  r["choices"] = json::array({std::move(choice)});
  r["usage"] = usage_json(result);
  return r;
}

}  // namespace lily
