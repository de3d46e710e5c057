// libFuzzer target for the request validation of every POST endpoint: the first input byte picks the
// endpoint, the rest is its body, which goes through what the endpoint's handler runs before the engine sees
// anything (parse_json_body, the endpoint's schema checks, the chat template). Every input must end in a
// result or an ApiError with a 4xx status, a message, and OpenAI error JSON that serializes; an exception
// escaping, a sanitizer finding or a violated invariant is a crash. Adding an endpoint is one line in
// kEndpoints.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "server/anthropic_api.h"
#include "server/chat_request.h"
#include "server/responses_api.h"

namespace {

using lily::ApiError;
using lily::json;
using lily::MaybeError;

const lily::ServedModel kModel{"tiny", 1024, 4096};

MaybeError validate_chat(const json& body) {
  lily::ChatRequest chat;
  RETURN_IF_API_ERROR(lily::parse_chat_request(body, kModel, chat));
  lily::Result<lily::ChatPrompt> prompt = lily::build_chat_prompt(chat);
  if (!prompt.ok()) return lily::from_status(prompt.status(), "messages");
  return std::nullopt;
}

MaybeError validate_completion(const json& body) {
  lily::CompletionRequest request;
  return lily::parse_completion_request(body, kModel, request);
}

MaybeError validate_apply_template(const json& body) {  // as Server::handle_apply_template: model optional
  json with_model = body;
  if (!with_model.contains("model")) with_model["model"] = kModel.id;
  return validate_chat(with_model);
}

MaybeError validate_messages(const json& body) {  // as Server::handle_messages
  json chat_body;
  RETURN_IF_API_ERROR(lily::anthropic_to_chat_body(body, /*count_only=*/false, chat_body));
  return validate_chat(chat_body);
}

MaybeError validate_count_tokens(const json& body) {
  json chat_body;
  RETURN_IF_API_ERROR(lily::anthropic_to_chat_body(body, /*count_only=*/true, chat_body));
  return validate_chat(chat_body);
}

MaybeError validate_responses(const json& body) {  // as Server::handle_responses
  json chat_body;
  RETURN_IF_API_ERROR(lily::responses_to_chat_body(body, chat_body));
  return validate_chat(chat_body);
}

MaybeError validate_tokenize(const json& body) {  // the field reads of Server::handle_tokenize
  std::optional<std::string> content;
  std::optional<bool> flag;
  RETURN_IF_API_ERROR(lily::read_string(body, "content", "content", content));
  for (const char* key : {"add_special", "with_pieces", "parse_special"})
    RETURN_IF_API_ERROR(lily::read_bool(body, key, key, flag));
  return std::nullopt;
}

MaybeError validate_detokenize(const json& body) {  // as Server::handle_detokenize
  const json* tokens = lily::field_of(body, "tokens");
  std::vector<int32_t> ids;
  return tokens == nullptr ? std::nullopt : lily::read_token_ids(*tokens, "tokens", kModel.vocab_size, ids);
}

struct Endpoint {
  const char* path;
  MaybeError (*validate)(const json& body);
};

const Endpoint kEndpoints[] = {
    {"/v1/chat/completions", validate_chat},
    {"/v1/completions", validate_completion},
    {"/apply-template", validate_apply_template},
    {"/v1/messages", validate_messages},
    {"/v1/messages/count_tokens", validate_count_tokens},
    {"/v1/responses", validate_responses},
    {"/tokenize", validate_tokenize},
    {"/detokenize", validate_detokenize},
};
constexpr size_t kNumEndpoints = sizeof(kEndpoints) / sizeof(kEndpoints[0]);

[[noreturn]] void violated(const char* what, const Endpoint& e, const ApiError& err) {
  std::fprintf(stderr, "fuzz_request_validation: %s: %s (status %d, message `%s`)\n", e.path, what,
               err.status, err.message.c_str());
  std::abort();
}

void check_error(const Endpoint& e, const ApiError& err) {
  if (err.status < 400 || err.status >= 500) violated("a validation error must be a 4xx", e, err);
  if (err.message.empty()) violated("an error without a message", e, err);
  std::string body = lily::error_body(err);
  if (!json::parse(body, nullptr, false).is_object()) violated("error JSON does not parse", e, err);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const Endpoint& e = kEndpoints[data[0] % kNumEndpoints];
  std::string_view body(reinterpret_cast<const char*>(data) + 1, size - 1);
  json parsed;
  if (MaybeError err = lily::parse_json_body(body, parsed)) {
    check_error(e, *err);
    return 0;
  }
  if (MaybeError err = e.validate(parsed)) check_error(e, *err);
  return 0;
}
