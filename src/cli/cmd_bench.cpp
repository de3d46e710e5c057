// lily bench: prefill tok/s at the standard prompt lengths and decode tok/s at the standard context lengths on the
// CUDA backend (median/min/max over --reps), the achieved weight-read GB/s, and per-kernel breakdowns of a prefill
// chunk and of one decode step; JSON out. The model is a checkpoint directory or the synthetic
// full-geometry 4-bit model built in memory (--synthetic full).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <nlohmann/json.hpp>

#include "cli/bench_ttft.h"
#include "cli/bench_verify.h"
#include "cli/cli_common.h"
#include "cli/commands.h"
#include "model/synth.h"

#ifdef LILY_HAVE_CUDA
#include "cuda/cuda_bench.h"
#endif

namespace lily::cli {

namespace {

struct BenchArgs {
  std::string model, synthetic = "full", json_path, mode = "all";
  std::vector<int64_t> contexts = {256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072};
  std::vector<int64_t> lengths = {256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072};
  int steps = 64;
  int reps = 3;
  int profile_context = 4096;
  std::vector<int> decode_rows = {1};  // decode: rows a step (sequences decoding together), each at every context
  int trace_steps = 0;  // --trace: decode steps replayed with the block timeline (kernels/trace.cuh)
  int prefill_chunk = 4096;
  std::string variants;  // "key=value,...;key=value,...": one whole run per variant, the model loaded once
  TtftOptions ttft;      // --mode ttft
  VerifyBenchOptions verify;  // --mode verify (rows; the rest from the shared flags)
  bool contexts_given = false;
};

#ifdef LILY_HAVE_CUDA
// Median, min and max of repeated measurements (tok/s).
nlohmann::json summary(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const double med = v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
  return {{"tok_per_s", med}, {"tok_per_s_min", v.front()}, {"tok_per_s_max", v.back()}, {"reps", v}};
}

void print_breakdown(const std::vector<cuda::KernelTiming>& kernels, nlohmann::json& out) {
  double total = 0;
  for (auto& k : kernels) total += k.ms;
  std::printf("%-16s %8s %10s %8s %10s %10s\n", "kernel", "launches", "ms", "share", "GB/s", "TFLOP/s");
  for (auto& k : kernels) {
    const double gbs = k.bytes > 0 ? k.bytes / (k.ms * 1e-3) / 1e9 : 0;
    const double tfs = k.flops > 0 ? k.flops / (k.ms * 1e-3) / 1e12 : 0;
    std::printf("%-16s %8d %10.4f %7.1f%% %10.0f %10.1f\n", k.name.c_str(), k.launches, k.ms, 100 * k.ms / total, gbs,
                tfs);
    out.push_back({{"name", k.name}, {"launches", k.launches}, {"ms", k.ms}, {"bytes", k.bytes}, {"gb_per_s", gbs},
                   {"flops", k.flops}, {"tflop_per_s", tfs}});
  }
  std::printf("%-16s %8s %10.4f\n", "total", "", total);
}

// The block timeline of the last traced step (cuda::TraceLaunch), by op name along the chain. For launch i and
// its chain predecessor p: share = end(i) - end(p) (what the launch adds to the step), release = first
// pdl_wait() return of i - end(p), after = end(i) - last wait return of i, ahead = end(p) - first start of i
// (how early its blocks were resident).
void print_trace(const std::vector<cuda::TraceLaunch>& all, nlohmann::json& out) {
  for (const auto& l : all)
    out["launches"].push_back({{"name", l.name}, {"kind", l.kind}, {"blocks", l.blocks},
                               {"start_first", l.start_first}, {"start_last", l.start_last},
                               {"wait_first", l.wait_first}, {"wait_last", l.wait_last},
                               {"end_first", l.end_first}, {"end_last", l.end_last}});
  size_t begin = 0;  // the last step: from the last "embed" on
  for (size_t i = 0; i < all.size(); ++i)
    if (all[i].name == "embed") begin = i;
  struct Agg {
    int n = 0;
    double share = 0, release = 0, after = 0, ahead = 0, blocks = 0;
  };
  std::vector<std::pair<std::string, Agg>> by;
  const cuda::TraceLaunch* prev = nullptr;
  double t_begin = 0, t_end = 0;
  for (size_t i = begin; i < all.size(); ++i) {
    const auto& l = all[i];
    if (!prev) t_begin = l.start_first;
    auto it = std::find_if(by.begin(), by.end(), [&](auto& e) { return e.first == l.name; });
    if (it == by.end()) it = by.insert(by.end(), {l.name, Agg{}});
    Agg& a = it->second;
    a.n += 1;
    a.blocks += l.blocks;
    a.share += l.end_last - (prev ? prev->end_last : l.start_first);
    if (prev) {
      a.release += (l.wait_first > 0 ? l.wait_first : l.start_first) - prev->end_last;
      a.ahead += prev->end_last - l.start_first;
    }
    a.after += l.end_last - (l.wait_last > 0 ? l.wait_last : l.start_first);
    prev = &l;
    t_end = std::max(t_end, l.end_last);
  }
  std::printf("%-16s %8s %7s %10s %7s %11s %11s %11s\n", "op", "launches", "blocks", "share ms", "share",
              "release us", "after us", "ahead us");
  for (auto& [name, a] : by) {
    std::printf("%-16s %8d %7.0f %10.4f %6.1f%% %11.2f %11.2f %11.2f\n", name.c_str(), a.n, a.blocks / a.n,
                a.share * 1e-3, 100 * a.share / (t_end - t_begin), a.release / a.n, a.after / a.n, a.ahead / a.n);
    out["by_op"].push_back({{"name", name}, {"launches", a.n}, {"share_ms", a.share * 1e-3},
                            {"release_us", a.release / a.n}, {"after_us", a.after / a.n}, {"ahead_us", a.ahead / a.n}});
  }
  std::printf("%-16s %8s %7s %10.4f\n", "step", "", "", (t_end - t_begin) * 1e-3);
  out["step_ms"] = (t_end - t_begin) * 1e-3;
}

// A chat's first turn as the engine prefills it: forward_with_checkpoint of n random tokens split at the anchor,
// n - 6 (a 1,026-token prompt's last <|im_start|> at 1,019 and the last token decoded), from an empty sequence (a
// checkpoint at 0 restored before each), against a plain forward of the n tokens: wall milliseconds, median of
// `reps`, and the position the checkpoint was taken at.
Status anchor_rows(cuda::CudaBench& b, const std::vector<int64_t>& lengths, int reps, nlohmann::json& out) {
  std::printf("\n%10s %8s %14s %12s %14s\n", "prompt", "split", "checkpoint at", "fwc ms", "forward ms");
  std::mt19937 rng(17);
  std::uniform_int_distribution<int32_t> id(0, b.config().vocab_size - 1);
  auto seq = b.new_sequence();
  if (!seq) return error(ErrorCode::internal, "cannot allocate a sequence");
  const std::unique_ptr<Checkpoint> empty = seq->checkpoint();
  if (!empty) return error(ErrorCode::internal, "cannot allocate a checkpoint");
  for (int64_t n : lengths) {
    if (n <= 6 || n > 4096) continue;  // a chat's first turn
    std::vector<int32_t> tokens(static_cast<size_t>(n));
    for (auto& t : tokens) t = id(rng);
    const int64_t split = n - 6;
    std::vector<double> fwc, plain;
    int64_t at = 0;
    for (int r = 0; r <= reps; ++r) {  // the first of each untimed (warm-up)
      RETURN_IF_ERROR(seq->restore(*empty));
      auto t0 = std::chrono::steady_clock::now();
      ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> cp,
                       b.forward_with_checkpoint(*seq, tokens, split, LogitsRows::none, nullptr));
      auto t1 = std::chrono::steady_clock::now();
      RETURN_IF_ERROR(seq->restore(*empty));
      auto t2 = std::chrono::steady_clock::now();
      RETURN_IF_ERROR(b.forward(*seq, tokens, LogitsRows::none, nullptr));
      auto t3 = std::chrono::steady_clock::now();
      at = cp ? cp->n_tokens() : -1;
      if (r == 0) continue;
      fwc.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
      plain.push_back(std::chrono::duration<double, std::milli>(t3 - t2).count());
    }
    std::sort(fwc.begin(), fwc.end());
    std::sort(plain.begin(), plain.end());
    const double fwc_ms = fwc[fwc.size() / 2], plain_ms = plain[plain.size() / 2];
    std::printf("%10lld %8lld %14lld %12.2f %14.2f\n", (long long)n, (long long)split, (long long)at, fwc_ms,
                plain_ms);
    std::fflush(stdout);
    out.push_back({{"length", n}, {"split", split}, {"checkpoint_at", at}, {"forward_with_checkpoint_ms", fwc_ms},
                   {"forward_ms", plain_ms}});
  }
  return ok_status();
}

std::vector<std::string> split_variants(const std::string& s) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at <= s.size()) {
    size_t semi = s.find(';', at);
    if (semi == std::string::npos) semi = s.size();
    out.push_back(s.substr(at, semi - at));
    at = semi + 1;
  }
  return out;
}

