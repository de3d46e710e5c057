// Row-parallel quantized GEMV for batch-1 decode: y = W x (+ residual), W an MLX 4-bit (or 8-bit) QMatrix.
// Memory-bound: moves rows * (cols/2 + cols/16) bytes for 4-bit (weights + bf16 scales/biases); target >= 85% of
// 4.27 TB/s on large matrices. 16-byte coalesced weight loads, dequantisation in registers, warp reductions.
// An optional prologue builds x from the raw input in the same kernel:
//   rms_norm:       x = in / RMS(in) * norm_w                         (eqs 1-2, multiplier form)
//   gated_rms_norm: per head of head_dim: x = norm_w * o / RMS(o) * silu(z)   (eq 19; in = o, gate_z = z)
#pragma once
#include "cuda/kernels/common.cuh"

namespace lily::cuda {

enum class GemvPrologue : int { none = 0, rms_norm = 1, gated_rms_norm = 2 };

struct GemvParams {
  QMatrix m;                   // [rows, cols]; cols in {512, 1024, 2048, 4096} (any multiple of 512 allowed)
  const float* in = nullptr;   // [cols]
  GemvPrologue prologue = GemvPrologue::none;
  const float* norm_w = nullptr;  // rms_norm: [cols]; gated_rms_norm: [head_dim]
  const float* gate_z = nullptr;  // gated_rms_norm: [cols]
  int head_dim = 128;             // gated_rms_norm
  float eps = 1e-6f;
  const float* residual = nullptr;  // optional, [rows]: y = residual + W x (may alias y)
  float* y = nullptr;               // [rows]
};

cudaError_t gemv(const GemvParams& p, cudaStream_t stream);

}  // namespace lily::cuda
