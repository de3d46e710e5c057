// MoE decode (eqs 21-25) in three kernels, all device-side (no host synchronisation):
//  moe_route:      x = RMSNorm(h) * norm_w; router logits (8-bit [E, H]) and the shared-expert gate logit
//                  (8-bit [1, H]); fp32 softmax over E, top-k (ties -> lower index), renormalised weights,
//                  sg = sigmoid(shared gate logit). Moves E*H + H bytes (8-bit) plus scales.
//  moe_expert_in:  for the k routed experts and the shared expert: act[s] = silu(W_gate x) * (W_up x), [k+1, I];
//                  no gate/up intermediate in device memory. Moves (k+1) * 2 * I * H / 2 bytes (4-bit) + scales.
//  moe_expert_out: h[r] += sum_s w_s * (W_down[e_s] act[s])[r] + sg * (W_sdown act[k])[r]: the down projections,
//                  routing weights, shared-expert sigmoid gate and the residual add. Moves (k+1) * H * I / 2 bytes.
// Selection in the expert kernels (router_logits set, n_experts <= 256): moe_route only writes the logits, x and
// the shared gate (select_top_k = false), and each block of moe_expert_in / moe_expert_out takes the softmax and
// top-k itself from the logits (the same code, so every block makes the same choice). That removes moe_route's
// cross-block step (fence, atomic ticket, a last block that reads all logits back) from the critical path, and
// lets moe_expert_out fetch its routed down-projection weights before moe_expert_in has finished: it reads the
// logits before waiting on its predecessor, which is safe because moe_expert_in signals its dependents only after
// its own wait, i.e. once moe_route has completed. So the three launches must follow each other on one stream.
#pragma once
#include "cuda/kernels/common.cuh"

namespace lily::cuda {

struct MoeRouteParams {
  QMatrix router;       // 8-bit [E, H]
  QMatrix shared_gate;  // 8-bit [1, H]
  const float* h = nullptr;       // [H] residual stream
  const float* norm_w = nullptr;  // [H] post_attention_layernorm multiplier
  float eps = 1e-6f;
  int top_k = 8;                  // <= 16
  float* x = nullptr;             // out [H]: the normalised MoE input
  float* logits = nullptr;        // scratch [E]
  unsigned* counter = nullptr;    // scratch: one zero-initialised counter (left at zero after the kernel)
  int* topk_idx = nullptr;        // out [top_k]
  float* topk_w = nullptr;        // out [top_k]
  float* shared_gate_value = nullptr;  // out [1]: sigmoid(w_seg . x)
  bool select_top_k = true;  // false: logits, x and shared gate only (counter, topk_idx, topk_w unused)
};

struct MoeExpertInParams {
  QMatrix gate, up;                // stacked [E, I, H] 4-bit (use .expert(e))
  QMatrix shared_gate, shared_up;  // [Is, H]; this kernel requires Is == I
  const float* x = nullptr;        // [H]
  const int* topk_idx = nullptr;   // [top_k]
  int top_k = 8;
  float* act = nullptr;            // out [top_k + 1, I]; row top_k is the shared expert
  const float* router_logits = nullptr;  // optional [n_experts]: select from these, not from topk_idx
  int n_experts = 0;                     // with router_logits, <= 256
};

struct MoeExpertOutParams {
  QMatrix down;                 // stacked [E, H, I]
  QMatrix shared_down;          // [H, I]
  const float* act = nullptr;   // [top_k + 1, I]
  const int* topk_idx = nullptr;
  const float* topk_w = nullptr;
  const float* shared_gate_value = nullptr;
  int top_k = 8;
  float* h = nullptr;           // [H] in/out residual stream
  const float* router_logits = nullptr;  // optional [n_experts]: select from these (topk_idx/topk_w unused)
  int n_experts = 0;                     // with router_logits, <= 256
};

cudaError_t moe_route(const MoeRouteParams& p, cudaStream_t stream);
cudaError_t moe_expert_in(const MoeExpertInParams& p, cudaStream_t stream);
cudaError_t moe_expert_out(const MoeExpertOutParams& p, cudaStream_t stream);

}  // namespace lily::cuda
