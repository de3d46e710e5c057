// The model's coarse operations on the CPU (the reference every other backend is compared with).
// Each block reads a normalised input [T, hidden] and writes the block's output [T, hidden] (before the
// residual add). Equations are numbered as in docs/MODEL.md.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "model/weights.h"
#include "util/tensor.h"
#include "util/thread_pool.h"

namespace lily::cpu {

// Optional hook to dump named intermediates ("layer.3.gdn.beta"); costs nothing when empty.
using TraceFn = std::function<void(const std::string& name, const float* data, const Shape& shape)>;

struct Context {
  ThreadPool& pool;
  const ModelConfig& cfg;
  const TraceFn& trace;
  int layer = 0;
  void dump(const char* what, const float* data, const Shape& shape) const {
    if (trace) trace("layer." + std::to_string(layer) + "." + what, data, shape);
  }
};

// Per-layer sequence state: the KV cache of an attention layer, or the conv and recurrent state of a
// Gated DeltaNet layer.
struct LayerState {
  std::vector<float> k, v;  // [n_tokens, n_kv_heads, head_dim] (fp32 on the CPU)
  std::vector<float> conv;  // [kernel - 1, conv_dim]: the last pre-conv vectors, oldest first
  std::vector<float> S;     // [n_v_heads, d_k, d_v]
};

void attention_block(const Context& ctx, const AttentionWeights& w, const float* a, int64_t T, int64_t pos0,
                     LayerState& st, float* out);
// `after` (optional) gets the conv and recurrent state after each of the T rows (speculative verification:
// a rejected draft restores the state after the last kept row without recomputing).
void delta_net_block(const Context& ctx, const DeltaNetWeights& w, const float* a, int64_t T, LayerState& st,
                     float* out, std::vector<LayerState>* after = nullptr);
void moe_block(const Context& ctx, const MoeWeights& w, const float* b, int64_t T, float* out);

// Eq 22: indices of the k largest probabilities (ties: lower index first) and their renormalised weights.
void route_top_k(const float* probs, int n_experts, int k, int* idx, float* weight);

}  // namespace lily::cpu
