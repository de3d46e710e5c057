// The OpenAI Responses API (POST /v1/responses) on top of the chat path: the body's input items become chat
// messages (responses_request.cpp), validated and rendered as /v1/chat/completions does, and the output
// parser's reasoning / text / tool calls become output items (responses_response.cpp): `reasoning` (its text
// as a reasoning_text content part; no summaries), `message` (one output_text part) and `function_call`.
//
// Stateless: nothing is stored. `store` is accepted and reported as false; `previous_response_id`,
// `conversation` and `background` are a 400 (send the whole conversation in `input`).
//
// Streaming: named SSE events, each with a sequence_number counting from 0:
//   response.created, response.in_progress
//   per item: response.output_item.added, then
//     reasoning: response.content_part.added, response.reasoning_text.delta ...,
//     response.reasoning_text.done,
//                response.content_part.done
//     message:   response.content_part.added, response.output_text.delta ..., response.output_text.done,
//                response.content_part.done
//     function_call: response.function_call_arguments.delta (the whole arguments: calls are parsed whole),
//                response.function_call_arguments.done
//   response.output_item.done
//   response.completed (status completed) or response.incomplete (max_output_tokens reached)
// An error after the stream began is one `error` event.
#pragma once
#include "server/chat_response.h"

namespace lily {

// A Responses body -> the equivalent chat-completions body.
MaybeError responses_to_chat_body(const json& body, json& chat_body);

// An error of the translated body, in the Responses API's field names (max_tokens -> max_output_tokens,
// response_format -> text.format, reasoning_effort -> reasoning.effort).
ApiError as_responses_error(ApiError e);

class ResponsesBuilder {
 public:
  // body: the request as sent (its tools, instructions, ... are echoed in the response object).
  ResponsesBuilder(const ChatRequest& request, const ChatPrompt& prompt, const json& body, ResponseMeta meta);

  std::string stream_start();
  std::string stream_piece(const GenerationPiece& piece);
  std::string stream_finish(const GenerationResult& result);
  std::string stream_error(const ApiError& e);

  void add_piece(const GenerationPiece& piece);
  json response(const GenerationResult& result);

 private:
  enum class Item { none, reasoning, message };
  std::string event(const char* type, json fields);  // type, sequence_number, then the fields
  std::string push(const ParsedDelta& d);
  std::string push_piece(const GenerationPiece& piece);  // counts reasoning tokens, then push()
  std::string open(Item kind);
  std::string close(const char* status = "completed");
  std::string add_call(const ToolCall& call);
  json response_object(const GenerationResult* result) const;  // null: still in progress

  ResponseMeta meta_;
  json echo_;  // instructions, max_output_tokens, tools, tool_choice, ... as the request set them
  OutputParser parser_;
  json output_ = json::array();
  // usage.output_tokens_details.reasoning_tokens: the tokens generated before the one that produced the first
  // answer text or call, when the prompt left the model reasoning.
  bool in_reasoning_;
  int reasoning_tokens_ = 0;
  Item open_ = Item::none;
  int sequence_ = 0;
};

}  // namespace lily
