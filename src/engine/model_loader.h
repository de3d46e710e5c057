// One model loader for `lily serve` and the CLI commands that run the model (chat, generate): a checkpoint
// directory's weights, tokenizer.json and generation_config.json, the backend the options ask for, the Engine
// over it, and the ids that end a generation. Errors name the file.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/backend_factory.h"
#include "engine/engine.h"
#include "engine/generation_config.h"
#include "tokenizer/tokenizer.h"

namespace lily {

struct ModelLoadOptions {
  std::string model_dir;
  BackendOptions backend;  // max_context: the --ctx-size (0: the backend's default; kContextAuto: the largest)
  EngineOptions engine;    // max_context is set to what the backend holds
  // The multi-token-prediction head from another checkpoint of the model (ModelWeights::attach_mtp), for a
  // directory without one (mlx-lm conversions drop it); empty: the model directory's own, if any.
  std::string mtp_from;
};

struct LoadedModel {
  std::unique_ptr<Engine> engine;
  Tokenizer tokenizer;  // a copy of the engine's
  SamplingDefaults defaults;
  std::vector<int32_t> stop_token_ids;
  int64_t ctx_size = 0;  // tokens a sequence holds (Backend::max_context)
  int32_t vocab_size = 0;
  std::string backend_name;
  double load_s = 0;
};

// The ids that end a generation: the model's eos ids (config.json), generation_config.json's, <|im_end|> and
// <|endoftext|> (when the tokenizer has them), each once, in that order.
std::vector<int32_t> stop_token_ids(const ModelConfig& config, const SamplingDefaults& defaults,
                                    const Tokenizer& tokenizer);

// With engine.speculative_tokens > 0 the checkpoint (or mtp_from) must have the MTP head and the backend must
// draft and verify with it (Backend::enable_mtp: the CPU backend always, the CUDA backend where its prefill path
// takes the geometry): otherwise loading fails with an error that says which, rather than running without
// speculation.
// `stage` (optional) is told each step before it starts ("mapping weights", "creating the backend", ...).
Result<LoadedModel> load_model(const ModelLoadOptions& options,
                               const std::function<void(const std::string&)>& stage = {});

}  // namespace lily
