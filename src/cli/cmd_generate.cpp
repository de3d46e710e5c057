// lily generate: a continuation of a prompt given as token ids (greedy ids printed, for tests and golden
// checks) or as text (raw, or wrapped as one user message with --chat), sampled with the model's defaults or
// the flags, the text streamed to stdout and the usage to stderr.
#include <chrono>
#include <cstdio>
#include <sstream>

#include "cli/cli_common.h"
#include "cli/commands.h"
#include "engine/backend_factory.h"
#include "tokenizer/chat_format.h"

namespace lily::cli {

static Result<std::vector<int32_t>> parse_ids(const std::string& s) {
  std::vector<int32_t> ids;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    try {
      size_t used = 0;
      long v = std::stol(item, &used);
      if (used != item.size() || v < 0 || v > INT32_MAX) throw std::invalid_argument(item);
      ids.push_back(static_cast<int32_t>(v));
    } catch (const std::exception&) {
      return invalid_argument("--prompt-ids: `%s` is not a token id", item.c_str());
    }
  }
  if (ids.empty()) return invalid_argument("--prompt-ids is empty");
  return ids;
}

static Status run_ids(const std::string& ids_text, int max_tokens, const EngineArgs& engine) {
  ASSIGN_OR_RETURN(std::vector<int32_t> ids, parse_ids(ids_text));
  ASSIGN_OR_RETURN(ModelWeights w, ModelWeights::load(engine.model));
  auto weights = std::make_shared<const ModelWeights>(std::move(w));
  BackendOptions options;
  ASSIGN_OR_RETURN(options.kind, parse_backend_kind(engine.backend));
  options.n_threads = engine.threads, options.cuda_options = engine.cuda_options;
  ASSIGN_OR_RETURN(auto backend, make_backend(weights, options));
  auto seq = backend->new_sequence();
  std::vector<float> logits;
  auto t0 = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(backend->forward(*seq, ids, LogitsRows::last, &logits));
  auto t1 = std::chrono::steady_clock::now();
  std::vector<int32_t> out;
  const auto& eos = backend->config().eos_token_ids;
  for (int i = 0; i < max_tokens; ++i) {
    int32_t next = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    out.push_back(next);
    if (std::find(eos.begin(), eos.end(), next) != eos.end() || i + 1 == max_tokens) break;
    RETURN_IF_ERROR(backend->forward(*seq, std::span<const int32_t>(&next, 1), LogitsRows::last, &logits));
  }
  auto t2 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < out.size(); ++i) std::printf("%s%d", i ? "," : "", out[i]);
  std::printf("\n");
  double prefill_s = std::chrono::duration<double>(t1 - t0).count(),
         decode_s = std::chrono::duration<double>(t2 - t1).count();
  std::fprintf(stderr, "backend %s: prefill %zu tokens %.1f tok/s, decode %zu tokens %.1f tok/s\n",
               backend->name(), ids.size(), ids.size() / prefill_s, out.size() - 1,
               out.size() > 1 ? (out.size() - 1) / decode_s : 0.0);
  return ok_status();
}

// " speculative mtp:K: D drafted, A accepted (x%) over S steps" when the run used speculative decoding.
static std::string speculative_summary(const Engine& engine, const GenerationResult& r) {
  const int k = engine.options().speculative_tokens;
  if (k == 0) return "";
  const double rate = r.drafted_tokens ? 100.0 * r.accepted_tokens / r.drafted_tokens : 0.0;
  return format(", speculative mtp:%d: %lld drafted, %lld accepted (%.1f%%) over %lld steps", k,
                (long long)r.drafted_tokens, (long long)r.accepted_tokens, rate, (long long)r.speculative_steps);
}

// --prompt-ids with --speculative: the same greedy ids (the final stop token included), through the engine's
// speculative loop.
static Status run_ids_speculative(const std::string& ids_text, int max_tokens, const EngineArgs& args) {
  ASSIGN_OR_RETURN(std::vector<int32_t> ids, parse_ids(ids_text));
  ASSIGN_OR_RETURN(LoadedEngine loaded, load_engine(args));
  Engine& engine = *loaded.engine;
  GenerationRequest request;
  request.prompt = ids;
  request.sampling.temperature = 0;
  request.sampling.max_tokens = max_tokens;
  const auto& eos = engine.config().eos_token_ids;
  request.stop_token_ids.assign(eos.begin(), eos.end());
  request.reuse_cache = false;
  ASSIGN_OR_RETURN(GenerationResult r, engine.generate(request, nullptr));
  std::vector<int32_t> out = r.tokens;
  if (r.stop_token >= 0) out.push_back(r.stop_token);
  for (size_t i = 0; i < out.size(); ++i) std::printf("%s%d", i ? "," : "", out[i]);
  std::printf("\n");
  const double decode_tps = r.completion_tokens > 1 ? (r.completion_tokens - 1) / (r.decode_ms / 1e3) : 0.0;
  std::fprintf(stderr, "backend %s: prefill %d tokens, decode %d tokens %.1f tok/s%s\n", engine.backend().name(),
               r.prompt_tokens, r.completion_tokens, decode_tps, speculative_summary(engine, r).c_str());
  return ok_status();
}

