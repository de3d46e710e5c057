#include "cli/bench_verify.h"

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "engine/backend_factory.h"
#include "model/synth.h"

namespace lily::cli {

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// ms of each of `reps` calls of f.
template <class F>
Result<std::vector<double>> time_calls(int reps, F&& f) {
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    RETURN_IF_ERROR(f());
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  return ms;
}

}  // namespace

Status run_verify_bench(const VerifyBenchOptions& o, nlohmann::json& out) {
  if (o.reps < 1) return invalid_argument("--reps must be >= 1, got %d", o.reps);
  for (int r : o.rows)
    if (r < 1 || r > 64) return invalid_argument("--rows %d: from 1 to 64", r);
  Result<ModelWeights> w = o.model.empty() ? synth_in_memory(o.synthetic, CheckpointLayout::mlx, 0)
                                           : ModelWeights::load(o.model);
  if (!w.ok()) return w.status();
  auto weights = std::make_shared<const ModelWeights>(std::move(*w));
  BackendOptions bo;
  ASSIGN_OR_RETURN(bo.kind, parse_backend_kind(o.backend));
  bo.n_threads = o.threads;
  bo.cuda_options = o.cuda_options;
  ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, make_backend(weights, bo));
  const bool drafts = backend->has_mtp();
  if (drafts) RETURN_IF_ERROR(backend->enable_mtp());
  const int32_t V = backend->config().vocab_size;
  std::printf("%s backend, %s; one call = one forward (median of %d)%s\n", backend->name(),
              o.model.empty() ? ("synthetic " + o.synthetic).c_str() : o.model.c_str(), o.reps,
              drafts ? "" : "; the checkpoint has no MTP head: no draft timing");
  std::printf("%8s %12s %10s %10s\n", "context", "call", "ms", "x decode");
  out = {{"backend", backend->name()}, {"model", o.model.empty() ? "synthetic " + o.synthetic : o.model},
         {"reps", o.reps}, {"results", nlohmann::json::array()}};
  std::vector<float> logits;
  for (int64_t ctx : o.contexts) {
    if (ctx < 1 || ctx + 2 * o.reps * (2 + static_cast<int64_t>(o.rows.size())) > backend->max_context())
      return invalid_argument("--contexts %lld: from 1 to what the backend holds, less the timed tokens", (long long)ctx);
    auto seq = backend->new_sequence();
    std::vector<int32_t> prompt(static_cast<size_t>(ctx));
    for (int64_t i = 0; i < ctx; ++i) prompt[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7919 + 13) % V);
    const int64_t piece = backend->preferred_prefill_tokens();
    for (int64_t p = 0; p < ctx; p += piece) {
      auto part = std::span<const int32_t>(prompt).subspan(static_cast<size_t>(p),
                                                           static_cast<size_t>(std::min(piece, ctx - p)));
      RETURN_IF_ERROR(backend->forward(*seq, part, LogitsRows::none, nullptr));
    }
    int32_t tok = 17;
    auto record = [&](const std::string& call, const std::vector<double>& ms, double base) {
      const double m = median(ms);
      std::printf("%8lld %12s %10.3f %10.2f\n", (long long)ctx, call.c_str(), m, base > 0 ? m / base : 1.0);
      out["results"].push_back({{"context", ctx}, {"call", call}, {"ms", m}, {"ms_all", ms}});
      return m;
    };
    ASSIGN_OR_RETURN(std::vector<double> decode, time_calls(o.reps, [&] {
      return backend->forward(*seq, std::span<const int32_t>(&tok, 1), LogitsRows::last, &logits);
    }));
    const double base = record("decode", decode, 0);
    for (int r : o.rows) {
      std::vector<int32_t> rows(static_cast<size_t>(r), tok);
      ASSIGN_OR_RETURN(std::vector<double> ms, time_calls(o.reps, [&]() -> Status {
        RETURN_IF_ERROR(backend->forward_verify(*seq, rows, &logits));
        return backend->accept_verified(*seq, 1);
      }));
      record("verify " + std::to_string(r), ms, base);
    }
    if (drafts) {
      ASSIGN_OR_RETURN(std::vector<double> ms, time_calls(o.reps, [&] { return backend->mtp_draft(*seq, tok, &logits); }));
      record("mtp draft", ms, base);
    }
  }
  return ok_status();
}

}  // namespace lily::cli
