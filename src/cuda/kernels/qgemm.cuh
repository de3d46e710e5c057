// Prefill matrix path: fused-dequant GEMM on tensor cores (the MoE block for many rows is moe_prefill.cuh).
//
// qgemm:        C[M, N] = A[M, K] . W[N, K]^T with A fp16 row-major activations and W an MLX affine QMatrix (4- or
//               8-bit, group 64): each weight tile is expanded to fp16 in shared memory once and multiplied against
//               the activation rows with mma.sync (fp32 accumulation). The fp16 weight array never exists in device
//               memory. Does 2*M*N*K FLOPs; moves N*K*bits/8 weight bytes (+ scales/biases) and M*K*2 + M*N*4 bytes.
// qgemm_swiglu: act[M, I] = silu(A W_gate^T) * (A W_up^T), fp16 out (eq 23/25's expert input), one kernel.
// Shapes: K a multiple of 64; any M >= 1 and N >= 1 (tails handled). Launchers return cudaErrorInvalidValue for
// shapes they do not take, never crash.
#pragma once
#include <cuda_fp16.h>

#include "cuda/kernels/common.cuh"

namespace lily::cuda {

enum class GemmOut : int {
  f32 = 0,      // c is float[M, ldc]: C = A W^T
  f16 = 1,      // c is fp16 [M, ldc]
  add_f32 = 2,  // c is float[M, ldc]: C += A W^T (the residual add)
};

struct QGemmParams {
  QMatrix w;                            // [N, K]
  const __half* a = nullptr;     // [M, K] row-major
  int M = 0;
  GemmOut out = GemmOut::f32;
  void* c = nullptr;
  int ldc = 0;                          // row stride of c in elements; 0 means N
  // true: the Hopper warpgroup-MMA kernel (qgemm_wgmma.cu; only where wgmma_built(), else
  // cudaErrorInvalidDeviceFunction); false: the mma.sync kernel (every GPU from sm_80).
  bool use_wgmma = false;
  // Split-K for small grids (qgemm_split_k_parts): with scratch of >= qgemm_split_scratch_bytes(...) bytes, a
  // GEMM whose tile grid would leave the SMs idle runs as S parts of K on the mma.sync tiles (whatever use_wgmma
  // says), the parts' fp32 results summed in the order 0..S-1 and written (f32, f16) or added (add_f32) to c by
  // one more launch (deterministic). nullptr, or too little scratch: never split.
  // Any M: where the rows past the last multiple of 128 would add a round of tile blocks on the SMs, the full
  // 128-row tiles and the tail rows run as two GEMMs (the tail on the mma.sync tiles, split-K where it can).
  void* split_scratch = nullptr;
  size_t split_scratch_bytes = 0;
  // With a 16-byte aligned buffer of >= qgemm_w16_halves(w) * 2 bytes here, the wgmma path runs a GEMM on W in fp16
  // whose producer only copies: bit-identical to the dequantising tiles (the same fp16 values). w16_expanded: the
  // buffer already holds W expanded by qgemm_expand_w16 (kept across calls); else each call first expands W into it.
  // The mma.sync path ignores both.
  __half* w16 = nullptr;
  size_t w16_bytes = 0;
  bool w16_expanded = false;
  // Test-only (the backend leaves it at 0): 0 lets the wgmma path choose its tiles' width (256 where
  // qgemm_util::wgmma_dense_wide, else 128); 128 or 256 forces it (anything else: cudaErrorInvalidValue), so that a
  // test can run both widths on grids of any size.
  int wgmma_tile_n = 0;
};
// The fp16 copy of W that qgemm_expand_w16 writes and QGemmParams::w16 reads, in halves: W's rows padded with zero
// rows up to a multiple of 256, as 32 KB tiles in tile order. Tile (b, kt) (rows 256 b .. 256 b + 255, columns
// 64 kt .. 64 kt + 63) starts at (b K / 64 + kt) 256 x 64 halves; row r of the tile is 128 bytes at 128 r, its
// 16-byte chunk c (columns 8 c .. 8 c + 7) at chunk c ^ (r & 7): the wgmma kernels' 128-byte swizzled shared-memory
// layout, so that a block's W tile of a step is 32 KB contiguous in global memory.
inline size_t qgemm_w16_halves(const QMatrix& w) {
  return static_cast<size_t>((w.rows + 255) / 256) * 256 * static_cast<size_t>(w.cols);
}
// W expanded to fp16 into w16 (qgemm_w16_halves(w) halves, 16-byte aligned, in that layout): the values qgemm's tiles
// compute (fp32 scale * q + bias rounded once), zeros in the padding rows; for QGemmParams::w16 with w16_expanded
// (Hopper builds; else cudaErrorInvalidDeviceFunction).
cudaError_t qgemm_expand_w16(const QMatrix& w, __half* w16, cudaStream_t stream);
// The parts qgemm splits K into for a GEMM of M rows by w given scratch (1: no split).
int qgemm_split_k_parts(int M, const QMatrix& w);
size_t qgemm_split_scratch_bytes(int M, const QMatrix& w);
// The tail rows qgemm runs as a GEMM of their own for M rows by w on the wgmma or the mma.sync tiles (0: none).
int qgemm_row_tail(int M, const QMatrix& w, bool wgmma);
// Its bound for any M and w: a split's parts times its 64 x 128 tiles stay <= 2 x 132 (4 bytes an element).
inline constexpr size_t kQgemmSplitScratchMax = size_t{4} * 2 * 132 * 64 * 128;

struct QGemmSwigluParams {
  QMatrix gate, up;                     // [I, K] each
  const __half* a = nullptr;     // [M, K]
  int M = 0;
  __half* act = nullptr;         // out [M, I]
};

cudaError_t qgemm(const QGemmParams& p, cudaStream_t stream);
// qgemm on wgmma whatever p.use_wgmma says (qgemm routes here when it is set): 128 x 256 (or 128 x 128) tiles,
// a producer warpgroup that loads and dequantises, two consumer warpgroups on wgmma.mma_async.
cudaError_t qgemm_wgmma(const QGemmParams& p, cudaStream_t stream);
cudaError_t qgemm_swiglu(const QGemmSwigluParams& p, cudaStream_t stream);


// out[t, :] = fp16(in[t, :] / RMS(in[t, :]) * w) for T rows of n (eqs 1-2 multiplier form; the A operand of a
// prefill GEMM), output rows out_stride elements apart (0: n); the _f32 form writes fp32 rows.
cudaError_t rms_norm_rows(const float* in, const float* w, int T, int n, float eps, __half* out,
                          cudaStream_t stream, int out_stride = 0);
cudaError_t rms_norm_rows_f32(const float* in, const float* w, int T, int n, float eps, float* out,
                              cudaStream_t stream, int out_stride = 0);

}  // namespace lily::cuda
