#include "cli/bench_verify.h"

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "engine/backend_factory.h"
#include "engine/speculative.h"
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
  // The decode baseline runs on a sequence made before the head is enabled: with it, every forward also has the
  // head read the row (what speculative decoding's own plain steps pay, not what decoding without it costs).
  std::unique_ptr<SequenceState> plain;
  std::unique_ptr<Checkpoint> plain_start;
  if (drafts) {
    plain = backend->new_sequence();
    if (!plain) return error(ErrorCode::out_of_range, "no memory for the decode baseline's sequence");
    plain_start = plain->checkpoint();
    if (!plain_start) return error(ErrorCode::out_of_range, "no memory for a checkpoint");
    RETURN_IF_ERROR(backend->enable_mtp());
  }
  const int32_t V = backend->config().vocab_size;
  std::printf("%s backend, %s; one call = one forward (median of %d)%s\n", backend->name(),
              o.model.empty() ? ("synthetic " + o.synthetic).c_str() : o.model.c_str(), o.reps,
              drafts ? "" : "; no MTP draft timing (no head, or the backend has none)");
  std::printf("%8s %17s %10s %10s\n", "context", "call", "ms", "x decode");
  out = {{"backend", backend->name()}, {"model", o.model.empty() ? "synthetic " + o.synthetic : o.model},
         {"reps", o.reps}, {"results", nlohmann::json::array()}};
  std::vector<float> logits;
  constexpr int kLoop = 8;  // tokens a timed call of the device decode loop
  for (int64_t ctx : o.contexts) {
    // Positions the timed calls take a rep: a decode call's, the device loop's kLoop, two drafts' (the head's KV)
    // and one for each verification (accepting 1; each row count twice: the logits and the argmax call).
    const int64_t timed = static_cast<int64_t>(o.reps) * (3 + kLoop + 2 * static_cast<int64_t>(o.rows.size()));
    if (ctx < 1 || ctx + timed > backend->max_context())
      return invalid_argument("--contexts %lld: from 1 to what the backend holds, less the timed tokens", (long long)ctx);
    auto seq = backend->new_sequence();
    if (!seq) return error(ErrorCode::out_of_range, "no memory for a sequence of context %lld", (long long)ctx);
    std::vector<int32_t> prompt(static_cast<size_t>(ctx));
    for (int64_t i = 0; i < ctx; ++i) prompt[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7919 + 13) % V);
    const int64_t piece = backend->preferred_prefill_tokens();
    auto prefill = [&](SequenceState& s) -> Status {
      for (int64_t p = 0; p < ctx; p += piece) {
        auto part = std::span<const int32_t>(prompt).subspan(static_cast<size_t>(p),
                                                             static_cast<size_t>(std::min(piece, ctx - p)));
        RETURN_IF_ERROR(backend->forward(s, part, LogitsRows::none, nullptr));
      }
      return ok_status();
    };
    RETURN_IF_ERROR(prefill(*seq));
    SequenceState* decode_seq = seq.get();
    if (plain) {
      RETURN_IF_ERROR(plain->restore(*plain_start));
      RETURN_IF_ERROR(prefill(*plain));
      decode_seq = plain.get();
    }
    int32_t tok = 17;
    std::vector<std::pair<int, double>> verify_ms;  // (rows, ms) of the greedy loop's calls (the argmax ones)
    double draft_ms = 0;
    auto record = [&](const std::string& call, const std::vector<double>& ms, double base) {
      const double m = median(ms);
      std::printf("%8lld %17s %10.3f %10.2f\n", (long long)ctx, call.c_str(), m, base > 0 ? m / base : 1.0);
      out["results"].push_back({{"context", ctx}, {"call", call}, {"ms", m}, {"ms_all", ms}});
      return m;
    };
    // The baseline is what plain greedy decoding costs a token: the device loop (a call of kLoop tokens) where the
    // backend samples on the device, else a forward with the logits to the host.
    const bool device_loop = backend->has_device_sampling();
    ASSIGN_OR_RETURN(std::vector<double> decode, time_calls(o.reps, [&] {
      return backend->forward(*decode_seq, std::span<const int32_t>(&tok, 1), LogitsRows::last, &logits);
    }));
    double base = record("decode", decode, 0);
    if (device_loop) {
      ASSIGN_OR_RETURN(std::vector<double> loop, time_calls(o.reps, [&] {
        return backend->generate_on_device(*decode_seq, tok, DeviceSampling{}, kLoop, [](int32_t) { return true; });
      }));
      for (double& m : loop) m /= kLoop;
      base = record("decode loop", loop, 0);
    }
    // The logits calls (sampled speculation, or requests with logit transforms) and the argmax calls (plain greedy
    // rounds, engine/speculative.cpp): the projection takes the latter.
    for (int r : o.rows) {
      std::vector<int32_t> rows(static_cast<size_t>(r), tok);
      std::vector<int32_t> ids;
      ASSIGN_OR_RETURN(std::vector<double> ms, time_calls(o.reps, [&]() -> Status {
        RETURN_IF_ERROR(backend->forward_verify(*seq, rows, &logits));
        return backend->accept_verified(*seq, 1);
      }));
      record("verify " + std::to_string(r), ms, base);
      ASSIGN_OR_RETURN(std::vector<double> am, time_calls(o.reps, [&]() -> Status {
        RETURN_IF_ERROR(backend->forward_verify_argmax(*seq, rows, &ids));
        return backend->accept_verified(*seq, 1);
      }));
      verify_ms.emplace_back(r, record("verify " + std::to_string(r) + " argmax", am, base));
    }
    if (drafts) {
      ASSIGN_OR_RETURN(std::vector<double> ms, time_calls(o.reps, [&] { return backend->mtp_draft(*seq, tok, &logits); }));
      record("mtp draft", ms, base);
      int32_t id = -1;
      ASSIGN_OR_RETURN(std::vector<double> am,
                       time_calls(o.reps, [&] { return backend->mtp_draft_argmax(*seq, tok, &id); }));
      draft_ms = record("mtp draft argmax", am, base);
    }
    // What the measured costs imply for K = rows - 1 drafts (bench_verify.h). Without a head to time, a draft is
    // assumed to cost 0.1 decode step (one decoder layer and the lm_head of a ~40-layer step).
    const bool assumed = !drafts;
    const double d = assumed ? 0.1 * base : draft_ms;
    std::printf("%8lld projection, greedy (the argmax calls against the %s; %s draft %.3f ms; acceptance a per "
                "draft, independent; published: 88%% for one draft, 81.5%% each for two):\n",
                (long long)ctx, device_loop ? "device decode loop" : "decode forward", assumed ? "assumed" : "measured",
                d);
    std::printf("%8s %4s %14s %16s %16s\n", "", "K", "break-even a", "x at a = 0.815", "x at a = 0.88");
    for (const auto& [r, v] : verify_ms) {
      const int K = r - 1;
      if (K < 1) continue;
      const double be = break_even_acceptance(K, base, d, v);
      const bool never = be >= 1.0;  // not even a = 1 wins
      const double x815 = speculative_projection(K, 0.815, base, d, v).speedup;
      const double x88 = speculative_projection(K, 0.88, base, d, v).speedup;
      char be_text[16] = "none";
      if (!never) std::snprintf(be_text, sizeof be_text, "%.3f", be);
      std::printf("%8s %4d %14s %16.2f %16.2f\n", "", K, be_text, x815, x88);
      out["projection"].push_back({{"context", ctx}, {"k", K}, {"verify_ms", v}, {"decode_ms", base},
                                   {"draft_ms", d}, {"draft_assumed", assumed},
                                   {"break_even_acceptance", never ? nlohmann::json() : nlohmann::json(be)},
                                   {"speedup_at_0_815", x815}, {"speedup_at_0_88", x88},
                                   {"verify_call", "forward_verify_argmax"},
                                   {"decode_call", device_loop ? "generate_on_device" : "forward"}});
    }
  }
  return ok_status();
}

}  // namespace lily::cli
