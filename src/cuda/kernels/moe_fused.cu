// moe_fused (moe.cuh): the MoE decode block (eqs 1-2 for post_attention_layernorm, eqs 21-25) as ONE persistent
// kernel a layer instead of moe_route + moe_expert_in + moe_expert_out; the two phase boundaries are grid-wide
// barriers, not kernel boundaries (each of those cost ~3-4 us in the decode graph: docs/PERF_NOTES.md).
//
// Grid: every block that can be resident at once (occupancy API x SMs; 2 blocks of 256 threads per SM at <= 128
// registers), so a barrier never waits for a block that has no place to run. A warp's rank is
// warp * gridDim.x + block: consecutive ranks sit in different blocks, and unit u of a phase goes to rank
// u mod (warps in the grid), looping when there are more units than warps.
// Phase A, after the predecessor's wait: each block normalises h into shared memory with moe_route's code and
//   block size (the same x bits). Units: the E router rows and the shared-expert gate row (a warp a row,
//   router_dot: the same logit bits as moe_route), then the shared expert's (gate, up) row pairs (P/2 pairs a
//   warp, moe_expert_in's layout: the same act bits). A warp loads its first unit's weights before the wait and
//   prefetches into L2 the shared expert's down rows of its phase C units (no unit depends on the routing yet).
// Barrier 1; every block is resident now, so dependents may launch (griddepcontrol.launch_dependents).
// Phase B: warp 0 of each block selects the experts from the logits (warp_route_top_k, as the chain's kernels:
//   the same choice, ties -> lower index) into shared memory. Units: the routed (gate, up) row pairs, as in phase
//   A. A warp issues its unit's loads, then prefetches into L2 the routed down rows of its phase C units, so
//   that phase C reads L2 rather than DRAM after the second barrier.
// Barrier 2. Phase C: the block copies act into shared memory (padded like x, in x's space). A unit is 32 / L
//   output rows, L = I / 32 lanes a row: lane j loads vector j of its row of all top_k + 1 down matrices (the L2
//   hits in flight while act is copied), weights each slot's term (routing weight; sigmoid shared gate for the
//   shared slot) and sums them in slot order, the L lanes of a row reduce by a fixed butterfly, and one lane adds
//   the total to h[row]: every element of h is written by one thread, in a fixed summation order.
// Bytes (as the three kernels): router E*H + shared gate H (8-bit) + (k+1) * 3 * I * H / 2 (4-bit) + bf16 scales
// and biases: 16.5 MB at E 256, H 2048, I 512, k 8, i.e. 3.9 us at 4.27 TB/s.
#include "cuda/kernels/grid_barrier.cuh"
#include "cuda/kernels/moe.cuh"
#include "cuda/kernels/quant_dot.cuh"

