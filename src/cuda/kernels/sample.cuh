// Sampling on the GPU for batch-1 decode: the next token id is written into the input slot of the next step and
// appended to a host-mapped ring, so the host never synchronises per token.
//  greedy (temperature == 0): argmax, ties -> lowest id.
//  temperature only (top_k == 0, top_p == 1, min_p == 0): exact sampling from softmax(logits / T) by the
//    Gumbel-max trick, argmax(logits / T + G) with G from a counter-based RNG (seed, step, token id).
//  top_k / top_p / min_p: candidates = the top min(top_k or 64, 64) logits; then top_p / min_p within them,
//    renormalise, draw one uniform from the same RNG. (top_p over the whole vocabulary is approximated by its
//    64 best tokens: documented limitation.)
//  penalties (SampleParams::penalties set): engine/sampler.h steps 2-3 on the logits row in place before the
//    choice, over the sequence's table of distinct history ids only (engine/penalties.h), and the chosen id
//    counted into that table after it, both on the device (sample_token launches them around the choice).
// Moves vocab * 4 bytes of logits; with penalties also 16 bytes per table entry and ~32 bytes for the count.
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
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  float repetition_penalty = 1.0f;
};

// A sequence's penalty table on the device (engine/penalties.h PenaltyTable): the distinct ids of the request's
// prompt + generated tokens in order of first occurrence with their counts among the generated, and an index by
// id (read one element per token: the chosen id's). Sized for every id the sequence can see (capacity >= the
// distinct ids the context can hold), so the count after a choice never overflows.
struct PenaltyState {
  int* ids = nullptr;     // [capacity]
  int* counts = nullptr;  // [capacity]
  int* n = nullptr;       // device: entries in use
  int* slot = nullptr;    // [vocab]: j where ids[j] == id, -1 for ids not in the table
  int capacity = 0;
  int vocab = 0;
};

struct SampleParams {
  float* logits = nullptr;  // [vocab]; with penalties the kernel writes the table's penalised logits back
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
  // Device: when set, the kernel reads temperature, top_k, top_p, min_p, seed and the penalties from here
  // (written before the launch) instead of the fields above, which then only choose the kernel (the mode, and
  // whether the penalty kernels run: penalties.ids) and must match it.
  const SampleKnobs* knobs = nullptr;
  // The penalties (engine/sampler.h steps 2-3) when penalties.ids is set; read from knobs when that is set.
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  float repetition_penalty = 1.0f;  // > 0
  PenaltyState penalties{};
};

// The kernel a configuration takes: 0 greedy, 1 temperature only (Gumbel-max), 2 top-k / top-p / min-p.
inline int sample_mode(float temperature, int top_k, float top_p, float min_p) {
  if (temperature == 0.0f) return 0;
  return top_k == 0 && top_p >= 1.0f && min_p <= 0.0f ? 1 : 2;
}

cudaError_t sample_token(const SampleParams& p, cudaStream_t stream);

// Loads a table of n entries (host arrays ids, counts; ids distinct, in [0, st.vocab)) into st: the index of the
// entries st held is cleared first, so loading costs O(old + new entries), never O(vocab). Stream-ordered: the
// host arrays must stay valid until the stream has run the copies (the backend synchronises after it).
cudaError_t penalty_state_load(const PenaltyState& st, const int* ids, const int* counts, int n, cudaStream_t stream);

}  // namespace lily::cuda
