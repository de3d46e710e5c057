// Device helpers of the generic kernels (generic.cuh): block reductions, the CPU reference's exact sigmoid/SiLU,
// and a warp's dot product of one MLX-quantized row (any cols multiple of 64, 4 or 8 bits) with an fp32 vector.
// In namespace lily::cuda::gen so that they never collide with the fast kernels' helpers (quant_dot.cuh).
#pragma once
#include "cuda/kernels/common.cuh"

namespace lily::cuda::gen {

constexpr int kThreads = 256;  // block size of most generic kernels
constexpr int kWarps = kThreads / 32;
constexpr int kMaxDynSmemBytes = 200 * 1024;  // under the H100/H200 opt-in limit of 227 KiB per block
constexpr int kMaxDim = 4096;                 // head / state dims the attention and GDN kernels accept

#if defined(__CUDACC__)

// As lily::cpu::sigmoid / silu (expf, not __expf).
__device__ __forceinline__ float sigmoid_exact(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float silu_exact(float x) { return x * sigmoid_exact(x); }

// Block-wide sum and max (blockDim a multiple of 32); every thread gets the result. red_s: >= 32 floats; it may
// be reused right after the call returns (the leading barrier protects the previous call's readers).
__device__ __forceinline__ float block_sum(float v, float* red_s) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n_warps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) red_s[warp] = v;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < n_warps; ++w) total += red_s[w];
  return total;
}

__device__ __forceinline__ float block_max(float v, float* red_s) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n_warps = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) red_s[warp] = v;
  __syncthreads();
  float m = red_s[0];
  for (int w = 1; w < n_warps; ++w) m = fmaxf(m, red_s[w]);
  return m;
}

// This lane's share of row `row` of m times x (x: cols floats, shared or global memory). Lanes stride over the
// row's 32-bit words; each word lies inside one group of 64, so it takes one scale and one bias. Every weight
// is dequantised as in the CPU reference (value = scale * q + bias, fp32) before the multiply.
template <int BITS>
__device__ __forceinline__ float qrow_dot_lane(const QMatrix& m, size_t row, const float* x, int lane) {
  constexpr int kPerWord = 32 / BITS;
  constexpr uint32_t kMask = (1u << BITS) - 1;
  const int n_words = static_cast<int>(m.words_per_row());
  const uint32_t* w_row = m.w + row * m.words_per_row();
  const __nv_bfloat16* s_row = m.scales + row * m.groups_per_row();
  const __nv_bfloat16* b_row = m.biases + row * m.groups_per_row();
  float sum = 0.0f;
  for (int wi = lane; wi < n_words; wi += 32) {
    const uint32_t word = __ldg(w_row + wi);
    const int e0 = wi * kPerWord;
    const float s = __bfloat162float(s_row[e0 / 64]), b = __bfloat162float(b_row[e0 / 64]);
#pragma unroll
    for (int i = 0; i < kPerWord; ++i) {
      const float q = static_cast<float>((word >> (i * BITS)) & kMask);
      sum = fmaf(fmaf(s, q, b), x[e0 + i], sum);
    }
  }
  return sum;
}

// The whole warp's dot product of row `row` of m (4 or 8 bits) with x; every lane gets it.
__device__ __forceinline__ float qrow_dot(const QMatrix& m, size_t row, const float* x, int lane) {
  return warp_sum(m.bits == 8 ? qrow_dot_lane<8>(m, row, x, lane) : qrow_dot_lane<4>(m, row, x, lane));
}

#endif  // __CUDACC__

// Host side: a quantized matrix the generic kernels can read (4 or 8 bits, groups of 64, all pointers set).
inline bool generic_q_ok(const QMatrix& m, int rows, int cols) {
  return m.w && m.scales && m.biases && (m.bits == 4 || m.bits == 8) && m.rows == rows && m.cols == cols &&
         rows > 0 && cols > 0 && cols % 64 == 0;
}

}  // namespace lily::cuda::gen
