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
  // Optional: the state after this token goes to S_out and ring_out (all kernel slots: the history read and the
  // current vector) instead of back into S and conv_ring, which are then only read: a row of a verification
  // (several positions of one sequence, cuda_verify.cpp) steps from the state the row before left into its own.
  float* S_out = nullptr;     // [n_v, d_k, d_v], not aliasing S
  float* ring_out = nullptr;  // [kernel, conv_dim], not aliasing conv_ring
  // Optional eq 19 fused in: with norm_w, o receives x = norm_w * o / RMS(o_head) * silu(z) instead (the input of
  // an out-projection GEMV without prologue). The d_v / 32 blocks of a head run as one thread block cluster and
  // exchange their sums of squares through distributed shared memory; d_v <= 256; only with sm_90 code
  // (sm90_code_built), else cudaErrorInvalidDeviceFunction.
  const float* gate_z = nullptr;  // [n_v * d_v]: z (the fused projection's part after q|k|v)
  const float* norm_w = nullptr;  // [d_v]
  float eps = 1e-6f;
};

cudaError_t gdn_step(const GdnStepParams& p, cudaStream_t stream);
// n <= kMaxBatchRows rows (sequences) of one layer in one launch (grid z = row), each exactly as gdn_step.
cudaError_t gdn_step_rows(const GdnStepParams* rows, int n, cudaStream_t stream);

#if defined(__CUDACC__)
// ---- eq 14 / 17 device code ---------------------------------------------------------------------------------
__device__ __forceinline__ float gdn_silu(float x) { return x / (1.0f + expf(-x)); }

// Eq 17: beta = sigmoid(b), decay = exp(-exp(A_log) * softplus(a + dt_bias)); a_in = a + dt_bias.
__device__ __forceinline__ void gdn_gates(float b_logit, float a_in, float A_log, float& beta, float& decay) {
  beta = 1.0f / (1.0f + expf(-b_logit));
  const float softplus = a_in > 20.0f ? a_in : log1pf(expf(a_in));
  decay = expf(-expf(A_log) * softplus);
}
#endif  // __CUDACC__

}  // namespace lily::cuda
