// POST /v1/completions: the legacy text-completion request (one prompt, string or token ids).
#include "server/chat_request.h"

namespace lily {

namespace {

MaybeError read_token_ids(const json& arr, const std::string& param, int32_t vocab_size,
                          std::vector<int32_t>& out) {
  for (size_t i = 0; i < arr.size(); ++i) {
    const json& v = arr[i];
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= vocab_size) {
      return bad_request(format("'%s[%zu]': expected a token id in [0, %d)", param.c_str(), i, vocab_size),
                         param, "invalid_value");
    }
    out.push_back(static_cast<int32_t>(v.get<int64_t>()));
  }
  return std::nullopt;
}

MaybeError read_prompt(const json& body, int32_t vocab_size, CompletionRequest& out) {
  auto it = body.find("prompt");
  if (it == body.end() || it->is_null()) {
    return bad_request("'prompt' is required", "prompt", "missing_required_parameter");
  }
  const json* p = &*it;
  if (p->is_array() && p->size() == 1 && ((*p)[0].is_string() || (*p)[0].is_array())) {
    p = &(*p)[0];  // a batch of one: ["text"] or [[1, 2, 3]]
  } else if (p->is_array() && !p->empty() && ((*p)[0].is_string() || (*p)[0].is_array())) {
    return bad_request("'prompt': one prompt per request (batches are not supported)", "prompt",
                       "unsupported_value");
  }
  if (p->is_string()) {
    out.prompt_text = p->get<std::string>();
    if (out.prompt_text.empty()) return bad_request("'prompt' must not be empty", "prompt");
    return std::nullopt;
  }
  if (!p->is_array())
    return bad_request("'prompt': expected a string or an array of token ids", "prompt", "invalid_type");
  if (p->empty()) return bad_request("'prompt' must not be empty", "prompt");
  out.prompt_is_ids = true;
  return read_token_ids(*p, "prompt", vocab_size, out.prompt_ids);
}

}  // namespace

MaybeError parse_completion_request(const json& body, const ServedModel& model, CompletionRequest& out) {
  RETURN_IF_API_ERROR(check_model(body, model));
  RETURN_IF_API_ERROR(read_prompt(body, model.vocab_size, out));
  std::optional<int64_t> n, best_of, logprobs;
  RETURN_IF_API_ERROR(read_int(body, "n", "n", 1, 1, n));
  RETURN_IF_API_ERROR(read_int(body, "best_of", "best_of", 1, 1, best_of));
  RETURN_IF_API_ERROR(read_sampling(body, model, out.sampling));
  RETURN_IF_API_ERROR(read_stream_options(body, out.stream));
  RETURN_IF_API_ERROR(read_int(body, "logprobs", "logprobs", 0, 20, logprobs));
  out.logprobs = logprobs ? static_cast<int>(*logprobs) : -1;
  std::optional<bool> echo;
  RETURN_IF_API_ERROR(read_bool(body, "echo", "echo", echo));
  if (echo.value_or(false)) return bad_request("'echo' is not supported", "echo", "unsupported_value");
  std::optional<std::string> suffix;
  RETURN_IF_API_ERROR(read_string(body, "suffix", "suffix", suffix));
  if (suffix && !suffix->empty())
    return bad_request("'suffix' is not supported", "suffix", "unsupported_value");
  return std::nullopt;
}

}  // namespace lily
