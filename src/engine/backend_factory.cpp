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
      // A bad --cuda-options is the caller's error even where auto would fall back to the CPU.
      if (cuda.ok() || options.kind == BackendKind::cuda || cuda.status().code() == ErrorCode::invalid_argument)
        return cuda;
    } else if (options.kind == BackendKind::cuda) {
      return error(ErrorCode::unsupported, "this lily was built without CUDA");
    }
  }
  if (!options.cuda_options.empty())
    return invalid_argument("--cuda-options `%s`: the backend is the CPU one (%s)", options.cuda_options.c_str(),
                            options.kind == BackendKind::cpu ? "--backend cpu" : "no usable CUDA device");
  CpuBackendOptions cpu;
  cpu.n_threads = options.n_threads;
  return std::unique_ptr<Backend>(std::make_unique<CpuBackend>(std::move(weights), cpu));
}

}  // namespace lily
