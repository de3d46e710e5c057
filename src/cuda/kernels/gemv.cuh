// Row-parallel quantized GEMV for batch-1 decode: y = W x (+ residual), W an MLX 4-bit (or 8-bit) QMatrix.
// Memory-bound: moves rows * (cols/2 + cols/16) bytes for 4-bit (weights + bf16 scales/biases); target >= 85% of
// 4.27 TB/s on large matrices. 16-byte coalesced weight loads, dequantisation in registers, warp reductions.
// An optional prologue builds x from the raw input in the same kernel:
//   rms_norm:       x = in / RMS(in) * norm_w                         (eqs 1-2, multiplier form)
//   gated_rms_norm: per head of head_dim: x = norm_w * o / RMS(o) * silu(z)   (eq 19; in = o, gate_z = z)
#pragma once
#include "cuda/kernels/common.cuh"
#if defined(__CUDACC__)
#include "cuda/kernels/quant_dot.cuh"
#endif

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
  // Several activation rows against the same weights (gemv_rows): row r reads in + r * in_stride (and
  // gate_z + r * z_stride) and writes y + r * out_stride (residual likewise); n_rows <= kMaxBatchRows.
  int n_rows = 1;
  int in_stride = 0, z_stride = 0, out_stride = 0;  // floats
};

cudaError_t gemv(const GemvParams& p, cudaStream_t stream);
// p.n_rows rows at once: the weights are read once for all rows, and each row's result is bit-identical to
// gemv() of that row alone (the same prologue reduction, dot products and reduction order per row). Where the
// several-row kernel does not take the shape, one gemv() per row.
cudaError_t gemv_rows(const GemvParams& p, cudaStream_t stream);
// Row r of a several-row p as a one-row GemvParams.
inline GemvParams gemv_row(const GemvParams& p, int r) {
  GemvParams one = p;
  one.n_rows = 1;
  one.in = p.in + static_cast<size_t>(r) * p.in_stride;
  if (p.gate_z) one.gate_z = p.gate_z + static_cast<size_t>(r) * p.z_stride;
  if (p.residual) one.residual = p.residual + static_cast<size_t>(r) * p.out_stride;
  one.y = p.y + static_cast<size_t>(r) * p.out_stride;
  return one;
}

#if defined(__CUDACC__)
// ---- 4-bit chunk device code of gemv.cu -----------------------------------------------------------------------
namespace gemv_q4 {

constexpr int kChunkWeights = 8192;      // a chunk: 8192 / cols consecutive rows
constexpr int kChunkWeightBytes = 4096;  // 8192 4-bit weights
constexpr int kChunkScaleBytes = 256;    // their 128 bf16 scales (and as many biases)
constexpr int kStageBytes = kChunkWeightBytes + 2 * kChunkScaleBytes;
constexpr int kStages = 2;

// Copies chunk `chunk` into `stage`: lane j copies the 8 weight vectors it will read, lanes 0-15 the scales and
// 16-31 the biases (16 B each). Rows past the end are zero-filled.
template <int COLS>
__device__ __forceinline__ void issue_chunk(const QMatrix& m, int chunk, int lane, char* stage) {
  using Lay = Q4Layout<COLS>;
  const int j = lane % Lay::kLanesPerRow, sub = lane / Lay::kLanesPerRow;
  const char* w_chunk = reinterpret_cast<const char*>(m.w) + static_cast<size_t>(chunk) * kChunkWeightBytes;
#pragma unroll
  for (int pass = 0; pass < Lay::kPasses; ++pass) {
    const int r = pass * Lay::kRowsPerPass + sub;
    const bool valid = chunk * Lay::kRowsPerChunk + r < m.rows;
#pragma unroll
    for (int v = 0; v < Lay::kVecsPerLane; ++v) {
      const int piece = r * Lay::kVecsPerRow + v * Lay::kLanesPerRow + j;
      cp_async_16(stage + piece * 16, valid ? w_chunk + piece * 16 : w_chunk, valid);
    }
  }
  const int piece = lane & 15;  // 8 groups = 16 bytes of scales
  const bool valid = chunk * Lay::kRowsPerChunk + piece * 8 / (COLS / 64) < m.rows;
  const __nv_bfloat16* src = (lane < 16 ? m.scales : m.biases) + static_cast<size_t>(chunk) * (kChunkScaleBytes / 2);
  cp_async_16(stage + kChunkWeightBytes + (lane < 16 ? 0 : kChunkScaleBytes) + piece * 16,
              valid ? src + piece * 8 : src, valid);
}

// part[pass] = this lane's share of row(pass) . x from a chunk in shared memory.
template <int COLS>
__device__ __forceinline__ void dot_stage(const char* stage, const float* x_s, int lane,
                                          float (&part)[Q4Layout<COLS>::kPasses]) {
  using Lay = Q4Layout<COLS>;
  const int j = lane % Lay::kLanesPerRow, sub = lane / Lay::kLanesPerRow;
  const unsigned short* s_s = reinterpret_cast<const unsigned short*>(stage + kChunkWeightBytes);
  const unsigned short* b_s = s_s + kChunkScaleBytes / 2;
#pragma unroll
  for (int pass = 0; pass < Lay::kPasses; ++pass) part[pass] = 0.0f;
#pragma unroll
  for (int v = 0; v < Lay::kVecsPerLane; ++v) {
    float x[32];
    const int vec = v * Lay::kLanesPerRow + j;
    const float x_sum = load_x_vec(x_s, vec, x);
#pragma unroll
    for (int pass = 0; pass < Lay::kPasses; ++pass) {
      const int r = pass * Lay::kRowsPerPass + sub;
      const uint4 w = *reinterpret_cast<const uint4*>(stage + (r * Lay::kVecsPerRow + vec) * 16);
      const int g = r * (COLS / 64) + vec / 2;
      part[pass] += q4_group_term(dot_q4_vec(w, x), x_sum, s_s[g], b_s[g]);
    }
  }
}

// The output row of this lane in chunk `chunk` after group_reduce_scatter, and whether the lane writes it.
template <int COLS>
__device__ __forceinline__ int out_row(int chunk, int lane) {
  using Lay = Q4Layout<COLS>;
  const int j = lane % Lay::kLanesPerRow, sub = lane / Lay::kLanesPerRow;
  return chunk * Lay::kRowsPerChunk + (j / Lay::kLanesPerValue) * Lay::kRowsPerPass + sub;
}
template <int COLS>
__device__ __forceinline__ bool writes_row(int lane) {
  return (lane % Q4Layout<COLS>::kLanesPerRow) % Q4Layout<COLS>::kLanesPerValue == 0;
}

// Issues the loads of chunk `chunk` for this lane (rows past the end load nothing).
template <int COLS>
__device__ __forceinline__ void load_chunk(const QMatrix& m, int chunk, int lane, Q4Chunk<COLS>& c) {
  using Lay = Q4Layout<COLS>;
  const int j = lane % Lay::kLanesPerRow, sub = lane / Lay::kLanesPerRow;
#pragma unroll
  for (int pass = 0; pass < Lay::kPasses; ++pass) {
    const int row = chunk * Lay::kRowsPerChunk + pass * Lay::kRowsPerPass + sub;
    c.load(pass, m, row, row < m.rows, j);
  }
}

}  // namespace gemv_q4
#endif  // __CUDACC__

}  // namespace lily::cuda
