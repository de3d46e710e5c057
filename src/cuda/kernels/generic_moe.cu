// Generic MoE decode kernels (generic.cuh), the semantics of moe.cuh (eqs 21-25) for any geometry:
//  moe_route_generic: route_logits_kernel: each block normalises h into shared memory (eqs 1-2; block 0 also
//    writes x), a warp per row computes the router logits (rows 0..E-1) and the shared-expert gate (row E,
//    sigmoid applied); route_select_kernel (one block): fp32 softmax over E, rank of every expert (the number of
//    experts with a larger probability, or an equal one and a lower index: ties -> lower index), the top_k with
//    weights renormalised over them (eq 22). Two launches instead of the fast kernel's last-block ticket, so
//    `counter` is never touched.
//  moe_expert_in_generic: grid (row tiles of I, slot 0..top_k; slot top_k = the shared expert), a warp per row
//    r: act[slot, r] = silu(W_gate[e] x)[r] * (W_up[e] x)[r] (eq 23 inner part), x staged in shared memory.
//  moe_expert_out_generic: a warp per output row r of H: h[r] += sum_s w_s (W_down[e_s] act[s])[r]
//    + sg * (W_sdown act[top_k])[r], slots summed in a fixed order (eqs 23-25 and the residual add).
// Bytes moved as the fast kernels (moe.cu header), with 4-byte loads; for the small synthetic geometries.
#include <algorithm>

#include "cuda/kernels/generic.cuh"
#include "cuda/kernels/generic_util.cuh"

