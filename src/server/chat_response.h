// Turning generated pieces into OpenAI responses. ChatResponseBuilder runs the output parser (reasoning /
// content / tool calls) over the pieces and produces either the `chat.completion` object or the stream of
// `chat.completion.chunk` events, byte for byte as OpenAI frames them:
//   1. a role chunk: delta {"role":"assistant","content":""}
//   2. per piece: a chunk for each of reasoning_content, content and each completed tool call (tool calls
//      come whole: {"index", "id", "type":"function", "function":{"name","arguments"}}); with logprobs the
//      piece's token logprobs ride on its first chunk (an empty delta if the parser held the text back)
//   3. a finish chunk: delta {} and finish_reason stop | length | tool_calls
//   4. with stream_options.include_usage: every chunk carries "usage":null and a last chunk has
//      "choices":[] and the usage
//   5. data: [DONE]
// CompletionResponseBuilder does the same for /v1/completions (`text_completion` objects, no parsing).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "server/chat_request.h"
#include "server/sse.h"
#include "tokenizer/output_parser.h"
#include "tokenizer/tokenizer.h"

namespace lily {

struct ResponseMeta {
  std::string id;       // chatcmpl-... / cmpl-...
  int64_t created = 0;  // unix seconds
  std::string model;
  std::string system_fingerprint;
};

// PREFIX + 24 random alphanumerics: response, message and item ids.
std::string new_id(const char* prefix);

// The output parser of a chat request: it starts in reasoning when the prompt does, knows the tools' schemas
// (none with tool_choice none), and has already read a forced call prefix (which only opens a call).
OutputParser chat_output_parser(const ChatRequest& request, const ChatPrompt& prompt);

// usage object: prompt, completion, total tokens and prompt_tokens_details.cached_tokens.
json usage_json(const GenerationResult& result);
// A logprobs.content entry: token text, logprob, UTF-8 bytes, top_logprobs.
json token_logprob_json(const Tokenizer& tokenizer, int32_t id, float logprob,
                        const std::vector<TokenLogprob>& top, bool with_top);

class ChatResponseBuilder {
 public:
  // The tokenizer must outlive the builder.
  ChatResponseBuilder(const ChatRequest& request, const ChatPrompt& prompt, const Tokenizer& tokenizer,
                      ResponseMeta meta);

  // Streaming: the SSE bytes to send at each point.
  std::string stream_start();
  std::string stream_piece(const GenerationPiece& piece);
  std::string stream_finish(const GenerationResult& result);

  // Non-streaming: add every piece, then build the chat.completion object.
  void add_piece(const GenerationPiece& piece);
  json response(const GenerationResult& result);

  // "tool_calls" when the output held a tool call, else the engine's reason.
  std::string finish_reason(const GenerationResult& result) const;
  const std::string& content() const { return content_; }
  const std::string& reasoning() const { return reasoning_; }

 private:
  json chunk(json delta, json logprobs, json finish_reason) const;
  std::string stream_delta(const ParsedDelta& d, json logprobs);
  void accumulate(const ParsedDelta& d);
  json piece_logprobs(const GenerationPiece& piece);

  const Tokenizer& tokenizer_;
  ResponseMeta meta_;
  bool include_usage_, logprobs_, with_top_;
  OutputParser parser_;
  std::string reasoning_, content_;
  std::vector<ToolCall> tool_calls_;
  json logprob_entries_ = json::array();
};

class CompletionResponseBuilder {
 public:
  CompletionResponseBuilder(const CompletionRequest& request, const Tokenizer& tokenizer, ResponseMeta meta);

  std::string stream_piece(const GenerationPiece& piece);
  std::string stream_finish(const GenerationResult& result);
  void add_piece(const GenerationPiece& piece);
  json response(const GenerationResult& result);

 private:
  json chunk(const std::string& text, json logprobs, json finish_reason) const;
  json legacy_logprobs(const GenerationPiece& piece, size_t text_offset) const;

  const Tokenizer& tokenizer_;
  ResponseMeta meta_;
  bool include_usage_;
  int logprobs_;  // -1: none
  std::string text_;
  json tokens_ = json::array(), token_logprobs_ = json::array(), top_logprobs_ = json::array(),
       text_offsets_ = json::array();
};

}  // namespace lily
