// lily generate: greedy (or sampled) continuation of a prompt given as token ids or text.
#include <chrono>
#include <cstdio>
#include <sstream>

#include "cli/commands.h"
#include "engine/backend_factory.h"

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

static Status run_ids(const std::string& model, const std::string& ids_text, int max_tokens,
                      const std::string& backend_name) {
  ASSIGN_OR_RETURN(std::vector<int32_t> ids, parse_ids(ids_text));
  ASSIGN_OR_RETURN(ModelWeights w, ModelWeights::load(model));
  auto weights = std::make_shared<const ModelWeights>(std::move(w));
  ASSIGN_OR_RETURN(BackendKind kind, parse_backend_kind(backend_name));
  ASSIGN_OR_RETURN(auto backend, make_backend(weights, {kind, 0}));
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
  double prefill_s = std::chrono::duration<double>(t1 - t0).count(), decode_s = std::chrono::duration<double>(t2 - t1).count();
  std::fprintf(stderr, "backend %s: prefill %zu tokens %.1f tok/s, decode %zu tokens %.1f tok/s\n", backend->name(),
               ids.size(), ids.size() / prefill_s, out.size() - 1, out.size() > 1 ? (out.size() - 1) / decode_s : 0.0);
  return ok_status();
}

static void setup(CLI::App& app) {
  auto* cmd = app.add_subcommand("generate", "Generate tokens from a prompt");
  struct Args {
    std::string model, prompt_ids, backend = "auto";
    int max_tokens = 16;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("--model", a->model, "checkpoint directory")->required();
  cmd->add_option("--prompt-ids", a->prompt_ids, "comma-separated token ids; greedy ids are printed");
  cmd->add_option("--max-tokens", a->max_tokens, "tokens to generate")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--backend", a->backend, "auto | cpu | cuda");
  cmd->callback([a] {
    if (a->prompt_ids.empty()) {
      std::fprintf(stderr, "lily generate: give --prompt-ids\n");
      return set_exit_code(2);
    }
    Status st = run_ids(a->model, a->prompt_ids, a->max_tokens, a->backend);
    if (!st.ok()) {
      std::fprintf(stderr, "lily generate: %s\n", st.message().c_str());
      set_exit_code(1);
    }
  });
}
LILY_COMMAND(setup);

}  // namespace lily::cli
