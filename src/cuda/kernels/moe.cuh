// MoE decode (eqs 21-25) in three kernels, all device-side (no host synchronisation):
//  moe_route:      x = RMSNorm(h) * norm_w; router logits (8-bit [E, H]) and the shared-expert gate logit
//                  (8-bit [1, H]); fp32 softmax over E, top-k (ties -> lower index), renormalised weights,
//                  sg = sigmoid(shared gate logit). Moves E*H + H bytes (8-bit) plus scales.
//  moe_expert_in:  for the k routed experts and the shared expert: act[s] = silu(W_gate x) * (W_up x), [k+1, I];
//                  no gate/up intermediate in device memory. Moves (k+1) * 2 * I * H / 2 bytes (4-bit) + scales.
//  moe_expert_out: h[r] += sum_s w_s * (W_down[e_s] act[s])[r] + sg * (W_sdown act[k])[r]: the down projections,
//                  routing weights, shared-expert sigmoid gate and the residual add. Moves (k+1) * H * I / 2 bytes.
// Selection in the expert kernels (router_logits set, n_experts <= 256): moe_route only writes the logits, x and
// the shared gate (select_top_k = false), and each block of moe_expert_in / moe_expert_out takes the softmax and
// top-k itself from the logits (the same code, so every block makes the same choice). That removes moe_route's
// cross-block step (fence, atomic ticket, a last block that reads all logits back) from the critical path, and
// lets moe_expert_out fetch its routed down-projection weights before moe_expert_in has finished: it reads the
// logits before waiting on its predecessor, which is safe because moe_expert_in signals its dependents only after
// its own wait, i.e. once moe_route has completed. So the three launches must follow each other on one stream.
// moe_fused (moe_fused.cu; opt-in, CudaBackendOptions::moe_fused): the same block as ONE persistent kernel whose
// phase boundaries are grid-wide barriers instead of kernel boundaries: A = moe_route's logits and shared gate plus
// the shared expert's gate/up rows, B = selection in every block and the routed gate/up rows, C = moe_expert_out.
// The router and selection device code below is shared by moe.cu and moe_fused.cu, so both choose the same experts.
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
  // Optional, with router_logits: the selection (expert ids and renormalised weights, slot order) is also written
  // here, by one block, so that moe_expert_out can read it after its wait instead of selecting itself.
  int* topk_idx_out = nullptr;   // [top_k]
  float* topk_w_out = nullptr;   // [top_k]
};

struct MoeExpertOutParams {
  QMatrix down;                 // stacked [E, H, I]
  QMatrix shared_down;          // [H, I]
  const float* act = nullptr;   // [top_k + 1, I]
  const int* topk_idx = nullptr;
  const float* topk_w = nullptr;
  const float* shared_gate_value = nullptr;
  int top_k = 8;
  float* h = nullptr;           // [H] in/out residual stream
  const float* router_logits = nullptr;  // optional [n_experts]: select from these (topk_idx/topk_w unused)
  int n_experts = 0;                     // with router_logits, <= 256
};

// One persistent kernel for the whole MoE block (eqs 1-2 of post_attention_layernorm, 21-25), moe_fused.cu:
//  phase A: every block normalises h into shared memory; the warps share the E router rows, the shared-expert gate
//           row (-> logits, shared gate value) and the shared expert's gate/up rows (-> act row top_k);
//  barrier; phase B: every block selects the experts from the logits (warp_route_top_k) and the warps share the
//           routed gate/up rows (-> act rows 0..top_k-1);
//  barrier; phase C: a warp owns 32 / (I / 32) output rows: its lanes dot all top_k + 1 down rows with act,
//           weight them (routing weights, sigmoid shared gate) in slot order, reduce, and one lane adds the result
//           to h. Each element of h is written by one thread, in a fixed order.
// Moves the same bytes as the three kernels: ~16.5 MB a layer at E 256, H 2048, I 512, top-8.
// The barrier (arrive counter whose top bit flips when the last block arrives: cooperative groups' grid sync)
// needs every block resident at once: the launcher sizes the grid from the occupancy API (grid_blocks = 0) and
// refuses larger grids. Shapes: H in {1024, 2048, 4096}, I = Is in {256, 512, 1024}, E <= 256, top_k <= 16,
// router and shared gate row 8-bit, experts 4-bit.
struct MoeFusedParams {
  QMatrix router;                        // 8-bit [E, H]
  QMatrix shared_gate_row;               // 8-bit [1, H]: the shared-expert gate logit
  QMatrix gate, up;                      // stacked [E, I, H] 4-bit (use .expert(e))
  QMatrix down;                          // stacked [E, H, I] 4-bit
  QMatrix shared_gate, shared_up;        // [I, H] 4-bit
  QMatrix shared_down;                   // [H, I] 4-bit
  float* h = nullptr;                    // [H] in/out residual stream
  const float* norm_w = nullptr;         // [H] post_attention_layernorm multiplier
  float eps = 1e-6f;
  int top_k = 8;
  float* logits = nullptr;               // scratch [E]
  float* shared_gate_value = nullptr;    // scratch [1]
  float* act = nullptr;                  // scratch [top_k + 1, I], 16-byte aligned
  unsigned* barrier = nullptr;           // one counter, zero before the first launch; every launch leaves it as found
  int* topk_idx = nullptr;               // optional out [top_k]: the selection (written by block 0)
  float* topk_w = nullptr;               // optional out [top_k]
  int grid_blocks = 0;                   // 0: every block that can be resident at once; else at most that many
};

// Decode, on the step's prefetch branch (CudaBackendOptions::decode_prefetch 3), forked after moe_route: selects
// the experts from the router logits as the expert kernels do (warp_route_top_k) and asks the L2 for their down
// matrices (evict_last) while moe_expert_in runs, so that moe_expert_out finds them there. One block of 128
// threads at the lowest stream priority. Moves top_k * H * (I/2 + I/16) bytes from DRAM into the L2 (4.7 MB at
// k = 8, H = 2048, I = 512); writes nothing. E <= 256, top_k <= 16; cudaErrorInvalidValue otherwise.
struct MoePrefetchDownParams {
  const float* logits = nullptr;  // [E], written by moe_route
  int top_k = 8;
  QMatrix down;                   // stacked [E, H, I] 4-bit (use .expert(e))
  int n_experts = 0;
};
cudaError_t moe_prefetch_down(const MoePrefetchDownParams& p, cudaStream_t stream);

cudaError_t moe_route(const MoeRouteParams& p, cudaStream_t stream);
cudaError_t moe_expert_in(const MoeExpertInParams& p, cudaStream_t stream);
cudaError_t moe_expert_out(const MoeExpertOutParams& p, cudaStream_t stream);

// Whether moe_fused takes p's shapes, bits and pointers (everything its launcher checks except the grid size).
bool moe_fused_supported(const MoeFusedParams& p);
cudaError_t moe_fused(const MoeFusedParams& p, cudaStream_t stream);

// ---- routing device code shared by moe.cu and moe_fused.cu -----------------------------------------------------
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
