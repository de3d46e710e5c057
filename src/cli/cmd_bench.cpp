// lily bench: prefill tok/s at the standard prompt lengths and decode tok/s at the standard context lengths on the
// CUDA backend (median/min/max over --reps), the achieved weight-read GB/s, and per-kernel breakdowns of a prefill
// chunk and of one decode step; JSON out. The model is a checkpoint directory or the synthetic
// full-geometry 4-bit model built in memory (--synthetic full).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "model/synth.h"

#ifdef LILY_HAVE_CUDA
#include "cuda/cuda_backend.h"
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
  int prefill_chunk = 4096;
  int gdn_scan = 0;
  bool wgmma = true;
  bool moe_fused = false;
  bool gdn_fused = false;
  bool attn_fused = false;
  std::string moe_select = "experts";
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

Status run_bench(const BenchArgs& a) {
  if (a.mode != "all" && a.mode != "decode" && a.mode != "prefill")
    return invalid_argument("--mode must be decode, prefill or all, got `%s`", a.mode.c_str());
  if (a.reps < 1) return invalid_argument("--reps must be at least 1");
  if (a.moe_select != "route" && a.moe_select != "experts")
    return invalid_argument("--moe-select must be route or experts, got `%s`", a.moe_select.c_str());
  const bool do_decode = a.mode != "prefill", do_prefill = a.mode != "decode";
  auto t0 = std::chrono::steady_clock::now();
  Result<ModelWeights> w = a.model.empty() ? synth_in_memory(a.synthetic, CheckpointLayout::mlx, 0)
                                           : ModelWeights::load(a.model);
  if (!w.ok()) return w.status();
  auto weights = std::make_shared<const ModelWeights>(std::move(*w));
  int64_t max_ctx = 0;
  if (do_decode)
    for (int64_t c : a.contexts) max_ctx = std::max(max_ctx, c + a.steps * (a.reps + 1) + 16);
  if (do_prefill)
    for (int64_t n : a.lengths) max_ctx = std::max(max_ctx, n + 16);
  cuda::CudaBackendOptions opt;
  opt.max_context = max_ctx;
  opt.prefill_chunk = a.prefill_chunk;
  opt.gdn_scan_variant = a.gdn_scan;
  opt.dense_wgmma = a.wgmma;
  opt.moe_fused = a.moe_fused;
  opt.gdn_fused = a.gdn_fused;
  opt.attn_fused = a.attn_fused;
  opt.moe_select_in_experts = a.moe_select == "experts";
  ASSIGN_OR_RETURN(auto backend, cuda::make_cuda_backend(weights, opt));
  double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double wbytes = static_cast<double>(backend->weight_bytes_per_token());
  std::fprintf(stderr, "model ready in %.1f s on %s; %.3f GB of weights read per token\n", load_s,
               backend->device_name().c_str(), wbytes / 1e9);
  nlohmann::json out = {{"device", backend->device_name()}, {"model", a.model.empty() ? "synthetic " + a.synthetic : a.model},
                        {"weight_bytes_per_token", wbytes}, {"steps", a.steps}, {"reps", a.reps},
                        {"prefill_chunk", a.prefill_chunk}, {"gdn_scan", a.gdn_scan}, {"wgmma", a.wgmma},
                        {"moe_fused", a.moe_fused}, {"gdn_fused", a.gdn_fused}, {"attn_fused", a.attn_fused},
                        {"moe_select", a.moe_select}};
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
    const int64_t pn = std::min<int64_t>(a.profile_context, a.prefill_chunk);
    std::vector<cuda::KernelTiming> kernels;
    RETURN_IF_ERROR(backend->time_prefill(*seq, pn, &kernels).status());
    std::printf("\nper-kernel breakdown of a %lld-token prefill chunk (events around each launch):\n", (long long)pn);
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
    RETURN_IF_ERROR(backend->set_context_for_bench(*seq, a.profile_context));
    ASSIGN_OR_RETURN(auto kernels, backend->profile_step(*seq));
    std::printf("\nper-kernel breakdown of one decode step at context %d (events around each launch, no graph):\n",
                a.profile_context);
    print_breakdown(kernels, out["kernels"]);
  }
  if (!a.json_path.empty()) std::ofstream(a.json_path) << out.dump(2);
  return ok_status();
}
#else
Status run_bench(const BenchArgs&) { return error(ErrorCode::unsupported, "lily was built without CUDA"); }
#endif

void setup(CLI::App& app) {
  auto* cmd = app.add_subcommand("bench", "Benchmark prefill and decode on the GPU at the standard lengths");
  auto a = std::make_shared<BenchArgs>();
  cmd->add_option("--model", a->model, "checkpoint directory (default: synthetic model in memory)");
  cmd->add_option("--synthetic", a->synthetic, "synthetic preset when no --model: full | full4 | small | tiny");
  cmd->add_option("--mode", a->mode, "decode | prefill | all");
  cmd->add_option("--contexts", a->contexts, "decode context lengths")->delimiter(',');
  cmd->add_option("--lengths", a->lengths, "prefill prompt lengths")->delimiter(',');
  cmd->add_option("--reps", a->reps, "timed repetitions per length (median, min, max reported)");
  cmd->add_option("--prefill-chunk", a->prefill_chunk, "rows per prefill chunk");
  cmd->add_option("--gdn-scan", a->gdn_scan, "Gated DeltaNet prefill scan variant (0: chosen by length; gdn_prefill.cuh)");
  cmd->add_flag("--wgmma,!--no-wgmma", a->wgmma,
                "dense prefill projections on the wgmma GEMM (qgemm_wgmma.cu; default) or on mma.sync");
  cmd->add_flag("--moe-fused", a->moe_fused,
                "decode: each layer's MoE block as one persistent kernel (moe_fused.cu) instead of three");
  cmd->add_flag("--gdn-fused", a->gdn_fused,
                "decode: each Gated DeltaNet layer (in_proj, step, out_proj) as one persistent kernel (gdn_fused.cu)");
  cmd->add_flag("--attn-fused", a->attn_fused,
                "decode: each full-attention layer (in_proj, prep, split-KV attention, combine, out_proj) as one "
                "persistent kernel (attn_fused.cu)");
  cmd->add_option("--moe-select", a->moe_select,
                  "decode, three-kernel MoE: experts (the expert kernels select; default) or route");
  cmd->add_option("--steps", a->steps, "decode steps timed per context");
  cmd->add_option("--profile-context", a->profile_context, "context of the per-kernel breakdown");
  cmd->add_option("--json", a->json_path, "write results as JSON");
  cmd->callback([a] {
    Status st = run_bench(*a);
    if (!st.ok()) {
      std::fprintf(stderr, "lily bench: %s\n", st.message().c_str());
      set_exit_code(1);
    }
  });
}
LILY_COMMAND(setup);

}  // namespace

}  // namespace lily::cli
