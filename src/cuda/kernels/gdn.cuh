// Fused Gated DeltaNet decode step (eqs 14-18) for one token: conv-state update + SiLU, l2norm of q and k,
// beta = sigmoid(b), decay = exp(-exp(A_log) * softplus(a + dt_bias)), and the gated delta rule with the state
// held in registers: S <- decay*S; e = (v - S^T k) * beta; S <- S + k e^T; o = S^T q_hat.
// The gated RMSNorm with z (eq 19) is done here (norm_w set: a cluster per head) or by the out_proj GEMV prologue.
// Memory-bound: reads and writes the fp32 state, n_v * d_k * d_v * 8 bytes (4 MiB per layer at full size).
// The conv state is a ring of `kernel` pre-conv vectors indexed by position % kernel (zero-initialised), so
// no block overwrites a vector another block still reads.
#pragma once
#include "cuda/kernels/common.cuh"

namespace lily::cuda {

struct GdnStepParams {
  const float* proj = nullptr;    // [conv_dim (q|k|v) + value_dim (z) + n_v (b) + n_v (a)] from the fused GEMV
  float* conv_ring = nullptr;     // [kernel, conv_dim]
  const float* conv_w = nullptr;  // [conv_dim, kernel]
  const float* A_log = nullptr;   // [n_v]
  const float* dt_bias = nullptr; // [n_v]
  float* S = nullptr;             // [n_v, d_k, d_v] fp32
  const int* pos = nullptr;       // device: position of this token
  int n_k = 16, n_v = 32, d_k = 128, d_v = 128, kernel = 4;
  float* o = nullptr;             // out [n_v * d_v]: S^T q_hat (before the gated norm)
  // The kernel starts before its predecessor has finished (programmatic dependent launch) and waits for it before
  // reading proj. With prefetch_state it also reads *pos, S and the conv ring before that wait: only valid when no
  // kernel still in flight writes them (the decode graph: each layer's state is written by its own gdn_step
  // once per step, and pos by advance_position at the end of the previous step).
  bool prefetch_state = false;
  // Optional eq 19 fused in: with norm_w, o receives x = norm_w * o / RMS(o_head) * silu(z) instead (the input of
  // an out-projection GEMV without prologue). The d_v / 32 blocks of a head run as one thread block cluster and
  // exchange their sums of squares through distributed shared memory; d_v <= 256.
  const float* gate_z = nullptr;  // [n_v * d_v]: z (the fused projection's part after q|k|v)
  const float* norm_w = nullptr;  // [d_v]
  float eps = 1e-6f;
};

cudaError_t gdn_step(const GdnStepParams& p, cudaStream_t stream);

// The whole Gated DeltaNet decode layer (eqs 1-2 input_layernorm, 13 in_proj, 14-19, 20 out_proj + residual) as ONE
// persistent kernel instead of gemv gdn_in + gdn_step + gemv gdn_out (gdn_fused.cu; opt-in,
// CudaBackendOptions::gdn_fused). Two grid-wide barriers replace the two kernel boundaries:
//  phase A: every block normalises h (the chain GEMV's code and summation order: the same x bits); the warps of the
//           grid share the in_proj rows (gemv.cu's chunk code: the same proj bits);
//  barrier; phase B: block b steps value head b (+ multiples of the grid): conv, l2norm, gates, delta rule and the
//           gated RMSNorm, the whole head in one block (gdn_step's arithmetic and summation order: the same bits);
//           its state was fetched into shared memory before the barrier (before the predecessor wait with
//           prefetch_state), since S does not depend on the in_proj;
//  barrier; phase C: the warps share the out_proj rows and add them to h (each element written once).
// Moves in_proj + out_proj (18.95 MB at full size) + the state twice (4.19 MB). Shapes: d_k = d_v = 128, conv
// kernel 4, H in {1024, 2048}, n_v * d_v in {2048, 4096}, both projections 4-bit with 16-byte aligned scales.
struct GdnFusedParams {
  QMatrix in_proj;                 // [conv_dim + value_dim + 2 n_v, H] 4-bit: q|k|v, z, b, a
  QMatrix out_proj;                // [H, value_dim] 4-bit
  float* h = nullptr;              // [H] in/out residual stream
  const float* input_norm = nullptr;  // [H] input_layernorm multiplier
  const float* conv_w = nullptr;   // [conv_dim, kernel]
  const float* A_log = nullptr;    // [n_v]
  const float* dt_bias = nullptr;  // [n_v]
  const float* norm_w = nullptr;   // [d_v] the gated RMSNorm's multiplier (eq 19)
  float* conv_ring = nullptr;      // [kernel, conv_dim], as GdnStepParams
  float* S = nullptr;              // [n_v, d_k, d_v] fp32, 16-byte aligned
  const int* pos = nullptr;        // device: position of this token
  int n_k = 16, n_v = 32, d_k = 128, d_v = 128, kernel = 4;
  float eps = 1e-6f;               // both RMSNorms
  float* proj = nullptr;           // scratch [in_proj.rows]
  float* o = nullptr;              // scratch [value_dim], 16-byte aligned: the out_proj's input (eq 19's x)
  unsigned* barrier = nullptr;     // one counter, zero before the first launch; every launch leaves it as found
  bool prefetch_state = false;     // as GdnStepParams: pos, S, ring history read before the predecessor wait
  int grid_blocks = 0;             // 0: every block that can be resident at once; else at most that many
};

// Whether gdn_fused takes p's shapes, bits and pointers (everything its launcher checks except the grid size).
bool gdn_fused_supported(const GdnFusedParams& p);
cudaError_t gdn_fused(const GdnFusedParams& p, cudaStream_t stream);

#if defined(__CUDACC__)
// ---- eq 14 / 17 device code shared by gdn.cu and gdn_fused.cu (the same bits in both) ------------------------
__device__ __forceinline__ float gdn_silu(float x) { return x / (1.0f + expf(-x)); }

// Eq 17: beta = sigmoid(b), decay = exp(-exp(A_log) * softplus(a + dt_bias)); a_in = a + dt_bias.
__device__ __forceinline__ void gdn_gates(float b_logit, float a_in, float A_log, float& beta, float& decay) {
  beta = 1.0f / (1.0f + expf(-b_logit));
  const float softplus = a_in > 20.0f ? a_in : log1pf(expf(a_in));
  decay = expf(-expf(A_log) * softplus);
}
#endif  // __CUDACC__

}  // namespace lily::cuda
