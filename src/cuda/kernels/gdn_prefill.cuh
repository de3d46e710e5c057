// Gated DeltaNet prefill (eqs 13-19 of docs/MODEL.md) for T rows of one layer, from the fused input projection to the
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
// the chunk-start states of GdnScan::chunked_split: ceil(T / 64) * n_v * d_k * d_v * 4 bytes,
// 2 MiB per 64 rows at full geometry (128 MiB at T = 4096), reserved whichever scan runs.
#pragma once
#include <cuda_fp16.h>

#include "cuda/kernels/common.cuh"

namespace lily::cuda {

// The gated delta rule's scans over the T rows (eq 18). All give the same results to fp32 rounding.
enum class GdnScan : int {
  by_length,      // the default: sequential below 256 rows; from 256 chunked_wgmma where wgmma_built(), elsewhere
                  // chunked below 512 and chunked_split from 512 (d_k = d_v; else sequential); crossovers measured
                  // on the H200 (gdn_prefill.cu)
  sequential,     // row by row with S in registers, 8 lanes a column (gdn_scan_rows.cu)
  chunked,        // chunks of 64 rows in the WY / UT-transform form on the tensor cores, 3xTF32 (gdn_chunk_scan.cu)
  chunked_split,  // as chunked, split into a serial state pass and a parallel output pass (gdn_chunk_state.cu)
  chunked_wgmma,  // as chunked_split, the state pass on warpgroup MMAs (Hopper only: wgmma_built())
};

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
  GdnScan scan = GdnScan::by_length;  // the recurrence's kernels (tests name one; the engine takes the default)
};

size_t gdn_prefill_scratch_bytes(int T, int n_k, int n_v, int d_k, int d_v);
cudaError_t gdn_prefill(const GdnPrefillParams& p, cudaStream_t stream);

// The scan gdn_prefill(p) runs (p.scan, or for by_length the default by length) and its name.
GdnScan scan_for(const GdnPrefillParams& p);
const char* scan_name(GdnScan s);

}  // namespace lily::cuda
