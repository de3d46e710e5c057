// Typed reads of optional request fields with OpenAI-style errors: a wrong type or an out-of-range value is a
// 400 naming the field (`param`) and saying what was expected and what was found. A JSON null reads as
// absent. Also the sampling fields shared by /v1/chat/completions and /v1/completions.
#pragma once
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "engine/generation_config.h"
#include "engine/sampler.h"
#include "server/api_error.h"

namespace lily {

using json = nlohmann::ordered_json;
using MaybeError = std::optional<ApiError>;

#define RETURN_IF_API_ERROR(expr)    \
  do {                               \
    if (auto _e = (expr)) return _e; \
  } while (0)

// "string", "number", "array", ... as OpenAI's messages name JSON types.
const char* json_type_name(const json& v);
// 400 invalid_type: "'param': expected EXPECTED, got a string".
ApiError wrong_type_error(const std::string& param, const char* expected, const json& found);
// An array of token ids, each in [0, vocab_size): a 400 naming the first bad element otherwise.
MaybeError read_token_ids(const json& value, const std::string& param, int32_t vocab_size,
                          std::vector<int32_t>& out);
// obj[key] must be a string (it may be empty): else a 400 naming `at.key`.
MaybeError read_required_string(const json& obj, const char* key, const std::string& at, std::string& out);
// Each element of body[key] (an array, when present and not null) through `each`, which gets the element
// (an object, checked) and its param name ("tools[2]").
MaybeError for_each_object(const json& body, const char* key,
                           const std::function<MaybeError(const json& element, const std::string& at)>& each);
// e with its param (and the quoted name in its message) renamed from a chat-completions field to the one the
// client's API names: {from, to} pairs, matching the whole param or its part before '[' or '.'.
ApiError rename_param(ApiError e, std::initializer_list<std::pair<const char*, const char*>> renames);
// The field when it is present and not null.
const json* field_of(const json& obj, const char* key);

struct Range {
  double lo, hi;
  bool lo_open = false;  // (lo, hi] instead of [lo, hi]
};

MaybeError read_number(const json& obj, const char* key, const std::string& param, Range range,
                       std::optional<double>& out);
MaybeError read_int(const json& obj, const char* key, const std::string& param, int64_t lo, int64_t hi,
                    std::optional<int64_t>& out);
MaybeError read_bool(const json& obj, const char* key, const std::string& param, std::optional<bool>& out);
MaybeError read_string(const json& obj, const char* key, const std::string& param,
                       std::optional<std::string>& out);

// What validation checks a request against.
struct ServedModel {
  std::string id;  // the name in /v1/models; requests must name it
  int32_t vocab_size = 0;
  int ctx_size = 0;  // prompt + completion tokens
};

// The sampling part of a request, before the model's defaults are applied (apply_defaults).
struct SamplingRequest {
  SamplingParams params;       // penalties, logit_bias, seed, stop, min_tokens, logprobs: the request's own
  RequestOverrides overrides;  // temperature, top_k, top_p, min_p, repetition_penalty, max_tokens if set
  std::vector<int32_t> stop_token_ids;  // vLLM's stop_token_ids: added to the model's own stop tokens
};

// temperature, top_p, top_k, min_p, presence/frequency/repetition_penalty, seed, stop, logit_bias,
// max_tokens / max_completion_tokens (the latter wins), and vLLM's min_tokens, stop_token_ids and
// include_stop_str_in_output. Fields that would change what the output means and that lily cannot honour
// (grammar, json_schema, guided_*) are a 400, never ignored. Logprobs differ between the endpoints and are
// read by each.
MaybeError read_sampling(const json& body, const ServedModel& model, SamplingRequest& out);
// The 400 for grammar, json_schema, structured_outputs and guided_* (part of read_sampling).
MaybeError refuse_constrained_decoding(const json& body);

// `model` must name the served model: 404 model_not_found otherwise (as OpenAI).
MaybeError check_model(const json& body, const ServedModel& model);

// stream, stream_options.include_usage, and the `cache_prompt` extension (false: no session-cache reuse).
struct StreamOptions {
  bool stream = false, include_usage = false, reuse_cache = true;
};
MaybeError read_stream_options(const json& body, StreamOptions& out);

// The raw body -> JSON in linear time (json_body.cpp): valid UTF-8, well-formed JSON, finite numbers, an
// object, nesting at most 64 deep. `client_gone`, when given, is asked now and then; once it says true,
// parsing stops with a 499 `client_gone` error (Server::send_error abandons such a request).
MaybeError parse_json_body(std::string_view body, json& out, const std::function<bool()>& client_gone = {});
// The 499 `client_gone` error of a request whose client has left (nothing is sent for it).
ApiError client_gone_error();

}  // namespace lily
