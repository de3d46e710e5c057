// MoE decode (eqs 21-25) in three kernels, all device-side (no host synchronisation):
//  moe_route:      x = RMSNorm(h) * norm_w; router logits (8-bit [E, H]) and the shared-expert gate logit
//                  (8-bit [1, H]); fp32 softmax over E, top-k (ties -> lower index), renormalised weights,
//                  sg = sigmoid(shared gate logit). Moves E*H + H bytes (8-bit) plus scales.
//  moe_expert_in:  for the k routed experts and the shared expert: act[s] = silu(W_gate x) * (W_up x), [k+1, I];
//                  no gate/up intermediate in device memory. Moves (k+1) * 2 * I * H / 2 bytes (4-bit) + scales.
//  moe_expert_out: h[r] += sum_s w_s * (W_down[e_s] act[s])[r] + sg * (W_sdown act[k])[r]: the down projections,
//                  routing weights, shared-expert sigmoid gate and the residual add. Moves (k+1) * H * I / 2 bytes.
// Selection in moe_expert_in (router_logits set, n_experts <= 256; the decode step does so where the expert
// kernels take the geometry): moe_route only writes the logits, x and the shared gate (select_top_k = false), each
// block of moe_expert_in takes the softmax and top-k itself from the logits (the same code, so every block makes the
// same choice) and one block writes the selection, which moe_expert_out reads after its wait. That removes
// moe_route's cross-block step (fence, atomic ticket, a last block that reads all logits back) from the critical
// path. The three launches must follow each other on one stream.
#pragma once
#include "cuda/kernels/common.cuh"
#if defined(__CUDACC__)
#include "cuda/kernels/quant_dot.cuh"  // the routing device code at the end
#endif

namespace lily::cuda {

struct MoeRouteParams {
  QMatrix router;       // 8-bit [E, H]
  QMatrix shared_gate;  // 8-bit [1, H]
  const float* h = nullptr;       // [H] residual stream
  const float* norm_w = nullptr;  // [H] post_attention_layernorm multiplier
  float eps = 1e-6f;
  int top_k = 8;                  // <= 16
  float* x = nullptr;             // out [H]: the normalised MoE input
  float* logits = nullptr;        // scratch [E]
  unsigned* counter = nullptr;    // scratch: one zero-initialised counter (left at zero after the kernel)
  int* topk_idx = nullptr;        // out [top_k]
  float* topk_w = nullptr;        // out [top_k]
  float* shared_gate_value = nullptr;  // out [1]: sigmoid(w_seg . x)
  bool select_top_k = true;  // false: logits, x and shared gate only (counter, topk_idx, topk_w unused)
};

struct MoeExpertInParams {
  QMatrix gate, up;                // stacked [E, I, H] 4-bit (use .expert(e))
  QMatrix shared_gate, shared_up;  // [Is, H]; this kernel requires Is == I
  const float* x = nullptr;        // [H]
  const int* topk_idx = nullptr;   // [top_k]
  int top_k = 8;
  float* act = nullptr;            // out [top_k + 1, I]; row top_k is the shared expert
  const float* router_logits = nullptr;  // optional [n_experts]: select from these, not from topk_idx
  int n_experts = 0;                     // with router_logits, <= 256
  // With router_logits: the selection (expert ids and renormalised weights, slot order) is written here by one
  // block, for moe_expert_out.
  int* topk_idx_out = nullptr;   // [top_k]
  float* topk_w_out = nullptr;   // [top_k]
};

struct MoeExpertOutParams {
  QMatrix down;                 // stacked [E, H, I]
  QMatrix shared_down;          // [H, I]
  const float* act = nullptr;   // [top_k + 1, I]
  const int* topk_idx = nullptr;  // [top_k]: moe_route's or moe_expert_in's selection
  const float* topk_w = nullptr;  // [top_k]
  const float* shared_gate_value = nullptr;
  int top_k = 8;
  float* h = nullptr;           // [H] in/out residual stream
};

cudaError_t moe_route(const MoeRouteParams& p, cudaStream_t stream);
cudaError_t moe_expert_in(const MoeExpertInParams& p, cudaStream_t stream);
cudaError_t moe_expert_out(const MoeExpertOutParams& p, cudaStream_t stream);
// n <= kMaxBatchRows rows (tokens of different sequences) in one launch each (grid z = row), every row exactly as
// its single-row launch; the rows share the layer's weights.
cudaError_t moe_route_rows(const MoeRouteParams* rows, int n, cudaStream_t stream);
cudaError_t moe_expert_in_rows(const MoeExpertInParams* rows, int n, cudaStream_t stream);
cudaError_t moe_expert_out_rows(const MoeExpertOutParams* rows, int n, cudaStream_t stream);

// ---- routing device code (moe.cu) -------------------------------------------------------------------------------
#if defined(__CUDACC__)
inline constexpr int kRoutePrefetch = 4;  // 16-byte vectors per lane loaded before the prologue: all of H <= 2048

// One 16-byte vector (16 8-bit weights) of a router row against x (padded in shared memory).
__device__ __forceinline__ float router_vec(uint4 w, unsigned short s_bits, unsigned short b_bits, const float* x_s,
                                            int vec) {
  const int e0 = vec * kVecElems8;
  const float4* xv = reinterpret_cast<const float4*>(x_s + xpad(e0));
  float x[16];
  float x_sum = 0.0f;
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    const float4 v = xv[t];
    x[4 * t] = v.x, x[4 * t + 1] = v.y, x[4 * t + 2] = v.z, x[4 * t + 3] = v.w;
    x_sum += (v.x + v.y) + (v.z + v.w);
  }
  return bf16_bits_to_float(s_bits) * dot_q8_vec(w, x) + bf16_bits_to_float(b_bits) * x_sum;
}