// Decode with several sequences a step (--rows above 1): per context, milliseconds a step, the aggregate and
// per-sequence tok/s; then the per-kernel breakdown of one step of the most rows at --profile-context.
Status several_rows(cuda::CudaBench& backend, const BenchArgs& a, SequenceState& first, nlohmann::json& out) {
  const int most = *std::max_element(a.decode_rows.begin(), a.decode_rows.end());
  if (most <= 1) return ok_status();
  std::vector<std::unique_ptr<SequenceState>> extra;
  std::vector<SequenceState*> all = {&first};
  for (int r = 1; r < most; ++r) {
    extra.push_back(backend.new_sequence());
    if (!extra.back()) return error(ErrorCode::out_of_range, "no device memory for %d sequences", most);
    all.push_back(extra.back().get());
  }
  std::printf("\n%6s %10s %12s %16s %16s\n", "rows", "context", "ms/step", "aggregate tok/s", "per-row tok/s");
  for (int rows : a.decode_rows) {
    if (rows <= 1) continue;
    for (int64_t ctx : a.contexts) {
      std::vector<double> ms_list;
      for (int rep = 0; rep < a.reps; ++rep) {
        for (int r = 0; r < rows; ++r) RETURN_IF_ERROR(backend.set_context_for_bench(*all[r], ctx));
        ASSIGN_OR_RETURN(double ms, backend.time_decode_rows(std::span<SequenceState* const>(all.data(), rows), a.steps));
        ms_list.push_back(ms);
      }
      std::sort(ms_list.begin(), ms_list.end());
      const double ms = ms_list[ms_list.size() / 2];
      std::printf("%6d %10lld %12.3f %16.1f %16.1f\n", rows, (long long)ctx, ms, 1000.0 * rows / ms, 1000.0 / ms);
      std::fflush(stdout);
      out["decode_rows"].push_back({{"rows", rows}, {"context", ctx}, {"ms_per_step", ms},
                                    {"aggregate_tok_per_s", 1000.0 * rows / ms}, {"per_row_tok_per_s", 1000.0 / ms}});
    }
  }
  const int prof_rows = std::min(most, 8);
  for (int r = 0; r < prof_rows; ++r) RETURN_IF_ERROR(backend.set_context_for_bench(*all[r], a.profile_context));
  ASSIGN_OR_RETURN(auto kernels, backend.profile_rows(std::span<SequenceState* const>(all.data(), prof_rows)));
  std::printf("\nper-kernel breakdown of one %d-row decode step at context %d (events around each launch, no graph):\n",
              prof_rows, a.profile_context);
  print_breakdown(kernels, out["rows_kernels"]);
  return ok_status();
}

