#include "cli/cli_common.h"

#include <algorithm>
#include <chrono>
#include <filesystem>

#include "engine/backend_factory.h"
#include "hub/hf_cache.h"

namespace lily::cli {

CLI::Validator model_location() {
  return CLI::Validator(
      [](std::string& value) {
        Result<ModelLocation> where = resolve_model(value);
        if (!where.ok()) return where.status().message();
        value = where->path;
        return std::string();
      },
      "DIR|ORG/NAME[@REV]");
}

void add_engine_options(CLI::App* cmd, EngineArgs& args) {
  cmd->add_option("--model", args.model, kModelHelp)->required()->transform(model_location());
  cmd->add_option("--backend", args.backend, "auto | cpu | cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  cmd->add_option("--threads", args.threads, "CPU backend threads (0: all cores)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--ctx-size", args.ctx_size, "tokens a sequence may hold")
      ->check(CLI::Range(int64_t{16}, int64_t{1} << 30));
  cmd->add_option("--cuda-options", args.cuda_options, kCudaOptionsHelp);
}

Result<LoadedEngine> load_engine(const EngineArgs& args) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::filesystem::path dir(args.model);
  const std::string tokenizer_path = (dir / "tokenizer.json").string();
  std::error_code ec;
  if (!std::filesystem::exists(tokenizer_path, ec))
    return error(ErrorCode::not_found, "%s: no tokenizer.json in the model directory",
                 tokenizer_path.c_str());
  ASSIGN_OR_RETURN(Tokenizer tokenizer, Tokenizer::load(tokenizer_path));
  LoadedEngine out;
  ASSIGN_OR_RETURN(out.defaults, load_generation_config(args.model));
  ASSIGN_OR_RETURN(BackendKind kind, parse_backend_kind(args.backend));
  ASSIGN_OR_RETURN(ModelWeights w, ModelWeights::load(args.model));
  auto weights = std::make_shared<const ModelWeights>(std::move(w));
  BackendOptions backend_options;
  backend_options.kind = kind, backend_options.n_threads = args.threads;
  if (args.ctx_size > 0) backend_options.max_context = args.ctx_size;  // the CUDA backend's KV capacity
  backend_options.cuda_options = args.cuda_options;
  ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, make_backend(weights, backend_options));

  auto add_stop = [&](int32_t id) {
    if (id >= 0 &&
        std::find(out.stop_token_ids.begin(), out.stop_token_ids.end(), id) == out.stop_token_ids.end())
      out.stop_token_ids.push_back(id);
  };
  for (int id : weights->config.eos_token_ids) add_stop(id);
  for (int32_t id : out.defaults.eos_token_ids) add_stop(id);
  add_stop(tokenizer.token_id("<|im_end|>"));
  add_stop(tokenizer.token_id("<|endoftext|>"));

  EngineOptions options;
  options.max_context = args.ctx_size;
  out.engine = std::make_unique<Engine>(std::move(backend), std::move(tokenizer), options);
  out.load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

void add_sampling_options(CLI::App* cmd, SamplingArgs& a) {
  a.temperature_opt = cmd->add_option("--temperature", a.temperature, "0 = greedy (default: the model's)");
  a.top_k_opt = cmd->add_option("--top-k", a.top_k, "keep the k most likely tokens (0 = off)");
  a.top_p_opt = cmd->add_option("--top-p", a.top_p, "nucleus sampling (1 = off)");
  a.min_p_opt = cmd->add_option("--min-p", a.min_p, "drop tokens below min_p * p_max (0 = off)");
  a.seed_opt = cmd->add_option("--seed", a.seed, "random seed (same seed, same output)");
  a.max_tokens_opt =
      cmd->add_option("--max-tokens", a.max_tokens, "tokens to generate (-1: until the context ends)");
}

Result<SamplingParams> sampling_params(const SamplingArgs& a, const SamplingDefaults& defaults,
                                       int32_t vocab_size) {
  RequestOverrides o;
  if (*a.temperature_opt) o.temperature = a.temperature;
  if (*a.top_k_opt) o.top_k = a.top_k;
  if (*a.top_p_opt) o.top_p = a.top_p;
  if (*a.min_p_opt) o.min_p = a.min_p;
  if (*a.max_tokens_opt) o.max_tokens = a.max_tokens;
  SamplingParams p;
  apply_defaults(p, defaults, o);
  if (*a.seed_opt) p.seed = a.seed;
  RETURN_IF_ERROR(p.validate(vocab_size));
  return p;
}

}  // namespace lily::cli
