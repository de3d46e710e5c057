// generation_config.json: the sampling defaults a checkpoint ships with (Hugging Face GenerationConfig), and
// how they combine with a request. Precedence, per field: the request's explicit value, else the file's
// value, else the built-in default (temperature 1.0, top_k 0 = off, top_p 1.0, min_p 0,
// repetition_penalty 1.0), as vLLM does with `--generation-config auto`. Only the sampling fields vLLM takes
// from the file are used (do_sample is ignored, as there); Qwen3.6-35B-A3B ships temperature 1.0, top_k 20,
// top_p 0.95 and eos [248046, 248044].
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/sampler.h"
#include "util/status.h"

namespace lily {

struct SamplingDefaults {
  float temperature = 1.0f;
  int top_k = 0;  // 0 = off; the file's -1 (vLLM's "off") also reads as 0
  float top_p = 1.0f;
  float min_p = 0.0f;
  float repetition_penalty = 1.0f;
  std::optional<int> max_new_tokens;     // default for a request's max_tokens
  std::vector<int32_t> eos_token_ids;    // `eos_token_id` (an integer or a list): stop on any of them
  std::optional<int32_t> bos_token_id;
  std::optional<int32_t> pad_token_id;
  bool from_file = false;  // false when the model has no generation_config.json
};

// What a request set explicitly; unset fields fall back to the defaults.
struct RequestOverrides {
  std::optional<float> temperature;
  std::optional<int> top_k;
  std::optional<float> top_p;
  std::optional<float> min_p;
  std::optional<float> repetition_penalty;
  std::optional<int> max_tokens;
};

// Reads <model_dir>/generation_config.json. A missing file gives the built-in defaults and no error;
// unreadable or malformed JSON, a field of the wrong type or out of range gives an error naming the file and
// the field.
Result<SamplingDefaults> load_generation_config(const std::string& model_dir);
// The same from JSON text; `where` names the source in errors.
Result<SamplingDefaults> parse_generation_config(std::string_view json_text, const std::string& where);

// Sets params' temperature, top_k, top_p, min_p, repetition_penalty and max_tokens: request, else file, else
// built-in. Other fields of params (penalties, bias, seed, stop, logprobs) are the request's alone and
// untouched.
void apply_defaults(SamplingParams& params, const SamplingDefaults& defaults,
                    const RequestOverrides& request);

}  // namespace lily