// The whole benchmark (prefill lengths, decode contexts, breakdowns) on one backend.
Status run_one(const BenchArgs& a, std::shared_ptr<const ModelWeights> weights, const cuda::CudaBackendOptions& opt,
               double load_s, nlohmann::json& out) {
  const bool do_decode = a.mode != "prefill", do_prefill = a.mode != "decode";
  auto t0 = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(auto backend, cuda::make_cuda_bench(std::move(weights), opt));
  load_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double wbytes = static_cast<double>(backend->weight_bytes_per_token());
  std::fprintf(stderr, "model ready in %.1f s on %s; %.3f GB of weights read per token\n", load_s,
               backend->device_name().c_str(), wbytes / 1e9);
  out = {{"device", backend->device_name()}, {"model", a.model.empty() ? "synthetic " + a.synthetic : a.model},
         {"weight_bytes_per_token", wbytes}, {"steps", a.steps}, {"reps", a.reps},
         {"prefill_chunk", opt.prefill_chunk}, {"kernel_paths", backend->kernel_paths()},
         {"max_context", backend->max_context()}};
  auto seq = backend->new_sequence();
  if (!seq) return error(ErrorCode::internal, "cannot allocate a sequence of %lld tokens", (long long)opt.max_context);
  if (do_prefill) {
    std::printf("%10s %12s %12s %12s %12s %12s %12s\n", "prompt", "ms", "tok/s", "min tok/s", "max tok/s", "scratch MiB",
                "GPU MiB used");
    for (int64_t n : a.lengths) {
      if (n <= 16384) RETURN_IF_ERROR(backend->time_prefill(*seq, n, nullptr).status());  // warm-up (long: no need)
      std::vector<double> tps;
      for (int r = 0; r < a.reps; ++r) {
        ASSIGN_OR_RETURN(double ms, backend->time_prefill(*seq, n, nullptr));
        tps.push_back(1000.0 * n / ms);
      }
      nlohmann::json row = summary(tps);
      const double med = row["tok_per_s"];
      const double scratch = static_cast<double>(backend->prefill_scratch_bytes());
      const double used = static_cast<double>(backend->device_bytes_in_use());
      std::printf("%10lld %12.2f %12.0f %12.0f %12.0f %12.1f %12.0f\n", (long long)n, 1000.0 * n / med, med,
                  row["tok_per_s_min"].get<double>(), row["tok_per_s_max"].get<double>(), scratch / 1048576.0,
                  used / 1048576.0);
      std::fflush(stdout);
      row["length"] = n;
      row["ms"] = 1000.0 * n / med;
      row["scratch_bytes"] = scratch;
      row["device_bytes_in_use"] = used;
      out["prefill"].push_back(row);
    }
    RETURN_IF_ERROR(anchor_rows(*backend, a.lengths, a.reps, out["anchor_checkpoint"]));
    // The chunk that ends at --profile-context: beyond one chunk, the last chunk of such a prompt (its attention
    // reads the whole context).
    const int64_t pn = std::min<int64_t>(a.profile_context, a.prefill_chunk), pos0 = a.profile_context - pn;
    std::vector<cuda::KernelTiming> kernels;
    RETURN_IF_ERROR(backend->time_prefill(*seq, pn, &kernels, pos0).status());
    std::printf("\nper-kernel breakdown of a %lld-token prefill chunk at positions %lld.. (events around each launch):\n",
                (long long)pn, (long long)pos0);
    print_breakdown(kernels, out["prefill_kernels"]);
  }
  if (do_decode) {
    std::printf("\n%10s %12s %12s %12s %12s %14s\n", "context", "ms/token", "tok/s", "min tok/s", "max tok/s",
                "weights GB/s");
    for (int64_t ctx : a.contexts) {
      std::vector<double> tps;
      for (int r = 0; r < a.reps; ++r) {
        RETURN_IF_ERROR(backend->set_context_for_bench(*seq, ctx));
        ASSIGN_OR_RETURN(double ms, backend->time_decode(*seq, a.steps));
        tps.push_back(1000.0 / ms);
      }
      nlohmann::json row = summary(tps);
      const double med = row["tok_per_s"], ms = 1000.0 / med, gbs = wbytes / (ms * 1e-3) / 1e9;
      std::printf("%10lld %12.3f %12.1f %12.1f %12.1f %14.0f\n", (long long)ctx, ms, med,
                  row["tok_per_s_min"].get<double>(), row["tok_per_s_max"].get<double>(), gbs);
      std::fflush(stdout);
      row["context"] = ctx;
      row["ms_per_token"] = ms;
      row["weight_gb_per_s"] = gbs;
      out["decode"].push_back(row);
    }
    RETURN_IF_ERROR(several_rows(*backend, a, *seq, out));
    RETURN_IF_ERROR(backend->set_context_for_bench(*seq, a.profile_context));
    ASSIGN_OR_RETURN(auto kernels, backend->profile_step(*seq));
    std::printf("\nper-kernel breakdown of one decode step at context %d (events around each launch, no graph):\n",
                a.profile_context);
    print_breakdown(kernels, out["kernels"]);
    if (backend->kernel_paths().find("decode: megakernel") != std::string::npos) {
      RETURN_IF_ERROR(backend->set_context_for_bench(*seq, a.profile_context));
      double span = 0;
      ASSIGN_OR_RETURN(std::string timeline, backend->megakernel_timeline(*seq, &span));
      std::printf("\nthe megakernel's instruction timeline of one step at context %d, by op (%%globaltimer):\n%s",
                  a.profile_context, timeline.c_str());
      out["megakernel_timeline"] = timeline;
      out["megakernel_span_us"] = span;
    }
    if (a.trace_steps > 0) {
      RETURN_IF_ERROR(backend->set_context_for_bench(*seq, a.profile_context));
      ASSIGN_OR_RETURN(auto launches, backend->trace_decode(*seq, a.trace_steps));
      std::printf("\nblock timeline of one decode step at context %d (graph replay, %%globaltimer):\n",
                  a.profile_context);
      print_trace(launches, out["trace"]);
    }
  }
  return ok_status();
}

