// moe_prefill: the whole MoE block (eqs 20-25 of docs/MODEL.md) for T rows with routing on the GPU and no host synchronisation:
//  x = RMSNorm(h) (fp16), router GEMM (8-bit), fp32 softmax / top-k (ties: lower index) /
//  renormalise, histogram of rows per expert, prefix scan to offsets, scatter of (row, slot) into expert
//  order, block map of the tiles the grouped GEMM runs; grouped qgemm_swiglu over the routed rows
//  and the shared expert's (one more expert of the tile list), grouped down projection; then
//  h[t] += sum_s w_s * y[t, s] + sg[t] * y_shared[t] in a fixed order (deterministic).
#pragma once
#include "cuda/kernels/qgemm.cuh"

namespace lily::cuda {

// MoePrefillParams::tile_rows for the register-sourced wgmma tiles (qgemm_util::kRsRows).
inline constexpr int kMoeRsTileRows = 192;

struct MoePrefillParams {
  QMatrix router;        // 8-bit [E, H]
  QMatrix shared_gate;   // 8-bit [1, H]  (shared_expert_gate)
  QMatrix gate, up;      // stacked [E, I, H]
  QMatrix down;          // stacked [E, H, I]
  QMatrix shared_gate_proj, shared_up, shared_down;  // [Is, H], [Is, H], [H, Is]
  float* h = nullptr;            // [T, H] fp32 residual stream, in/out
  const float* norm_w = nullptr; // [H] post_attention_layernorm multiplier
  float eps = 1e-6f;
  int T = 0;
  int top_k = 8;
  void* scratch = nullptr;       // moe_prefill_scratch_bytes(...) bytes of device memory
  size_t scratch_bytes = 0;
  // rows of a grouped expert tile: 32 (qgemm_util::kFewRows: launch_grouped_few, 4-bit experts with the shared
  // expert folded in), 64 or 128 (the qgemm.cu / wgmma tiles), 192 (qgemm_util::kRsRows: launch_grouped_rs, the
  // weights in registers on sm_90a; 4-bit, shared expert folded in, H and I multiples of 512); 0 picks from
  // T * top_k / E
  int tile_rows = 0;
  // The experts' resident fp16 copies (moe_expand_w16 of these matrices), or nullptr. Where set, the 192-row
  // tiles (tile_rows kRsRows, or 0 from kW16MinRowsPerExpert rows an expert) read them instead of expanding the
  // 4-bit weights (launch_grouped_w16; sm_90a, 4-bit experts with the shared expert folded in).
  const __half* w16 = nullptr;
};

// Rows an expert (T top_k / E) from which moe_prefill takes the fp16 copies when it has them.
inline constexpr int kW16MinRowsPerExpert = 40;

// The fp16 copies of one layer's experts (the routed ones and the shared one, index E): halves, and the
// expansion (gate / up then down, each expert's weights in the order the w16 tiles' stages read them: 128-row x
// 64-k tiles in the 128-byte swizzle). The values are those the register-sourced tiles compute (fp16 scale * q +
// bias in one fp16 fma). 4-bit experts, I == Is, H a multiple of 128, I of 64; cudaErrorInvalidValue otherwise.
size_t moe_w16_halves(int n_experts, int H, int I);
size_t moe_w16_down_offset(int n_experts, int H, int I);  // halves before the down projections' copies
cudaError_t moe_expand_w16(const MoePrefillParams& p, __half* out, cudaStream_t stream);

// Scratch moe_prefill needs for T rows (linear in T; the caller bounds T by chunking).
size_t moe_prefill_scratch_bytes(int T, int H, int I, int Is, int n_experts, int top_k);
cudaError_t moe_prefill(const MoePrefillParams& p, cudaStream_t stream);

}  // namespace lily::cuda
