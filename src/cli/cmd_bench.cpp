// lily bench: decode tok/s at the standard context lengths on the CUDA backend, the achieved weight-read GB/s,
// and the per-kernel breakdown of one step; JSON out. The model is a checkpoint directory or the synthetic
// full-geometry 4-bit model built in memory (--synthetic full).
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
  std::string model, synthetic = "full", json_path;
  std::vector<int64_t> contexts = {256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072};
  int steps = 64;
  int profile_context = 4096;
};

#ifdef LILY_HAVE_CUDA
Status run_bench(const BenchArgs& a) {
  auto t0 = std::chrono::steady_clock::now();
  Result<ModelWeights> w = a.model.empty() ? synth_in_memory(a.synthetic, CheckpointLayout::mlx, 0)
                                           : ModelWeights::load(a.model);
  if (!w.ok()) return w.status();
  auto weights = std::make_shared<const ModelWeights>(std::move(*w));
  int64_t max_ctx = 0;
  for (int64_t c : a.contexts) max_ctx = std::max(max_ctx, c);
  cuda::CudaBackendOptions opt;
  opt.max_context = max_ctx + a.steps + 16;
  ASSIGN_OR_RETURN(auto backend, cuda::make_cuda_backend(weights, opt));
  double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double wbytes = static_cast<double>(backend->weight_bytes_per_token());
  std::fprintf(stderr, "model ready in %.1f s on %s; %.3f GB of weights read per token\n", load_s,
               backend->device_name().c_str(), wbytes / 1e9);
  nlohmann::json out = {{"device", backend->device_name()}, {"model", a.model.empty() ? "synthetic " + a.synthetic : a.model},
                        {"weight_bytes_per_token", wbytes}, {"steps", a.steps}};
  auto seq = backend->new_sequence();
  if (!seq) return error(ErrorCode::internal, "cannot allocate a sequence of %lld tokens", (long long)opt.max_context);
  std::printf("%10s %12s %12s %14s\n", "context", "ms/token", "tok/s", "weights GB/s");
  for (int64_t ctx : a.contexts) {
    RETURN_IF_ERROR(backend->set_context_for_bench(*seq, ctx));
    ASSIGN_OR_RETURN(double ms, backend->time_decode(*seq, a.steps));
    double tps = 1000.0 / ms, gbs = wbytes / (ms * 1e-3) / 1e9;
    std::printf("%10lld %12.3f %12.1f %14.0f\n", (long long)ctx, ms, tps, gbs);
    std::fflush(stdout);
    out["decode"].push_back({{"context", ctx}, {"ms_per_token", ms}, {"tok_per_s", tps}, {"weight_gb_per_s", gbs}});
  }
  RETURN_IF_ERROR(backend->set_context_for_bench(*seq, a.profile_context));
  ASSIGN_OR_RETURN(auto kernels, backend->profile_step(*seq));
  double total = 0;
  for (auto& k : kernels) total += k.ms;
  std::printf("\nper-kernel breakdown of one step at context %d (events around each launch, no graph):\n",
              a.profile_context);
  std::printf("%-16s %8s %10s %8s %10s\n", "kernel", "launches", "ms", "share", "GB/s");
  for (auto& k : kernels) {
    double gbs = k.bytes > 0 ? k.bytes / (k.ms * 1e-3) / 1e9 : 0;
    std::printf("%-16s %8d %10.4f %7.1f%% %10.0f\n", k.name.c_str(), k.launches, k.ms, 100 * k.ms / total, gbs);
    out["kernels"].push_back({{"name", k.name}, {"launches", k.launches}, {"ms", k.ms}, {"bytes", k.bytes}, {"gb_per_s", gbs}});
  }
  std::printf("%-16s %8s %10.4f\n", "total", "", total);
  if (!a.json_path.empty()) std::ofstream(a.json_path) << out.dump(2);
  return ok_status();
}
#else
Status run_bench(const BenchArgs&) { return error(ErrorCode::unsupported, "lily was built without CUDA"); }
#endif

void setup(CLI::App& app) {
  auto* cmd = app.add_subcommand("bench", "Benchmark decode on the GPU at the standard context lengths");
  auto a = std::make_shared<BenchArgs>();
  cmd->add_option("--model", a->model, "checkpoint directory (default: synthetic model in memory)");
  cmd->add_option("--synthetic", a->synthetic, "synthetic preset when no --model: full | full4 | small | tiny");
  cmd->add_option("--contexts", a->contexts, "context lengths")->delimiter(',');
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
