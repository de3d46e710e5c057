#include "engine/backend_factory.h"

#include "cpu/cpu_backend.h"

namespace lily {

namespace {
CudaBackendFactory g_cuda_factory = nullptr;  // set once at start-up, before any thread starts
}

void register_cuda_backend_factory(CudaBackendFactory factory) { g_cuda_factory = factory; }

Result<BackendKind> parse_backend_kind(const std::string& s) {
  if (s == "auto") return BackendKind::automatic;
  if (s == "cpu") return BackendKind::cpu;
  if (s == "cuda") return BackendKind::cuda;
  return invalid_argument("unknown backend `%s` (auto, cpu, cuda)", s.c_str());
}

Result<std::unique_ptr<Backend>> make_backend(std::shared_ptr<const ModelWeights> weights,
                                              const BackendOptions& options) {
  if (options.kind != BackendKind::cpu) {
    if (g_cuda_factory) {
      auto cuda = g_cuda_factory(weights, options);
      if (cuda.ok() || options.kind == BackendKind::cuda) return cuda;
    } else if (options.kind == BackendKind::cuda) {
      return error(ErrorCode::unsupported, "this lily was built without CUDA");
    }
  }
  CpuBackendOptions cpu;
  cpu.n_threads = options.n_threads;
  return std::unique_ptr<Backend>(std::make_unique<CpuBackend>(std::move(weights), cpu));
}

}  // namespace lily
