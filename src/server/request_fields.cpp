#include "server/request_fields.h"

#include <cmath>
#include <cstdlib>
#include <limits>

#include "tokenizer/json_dump.h"

namespace lily {

namespace {

constexpr size_t kMaxStopStrings = 16;

const json* field(const json& obj, const char* key) {
  return field_of(obj, key);
}

ApiError wrong_type(const std::string& param, const char* expected, const json& found) {
  return wrong_type_error(param, expected, found);
}

std::string show_number(double v) {
  if (std::isnan(v)) return "NaN";
  return python_float_repr(v);
}

}  // namespace

const json* field_of(const json& obj, const char* key) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

ApiError wrong_type_error(const std::string& param, const char* expected, const json& found) {
  return bad_request(format("'%s': expected %s, got %s", param.c_str(), expected, json_type_name(found)),
                     param, "invalid_type");
}

MaybeError read_required_string(const json& obj, const char* key, const std::string& at, std::string& out) {
  const json* v = field_of(obj, key);
  if (v == nullptr || !v->is_string()) {
    return bad_request(format("'%s.%s' is required and must be a string", at.c_str(), key), at + "." + key);
  }
  out = v->get<std::string>();
  return std::nullopt;
}

MaybeError for_each_object(
    const json& body, const char* key,
    const std::function<MaybeError(const json& element, const std::string& at)>& each) {
  const json* v = field_of(body, key);
  if (v == nullptr) return std::nullopt;
  if (!v->is_array()) return wrong_type_error(key, "an array", *v);
  for (size_t i = 0; i < v->size(); ++i) {
    std::string at = format("%s[%zu]", key, i);
    if (!(*v)[i].is_object()) return wrong_type_error(at, "an object", (*v)[i]);
    RETURN_IF_API_ERROR(each((*v)[i], at));
  }
  return std::nullopt;
}

ApiError rename_param(ApiError e, std::initializer_list<std::pair<const char*, const char*>> renames) {
  for (const auto& [from, to] : renames) {
    const std::string_view f = from;
    const std::string_view p = e.param;
    if (!p.starts_with(f) || (p.size() > f.size() && p[f.size()] != '[' && p[f.size()] != '.')) continue;
    e.param = std::string(to) + e.param.substr(f.size());
    const std::string quoted = "'" + std::string(from);
    if (size_t at = e.message.find(quoted); at != std::string::npos)
      e.message.replace(at, quoted.size(), "'" + std::string(to));
    break;
  }
  return e;
}

const char* json_type_name(const json& v) {
  switch (v.type()) {
    case json::value_t::null:
      return "null";
    case json::value_t::boolean:
      return "a boolean";
    case json::value_t::string:
      return "a string";
    case json::value_t::array:
      return "an array";
    case json::value_t::object:
      return "an object";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
      return "an integer";
    case json::value_t::number_float:
      return "a number";
    default:
      return "an unsupported value";
  }
}

MaybeError read_number(const json& obj, const char* key, const std::string& param, Range range,
                       std::optional<double>& out) {
  const json* v = field(obj, key);
  if (v == nullptr) return std::nullopt;
  if (!v->is_number()) return wrong_type(param, "a number", *v);
  double x = v->get<double>();
  bool below = range.lo_open ? !(x > range.lo) : !(x >= range.lo);
  if (below || !(x <= range.hi)) {
    return bad_request(
        format("'%s': %s is out of range; expected %s%s, %s]", param.c_str(), show_number(x).c_str(),
               range.lo_open ? "(" : "[", show_number(range.lo).c_str(), show_number(range.hi).c_str()),
        param, "invalid_value");
  }
  out = x;
  return std::nullopt;
}

MaybeError read_int(const json& obj, const char* key, const std::string& param, int64_t lo, int64_t hi,
                    std::optional<int64_t>& out) {
  const json* v = field(obj, key);
  if (v == nullptr) return std::nullopt;
  int64_t x = 0;
  if (v->is_number_integer()) {
    if (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
      x = INT64_MAX;
    } else {
      x = v->get<int64_t>();
    }
  } else if (v->is_number_float() && std::trunc(v->get<double>()) == v->get<double>() &&
             std::fabs(v->get<double>()) < 9e15) {
    x = static_cast<int64_t>(v->get<double>());  // 16.0 is an integer in JSON Schema terms
  } else {
    return wrong_type(param, "an integer", *v);
  }
  if (x < lo || x > hi) {
    std::string bound =
        hi == INT64_MAX ? format(">= %lld", static_cast<long long>(lo))
                        : format("in [%lld, %lld]", static_cast<long long>(lo), static_cast<long long>(hi));
    return bad_request(format("'%s': %lld is out of range; expected an integer %s", param.c_str(),
                              static_cast<long long>(x), bound.c_str()),
                       param, "invalid_value");
  }
  out = x;
  return std::nullopt;
}

MaybeError read_bool(const json& obj, const char* key, const std::string& param, std::optional<bool>& out) {
  const json* v = field(obj, key);
  if (v == nullptr) return std::nullopt;
  if (!v->is_boolean()) return wrong_type(param, "a boolean", *v);
  out = v->get<bool>();
  return std::nullopt;
}

MaybeError read_string(const json& obj, const char* key, const std::string& param,
                       std::optional<std::string>& out) {
  const json* v = field(obj, key);
  if (v == nullptr) return std::nullopt;
  if (!v->is_string()) return wrong_type(param, "a string", *v);
  out = v->get<std::string>();
  return std::nullopt;
}

static MaybeError read_stop_strings(const json& value, const std::string& name,
                                    std::vector<std::string>& out) {
  const json* v = &value;
  if (v->is_string()) {
    if (v->get<std::string>().empty())
      return bad_request(format("'%s': a stop string must not be empty", name.c_str()), name);
    out.push_back(v->get<std::string>());
    return std::nullopt;
  }
  if (!v->is_array()) return wrong_type(name, "a string or an array of strings", *v);
  if (v->size() > kMaxStopStrings) {
    return bad_request(
        format("'%s': at most %zu stop strings, got %zu", name.c_str(), kMaxStopStrings, v->size()), name);
  }
  for (size_t i = 0; i < v->size(); ++i) {
    const json& s = (*v)[i];
    std::string param = format("%s[%zu]", name.c_str(), i);
    if (!s.is_string()) return wrong_type(param, "a string", s);
    if (s.get<std::string>().empty())
      return bad_request(format("'%s' must not be empty", param.c_str()), param);
    out.push_back(s.get<std::string>());
  }
  return std::nullopt;
}

static MaybeError read_stop(const json& body, std::vector<std::string>& out) {
  const json* v = field(body, "stop");
  return v == nullptr ? std::nullopt : read_stop_strings(*v, "stop", out);
}

MaybeError read_token_ids(const json& value, const std::string& param, int32_t vocab_size,
                          std::vector<int32_t>& out) {
  if (!value.is_array()) return wrong_type(param, "an array of token ids", value);
  for (size_t i = 0; i < value.size(); ++i) {
    std::optional<int64_t> id;
    json one = {{"id", value[i]}};
    std::string at = format("%s[%zu]", param.c_str(), i);
    if (value[i].is_null()) return wrong_type(at, "an integer", value[i]);
    RETURN_IF_API_ERROR(read_int(one, "id", at, 0, vocab_size - 1, id));
    out.push_back(static_cast<int32_t>(*id));
  }
  return std::nullopt;
}

static MaybeError read_stop_token_ids(const json& body, int32_t vocab_size, std::vector<int32_t>& out) {
  const json* v = field(body, "stop_token_ids");
  return v == nullptr ? std::nullopt : read_token_ids(*v, "stop_token_ids", vocab_size, out);
}

MaybeError refuse_constrained_decoding(const json& body) {
  for (const auto& [key, value] : body.items()) {
    if (value.is_null()) continue;
    if (key == "grammar" || key == "json_schema" || key == "structured_outputs" ||
        key.starts_with("guided_")) {
      return bad_request(format("'%s': constrained decoding is not supported by this server (generation is "
                                "never grammar-, schema- or regex-constrained); remove the field",
                                key.c_str()),
                         key, "unsupported_parameter");
    }
  }
  return std::nullopt;
}

static MaybeError read_logit_bias(const json& body, int32_t vocab_size,
                                  std::unordered_map<int32_t, float>& out) {
  const json* v = field(body, "logit_bias");
  if (v == nullptr) return std::nullopt;
  if (!v->is_object()) return wrong_type("logit_bias", "an object mapping token ids to biases", *v);
  for (const auto& [key, bias] : v->items()) {
    std::string param = "logit_bias." + key;
    char* end = nullptr;
    long id = std::strtol(key.c_str(), &end, 10);
    if (key.empty() || *end != '\0' || id < 0 || id >= vocab_size) {
      return bad_request(format("'logit_bias': `%s` is not a token id in [0, %d)", key.c_str(), vocab_size),
                         "logit_bias", "invalid_value");
    }
    std::optional<double> b;
    json one = {{"b", bias}};
    if (bias.is_null()) return wrong_type(param, "a number", bias);
    RETURN_IF_API_ERROR(read_number(one, "b", param, {-100, 100}, b));
    out[static_cast<int32_t>(id)] = static_cast<float>(*b);
  }
  return std::nullopt;
}

MaybeError read_sampling(const json& body, const ServedModel& model, SamplingRequest& out) {
  RETURN_IF_API_ERROR(refuse_constrained_decoding(body));
  std::optional<double> temperature, top_p, min_p, presence, frequency, repetition;
  RETURN_IF_API_ERROR(read_number(body, "temperature", "temperature", {0, 2}, temperature));
  RETURN_IF_API_ERROR(read_number(body, "top_p", "top_p", {0, 1, true}, top_p));
  RETURN_IF_API_ERROR(read_number(body, "min_p", "min_p", {0, 1}, min_p));
  RETURN_IF_API_ERROR(read_number(body, "presence_penalty", "presence_penalty", {-2, 2}, presence));
  RETURN_IF_API_ERROR(read_number(body, "frequency_penalty", "frequency_penalty", {-2, 2}, frequency));
  RETURN_IF_API_ERROR(
      read_number(body, "repetition_penalty", "repetition_penalty", {0, 10, true}, repetition));
  std::optional<int64_t> top_k, seed, max_tokens, max_completion_tokens;
  RETURN_IF_API_ERROR(read_int(body, "top_k", "top_k", -1, model.vocab_size, top_k));  // -1: off (vLLM)
  if (const json* v = field(body, "seed"); v != nullptr && v->is_number_unsigned()) {
    out.params.seed = v->get<uint64_t>();  // the full uint64 range, as a seed
  } else {
    RETURN_IF_API_ERROR(read_int(body, "seed", "seed", INT64_MIN, INT64_MAX, seed));
  }
  RETURN_IF_API_ERROR(read_int(body, "max_tokens", "max_tokens", 1, INT32_MAX, max_tokens));
  RETURN_IF_API_ERROR(
      read_int(body, "max_completion_tokens", "max_completion_tokens", 1, INT32_MAX, max_completion_tokens));

  SamplingParams& p = out.params;
  RequestOverrides& o = out.overrides;
  if (temperature) o.temperature = static_cast<float>(*temperature);
  if (top_p) o.top_p = static_cast<float>(*top_p);
  if (min_p) o.min_p = static_cast<float>(*min_p);
  if (repetition) o.repetition_penalty = static_cast<float>(*repetition);
  if (top_k) o.top_k = *top_k < 0 ? 0 : static_cast<int>(*top_k);
  if (max_completion_tokens) {
    o.max_tokens = static_cast<int>(*max_completion_tokens);
  } else if (max_tokens) {
    o.max_tokens = static_cast<int>(*max_tokens);
  }
  if (presence) p.presence_penalty = static_cast<float>(*presence);
  if (frequency) p.frequency_penalty = static_cast<float>(*frequency);
  if (seed) p.seed = static_cast<uint64_t>(*seed);
  RETURN_IF_API_ERROR(read_stop(body, p.stop));
  std::optional<int64_t> min_tokens;
  std::optional<bool> include_stop;
  RETURN_IF_API_ERROR(read_int(body, "min_tokens", "min_tokens", 0, INT32_MAX, min_tokens));
  const std::optional<int>& max = o.max_tokens;
  if (min_tokens && max && *min_tokens > *max) {
    return bad_request(format("'min_tokens' (%lld) must be <= the maximum number of tokens (%d)",
                              static_cast<long long>(*min_tokens), *max),
                       "min_tokens", "invalid_value");
  }
  p.min_tokens = static_cast<int>(min_tokens.value_or(0));
  RETURN_IF_API_ERROR(
      read_bool(body, "include_stop_str_in_output", "include_stop_str_in_output", include_stop));
  p.include_stop_str_in_output = include_stop.value_or(false);
  RETURN_IF_API_ERROR(read_stop_token_ids(body, model.vocab_size, out.stop_token_ids));
  RETURN_IF_API_ERROR(read_logit_bias(body, model.vocab_size, p.logit_bias));
  return std::nullopt;
}

MaybeError check_model(const json& body, const ServedModel& model) {
  const json* v = field(body, "model");
  if (v == nullptr) return bad_request("'model' is required", "model", "missing_required_parameter");
  if (!v->is_string()) return wrong_type("model", "a string", *v);
  if (v->get<std::string>() != model.id) {
    ApiError e = bad_request(format("The model `%s` does not exist; this server serves `%s`.",
                                    v->get<std::string>().c_str(), model.id.c_str()),
                             "model", "model_not_found");
    e.status = 404;
    return e;
  }
  return std::nullopt;
}

MaybeError read_stream_options(const json& body, StreamOptions& out) {
  std::optional<bool> stream, reuse;
  RETURN_IF_API_ERROR(read_bool(body, "stream", "stream", stream));
  RETURN_IF_API_ERROR(read_bool(body, "cache_prompt", "cache_prompt", reuse));
  out.stream = stream.value_or(false);
  out.reuse_cache = reuse.value_or(true);
  if (const json* so = field(body, "stream_options")) {
    if (!so->is_object()) return wrong_type("stream_options", "an object", *so);
    if (!out.stream) {
      return bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options");
    }
    std::optional<bool> include_usage;
    RETURN_IF_API_ERROR(read_bool(*so, "include_usage", "stream_options.include_usage", include_usage));
    out.include_usage = include_usage.value_or(false);
  }
  return std::nullopt;
}

}  // namespace lily