namespace lily::cuda {

namespace {

constexpr int kMaxTopK = 16;      // as moe.cu's launchers
constexpr int kMaxExperts = 256;  // warp_route_top_k<8>: one warp, 8 experts a lane
constexpr int kFusedThreads = 256;  // moe_route's block size: block_load_x then sums the squares in its order
constexpr int kFusedWarps = kFusedThreads / 32;
constexpr int kSlotBatch = 9;  // down rows a lane loads at once in phase C: all top_k + 1 of the model (k = 8)

// Shared memory floats: x (padded, H) in phases A and B, then act (top_k + 1 padded rows of I) in phase C.
__host__ __device__ constexpr int fused_smem_floats(int hidden, int inter, int top_k) {
  return xpad_floats(hidden) > (top_k + 1) * xpad_floats(inter) ? xpad_floats(hidden)
                                                                 : (top_k + 1) * xpad_floats(inter);
}

template <int H, int I>
__global__ void __launch_bounds__(kFusedThreads, 2) moe_fused_kernel(const __grid_constant__ MoeFusedParams p) {
  const trace::BlockTrace trace_block(trace::kFused);
  using In = Q4Layout<H>;                   // gate/up rows of H columns, as moe_expert_in
  constexpr int kPairs = In::kPasses / 2;   // (gate, up) pairs a warp unit: passes [0, kPairs) gate, the rest up
  constexpr int kUnitsPerExpert = I / kPairs;
  constexpr int kLanesC = I / kVecElems4;   // phase C: lanes a down row (one 16-byte vector each)
  constexpr int kRowsC = 32 / kLanesC;      // down rows a warp unit
  constexpr int kActStride = xpad_floats(I);
  static_assert(In::kRowsPerPass == 1 && kPairs >= 1 && I % kPairs == 0, "one gate/up row per pass");
  static_assert(kLanesC == 8 || kLanesC == 16 || kLanesC == 32, "I in {256, 512, 1024}");
  static_assert(H % kRowsC == 0, "whole phase C units");
  extern __shared__ __align__(16) float smem[];
  __shared__ float red_s[32];
  __shared__ int idx_s[kMaxTopK];
  __shared__ float w_s[kMaxTopK + 1];  // routing weights, then the shared gate value
  const int E = p.router.rows, k = p.top_k, lane = threadIdx.x & 31;
  const int n_warps = gridDim.x * kFusedWarps;
  const int rank = (threadIdx.x >> 5) * gridDim.x + blockIdx.x;
  const int n_router = E + 1;  // row E: the shared-expert gate
  const int n_a = n_router + kUnitsPerExpert, n_b = k * kUnitsPerExpert, n_c = H / kRowsC;
  const int j_c = lane % kLanesC, sub_c = lane / kLanesC;

  // (gate, up) row pairs pair0 .. pair0 + kPairs - 1 of one expert into registers; then act[slot][pair].
  Q4Chunk<H> c;
  auto load_pairs = [&](const QMatrix& gate, const QMatrix& up, int pair0) {
#pragma unroll
    for (int pass = 0; pass < In::kPasses; ++pass) {
      const int row = pair0 + pass % kPairs;
      c.load(pass, pass < kPairs ? gate : up, row, row < I, lane);
    }
  };
  auto finish_pairs = [&](int slot, int pair0) {
    float part[In::kPasses];
    c.dot(smem, lane, part);
    group_reduce_scatter<In::kPasses, 32>(part, lane);
    // Lane j holds pass j / kLanesPerValue: gate of pair i in the lower half-warp, its up 16 lanes higher.
    const float up_dot = __shfl_down_sync(0xffffffffu, part[0], 16);
    const int pair = pair0 + lane / In::kLanesPerValue;
    if (lane < 16 && lane % In::kLanesPerValue == 0 && pair < I) {
      p.act[static_cast<size_t>(slot) * I + pair] = siluf_(part[0]) * up_dot;
    }
  };
  // Phase C unit u: row u * kRowsC + sub_c of a down matrix, vector j_c (and its scale and bias).
  auto prefetch_down = [&](const QMatrix& m, int u) {
    const size_t row = static_cast<size_t>(u) * kRowsC + sub_c;
    prefetch_l2(reinterpret_cast<const uint4*>(m.w) + row * kLanesC + j_c);
    if (j_c == 0) prefetch_l2(m.scales + row * (I / 64)), prefetch_l2(m.biases + row * (I / 64));
  };

  // ---- phase A: x, router logits, shared gate, shared expert's act row ----
  RouterRow rr;
  auto load_a = [&](int t) {
    if (t < n_router) route_prefetch(t < E ? p.router : p.shared_gate_row, t < E ? t : 0, true, lane, rr);
    else load_pairs(p.shared_gate, p.shared_up, (t - n_router) * kPairs);
  };
  if (rank < n_a) load_a(rank);  // weights: before the wait
  for (int u = rank; u < n_c; u += n_warps) prefetch_down(p.shared_down, u);
  pdl_wait();
  block_load_x(p.h, p.norm_w, p.eps, H, smem, red_s);
  for (int t = rank; t < n_a; t += n_warps) {
    if (t != rank) load_a(t);
    if (t < n_router) {
      const float logit = router_dot(t < E ? p.router : p.shared_gate_row, t < E ? t : 0, rr, smem, lane);
      if (lane == 0 && t < E) p.logits[t] = logit;
      if (lane == 0 && t == E) *p.shared_gate_value = sigmoidf_(logit);
    } else {
      finish_pairs(k, (t - n_router) * kPairs);
    }
  }

  grid_barrier(p.barrier);
  // Every block has arrived, so all are resident: blocks of a dependent launched now can only take room no block
  // of this grid is waiting for (signalling before barrier 1 could deadlock it; see the launcher).
  pdl_launch_dependents();

  // ---- phase B: selection, routed experts' act rows ----
  if (threadIdx.x < 32) {
    const RouteChoice choice = warp_route_top_k<8>(p.logits, E, k);
    if (lane < k) {
      idx_s[lane] = choice.idx, w_s[lane] = choice.weight;
      if (blockIdx.x == 0 && p.topk_idx) p.topk_idx[lane] = choice.idx;
      if (blockIdx.x == 0 && p.topk_w) p.topk_w[lane] = choice.weight;
    }
    if (lane == 0) w_s[k] = __ldcg(p.shared_gate_value);
  }
  __syncthreads();
  auto load_b = [&](int t) {
    const int e = idx_s[t / kUnitsPerExpert];
    load_pairs(p.gate.expert(e), p.up.expert(e), (t % kUnitsPerExpert) * kPairs);
  };
  if (rank < n_b) load_b(rank);  // first in the memory queue: on the critical path
  for (int u = rank; u < n_c; u += n_warps) {
    for (int s = 0; s < k; ++s) prefetch_down(p.down.expert(idx_s[s]), u);
  }
  for (int t = rank; t < n_b; t += n_warps) {
    if (t != rank) load_b(t);
    finish_pairs(t / kUnitsPerExpert, (t % kUnitsPerExpert) * kPairs);
  }

  grid_barrier(p.barrier);

  // ---- phase C: down projections, routing weights, shared gate, residual ----
  uint4 dw[kSlotBatch];
  unsigned short ds[kSlotBatch], db[kSlotBatch];
  auto load_down = [&](int u, int s0) {  // slots s0 .. s0 + kSlotBatch - 1 (those <= k)
    const size_t row = static_cast<size_t>(u) * kRowsC + sub_c;
#pragma unroll
    for (int i = 0; i < kSlotBatch; ++i) {
      const int s = s0 + i;
      const bool valid = s <= k;
      const QMatrix m = valid && s < k ? p.down.expert(idx_s[s]) : p.shared_down;
      dw[i] = valid ? ld_stream(reinterpret_cast<const uint4*>(m.w) + row * kLanesC + j_c) : make_uint4(0, 0, 0, 0);
      ds[i] = valid ? ld_bf16_bits(m.scales + row * (I / 64) + j_c / 2) : 0;
      db[i] = valid ? ld_bf16_bits(m.biases + row * (I / 64) + j_c / 2) : 0;
    }
  };
  if (rank < n_c) load_down(rank, 0);  // L2 hits (prefetched above), in flight while act is copied
  for (int i = threadIdx.x; i < (k + 1) * I / 4; i += kFusedThreads) {
    const int s = 4 * i / I, e = 4 * i - s * I;  // 4 consecutive elements stay contiguous in the padded layout
    *reinterpret_cast<float4*>(smem + s * kActStride + xpad(e)) = __ldcg(reinterpret_cast<const float4*>(p.act) + i);
  }
  __syncthreads();
  for (int u = rank; u < n_c; u += n_warps) {
    const int row = u * kRowsC + sub_c;
    const float h_old = j_c == 0 ? p.h[row] : 0.0f;
    float total = 0.0f;
    for (int s0 = 0; s0 <= k; s0 += kSlotBatch) {
      if (u != rank || s0 != 0) load_down(u, s0);
#pragma unroll
      for (int i = 0; i < kSlotBatch; ++i) {
        const int s = s0 + i;
        if (s <= k) {
          float x[32];
          const float x_sum = load_x_vec(smem + s * kActStride, j_c, x);
          total += w_s[s] * q4_group_term(dot_q4_vec(dw[i], x), x_sum, ds[i], db[i]);
        }
      }
    }
#pragma unroll
    for (int offset = kLanesC / 2; offset > 0; offset >>= 1) total += __shfl_xor_sync(0xffffffffu, total, offset);
    if (j_c == 0) p.h[row] = h_old + total;
  }
}

// ---- launcher --------------------------------------------------------------------------------------------------

bool is_q(const QMatrix& m, int bits, int rows, int cols) {
  return m.w && m.scales && m.biases && m.bits == bits && m.rows == rows && m.cols == cols &&
         reinterpret_cast<uintptr_t>(m.w) % 16 == 0;
}

template <int H, int I>
cudaError_t launch_fused(const MoeFusedParams& p, cudaStream_t stream) {
  auto kernel = moe_fused_kernel<H, I>;
  const size_t smem = fused_smem_floats(H, I, p.top_k) * sizeof(float);
  if (smem > 48 * 1024) {
    CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  }
  // The barriers need every block resident at once. The grid is at most what fits the whole device (ordinary
  // launch, so PDL keeps working and the launch is legal in stream capture): blocks queued behind the
  // predecessor's run once it exits (it never waits for this grid), and this grid lets its own dependents launch
  // only after barrier 1, when all its blocks have arrived, so nothing that waits for it can hold their place.
  int blocks = 0, sms = 0;
  CUDA_TRY(persistent_grid(kernel, kFusedThreads, smem, p.grid_blocks, blocks, sms));
  return launch_pdl(kernel, dim3(blocks), dim3(kFusedThreads), smem, stream, p);
}

template <int H>
cudaError_t launch_for_inter(const MoeFusedParams& p, cudaStream_t stream) {
  switch (p.gate.rows) {
    case 256: return launch_fused<H, 256>(p, stream);
    case 512: return launch_fused<H, 512>(p, stream);
    case 1024: return launch_fused<H, 1024>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

bool moe_fused_supported(const MoeFusedParams& p) {
  const int E = p.router.rows, H = p.router.cols, I = p.gate.rows, k = p.top_k;
  if (H != 1024 && H != 2048 && H != 4096) return false;
  if (I != 256 && I != 512 && I != 1024) return false;
  if (k < 1 || k > kMaxTopK || E < k || E > kMaxExperts) return false;
  if (!is_q(p.router, 8, E, H) || !is_q(p.shared_gate_row, 8, 1, H)) return false;
  if (!is_q(p.gate, 4, I, H) || !is_q(p.up, 4, I, H) || !is_q(p.down, 4, H, I)) return false;
  if (!is_q(p.shared_gate, 4, I, H) || !is_q(p.shared_up, 4, I, H) || !is_q(p.shared_down, 4, H, I)) return false;
  return p.h && p.norm_w && p.logits && p.shared_gate_value && p.act && aligned16(p.act) && p.barrier &&
         p.grid_blocks >= 0;
}

cudaError_t moe_fused(const MoeFusedParams& p, cudaStream_t stream) {
  if (!moe_fused_supported(p)) return cudaErrorInvalidValue;
  switch (p.router.cols) {
    case 1024: return launch_for_inter<1024>(p, stream);
    case 2048: return launch_for_inter<2048>(p, stream);
    case 4096: return launch_for_inter<4096>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace lily::cuda
