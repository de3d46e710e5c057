// Sampling on the GPU for batch-1 decode: the next token id is written into the input slot of the next step and
// appended to a host-mapped ring, so the host never synchronises per token.
//  greedy (temperature == 0): argmax, ties -> lowest id.
//  temperature only (top_k == 0, top_p == 1, min_p == 0): exact sampling from softmax(logits / T) by the
//    Gumbel-max trick, argmax(logits / T + G) with G from a counter-based RNG (seed, step, token id).
//  top_k / top_p / min_p: candidates = the top min(top_k or 64, 64) logits; then top_p / min_p within them,
//    renormalise, draw one uniform from the same RNG. (top_p over the whole vocabulary is approximated by its
//    64 best tokens: documented limitation.)
// Moves vocab * 4 bytes of logits.
#pragma once
#include "cuda/kernels/common.cuh"

namespace lily::cuda {

// The numbers of a sampling configuration, also readable by the kernel from device memory
// (SampleParams::knobs), so one captured graph serves every request of a mode - greedy, temperature only, or
// top-k/top-p/min-p - whatever its seed and values.
struct SampleKnobs {
  float temperature = 0.0f;
  int top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  unsigned long long seed = 0;
};

struct SampleParams {
  const float* logits = nullptr;  // [vocab]
  int vocab = 0;
  float temperature = 0.0f;
  int top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  unsigned long long seed = 0;
  const int* step = nullptr;      // device: step counter (RNG offset); the kernel does not change it
  float* scratch = nullptr;       // >= 2 * 1024 * 64 floats
  unsigned* counter = nullptr;    // zero-initialised; left at zero
  int* out_token = nullptr;       // device: the next step's input token
  int* ring = nullptr;            // host-mapped ring of emitted tokens, ring[*step % ring_size] = token
  int ring_size = 0;
  // Device: when set, the kernel reads temperature, top_k, top_p, min_p and seed from here (written before the
  // launch) instead of the fields above, which then only choose the kernel (the mode) and must match it.
  const SampleKnobs* knobs = nullptr;
};

// The kernel a configuration takes: 0 greedy, 1 temperature only (Gumbel-max), 2 top-k / top-p / min-p.
inline int sample_mode(float temperature, int top_k, float top_p, float min_p) {
  if (temperature == 0.0f) return 0;
  return top_k == 0 && top_p >= 1.0f && min_p <= 0.0f ? 1 : 2;
}

cudaError_t sample_token(const SampleParams& p, cudaStream_t stream);

}  // namespace lily::cuda