Status run_bench(const BenchArgs& a) {
  if (a.mode != "all" && a.mode != "decode" && a.mode != "prefill")
    return invalid_argument("--mode must be decode, prefill, all or ttft, got `%s`", a.mode.c_str());
  if (a.reps < 1) return invalid_argument("--reps must be at least 1");
  const bool do_decode = a.mode != "prefill", do_prefill = a.mode != "decode";
  cuda::CudaBackendOptions base;
  base.max_context = 0;
  if (do_decode)
    for (int64_t c : a.contexts) base.max_context = std::max(base.max_context, c + a.steps * (a.reps + 1) + 16);
  if (do_prefill) {
    for (int64_t n : a.lengths) base.max_context = std::max(base.max_context, n + 16);
    // the per-kernel breakdown prefills the chunk that ends at --profile-context
    base.max_context = std::max<int64_t>(base.max_context, a.profile_context + 16);
  }
  base.prefill_chunk = a.prefill_chunk;
  RETURN_IF_ERROR(cuda::apply_option_spec(a.ttft.cuda_options, base, "--cuda-options"));
  const std::vector<std::string> variants = a.variants.empty() ? std::vector<std::string>{""} : split_variants(a.variants);
  std::vector<cuda::CudaBackendOptions> opts;
  for (const std::string& v : variants) {  // every variant checked before the (slow) load
    opts.push_back(base);
    RETURN_IF_ERROR(cuda::apply_option_spec(v, opts.back(), "--variants"));
  }
  auto t0 = std::chrono::steady_clock::now();
  Result<ModelWeights> w = a.model.empty() ? synth_in_memory(a.synthetic, CheckpointLayout::mlx, 0)
                                           : ModelWeights::load(a.model);
  if (!w.ok()) return w.status();
  auto weights = std::make_shared<const ModelWeights>(std::move(*w));
  const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  nlohmann::json all = nlohmann::json::array();
  for (size_t i = 0; i < variants.size(); ++i) {
    if (!a.variants.empty()) std::printf("%s== variant %zu: %s\n", i ? "\n" : "", i + 1, variants[i].c_str());
    nlohmann::json out;
    RETURN_IF_ERROR(run_one(a, weights, opts[i], i == 0 ? load_s : 0.0, out));  // the backend is freed after each
    out["variant"] = variants[i];
    all.push_back(std::move(out));
    std::fflush(stdout);
  }
  if (!a.json_path.empty()) std::ofstream(a.json_path) << (a.variants.empty() ? all[0] : all).dump(2);
  return ok_status();
}
#else
Status run_bench(const BenchArgs&) { return error(ErrorCode::unsupported, "lily was built without CUDA"); }
#endif

