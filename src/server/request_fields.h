// Typed reads of optional request fields with OpenAI-style errors: a wrong type or an out-of-range value is a
// 400 naming the field (`param`) and saying what was expected and what was found. A JSON null reads as
// absent. Also the sampling fields shared by /v1/chat/completions and /v1/completions.
#pragma once
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

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
  SamplingParams params;       // penalties, logit_bias, seed, stop, logprobs: the request's own
  RequestOverrides overrides;  // temperature, top_k, top_p, min_p, repetition_penalty, max_tokens if set
};

// temperature, top_p, top_k, min_p, presence/frequency/repetition_penalty, seed, stop, logit_bias, and
// max_tokens / max_completion_tokens (the latter wins). Logprobs differ between the endpoints and are read by
// each.
MaybeError read_sampling(const json& body, const ServedModel& model, SamplingRequest& out);

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

}  // namespace lily
