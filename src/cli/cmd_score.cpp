// lily score: teacher-forced scoring of a token-id sequence, for fidelity checks against a reference
// (bench/fidelity.py). One forward over all T ids with the logits of every row; for each position t < T-1 the
// top-1 id and the log-probability of ids[t+1] (log-softmax in double), their sum, and the perplexity
// exp(-mean log p). --json writes these per position; --logits writes the whole fp32 logits [T, V], raw
// little-endian row-major, so a reference can compare rows directly.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/cli_common.h"
#include "cli/commands.h"
#include "engine/backend_factory.h"

namespace lily::cli {

namespace {

struct ScoreArgs {
  std::string model, ids_file, backend = "auto", json_path, logits_path;
  int threads = 0;
};

// Token ids separated by whitespace and/or commas.
Result<std::vector<int32_t>> read_ids(const std::string& path, int32_t vocab_size) {
  std::ifstream f(path);
  if (!f) return error(ErrorCode::not_found, "%s: cannot open the ids file", path.c_str());
  std::stringstream ss;
  ss << f.rdbuf();
  std::string text = ss.str();
  std::replace(text.begin(), text.end(), ',', ' ');
  std::istringstream in(text);
  std::vector<int32_t> ids;
  std::string item;
  while (in >> item) {
    size_t used = 0;
    long long v = -1;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != item.size())
      return invalid_argument("%s: `%s` (token %zu) is not a token id", path.c_str(), item.c_str(), ids.size());
    if (v < 0 || v >= vocab_size)
      return error(ErrorCode::out_of_range, "%s: token %zu is %lld, outside the vocabulary [0, %d)", path.c_str(),
                   ids.size(), v, vocab_size);
    ids.push_back(static_cast<int32_t>(v));
  }
  if (ids.size() < 2)
    return invalid_argument("%s: %zu token ids; scoring needs at least 2", path.c_str(), ids.size());
  return ids;
}

Status run_score(const ScoreArgs& a) {
  const auto t0 = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(ModelWeights w, ModelWeights::load(a.model));
  auto weights = std::make_shared<const ModelWeights>(std::move(w));
  const int32_t vocab = weights->config.vocab_size;
  ASSIGN_OR_RETURN(std::vector<int32_t> ids, read_ids(a.ids_file, vocab));
  const int64_t n = static_cast<int64_t>(ids.size());
  ASSIGN_OR_RETURN(BackendKind kind, parse_backend_kind(a.backend));
  BackendOptions options;
  options.kind = kind, options.n_threads = a.threads;
  options.max_context = std::max<int64_t>(n + 16, 4096);
  ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, make_backend(weights, options));
  auto seq = backend->new_sequence();
  if (!seq) return error(ErrorCode::internal, "cannot allocate a sequence of %lld tokens", (long long)n);
  const auto t1 = std::chrono::steady_clock::now();
  std::vector<float> logits;
  RETURN_IF_ERROR(backend->forward(*seq, ids, LogitsRows::all, &logits));
  const auto t2 = std::chrono::steady_clock::now();
  if (logits.size() != static_cast<size_t>(n) * vocab)
    return error(ErrorCode::internal, "backend %s returned %zu logits, expected %lld x %d", backend->name(),
                 logits.size(), (long long)n, vocab);

  std::vector<int32_t> top1(n - 1);
  std::vector<double> logprob(n - 1);
  double sum = 0;
  int64_t hits = 0;
  for (int64_t t = 0; t + 1 < n; ++t) {
    const float* row = logits.data() + t * vocab;
    const float* best = std::max_element(row, row + vocab);
    double sum_exp = 0;
    for (int32_t v = 0; v < vocab; ++v) sum_exp += std::exp(static_cast<double>(row[v]) - *best);
    top1[t] = static_cast<int32_t>(best - row);
    logprob[t] = static_cast<double>(row[ids[t + 1]]) - *best - std::log(sum_exp);
    sum += logprob[t];
    hits += top1[t] == ids[t + 1];
  }
  const double ppl = std::exp(-sum / static_cast<double>(n - 1));
  const double load_s = std::chrono::duration<double>(t1 - t0).count(),
               forward_s = std::chrono::duration<double>(t2 - t1).count();
  std::printf("backend %s: %lld ids, %lld scored positions, perplexity %.6f, top-1 = next id at %lld\n",
              backend->name(), (long long)n, (long long)(n - 1), ppl, (long long)hits);
  std::fprintf(stderr, "load %.1f s, forward %.3f s\n", load_s, forward_s);

  if (!a.logits_path.empty()) {
    std::ofstream f(a.logits_path, std::ios::binary);
    f.write(reinterpret_cast<const char*>(logits.data()), static_cast<std::streamsize>(logits.size() * 4));
    if (!f) return io_error("%s: cannot write the logits", a.logits_path.c_str());
  }
  if (!a.json_path.empty()) {
    nlohmann::ordered_json out = {{"model", a.model},
                                  {"backend", backend->name()},
                                  {"n_ids", n},
                                  {"vocab_size", vocab},
                                  {"n_positions", n - 1},
                                  {"sum_logprob", sum},
                                  {"perplexity", ppl},
                                  {"top1_equals_next_id", hits},
                                  {"load_s", load_s},
                                  {"forward_s", forward_s},
                                  {"logits_file", a.logits_path},
                                  {"logits_dtype", "float32 little-endian row-major [n_ids, vocab_size]"},
                                  {"top1", top1},
                                  {"logprob", logprob}};
    std::ofstream f(a.json_path);
    f << out.dump(1) << "\n";
    if (!f) return io_error("%s: cannot write the JSON", a.json_path.c_str());
  }
  return ok_status();
}

void setup(CLI::App& app) {
  auto* cmd = app.add_subcommand("score", "Teacher-forced scoring of token ids: log-probs, top-1, logits");
  auto a = std::make_shared<ScoreArgs>();
  cmd->add_option("--model", a->model, kModelHelp)->required()->transform(model_location());
  cmd->add_option("--ids-file", a->ids_file, "token ids, separated by whitespace or commas (at least 2)")
      ->required();
  cmd->add_option("--backend", a->backend, "auto | cpu | cuda")->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  cmd->add_option("--threads", a->threads, "CPU backend threads (0: all cores)")->check(CLI::NonNegativeNumber);
  cmd->add_option("--json", a->json_path, "write per-position top-1 ids and log-probs as JSON");
  cmd->add_option("--logits", a->logits_path, "write the fp32 logits [n_ids, vocab] (raw little-endian)");
  cmd->callback([a] {
    Status st = run_score(*a);
    if (!st.ok()) {
      std::fprintf(stderr, "lily score: %s\n", st.message().c_str());
      set_exit_code(1);
    }
  });
}
LILY_COMMAND(setup);

}  // namespace

}  // namespace lily::cli