// A warp's router row: vectors lane + 32 t; the first kRoutePrefetch per lane are fetched by route_prefetch.
struct RouterRow {
  uint4 w[kRoutePrefetch];
  unsigned short s[kRoutePrefetch], b[kRoutePrefetch];
};

__device__ __forceinline__ void route_prefetch(const QMatrix& m, int row, bool active, int lane, RouterRow& r) {
  const int n_vecs = m.cols / kVecElems8;
  const uint4* w_row = reinterpret_cast<const uint4*>(m.w + row * m.words_per_row());
  const size_t g_row = static_cast<size_t>(row) * m.groups_per_row();
#pragma unroll
  for (int t = 0; t < kRoutePrefetch; ++t) {
    const int vec = lane + 32 * t;
    const bool valid = active && vec < n_vecs;
    r.w[t] = valid ? ld_stream(w_row + vec) : make_uint4(0, 0, 0, 0);
    r.s[t] = valid ? ld_bf16_bits(m.scales + g_row + vec / 4) : 0;
    r.b[t] = valid ? ld_bf16_bits(m.biases + g_row + vec / 4) : 0;
  }
}

__device__ inline float router_dot(const QMatrix& m, int row, const RouterRow& r, const float* x_s, int lane) {
  const int n_vecs = m.cols / kVecElems8;
  float sum = 0.0f;
#pragma unroll
  for (int t = 0; t < kRoutePrefetch; ++t) {
    if (lane + 32 * t < n_vecs) sum += router_vec(r.w[t], r.s[t], r.b[t], x_s, lane + 32 * t);
  }
  const uint4* w_row = reinterpret_cast<const uint4*>(m.w + row * m.words_per_row());
  const size_t g_row = static_cast<size_t>(row) * m.groups_per_row();
  for (int vec = lane + 32 * kRoutePrefetch; vec < n_vecs; vec += 32) {  // H > 2048
    sum += router_vec(ld_stream(w_row + vec), ld_bf16_bits(m.scales + g_row + vec / 4),
                      ld_bf16_bits(m.biases + g_row + vec / 4), x_s, vec);
  }
  return warp_sum(sum);
}

// Lane r < top_k of the selecting warp: the expert of rank r and its renormalised routing weight.
struct RouteChoice {
  int idx;
  float weight;
};

// Eq 22 by one warp: p = softmax(logits) in fp32 (expf(l - max) * (1 / sum), as the block version before it), the
// top_k largest p with ties -> lower index, weights p / (sum of the k p in rank order), like cpu::route_top_k.
// Lane l holds experts l*PER_LANE .. +PER_LANE-1 (E <= 32 * PER_LANE). Each expert's key is (bits of p) << 32 |
// ~index: unique, and ordered like (p, -index) since p >= 0. A round takes the warp's largest key with two
// redux.sync maxima (high words, then low words of the lanes holding the highest) and removes it. Logits are read
// through L2: they were written by other blocks or kernels.
template <int PER_LANE>
__device__ inline RouteChoice warp_route_top_k(const float* logits, int n_experts, int top_k) {
  using u64 = unsigned long long;
  const int lane = threadIdx.x & 31;
  float v[PER_LANE];
  float local_max = -INFINITY;
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    const int e = lane * PER_LANE + i;
    v[i] = e < n_experts ? __ldcg(logits + e) : -INFINITY;
    local_max = fmaxf(local_max, v[i]);
  }
  const float max_logit = warp_max(local_max);
  float local_sum = 0.0f;
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    v[i] = lane * PER_LANE + i < n_experts ? expf(v[i] - max_logit) : 0.0f;
    local_sum += v[i];
  }
  const float inv_sum = 1.0f / warp_sum(local_sum);
  u64 key[PER_LANE];
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    const int e = lane * PER_LANE + i;
    key[i] = e < n_experts ? (u64{__float_as_uint(v[i] * inv_sum)} << 32) | ~static_cast<uint32_t>(e) : 0ull;
  }
  RouteChoice mine{0, 0.0f};
  float sum = 0.0f;
  for (int r = 0; r < top_k; ++r) {
    u64 best = key[0];
#pragma unroll
    for (int i = 1; i < PER_LANE; ++i) best = key[i] > best ? key[i] : best;
    const uint32_t hi = __reduce_max_sync(0xffffffffu, static_cast<uint32_t>(best >> 32));
    const uint32_t lo = __reduce_max_sync(
        0xffffffffu, static_cast<uint32_t>(best >> 32) == hi ? static_cast<uint32_t>(best) : 0u);
    const u64 win = (u64{hi} << 32) | lo;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) key[i] = key[i] == win ? 0ull : key[i];
    const float prob = __uint_as_float(hi);
    sum += prob;
    if (lane == r) mine = RouteChoice{static_cast<int>(~lo), prob};
  }
  mine.weight /= sum;
  return mine;
}
#endif  // __CUDACC__

}  // namespace lily::cuda
