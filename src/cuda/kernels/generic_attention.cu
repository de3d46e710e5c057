// Generic gated attention for batch-1 decode (generic.cuh), the semantics of attention.cuh (eqs 9-12) for any
// head_dim and GQA group:
//  attn_prep_generic: one block per head (nq query heads, then nkv kv heads), threads stride over dims. q/k:
//    y = x * (1 / sqrt(mean x^2 + eps)) * w (eq 9), NeoX RoPE on dims 0..rotary_dim-1 with inv_freq rounded to fp32
//    from 1/theta^(2i/rot) in double and angle = float(pos) * inv_freq (eq 10, as the CPU reference); k and v go
//    to row *pos of the bf16 caches [max_ctx, nkv, D].
//  attn_decode_generic: grid (nq, n_splits), 4 warps. Block (j, s) takes query head j (kv head j / (nq/nkv)) and
//    cache rows [s*chunk, min((s+1)*chunk, n)), n = *pos + 1, chunk = ceil(n / n_splits). Warps take rows
//    round-robin: score = scale * q . k_r (warp reduction), online softmax (running max m, sum l) with the
//    warp's unnormalised o in shared memory; the warps merge and the block writes o [D] and (m, l), m in natural
//    units of the scaled scores; an empty range writes m = -inf, l = 0, o = 0 (as the fast kernel).
//    Reads each K/V row once per query head (group times the fast kernel's bytes): for small geometries.
//  attn_combine_generic: a block per query head: weights exp(m_s - M) per split, o = sum_s w_s o_s / sum_s w_s l_s,
//    times sigmoid(gate) (eq 12), gate of head j at proj[j*2*D + D + d].
#include <cmath>

#include "cuda/kernels/generic.cuh"
#include "cuda/kernels/generic_util.cuh"

namespace lily::cuda {

namespace {

constexpr int kMaxSplits = 4096;  // as the fast kernels
constexpr int kDecodeWarps = 4;

// ---- attn_prep -----------------------------------------------------------------------------------------------

__global__ void __launch_bounds__(gen::kThreads) attn_prep_generic_kernel(const __grid_constant__ AttnPrepParams p) {
  extern __shared__ float y_s[];  // [D]
  __shared__ float red_s[32];
  const int D = p.head_dim, b = blockIdx.x, pos = *p.pos;
  const bool is_q = b < p.nq;
  const int m = b - p.nq;  // kv head of the k/v blocks
  const float* src = is_q ? p.proj + static_cast<size_t>(b) * 2 * D
                          : p.proj + static_cast<size_t>(p.nq) * 2 * D + static_cast<size_t>(m) * D;
  const float* w = is_q ? p.q_norm : p.k_norm;
  float ss = 0.0f;
  for (int d = threadIdx.x; d < D; d += blockDim.x) ss += src[d] * src[d];
  const float inv = 1.0f / sqrtf(gen::block_sum(ss, red_s) / static_cast<float>(D) + p.eps);
  for (int d = threadIdx.x; d < D; d += blockDim.x) y_s[d] = src[d] * inv * w[d];
  __syncthreads();
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    const float y = rope_element(y_s, d, p.rotary_dim, p.rope_theta, pos);  // eq 10
    if (is_q) {
      p.q[static_cast<size_t>(b) * D + d] = y;
    } else {
      const size_t row = (static_cast<size_t>(pos) * p.nkv + m) * D + d;
      p.k_cache[row] = __float2bfloat16_rn(y);
      p.v_cache[row] = __float2bfloat16_rn(p.proj[static_cast<size_t>(p.nq) * 2 * D + static_cast<size_t>(p.nkv + m) * D + d]);
    }
  }
}

// ---- attn_decode ---------------------------------------------------------------------------------------------

__global__ void __launch_bounds__(kDecodeWarps * 32) attn_decode_generic_kernel(
    const __grid_constant__ AttnDecodeParams p) {
  extern __shared__ float smem[];  // q [D] (pre-scaled), o [kDecodeWarps][D]
  __shared__ float m_s[kDecodeWarps], l_s[kDecodeWarps];
  const int D = p.head_dim, j = blockIdx.x, split = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int kv_head = j / (p.nq / p.nkv);
  float* q_s = smem;
  float* o_w = smem + D + warp * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) q_s[d] = p.q[static_cast<size_t>(j) * D + d] * p.scale;
  for (int d = lane; d < D; d += 32) o_w[d] = 0.0f;
  __syncthreads();

