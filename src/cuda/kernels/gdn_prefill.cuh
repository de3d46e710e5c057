// Gated DeltaNet prefill (issue 6, eqs 13-19) for T rows of one layer, from the fused input projection to the
// out_proj's A operand:
//  conv over the chunk (depthwise causal, kernel 4) continuing from the carried conv ring + SiLU; l2norm of q and
//  k; beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias); the gated delta rule over the T rows
//  (S <- exp(g) S; e = (v - S^T k) beta; S <- S + k e^T; o = S^T q / sqrt(d_k) as the CPU reference orders it),
//  row by row or, for long T, chunk by chunk on the tensor cores;
//  the gated RMSNorm with z (eq 19). The recurrent state S and the conv ring carry to the next chunk / decode step.
// The conv ring is the decode kernels' convention (gdn.cuh): `kernel` pre-conv vectors, the vector of position p in
// slot p % kernel; after the call it holds positions pos0+T-kernel .. pos0+T-1 exactly as T decode steps would.
// Moves the proj rows (T * (2*conv_dim... ) * 4 bytes) and S twice; FLOPs ~ 4 * T * n_v * d_k * d_v.
// Scratch (gdn_prefill_scratch_bytes) is linear in T: ~73 KB a row at full geometry for the row-wise sections, plus
// the chunk-start states of the split chunked path (variants 11-14): ceil(T / 64) * n_v * d_k * d_v * 4 bytes,
// 2 MiB per 64 rows at full geometry (128 MiB at T = 4096), reserved whichever variant runs.
#pragma once
#include <cuda_fp16.h>

#include "cuda/kernels/common.cuh"

namespace lily::cuda {

struct GdnPrefillParams {
  const float* proj = nullptr;    // [T, conv_dim (q|k|v) + value_dim (z) + n_v (b) + n_v (a)] row-major
  int T = 0;
  int pos0 = 0;                   // position of row 0 (host value)
  float* conv_ring = nullptr;     // [kernel, conv_dim], in/out
  const float* conv_w = nullptr;  // [conv_dim, kernel]
  const float* A_log = nullptr;   // [n_v]
  const float* dt_bias = nullptr; // [n_v]
  float* S = nullptr;             // [n_v, d_k, d_v] fp32, in/out
  int n_k = 16, n_v = 32, d_k = 128, d_v = 128, kernel = 4;
  const float* norm_w = nullptr;  // [d_v] gated RMSNorm weight (linear_attn.norm, plain multiplier)
  float eps = 1e-6f;
  __half* out = nullptr;          // [T, n_v * d_v]: norm_w * o / RMS(o_head) * silu(z)
  void* scratch = nullptr;        // gdn_prefill_scratch_bytes(...) bytes
  size_t scratch_bytes = 0;
  // The recurrence's kernels, for benchmarks and tests (gdn_prefill.cu). 1-6, the sequential scan: 1, 2, 3: the 32
  // lanes of a warp span d_k, 2, 4 or 8 columns per warp; 4, 5, 6: 4, 8 or 16 lanes per column. 7-10: the chunked
  // (WY / UT-transform) formulation on the tensor cores (needs d_v = d_k), 4 or 8 warps per 32 columns of S:
  // 7, 8 in tf32 (~1e-2 of the head's RMS off), 9, 10 in 3xTF32 (fp32 accuracy). 11, 12: the chunked path split
  // (flash-linear-attention's fwd_h / fwd_o) into a serial pass that only carries the state (storing each chunk's
  // start state and V') and a fully parallel output pass; 11 in 3xTF32 (8 warps), 12 in tf32 (4 warps); the same
  // arithmetic as 9, 10 and 7, 8 (11 is bit-identical to 10; at 4K rows 0.96 vs 1.03 ms a layer on the H200).
  // 13, 14: 11 with the state pass's 3xTF32 correction products (lo*hi, hi*lo) in accumulators of their own, added
  // once per product (three independent mma per k-step, not a chain of three; fp32-class, not bit-identical to 11),
  // 8 warps (13) or 4 (14). Opt-in, UNVERIFIED ON GPU.
  // 0, the default (crossovers measured on the H200) when d_v = d_k: 5 below 256 rows, 10 below 512, then 11; else 5.
  int scan_variant = 0;
};

// Rows per chunk of the chunked formulation (variants 7-14): the split chunked path stores the state at every
// multiple of it.
constexpr int kGdnPrefillChunkRows = 64;

size_t gdn_prefill_scratch_bytes(int T, int n_k, int n_v, int d_k, int d_v);
cudaError_t gdn_prefill(const GdnPrefillParams& p, cudaStream_t stream);

// Whether gdn_prefill(p) runs the split chunked path (variants 11-14, given or chosen by length; d_k = d_v), which
// leaves every chunk's start state in its scratch for gdn_prefill_checkpoint.
bool gdn_prefill_stores_chunk_states(const GdnPrefillParams& p);

// The conv ring and the state S as they were after the first `row` rows of the gdn_prefill(p) call just enqueued on
// `stream` (before anything else writes p.scratch), without a second scan: S from the chunk-start state the scan
// stored in scratch (hs[row / 64], fp32 [n_v, d_k, d_v], S's own layout; the very values the scan carried, so equal
// to the final S of a call of only those rows, bit for bit), the ring's `kernel` slots from proj rows row-kernel ..
// row-1 (position pos0 + t in slot (pos0 + t) % kernel, as gdn_norm writes them). Into S_out [n_v, d_k, d_v] and
// ring_out [kernel, conv_dim]: device-to-device copies of n_v * d_k * d_v * 4 bytes (2 MiB at full geometry) and
// kernel * conv_dim * 4 (128 KB). Needs gdn_prefill_stores_chunk_states(p) and `row` a multiple of 64 with
// 0 < row < p.T; cudaErrorInvalidValue otherwise.
cudaError_t gdn_prefill_checkpoint(const GdnPrefillParams& p, int row, float* S_out, float* ring_out,
                                   cudaStream_t stream);

}  // namespace lily::cuda
