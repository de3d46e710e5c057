// The endpoints other clients speak: POST /v1/messages and /v1/messages/count_tokens (Anthropic), POST
// /v1/responses (OpenAI Responses), POST /tokenize and /detokenize (llama-server). Each translates its body
// into the chat path (prepare_chat) or uses the tokenizer directly; errors come in the API's own shape.
#include "server/anthropic_api.h"
#include "server/loaded_model.h"
#include "server/responses_api.h"
#include "server/server.h"
#include "tokenizer/pretokenize_utf8.h"

namespace lily {

void Server::handle_messages(const HttpRequest& req, HttpExchange& ex) {
  json body, chat_body;
  ChatRequest chat;
  ChatPrompt prompt;
  GenerationRequest g;
  if (auto e = parse_json_body(req.body, body, ex.client_gone_fn())) return send_error(req, ex, *e);
  if (auto e = anthropic_to_chat_body(body, /*count_only=*/false, chat_body)) return send_error(req, ex, *e);
  if (auto e = prepare_chat(chat_body, chat, prompt, g, ex.client_gone_fn())) return send_error(req, ex, as_messages_error(*e));
  AnthropicResponseBuilder builder(chat, prompt, response_meta("msg_"), static_cast<int>(g.prompt.size()));
  StreamCallbacks cb = builder_callbacks(builder, chat.stream.stream);
  if (cb.stream) {
    cb.start = [&] { return builder.stream_start(); };
    cb.stream_error = AnthropicResponseBuilder::stream_error;
  }
  run_job(req, ex, make_job(std::move(g)), cb);
}

void Server::handle_count_tokens(const HttpRequest& req, HttpExchange& ex) {
  json body, chat_body;
  ChatRequest chat;
  if (auto e = parse_json_body(req.body, body, ex.client_gone_fn())) return send_error(req, ex, *e);
  if (auto e = anthropic_to_chat_body(body, /*count_only=*/true, chat_body)) return send_error(req, ex, *e);
  if (auto e = parse_chat_request(chat_body, loaded_->served, chat))
    return send_error(req, ex, as_messages_error(*e));
  Result<ChatPrompt> prompt = build_chat_prompt(chat);
  if (!prompt.ok()) return send_error(req, ex, from_status(prompt.status(), "messages"));
  ex.send_json(200, dump_json(json{{"input_tokens", loaded_->tokenizer.encode(prompt->text).size()}}));
}

void Server::handle_responses(const HttpRequest& req, HttpExchange& ex) {
  json body, chat_body;
  ChatRequest chat;
  ChatPrompt prompt;
  GenerationRequest g;
  if (auto e = parse_json_body(req.body, body, ex.client_gone_fn())) return send_error(ex, *e);
  if (auto e = responses_to_chat_body(body, chat_body)) return send_error(ex, *e);
  if (auto e = prepare_chat(chat_body, chat, prompt, g, ex.client_gone_fn())) return send_error(ex, as_responses_error(*e));
  ResponsesBuilder builder(chat, prompt, body, response_meta("resp_"));
  StreamCallbacks cb = builder_callbacks(builder, chat.stream.stream);
  if (cb.stream) {
    cb.start = [&] { return builder.stream_start(); };
    cb.stream_error = [&](const ApiError& e) { return builder.stream_error(e); };
  }
  run_job(req, ex, make_job(std::move(g)), cb);
}

namespace {

// A token's bytes as llama-server shows a piece: the text when it is valid UTF-8, else the byte values.
json piece_json(std::string_view bytes) {
  if (is_valid_utf8(bytes)) return std::string(bytes);
  json out = json::array();
  for (unsigned char c : bytes) out.push_back(static_cast<int>(c));
  return out;
}

}  // namespace

// {"content", "add_special", "with_pieces"} -> {"tokens": [ids] | [{"id", "piece"}]}. Qwen's tokenizer adds
// no BOS, so add_special changes nothing; special-token text is always read as the special token.
void Server::handle_tokenize(const HttpRequest& req, HttpExchange& ex) {
  json body;
  if (auto e = parse_json_body(req.body, body, ex.client_gone_fn())) return send_error(ex, *e);
  std::optional<std::string> content;
  std::optional<bool> add_special, with_pieces, parse_special;
  if (auto e = read_string(body, "content", "content", content)) return send_error(ex, *e);
  if (!content)
    return send_error(ex, bad_request("'content' is required", "content", "missing_required_parameter"));
  for (auto [key, out] : {std::pair{"add_special", &add_special}, std::pair{"with_pieces", &with_pieces},
                          std::pair{"parse_special", &parse_special}}) {
    if (auto e = read_bool(body, key, key, *out)) return send_error(ex, *e);
  }
  if (!parse_special.value_or(true)) {
    return send_error(
        ex, bad_request("'parse_special': false is not supported (special-token text is always read "
                        "as the special token)",
                        "parse_special", "unsupported_value"));
  }
  const Tokenizer& tok = loaded_->tokenizer;
  json tokens = json::array();
  for (int32_t id : tok.encode(*content)) {
    if (with_pieces.value_or(false)) {
      tokens.push_back({{"id", id}, {"piece", piece_json(tok.token_bytes(id))}});
    } else {
      tokens.push_back(id);
    }
  }
  ex.send_json(200, dump_json(json{{"tokens", std::move(tokens)}}));
}

// {"tokens": [ids]} -> {"content": text}; an id outside the vocabulary is a 400 naming it.
void Server::handle_detokenize(const HttpRequest& req, HttpExchange& ex) {
  json body;
  if (auto e = parse_json_body(req.body, body, ex.client_gone_fn())) return send_error(ex, *e);
  const json* tokens = field_of(body, "tokens");
  if (tokens == nullptr)
    return send_error(ex, bad_request("'tokens' is required", "tokens", "missing_required_parameter"));
  std::vector<int32_t> ids;
  if (auto e = read_token_ids(*tokens, "tokens", loaded_->served.vocab_size, ids)) return send_error(ex, *e);
  ex.send_json(200, dump_json(json{{"content", loaded_->tokenizer.decode(ids)}}));
}

}  // namespace lily