  const int n = *p.pos + 1;
  const int chunk = (n + p.n_splits - 1) / p.n_splits;
  const int row_begin = min(split * chunk, n), row_end = min(row_begin + chunk, n);
  const size_t row_stride = static_cast<size_t>(p.nkv) * D;
  float m_run = -INFINITY, l_run = 0.0f;
  for (int r = row_begin + warp; r < row_end; r += kDecodeWarps) {
    const __nv_bfloat16* k_row = p.k_cache + r * row_stride + static_cast<size_t>(kv_head) * D;
    const __nv_bfloat16* v_row = p.v_cache + r * row_stride + static_cast<size_t>(kv_head) * D;
    float part = 0.0f;
    for (int d = lane; d < D; d += 32) part = fmaf(q_s[d], __bfloat162float(k_row[d]), part);
    const float score = warp_sum(part);
    const float m_new = fmaxf(m_run, score);
    const float alpha = m_run == -INFINITY ? 0.0f : expf(m_run - m_new);
    const float pr = expf(score - m_new);
    l_run = l_run * alpha + pr;
    for (int d = lane; d < D; d += 32) o_w[d] = o_w[d] * alpha + pr * __bfloat162float(v_row[d]);
    m_run = m_new;
  }
  if (lane == 0) m_s[warp] = m_run, l_s[warp] = l_run;
  __syncthreads();

  float mx = -INFINITY;
#pragma unroll
  for (int w = 0; w < kDecodeWarps; ++w) mx = fmaxf(mx, m_s[w]);
  float f[kDecodeWarps], l = 0.0f;
#pragma unroll
  for (int w = 0; w < kDecodeWarps; ++w) {
    f[w] = m_s[w] == -INFINITY ? 0.0f : expf(m_s[w] - mx);  // warps without rows contribute nothing
    l += f[w] * l_s[w];
  }
  const size_t head = static_cast<size_t>(split) * p.nq + j;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float o = 0.0f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) o += f[w] * smem[D + w * D + d];
    p.part_o[head * D + d] = o;
  }
  if (threadIdx.x == 0) p.part_ml[head * 2] = mx, p.part_ml[head * 2 + 1] = l;
}

// ---- attn_combine --------------------------------------------------------------------------------------------

__global__ void __launch_bounds__(gen::kThreads) attn_combine_generic_kernel(
    const __grid_constant__ AttnCombineParams p) {
  extern __shared__ float w_s[];  // [n_splits]: exp(m_s - M)
  __shared__ float red_s[32];
  const int j = blockIdx.x, D = p.head_dim;
  float mx = -INFINITY;
  for (int s = threadIdx.x; s < p.n_splits; s += blockDim.x) mx = fmaxf(mx, p.part_ml[(static_cast<size_t>(s) * p.nq + j) * 2]);
  mx = gen::block_max(mx, red_s);
  float l = 0.0f;
  for (int s = threadIdx.x; s < p.n_splits; s += blockDim.x) {
    const float* ml = p.part_ml + (static_cast<size_t>(s) * p.nq + j) * 2;
    const float w = ml[0] == -INFINITY ? 0.0f : expf(ml[0] - mx);  // empty splits weigh nothing
    w_s[s] = w;
    l += w * ml[1];
  }
  l = gen::block_sum(l, red_s);  // its barriers also publish w_s
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float o = 0.0f;
    for (int s = 0; s < p.n_splits; ++s) o += w_s[s] * p.part_o[(static_cast<size_t>(s) * p.nq + j) * D + d];
    const float gate = p.proj[static_cast<size_t>(j) * 2 * D + D + d];
    p.out[static_cast<size_t>(j) * D + d] = o / l * gen::sigmoid_exact(gate);
  }
}

}  // namespace

