// The Anthropic Messages API (POST /v1/messages, POST /v1/messages/count_tokens) on top of the chat path:
// a Messages body is translated into a chat-completions body (anthropic_request.cpp), validated and rendered
// by the same code as /v1/chat/completions, and the output parser's reasoning / text / tool calls become
// Anthropic content blocks (anthropic_response.cpp).
//
// Streaming events, in Anthropic's order:
//   message_start {message: id, type, role, content [], model, stop_reason null, usage}
//   per block: content_block_start {index, content_block}, content_block_delta {index, delta} ...,
//              content_block_stop {index}; a ping right after the first content_block_start
//   message_delta {delta: {stop_reason, stop_sequence}, usage}, message_stop
// Deltas: text_delta, thinking_delta (then one signature_delta before the thinking block stops),
// input_json_delta (a tool call's whole input as one partial_json: calls are parsed whole).
#pragma once
#include <string>
#include <string_view>

#include "server/chat_response.h"

namespace lily {

bool is_anthropic_path(std::string_view path);

// {"type":"error","error":{"type", "message"}}: 400 invalid_request_error, 401 authentication_error,
// 403 permission_error, 404 not_found_error, 413 request_too_large, 429 rate_limit_error, 503
// overloaded_error, other 5xx api_error.
std::string anthropic_error_body(const ApiError& e);
json anthropic_error_json(const ApiError& e);

// A Messages body -> the equivalent chat-completions body (system first, tool_use / tool_result blocks as
// tool calls and tool messages, thinking as chat_template_kwargs.enable_thinking, stop_sequences as stop).
// count_only: the body of count_tokens (max_tokens is not required there).
MaybeError anthropic_to_chat_body(const json& body, bool count_only, json& chat_body);

// An error of the translated body, in the Messages API's field names (stop -> stop_sequences).
ApiError as_messages_error(ApiError e);

// `signature` of a thinking block: "lily1:" + 16 hex digits of the FNV-1a 64-bit hash of the thinking text.
// It is a digest, not a secret: a client can tell the block is unchanged; lily does not require it back.
std::string thinking_signature(std::string_view thinking);

class AnthropicResponseBuilder {
 public:
  // input_tokens: the prompt's token count (message_start goes out before the cache lookup is known).
  AnthropicResponseBuilder(const ChatRequest& request, const ChatPrompt& prompt, ResponseMeta meta,
                           int input_tokens);

  std::string stream_start();
  std::string stream_piece(const GenerationPiece& piece);
  std::string stream_finish(const GenerationResult& result);
  static std::string stream_error(const ApiError& e);

  void add_piece(const GenerationPiece& piece);
  json response(const GenerationResult& result);

 private:
  enum class Block { none, thinking, text };
  std::string push(const ParsedDelta& d);  // events for what the parser completed; blocks_ kept
  std::string open(Block kind);            // closes the open block if it is another kind
  std::string close();
  json usage(const GenerationResult& result) const;
  std::string stop_reason(const GenerationResult& result) const;

  ResponseMeta meta_;
  int input_tokens_;
  OutputParser parser_;
  json blocks_ = json::array();  // the content blocks so far, as the non-streamed message has them
  Block open_ = Block::none;
  bool any_tool_use_ = false, pinged_ = false;
};

}  // namespace lily
