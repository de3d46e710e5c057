// Shared by the CLI commands that run the model (generate, chat): loading a checkpoint directory (weights,
// tokenizer.json, generation_config.json) into an Engine, and the sampling flags with the model's defaults.
#pragma once
#include <CLI/CLI.hpp>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/generation_config.h"

namespace lily::cli {

struct EngineArgs {
  std::string model, backend = "auto";
  int threads = 0;           // CPU backend; 0: all cores
  int64_t ctx_size = 32768;  // tokens a sequence may hold (the CUDA backend's default KV capacity)
  std::string cuda_options;  // CUDA backend tuning (BackendOptions::cuda_options)
};

// --model (required), --backend, --threads, --ctx-size, --cuda-options.
void add_engine_options(CLI::App* cmd, EngineArgs& args);

// Every --model option's transform: a directory stays as it is (it wins when it exists); ORG/NAME[@REVISION]
// becomes its snapshot directory in the Hugging Face cache (hub/hf_cache.h); anything else is a parse error
// that says what to do ("run `lily pull ORG/NAME`").
CLI::Validator model_location();
inline constexpr const char* kModelHelp =
    "checkpoint directory, or a Hugging Face id ORG/NAME[@REVISION] found in the hub cache (see `lily pull`)";

// The help of every command's --cuda-options (serve, chat, generate).
inline constexpr const char* kCudaOptionsHelp =
    "CUDA backend tuning, key=value,... (the keys of `lily bench --variants`; experiments, off by default)";

struct LoadedEngine {
  std::unique_ptr<Engine> engine;
  SamplingDefaults defaults;
  std::vector<int32_t> stop_token_ids;  // the model's eos ids, plus <|im_end|> and <|endoftext|>
  double load_s = 0;
};

// Reads <model>/tokenizer.json, <model>/generation_config.json (optional) and the weights, and builds the
// backend the flags ask for. Errors name the file.
Result<LoadedEngine> load_engine(const EngineArgs& args);

// --temperature --top-k --top-p --min-p --seed --max-tokens; unset ones come from generation_config.json.
struct SamplingArgs {
  float temperature = 0, top_p = 1, min_p = 0;
  int top_k = 0, max_tokens = -1;
  uint64_t seed = 0;
  CLI::Option *temperature_opt = nullptr, *top_p_opt = nullptr, *min_p_opt = nullptr, *top_k_opt = nullptr,
              *max_tokens_opt = nullptr, *seed_opt = nullptr;
};
void add_sampling_options(CLI::App* cmd, SamplingArgs& args);
// The request's sampling parameters, validated against the vocabulary.
Result<SamplingParams> sampling_params(const SamplingArgs& args, const SamplingDefaults& defaults,
                                       int32_t vocab_size);

}  // namespace lily::cli
