// /v1/completions responses: `text_completion` objects, streamed or whole, with the legacy logprobs layout
// {tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}.
#include <cmath>

#include "server/chat_response.h"

namespace lily {

CompletionResponseBuilder::CompletionResponseBuilder(const CompletionRequest& request,
                                                     const Tokenizer& tokenizer, ResponseMeta meta)
    : tokenizer_(tokenizer),
      meta_(std::move(meta)),
      include_usage_(request.stream.include_usage),
      logprobs_(request.logprobs) {}

json CompletionResponseBuilder::chunk(const std::string& text, json logprobs, json finish_reason) const {
  json c;
  c["id"] = meta_.id;
  c["object"] = "text_completion";
  c["created"] = meta_.created;
  c["model"] = meta_.model;
  c["system_fingerprint"] = meta_.system_fingerprint;
  json choice;
  choice["index"] = 0;
  choice["text"] = text;
  choice["logprobs"] = std::move(logprobs);
  choice["finish_reason"] = std::move(finish_reason);
  c["choices"] = json::array({std::move(choice)});
  if (include_usage_) c["usage"] = nullptr;
  return c;
}

json CompletionResponseBuilder::legacy_logprobs(const GenerationPiece& piece, size_t text_offset) const {
  auto lp = [](float v) { return std::isfinite(v) ? static_cast<double>(v) : -9999.0; };
  json top = json::object();
  for (const TokenLogprob& t : piece.top) top[std::string(tokenizer_.token_bytes(t.id))] = lp(t.logprob);
  json j;
  j["tokens"] = json::array({std::string(tokenizer_.token_bytes(piece.token))});
  j["token_logprobs"] = json::array({lp(piece.logprob)});
  j["top_logprobs"] = json::array({std::move(top)});
  j["text_offset"] = json::array({text_offset});
  return j;
}

std::string CompletionResponseBuilder::stream_piece(const GenerationPiece& piece) {
  json logprobs = logprobs_ >= 0 && piece.token >= 0 ? legacy_logprobs(piece, text_.size()) : json(nullptr);
  text_ += piece.text;
  if (piece.text.empty() && logprobs.is_null()) return "";
  return sse_json(chunk(piece.text, std::move(logprobs), nullptr));
}

std::string CompletionResponseBuilder::stream_finish(const GenerationResult& result) {
  std::string out = sse_json(chunk("", nullptr, result.finish_reason));
  if (include_usage_) {
    json last = chunk("", nullptr, nullptr);
    last["choices"] = json::array();
    last["usage"] = usage_json(result);
    out += sse_json(last);
  }
  return out + sse_done();
}

void CompletionResponseBuilder::add_piece(const GenerationPiece& piece) {
  if (logprobs_ >= 0 && piece.token >= 0) {
    json one = legacy_logprobs(piece, text_.size());
    tokens_.push_back(one["tokens"][0]);
    token_logprobs_.push_back(one["token_logprobs"][0]);
    top_logprobs_.push_back(one["top_logprobs"][0]);
    text_offsets_.push_back(one["text_offset"][0]);
  }
  text_ += piece.text;
}

json CompletionResponseBuilder::response(const GenerationResult& result) {
  json logprobs = nullptr;
  if (logprobs_ >= 0) {
    logprobs = {{"tokens", tokens_},
                {"token_logprobs", token_logprobs_},
                {"top_logprobs", top_logprobs_},
                {"text_offset", text_offsets_}};
  }
  json r = chunk(text_, std::move(logprobs), result.finish_reason);
  r.erase("usage");
  r["usage"] = usage_json(result);
  return r;
}

}  // namespace lily
