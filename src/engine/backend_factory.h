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
  int64_t max_context = 32768;   // CUDA backend: KV capacity of each sequence (the CPU backend grows as needed)
  // CUDA backend tuning, `key=value,...` (cuda::apply_option_spec: the `lily bench --variants` keys); refused
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