struct GenerateArgs {
  EngineArgs engine;
  SamplingArgs sampling;
  std::string prompt_ids, prompt;
  bool chat = false, no_thinking = false;
};

// --prompt TEXT: raw text (or one user message with --chat), streamed.
static Status run_text(const GenerateArgs& a) {
  ASSIGN_OR_RETURN(LoadedEngine loaded, load_engine(a.engine));
  Engine& engine = *loaded.engine;
  std::string text = a.prompt;
  if (a.chat) {
    nlohmann::ordered_json messages =
        nlohmann::ordered_json::array({{{"role", "user"}, {"content", a.prompt}}});
    ChatOptions options;
    options.enable_thinking = !a.no_thinking;
    ASSIGN_OR_RETURN(text, render_chat(messages, nullptr, options));
  }
  GenerationRequest request;
  request.prompt = engine.tokenizer().encode(text);
  ASSIGN_OR_RETURN(request.sampling,
                   sampling_params(a.sampling, loaded.defaults, engine.config().vocab_size));
  if (!*a.sampling.max_tokens_opt && !loaded.defaults.max_new_tokens) request.sampling.max_tokens = 256;
  request.stop_token_ids = loaded.stop_token_ids;
  request.reuse_cache = false;
  ASSIGN_OR_RETURN(GenerationResult r, engine.generate(request, [](const GenerationPiece& p) {
    std::fwrite(p.text.data(), 1, p.text.size(), stdout);
    std::fflush(stdout);
    return true;
  }));
  std::printf("\n");
  const double decode_tps = r.completion_tokens > 1 ? (r.completion_tokens - 1) / (r.decode_ms / 1e3) : 0.0;
  std::fprintf(stderr,
               "backend %s: prompt %d tokens (prefill %.1f tok/s, first token after %.0f ms), %d generated "
               "(%.1f tok/s), finish %s%s\n",
               engine.backend().name(), r.prompt_tokens, r.prompt_tokens / (r.prefill_ms / 1e3),
               r.time_to_first_token_ms, r.completion_tokens, decode_tps, r.finish_reason.c_str(),
               speculative_summary(engine, r).c_str());
  return ok_status();
}

static void setup(CLI::App& app) {
  auto* cmd = app.add_subcommand("generate", "Generate from a prompt (token ids or text)");
  auto a = std::make_shared<GenerateArgs>();
  add_engine_options(cmd, a->engine);
  cmd->add_option("--prompt-ids", a->prompt_ids, "comma-separated token ids; greedy ids are printed");
  cmd->add_option("--prompt", a->prompt, "prompt text, tokenized as is; the generated text is streamed");
  cmd->add_flag("--chat", a->chat, "wrap --prompt as one user message in the chat template");
  cmd->add_flag("--no-thinking", a->no_thinking, "with --chat: the template's enable_thinking=false");
  add_sampling_options(cmd, a->sampling);
  cmd->callback([a] {
    if (a->prompt_ids.empty() == a->prompt.empty()) {
      std::fprintf(stderr, "lily generate: give one of --prompt-ids or --prompt\n");
      return set_exit_code(2);
    }
    Status st;
    if (!a->prompt_ids.empty()) {
      int max_tokens = *a->sampling.max_tokens_opt ? a->sampling.max_tokens : 16;
      if (max_tokens < 1) st = invalid_argument("--max-tokens must be >= 1 with --prompt-ids");
      else if (!a->engine.speculative.empty() || !a->engine.mtp_from.empty())
        st = run_ids_speculative(a->prompt_ids, max_tokens, a->engine);
      else st = run_ids(a->prompt_ids, max_tokens, a->engine);
    } else {
      st = run_text(*a);
    }
    if (!st.ok()) {
      std::fprintf(stderr, "lily generate: %s\n", st.message().c_str());
      set_exit_code(1);
    }
  });
}
LILY_COMMAND(setup);

}  // namespace lily::cli
