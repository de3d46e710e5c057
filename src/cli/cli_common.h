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
  std::string ctx_size;      // --ctx-size: tokens a sequence may hold, or "auto" (parse_ctx_size); empty: default
  std::string cuda_options;  // CUDA backend options (BackendOptions::cuda_options)
  std::string speculative;   // --speculative mtp:K (engine/speculative.h parse_speculative); empty: off
  std::string mtp_from;      // --mtp-from DIR: the MTP head from another checkpoint of the model
};

// --model (required), --backend, --threads, --ctx-size, --cuda-options, --speculative, --mtp-from.
void add_engine_options(CLI::App* cmd, EngineArgs& args);

// Every --model option's transform: a directory stays as it is (it wins when it exists); ORG/NAME[@REVISION]
// becomes its snapshot directory in the Hugging Face cache (hub/hf_cache.h); anything else is a parse error
// that says what to do ("run `lily pull ORG/NAME`").
CLI::Validator model_location();
inline constexpr const char* kModelHelp =
    "checkpoint directory, or a Hugging Face id ORG/NAME[@REVISION] found in the hub cache (see `lily pull`)";


// The help of every command's --cuda-options (serve, chat, generate) and --ctx-size.
inline constexpr const char* kCudaOptionsHelp = "CUDA backend options, key=value,... (the keys of `lily bench --variants`)";
inline constexpr const char* kCtxSizeHelp =
    "tokens a sequence may hold, or auto: the largest that fits (CUDA: the GPU's free memory after the weights; "
    "CPU: the model's maximum). Default: 32768 on CUDA, the model's maximum on the CPU";

inline constexpr const char* kSpeculativeHelp =
    "mtp:K (K = 1..3): speculative decoding, K tokens drafted per step by the checkpoint's multi-token-prediction "
    "head and verified in one forward (greedy output unchanged, sampled output equally distributed); off by "
    "default; CPU and CUDA backends";
inline constexpr const char* kMtpFromHelp =
    "take the MTP head from this checkpoint of the same model (e.g. the Hugging Face one; mlx-lm conversions have "
    "none)";

// --ctx-size: a positive count, or "auto" (BackendOptions::kContextAuto); empty: 0 (the backend's default).
Result<int64_t> parse_ctx_size(const std::string& s);

struct LoadedEngine {
  std::unique_ptr<Engine> engine;
  SamplingDefaults defaults;
  std::vector<int32_t> stop_token_ids;  // the model's eos ids, plus <|im_end|> and <|endoftext|>
  double load_s = 0;
};

// engine/model_loader.h's load_model with the flags (the loader `lily serve` uses too).
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