// --mode ttft and verify run on any backend; the others need the CUDA build.
Status bench_main(BenchArgs a) {
  if (a.mode == "verify") {
    VerifyBenchOptions& v = a.verify;
    v.model = a.model, v.synthetic = a.synthetic, v.backend = a.ttft.backend, v.threads = a.ttft.threads;
    v.cuda_options = a.ttft.cuda_options, v.reps = a.reps;
    if (a.contexts_given) v.contexts = a.contexts;
    nlohmann::json out;
    RETURN_IF_ERROR(run_verify_bench(v, out));
    if (!a.json_path.empty()) std::ofstream(a.json_path) << out.dump(2);
    return ok_status();
  }
  if (a.mode != "ttft") return run_bench(a);
  a.ttft.model = a.model;
  a.ttft.reps = a.reps;
  nlohmann::json out;
  RETURN_IF_ERROR(run_ttft_bench(a.ttft, out));
  if (!a.json_path.empty()) std::ofstream(a.json_path) << out.dump(2);
  return ok_status();
}

void setup(CLI::App& app) {
  auto* cmd = app.add_subcommand("bench", "Benchmark prefill and decode on the GPU at the standard lengths");
  auto a = std::make_shared<BenchArgs>();
  cmd->add_option("--model", a->model, std::string(kModelHelp) + " (default: a synthetic model in memory)")
      ->transform(model_location());
  cmd->add_option("--synthetic", a->synthetic, "synthetic preset when no --model: full | full4 | small | tiny");
  cmd->add_option("--mode", a->mode,
                  "decode | prefill | all (the GPU benchmark) | ttft (time to first token through `lily serve` on "
                  "--model, any backend) | verify (speculative verification of --rows rows vs a decode step, and "
                  "an MTP draft step, at --contexts (default 256), any backend)");
  cmd->add_option("--rows", a->verify.rows, "verify: rows per verification forward (1+K)")->delimiter(',');
  cmd->add_option("--prompt-tokens", a->ttft.prompt_tokens, "ttft: prompt length in tokens (chat template included)");
  cmd->add_option("--port", a->ttft.port, "ttft: the server's port");
  cmd->add_option("--decode-tokens", a->ttft.decode_tokens,
                  "ttft: then stream one answer of this many tokens and report the decode rate the client sees")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--streams", a->ttft.streams,
                  "ttft: then, for each N of the list, N such answers streamed at once (per-stream and aggregate rates)")
      ->delimiter(',');
  cmd->add_option("--busy-streams", a->ttft.busy_streams,
                  "ttft: the first token of a new prompt while this many answers stream (needs --decode-tokens)")
      ->check(CLI::Range(0, 64));
  cmd->add_option("--decode-field", a->ttft.decode_fields,
                  "ttft: KEY=JSON added to the decode requests' bodies (e.g. min_tokens=1: the host-sampling loop)");
  cmd->add_option("--parallel", a->ttft.parallel, "ttft: the server's --parallel (0: its default)")
      ->check(CLI::Range(0, 16));
  cmd->add_option("--backend", a->ttft.backend, "ttft: the server's backend; verify: the backend (auto | cpu | cuda)");
  cmd->add_option("--ctx-size", a->ttft.ctx_size, "ttft: the server's context length");
  cmd->add_option("--threads", a->ttft.threads, "ttft, verify: CPU threads (0: all)");
  cmd->add_option("--cuda-options", a->ttft.cuda_options,
                  "CUDA backend options key=value,... (the --variants keys): the base of every variant; ttft: the "
                  "server's --cuda-options");
  cmd->add_option("--contexts", a->contexts, "decode context lengths")
      ->delimiter(',')
      ->each([a](const std::string&) { a->contexts_given = true; });
  cmd->add_option("--lengths", a->lengths, "prefill prompt lengths")->delimiter(',');
  cmd->add_option("--reps", a->reps, "timed repetitions per length (median, min, max reported)");
  cmd->add_option("--prefill-chunk", a->prefill_chunk, "rows per prefill chunk");
