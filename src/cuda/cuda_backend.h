// The CUDA backend for batch-1 decode on the H200: the whole step (embedding, 40 layers, lm_head, sampling) is
// one CUDA graph replayed per token; positions live in device memory so the same graph serves every step, and the
// sampled token is written straight into the next step's input slot. Prompts currently run through the same step
// token by token (the tensor-core prefill path is issue 6).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "engine/backend.h"

namespace lily::cuda {

struct CudaBackendOptions {
  int64_t max_context = 32768;  // KV capacity of each sequence
};

// One kernel launch of a profiled step.
struct KernelTiming {
  std::string name;
  double ms = 0;
  double bytes = 0;  // bytes the kernel must move
  int launches = 0;
};

class CudaBackendApi : public Backend {
 public:
  // Benchmark hooks: make `seq` look like it holds n tokens (KV rows filled with random values; the recurrent
  // state keeps whatever it had), so decode at context n can be timed without an n-token prefill.
  virtual Status set_context_for_bench(SequenceState& seq, int64_t n) = 0;
  // Replays `steps` decode steps back to back (greedy on the device) and returns milliseconds per step.
  virtual Result<double> time_decode(SequenceState& seq, int steps) = 0;
  // One step with an event around every kernel: per-kernel-kind totals.
  virtual Result<std::vector<KernelTiming>> profile_step(SequenceState& seq) = 0;
  virtual size_t weight_bytes_per_token() const = 0;
  virtual std::string device_name() const = 0;
};

Result<std::unique_ptr<CudaBackendApi>> make_cuda_backend(std::shared_ptr<const ModelWeights> weights,
                                                          const CudaBackendOptions& options = {});

// Registers make_cuda_backend with the engine's backend factory (call once at start-up).
void register_cuda_backend();

// Split-KV blocks per KV head for a context of n rows (measured: docs/PERF_NOTES.md).
int attention_splits(int64_t n);

}  // namespace lily::cuda
