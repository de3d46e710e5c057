// Generic quantized GEMV for batch-1 decode (generic.cuh): y = W x (+ residual) for any MLX QMatrix [rows, cols]
// with cols a multiple of 64, 4 or 8 bits, x built from `in` by the prologue of gemv.cuh:
//   rms_norm:       x = in / RMS(in) * norm_w                                    (eqs 1-2, multiplier form)
//   gated_rms_norm: per head of head_dim: x = (norm_w * o / RMS(o_head)) * silu(z)   (eq 19)
// Each block builds x in shared memory (cols floats), then a warp per row (grid-stride) dots it with the row
// (generic_util.cuh qrow_dot). Memory-bound like the fast kernel (rows * (cols*bits/8 + cols/16) bytes) but
// with 4-byte loads and no pipelining: meant for the small synthetic geometries, not for speed.
#include <algorithm>

#include "cuda/kernels/generic.cuh"
#include "cuda/kernels/generic_util.cuh"
#include "cuda/kernels/quant_dot.cuh"

namespace lily::cuda {

namespace {

constexpr int kMaxBlocks = 2048;  // grid-stride beyond: each block re-does the (cheap) prologue

// x_s[0..cols) from p.in per the prologue. red_s: >= 32 floats.
__device__ void build_x_generic(const GemvParams& p, float* x_s, float* red_s) {
  const int cols = p.m.cols;
  if (p.prologue == GemvPrologue::rms_norm) {
    float ss = 0.0f;
    for (int e = threadIdx.x; e < cols; e += blockDim.x) ss += p.in[e] * p.in[e];
    const float inv = 1.0f / sqrtf(gen::block_sum(ss, red_s) / static_cast<float>(cols) + p.eps);
    for (int e = threadIdx.x; e < cols; e += blockDim.x) x_s[e] = p.in[e] * inv * p.norm_w[e];
  } else if (p.prologue == GemvPrologue::gated_rms_norm) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n_warps = blockDim.x >> 5, hd = p.head_dim;
    for (int head = warp; head * hd < cols; head += n_warps) {  // a warp per head
      const float* o = p.in + static_cast<size_t>(head) * hd;
      float ss = 0.0f;
      for (int d = lane; d < hd; d += 32) ss += o[d] * o[d];
      const float inv = 1.0f / sqrtf(warp_sum(ss) / static_cast<float>(hd) + p.eps);
      for (int d = lane; d < hd; d += 32) {
        const int e = head * hd + d;
        x_s[e] = (o[d] * inv * p.norm_w[d]) * gen::silu_exact(p.gate_z[e]);
      }
    }
  } else {
    for (int e = threadIdx.x; e < cols; e += blockDim.x) x_s[e] = p.in[e];
  }
  __syncthreads();
}

__global__ void __launch_bounds__(gen::kThreads) gemv_generic_kernel(const __grid_constant__ GemvParams p) {
  const trace::BlockTrace trace_block(trace::kGemv);
  extern __shared__ float x_s[];  // [cols]
  __shared__ float red_s[32];
  build_x_generic(p, x_s, red_s);
  const int lane = threadIdx.x & 31;
  for (int row = blockIdx.x * gen::kWarps + (threadIdx.x >> 5); row < p.m.rows; row += gridDim.x * gen::kWarps) {
    const float dot = gen::qrow_dot(p.m, row, x_s, lane);
    if (lane == 0) p.y[row] = (p.residual ? p.residual[row] : 0.0f) + dot;  // residual may alias y: same thread
  }
}

}  // namespace

// The argument checks of gemv() in gemv.cu (valid_params): every shape it accepts runs on a fast path there.
bool gemv_fast_supported(const GemvParams& p) {
  const QMatrix& m = p.m;
  if (!m.w || !m.scales || !m.biases || !p.in || !p.y || m.rows <= 0 || m.cols <= 0 || m.cols % 512) return false;
  if (m.bits != 4 && m.bits != 8) return false;
  if (reinterpret_cast<uintptr_t>(m.w) % 16) return false;
  if (xpad_floats(m.cols) * sizeof(float) > 96 * 1024) return false;
  switch (p.prologue) {
    case GemvPrologue::none: return true;
    case GemvPrologue::rms_norm: return p.norm_w != nullptr;
    case GemvPrologue::gated_rms_norm: return p.norm_w && p.gate_z && p.head_dim > 0 && m.cols % p.head_dim == 0;
  }
  return false;
}

cudaError_t gemv_generic(const GemvParams& p, cudaStream_t stream) {
  const QMatrix& m = p.m;
  if (!gen::generic_q_ok(m, m.rows, m.cols) || !p.in || !p.y) return cudaErrorInvalidValue;
  const size_t smem = static_cast<size_t>(m.cols) * sizeof(float);
  if (smem > gen::kMaxDynSmemBytes) return cudaErrorInvalidValue;
  switch (p.prologue) {
    case GemvPrologue::none: break;
    case GemvPrologue::rms_norm:
      if (!p.norm_w) return cudaErrorInvalidValue;
      break;
    case GemvPrologue::gated_rms_norm:
      if (!p.norm_w || !p.gate_z || p.head_dim <= 0 || m.cols % p.head_dim) return cudaErrorInvalidValue;
      break;
    default: return cudaErrorInvalidValue;
  }
  if (smem > 48 * 1024) {
    CUDA_TRY(cudaFuncSetAttribute(gemv_generic_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(smem)));
  }
  const int blocks = std::min((m.rows + gen::kWarps - 1) / gen::kWarps, kMaxBlocks);
  gemv_generic_kernel<<<blocks, gen::kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace lily::cuda