#ifdef LILY_HAVE_CUDA
  const std::string keys = cuda::option_keys();
#else
  const std::string keys = "those of the CUDA backend; this lily was built without it";
#endif
  cmd->add_option("--variants", a->variants,
                  "backend option sets, each run in full on one loaded model: key=value,...;key=value,... (keys: " +
                      keys + ")");
  cmd->add_option("--steps", a->steps, "decode steps timed per context");
  cmd->add_option("--profile-context", a->profile_context,
                  "context of the per-kernel breakdowns (decode: the step at it; prefill: the chunk that ends at it)");
  cmd->add_option("--decode-rows", a->decode_rows, "decode: sequences a step (several-row steps), e.g. 1,2,4,8")
      ->delimiter(',')
      ->check(CLI::Range(1, 64));
  cmd->add_option("--trace", a->trace_steps,
                  "decode: replay this many steps with the block timeline recorded (kernels/trace.cuh) and print the "
                  "last one's by op; all launches go to the JSON")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--json", a->json_path, "write results as JSON");
  cmd->callback([a] {
    Status st = bench_main(*a);
    if (!st.ok()) {
      std::fprintf(stderr, "lily bench: %s\n", st.message().c_str());
      set_exit_code(1);
    }
  });
}
LILY_COMMAND(setup);

}  // namespace

}  // namespace lily::cli
