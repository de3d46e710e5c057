#include "cli/cli_common.h"

#include <cstdlib>

#include "engine/backend_factory.h"
#include "engine/model_loader.h"
#include "engine/speculative.h"
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
  cmd->add_option("--ctx-size", args.ctx_size, kCtxSizeHelp);
  cmd->add_option("--cuda-options", args.cuda_options, kCudaOptionsHelp);
  cmd->add_option("--speculative", args.speculative, kSpeculativeHelp);
  cmd->add_option("--mtp-from", args.mtp_from, kMtpFromHelp)->transform(model_location());
}

Result<int64_t> parse_ctx_size(const std::string& s) {
  if (s.empty()) return int64_t{0};
  if (s == "auto") return BackendOptions::kContextAuto;
  char* end = nullptr;
  const long long n = std::strtoll(s.c_str(), &end, 10);
  if (*end != '\0' || n < 16 || n > (1ll << 30))
    return invalid_argument("--ctx-size `%s`: a number of tokens from 16 to 2^30, or auto", s.c_str());
  return static_cast<int64_t>(n);
}

Result<LoadedEngine> load_engine(const EngineArgs& args) {
  ModelLoadOptions o;
  o.model_dir = args.model;
  ASSIGN_OR_RETURN(o.backend.kind, parse_backend_kind(args.backend));
  o.backend.n_threads = args.threads;
  ASSIGN_OR_RETURN(o.backend.max_context, parse_ctx_size(args.ctx_size));
  o.backend.cuda_options = args.cuda_options;
  ASSIGN_OR_RETURN(o.engine.speculative_tokens, parse_speculative(args.speculative));
  o.mtp_from = args.mtp_from;
  ASSIGN_OR_RETURN(LoadedModel m, load_model(o));
  LoadedEngine out;
  out.engine = std::move(m.engine);
  out.defaults = std::move(m.defaults);
  out.stop_token_ids = std::move(m.stop_token_ids);
  out.load_s = m.load_s;
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