namespace lily::cuda {

namespace {

constexpr int kMaxTopK = 16;
constexpr int kMaxExperts = 4096;  // probabilities in shared memory (16 KiB)

// ---- moe_route -----------------------------------------------------------------------------------------------

__global__ void __launch_bounds__(gen::kThreads) route_logits_kernel(const __grid_constant__ MoeRouteParams p) {
  extern __shared__ float x_s[];  // [H]
  __shared__ float red_s[32];
  const int hidden = p.router.cols, n_experts = p.router.rows, lane = threadIdx.x & 31;
  float ss = 0.0f;
  for (int e = threadIdx.x; e < hidden; e += blockDim.x) ss += p.h[e] * p.h[e];
  const float inv = 1.0f / sqrtf(gen::block_sum(ss, red_s) / static_cast<float>(hidden) + p.eps);
  for (int e = threadIdx.x; e < hidden; e += blockDim.x) {
    x_s[e] = p.h[e] * inv * p.norm_w[e];
    if (blockIdx.x == 0) p.x[e] = x_s[e];
  }
  __syncthreads();
  const int row = blockIdx.x * gen::kWarps + (threadIdx.x >> 5);
  if (row < n_experts) {
    const float logit = gen::qrow_dot(p.router, row, x_s, lane);
    if (lane == 0) p.logits[row] = logit;
  } else if (row == n_experts) {
    const float logit = gen::qrow_dot(p.shared_gate, 0, x_s, lane);
    if (lane == 0) *p.shared_gate_value = gen::sigmoid_exact(logit);
  }
}

__global__ void __launch_bounds__(gen::kThreads) route_select_kernel(const __grid_constant__ MoeRouteParams p) {
  extern __shared__ float prob_s[];  // [E]
  __shared__ float red_s[32];
  __shared__ int sel_idx[kMaxTopK];
  __shared__ float sel_p[kMaxTopK];
  const int n_experts = p.router.rows;
  if (threadIdx.x < kMaxTopK) sel_idx[threadIdx.x] = 0, sel_p[threadIdx.x] = 0.0f;  // NaN logits: valid ids
  float local_max = -INFINITY;
  for (int e = threadIdx.x; e < n_experts; e += blockDim.x) local_max = fmaxf(local_max, prob_s[e] = p.logits[e]);
  const float max_logit = gen::block_max(local_max, red_s);
  float local_sum = 0.0f;
  for (int e = threadIdx.x; e < n_experts; e += blockDim.x) local_sum += (prob_s[e] = expf(prob_s[e] - max_logit));
  const float inv_sum = 1.0f / gen::block_sum(local_sum, red_s);
  for (int e = threadIdx.x; e < n_experts; e += blockDim.x) prob_s[e] *= inv_sum;
  __syncthreads();
  for (int e = threadIdx.x; e < n_experts; e += blockDim.x) {
    const float pe = prob_s[e];
    int rank = 0;
    for (int o = 0; o < n_experts; ++o) rank += prob_s[o] > pe || (prob_s[o] == pe && o < e);
    if (rank < p.top_k) sel_idx[rank] = e, sel_p[rank] = pe;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float sum = 0.0f;
    for (int i = 0; i < p.top_k; ++i) sum += sel_p[i];
    for (int i = 0; i < p.top_k; ++i) p.topk_idx[i] = sel_idx[i], p.topk_w[i] = sel_p[i] / sum;
  }
}

// ---- moe_expert_in -------------------------------------------------------------------------------------------

__global__ void __launch_bounds__(gen::kThreads) expert_in_kernel(const __grid_constant__ MoeExpertInParams p) {
  extern __shared__ float x_s[];  // [H]
  const int hidden = p.gate.cols, n_rows = p.gate.rows, slot = blockIdx.y, lane = threadIdx.x & 31;
  for (int e = threadIdx.x; e < hidden; e += blockDim.x) x_s[e] = p.x[e];
  __syncthreads();
  const bool shared = slot == p.top_k;
  const int expert = shared ? 0 : p.topk_idx[slot];
  const QMatrix gate = shared ? p.shared_gate : p.gate.expert(expert);
  const QMatrix up = shared ? p.shared_up : p.up.expert(expert);
  for (int r = blockIdx.x * gen::kWarps + (threadIdx.x >> 5); r < n_rows; r += gridDim.x * gen::kWarps) {
    const float g = gen::qrow_dot(gate, r, x_s, lane), u = gen::qrow_dot(up, r, x_s, lane);
    if (lane == 0) p.act[static_cast<size_t>(slot) * n_rows + r] = gen::silu_exact(g) * u;
  }
}

// ---- moe_expert_out ------------------------------------------------------------------------------------------

__global__ void __launch_bounds__(gen::kThreads) expert_out_kernel(const __grid_constant__ MoeExpertOutParams p) {
  const int n_rows = p.down.rows, inter = p.down.cols, lane = threadIdx.x & 31;
  for (int r = blockIdx.x * gen::kWarps + (threadIdx.x >> 5); r < n_rows; r += gridDim.x * gen::kWarps) {
    float total = 0.0f;
    for (int s = 0; s < p.top_k; ++s) {
      const float* act = p.act + static_cast<size_t>(s) * inter;
      total += p.topk_w[s] * gen::qrow_dot(p.down.expert(p.topk_idx[s]), r, act, lane);
    }
    const float* act_shared = p.act + static_cast<size_t>(p.top_k) * inter;
    total += *p.shared_gate_value * gen::qrow_dot(p.shared_down, r, act_shared, lane);
    if (lane == 0) p.h[r] += total;
  }
}

bool is_q(const QMatrix& m, int bits, int rows, int cols) {  // moe.cu's check
  return m.w && m.scales && m.biases && m.bits == bits && m.rows == rows && m.cols == cols &&
         reinterpret_cast<uintptr_t>(m.w) % 16 == 0;
}

int row_blocks(int rows, int max_blocks) { return std::max(1, std::min((rows + gen::kWarps - 1) / gen::kWarps, max_blocks)); }

}  // namespace

// ---- predicates: the argument checks of moe_route / moe_expert_in / moe_expert_out in moe.cu -------------------

bool moe_fast_supported(const MoeRouteParams& p) {
  const int n_experts = p.router.rows, hidden = p.router.cols;
  if (!is_q(p.router, 8, n_experts, hidden) || !is_q(p.shared_gate, 8, 1, hidden)) return false;
  if (n_experts < 1 || n_experts > 1024 || hidden <= 0 || hidden % 512) return false;
  if (p.top_k < 1 || p.top_k > kMaxTopK || p.top_k > n_experts) return false;
  return p.h && p.norm_w && p.x && p.logits && p.counter && p.topk_idx && p.topk_w && p.shared_gate_value;
}

bool moe_fast_supported(const MoeExpertInParams& p) {
  const int n_rows = p.gate.rows, hidden = p.gate.cols;
  if (p.top_k < 1 || p.top_k > kMaxTopK || !p.x || !p.topk_idx || !p.act) return false;
  if (!is_q(p.gate, 4, n_rows, hidden) || !is_q(p.up, 4, n_rows, hidden)) return false;
  if (!is_q(p.shared_gate, 4, n_rows, hidden) || !is_q(p.shared_up, 4, n_rows, hidden)) return false;
  return hidden == 1024 || hidden == 2048 || hidden == 4096;
}

bool moe_fast_supported(const MoeExpertOutParams& p) {
  const int n_rows = p.down.rows, inter = p.down.cols;
  if (p.top_k < 1 || p.top_k > kMaxTopK || !p.act || !p.topk_idx || !p.topk_w || !p.shared_gate_value || !p.h) {
    return false;
  }
  if (!is_q(p.down, 4, n_rows, inter) || !is_q(p.shared_down, 4, n_rows, inter)) return false;
  return inter == 512 || inter == 1024;
}

// ---- launchers -----------------------------------------------------------------------------------------------

cudaError_t moe_route_generic(const MoeRouteParams& p, cudaStream_t stream) {
  const int n_experts = p.router.rows, hidden = p.router.cols;
  if (!gen::generic_q_ok(p.router, n_experts, hidden) || !gen::generic_q_ok(p.shared_gate, 1, hidden)) {
    return cudaErrorInvalidValue;
  }
  if (n_experts > kMaxExperts || p.top_k < 1 || p.top_k > kMaxTopK || p.top_k > n_experts) return cudaErrorInvalidValue;
  if (!p.h || !p.norm_w || !p.x || !p.logits || !p.topk_idx || !p.topk_w || !p.shared_gate_value) {
    return cudaErrorInvalidValue;
  }
  const size_t smem = static_cast<size_t>(hidden) * sizeof(float);
  if (smem > gen::kMaxDynSmemBytes) return cudaErrorInvalidValue;
  if (smem > 48 * 1024) {
    CUDA_TRY(cudaFuncSetAttribute(route_logits_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(smem)));
  }
  const int blocks = (n_experts + 1 + gen::kWarps - 1) / gen::kWarps;  // one warp per row, rows 0..E
  route_logits_kernel<<<blocks, gen::kThreads, smem, stream>>>(p);
  CUDA_TRY(cudaGetLastError());
  route_select_kernel<<<1, gen::kThreads, n_experts * sizeof(float), stream>>>(p);
  return cudaGetLastError();
}

cudaError_t moe_expert_in_generic(const MoeExpertInParams& p, cudaStream_t stream) {
  const int n_rows = p.gate.rows, hidden = p.gate.cols;
  if (p.top_k < 1 || p.top_k > kMaxTopK || !p.x || !p.topk_idx || !p.act) return cudaErrorInvalidValue;
  if (!gen::generic_q_ok(p.gate, n_rows, hidden) || !gen::generic_q_ok(p.up, n_rows, hidden)) {
    return cudaErrorInvalidValue;
  }
  if (!gen::generic_q_ok(p.shared_gate, n_rows, hidden) || !gen::generic_q_ok(p.shared_up, n_rows, hidden)) {
    return cudaErrorInvalidValue;  // the act layout [top_k + 1, I] needs Is == I
  }
  const size_t smem = static_cast<size_t>(hidden) * sizeof(float);
  if (smem > gen::kMaxDynSmemBytes) return cudaErrorInvalidValue;
  if (smem > 48 * 1024) {
    CUDA_TRY(cudaFuncSetAttribute(expert_in_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(smem)));
  }
  const dim3 grid(row_blocks(n_rows, 256), p.top_k + 1);
  expert_in_kernel<<<grid, gen::kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t moe_expert_out_generic(const MoeExpertOutParams& p, cudaStream_t stream) {
  const int n_rows = p.down.rows, inter = p.down.cols;
  if (p.top_k < 1 || p.top_k > kMaxTopK || !p.act || !p.topk_idx || !p.topk_w || !p.shared_gate_value || !p.h) {
    return cudaErrorInvalidValue;
  }
  if (!gen::generic_q_ok(p.down, n_rows, inter) || !gen::generic_q_ok(p.shared_down, n_rows, inter)) {
    return cudaErrorInvalidValue;
  }
  expert_out_kernel<<<row_blocks(n_rows, 1024), gen::kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace lily::cuda
