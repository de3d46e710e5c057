// Backend selection: `--backend auto|cpu|cuda`. The CUDA backend lives in its own library and registers its
// factory at start-up (src/cli does it when built with CUDA), so the engine and the server never depend on it.
#pragma once
#include <memory>
#include <string>

#include "engine/backend.h"

namespace lily {

enum class BackendKind { automatic, cpu, cuda };

Result<BackendKind> parse_backend_kind(const std::string& s);

struct BackendOptions {
  BackendKind kind = BackendKind::automatic;
  int n_threads = 0;             // CPU backend
  // Tokens a sequence may hold (Backend::max_context reports what the backend took). 0: the backend's default
  // (CUDA: 32,768, at most the model's maximum; CPU: the model's maximum); kContextAuto: the largest that fits
  // (CUDA: the GPU's free memory after the weights; CPU: the model's maximum, its state grows as needed).
  int64_t max_context = 0;
  static constexpr int64_t kContextAuto = -1;
  // CUDA backend options, `key=value,...` (cuda::apply_option_spec: the `lily bench --variants` keys); refused
  // when the backend is the CPU one.
  std::string cuda_options;
};

// Returns a CUDA backend, or an error saying why none is available (no GPU, not built with CUDA).
using CudaBackendFactory = Result<std::unique_ptr<Backend>> (*)(std::shared_ptr<const ModelWeights>,
                                                                const BackendOptions&);
void register_cuda_backend_factory(CudaBackendFactory factory);

// automatic: CUDA when a GPU is usable, else CPU.
Result<std::unique_ptr<Backend>> make_backend(std::shared_ptr<const ModelWeights> weights,
                                              const BackendOptions& options);

}  // namespace lily