// ---- predicates: the argument checks of attn_prep / attn_decode / attn_combine in attention.cu -----------------

bool attn_fast_supported(const AttnPrepParams& p) {
  if (!p.proj || !p.q_norm || !p.k_norm || !p.pos || !p.q || !p.k_cache || !p.v_cache) return false;
  if (p.nq <= 0 || p.nkv <= 0 || p.head_dim <= 0 || p.head_dim > 1024 || p.head_dim % 32 != 0) return false;
  return p.rotary_dim >= 0 && p.rotary_dim % 2 == 0 && p.rotary_dim <= p.head_dim;
}

bool attn_fast_supported(const AttnDecodeParams& p) {
  if (!p.q || !p.k_cache || !p.v_cache || !p.pos || !p.part_o || !p.part_ml) return false;
  if (p.head_dim != 256 || p.nkv <= 0 || p.nq % p.nkv != 0 || p.nq / p.nkv > 8) return false;
  if (p.n_splits < 1 || p.n_splits > kMaxSplits) return false;
  return reinterpret_cast<uintptr_t>(p.q) % 16 == 0;
}

bool attn_fast_supported(const AttnCombineParams& p) {
  if (!p.part_o || !p.part_ml || !p.proj || !p.out) return false;
  if (p.nq <= 0 || p.head_dim <= 0 || p.head_dim % 32 != 0) return false;
  return p.n_splits >= 1 && p.n_splits <= kMaxSplits;
}

// ---- launchers -----------------------------------------------------------------------------------------------

cudaError_t attn_prep_generic(const AttnPrepParams& p, cudaStream_t stream) {
  if (!p.proj || !p.q_norm || !p.k_norm || !p.pos || !p.q || !p.k_cache || !p.v_cache) return cudaErrorInvalidValue;
  if (p.nq <= 0 || p.nkv <= 0 || p.head_dim <= 0 || p.head_dim > gen::kMaxDim) return cudaErrorInvalidValue;
  if (p.rotary_dim < 0 || p.rotary_dim % 2 != 0 || p.rotary_dim > p.head_dim) return cudaErrorInvalidValue;
  attn_prep_generic_kernel<<<p.nq + p.nkv, gen::kThreads, p.head_dim * sizeof(float), stream>>>(p);
  return cudaGetLastError();
}

cudaError_t attn_decode_generic(const AttnDecodeParams& p, cudaStream_t stream) {
  if (!p.q || !p.k_cache || !p.v_cache || !p.pos || !p.part_o || !p.part_ml) return cudaErrorInvalidValue;
  if (p.nq <= 0 || p.nkv <= 0 || p.nq % p.nkv != 0) return cudaErrorInvalidValue;
  if (p.head_dim <= 0 || p.head_dim > gen::kMaxDim || p.n_splits < 1 || p.n_splits > kMaxSplits) {
    return cudaErrorInvalidValue;
  }
  const size_t smem = static_cast<size_t>(1 + kDecodeWarps) * p.head_dim * sizeof(float);  // <= 80 KiB
  if (smem > 48 * 1024) {
    CUDA_TRY(cudaFuncSetAttribute(attn_decode_generic_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(smem)));
  }
  attn_decode_generic_kernel<<<dim3(p.nq, p.n_splits), kDecodeWarps * 32, smem, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t attn_combine_generic(const AttnCombineParams& p, cudaStream_t stream) {
  if (!p.part_o || !p.part_ml || !p.proj || !p.out) return cudaErrorInvalidValue;
  if (p.nq <= 0 || p.head_dim <= 0 || p.n_splits < 1 || p.n_splits > kMaxSplits) return cudaErrorInvalidValue;
  attn_combine_generic_kernel<<<p.nq, gen::kThreads, p.n_splits * sizeof(float), stream>>>(p);
  return cudaGetLastError();
}

}  // namespace lily::cuda
