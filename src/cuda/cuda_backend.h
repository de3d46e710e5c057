// The CUDA backend for batch-1 decode: the whole step (embedding, 40 layers, lm_head, sampling) is one CUDA graph
// replayed per token (cuda_decode.cpp, cuda_graph.cpp); positions live in device memory so the same graph serves
// every step, and the sampled token is written straight into the next step's input slot. Prompts of more than one
// token take the prefill path (cuda_prefill.cpp): chunks of up to `prefill_chunk` rows through tensor-core GEMMs
// (qgemm.cuh, moe_prefill.cuh), the Gated DeltaNet scans (gdn_prefill.cuh) and flash attention (attn_prefill.cuh);
// scratch memory is sized by the chunk, not the prompt. Kernels are chosen at start by what the binary carries for
// the GPU (KernelPaths, printed once): wgmma on sm_90a code, mma.sync / cp.async elsewhere (sm_80 and later).
// The benchmark and trace hooks are a separate interface (cuda_bench.h).
#pragma once
#include <memory>
#include <string>

#include "engine/backend.h"

namespace lily::cuda {

struct CudaBackendOptions {
  // KV capacity of each sequence; kContextAuto: the largest that fits the GPU's free memory (at most the model's
  // max_position_embeddings). A capacity that does not fit is refused at load with the largest that does.
  int64_t max_context = 32768;
  static constexpr int64_t kContextAuto = -1;
  int prefill_chunk = 4096;  // rows per prefill chunk; 0: prompts run token by token through the decode step
  // 1: the MoE experts' resident fp16 copies for prefill (moe_prefill's fp16-copy tiles, Hopper; ~1.6 GB a layer
  // at full geometry) where they fit beside the context; 0: never (prefill expands the 4-bit experts each chunk).
  int expert_copies = 1;
  // The batch-1 decode step: 0 the kernel-per-op chain (one CUDA graph of ~264 launches); 1 the persistent
  // megakernel (megakernel/: one launch interprets the 40 layers and the lm_head; slower than the chain so far,
  // docs/PERF_NOTES.md). 1 needs an sm_90a build on a Hopper GPU and the model's own geometry; several-row steps,
  // verification and the MTP head stay on the chain.
  int megakernel = 0;
};

// Applies a spec `key=value,key=value` to o (`--cuda-options`, `lily bench --variants`): the keys are listed by
// option_keys(), ints in decimal. Errors (prefixed with `what`) name the unknown key or the bad value.
Status apply_option_spec(const std::string& spec, CudaBackendOptions& o, const char* what);
std::string option_keys();

Result<std::unique_ptr<Backend>> make_cuda_backend(std::shared_ptr<const ModelWeights> weights,
                                                   const CudaBackendOptions& options = {});

// Registers make_cuda_backend with the engine's backend factory (call once at start-up).
void register_cuda_backend();

// Split-KV blocks per KV head for a context of n rows (measured: docs/PERF_NOTES.md).
int attention_splits(int64_t n);

}  // namespace lily::cuda
