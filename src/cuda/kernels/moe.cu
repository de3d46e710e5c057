// MoE decode (eqs 21-25) in three kernels, all device-side, replayable in a CUDA graph (moe.cuh).
//
// moe_route: one kernel. Each block normalises h into shared memory (eqs 1-2) and computes the router logits of
//   8 rows (a warp per row) of the 8-bit [E, H] router plus, in the block that owns row E, the shared-expert
//   gate logit; block 0 also writes x. With select_top_k, the last block to finish (atomic ticket after a
//   __threadfence; it resets the counter for the next replay) selects the experts (warp_route_top_k) and writes
//   them; without, the expert kernels select (moe.cuh). Moves E*H + H bytes (8-bit) + 4*(E+1)*H/64 bytes of
//   scales: 0.5 MB.
// Selection (eq 22, warp_route_top_k in moe.cuh): one warp; fp32 softmax over E, the k
//   largest probabilities (ties -> lower index) by k rounds of a warp-wide maximum of unique 64-bit keys, weights
//   renormalised over the k.
// moe_expert_in: grid (pair tiles of I, slot 0..k; slot k = the shared expert). A warp takes P/2 (gate, up)
//   row pairs of its slot's expert (P = 4 at H = 2048: 8 x 16-byte loads in flight per lane), dots them with x
//   from shared memory and writes act = silu(gate . x) * (up . x). Moves (k+1) * 2 * I * (H/2 + H/16) bytes:
//   10.6 MB at k = 8, I = 512, H = 2048.
// moe_expert_out: grid (row tiles of H), one warp per slot: the warp keeps its slot's 32-float slice of act in
//   registers (cols = I = 512: a half-warp per row, 8 rows per half-warp), the block sums the k+1 slot partial
//   dots in a fixed order with the routing weights (sigmoid gate for the shared slot) and adds them to h.
//   Moves (k+1) * H * (I/2 + I/16) bytes: 5.3 MB.
// Weight layouts: quant_dot.cuh / common.cuh (MLX, stacked experts via QMatrix::expert).
#include "cuda/kernels/moe.cuh"
#include "cuda/kernels/quant_dot.cuh"

#include <type_traits>

namespace lily::cuda {

namespace {

constexpr int kMaxTopK = 16;
constexpr int kMaxExperts = 1024;

// ---- moe_route -----------------------------------------------------------------------------------------------

constexpr int kRouteThreads = 256;
constexpr int kRouteWarps = kRouteThreads / 32;

template <class Src>
__global__ void __launch_bounds__(kRouteThreads) moe_route_kernel(const __grid_constant__ Src args) {
  const trace::BlockTrace trace_block(trace::kMoeRoute);
  const MoeRouteParams& p = row_of(args);
  extern __shared__ __align__(16) float x_s[];  // x (padded, H)
  __shared__ float red_s[32];
  __shared__ bool is_last;
  const int n_experts = p.router.rows, hidden = p.router.cols, lane = threadIdx.x & 31;
  const int row = blockIdx.x * kRouteWarps + (threadIdx.x >> 5);  // E = the shared-expert gate
  const QMatrix& m = row < n_experts ? p.router : p.shared_gate;
  const int m_row = row < n_experts ? row : 0;

  pdl_launch_dependents();
  RouterRow r;
  route_prefetch(m, m_row, row <= n_experts, lane, r);
  pdl_wait();
  block_load_x(p.h, p.norm_w, p.eps, hidden, x_s, red_s);
  if (blockIdx.x == 0) {
    for (int e = threadIdx.x; e < hidden; e += blockDim.x) p.x[e] = x_s[xpad(e)];
  }
  if (row <= n_experts) {
    const float logit = router_dot(m, m_row, r, x_s, lane);
    if (lane == 0 && row < n_experts) p.logits[row] = logit;
    if (lane == 0 && row == n_experts) *p.shared_gate_value = sigmoidf_(logit);
  }
  if (!p.select_top_k) return;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(p.counter, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!is_last || threadIdx.x >= 32) return;
  if (threadIdx.x == 0) *p.counter = 0;  // ready for the next launch / graph replay
  const RouteChoice choice = n_experts <= 256
                                 ? warp_route_top_k<8>(p.logits, n_experts, p.top_k)
                                 : warp_route_top_k<kMaxExperts / 32>(p.logits, n_experts, p.top_k);
  if (lane < p.top_k) p.topk_idx[lane] = choice.idx, p.topk_w[lane] = choice.weight;
}

// ---- moe_expert_in -------------------------------------------------------------------------------------------

constexpr int kExpertThreads = 128;
constexpr int kExpertWarps = kExpertThreads / 32;

template <int H, class Src>
__device__ __forceinline__ void moe_expert_in_body(const Src& args) {
  const trace::BlockTrace trace_block(trace::kMoeExpertIn);
  const MoeExpertInParams& p = row_of(args);
  using Lay = Q4Layout<H>;
  constexpr int kPairs = Lay::kPasses / 2;  // (gate, up) pairs per warp: passes [0, kPairs) gate, the rest up
  static_assert(Lay::kRowsPerPass == 1 && kPairs >= 1, "one row per pass");
  __shared__ __align__(16) float x_s[xpad_floats(H)];
  __shared__ int expert_s;
  const int slot = blockIdx.y, lane = threadIdx.x & 31, n_rows = p.gate.rows;
  const bool shared = slot == p.top_k;
  const int pair0 = (blockIdx.x * kExpertWarps + (threadIdx.x >> 5)) * kPairs;
  // The shared expert's weights do not depend on the routing: fetch them before waiting for moe_route.
  Q4Chunk<H> c;
  auto load = [&](const QMatrix& gate, const QMatrix& up) {
#pragma unroll
    for (int pass = 0; pass < Lay::kPasses; ++pass) {
      const int row = pair0 + pass % kPairs;
      c.load(pass, pass < kPairs ? gate : up, row, row < n_rows, lane);
    }
  };
  if (shared) load(p.shared_gate, p.shared_up);
  pdl_wait();
  pdl_launch_dependents();  // only after the wait: moe_expert_out may read moe_route's logits early (moe.cuh)
  constexpr int kXVecs = H / 4 / kExpertThreads;
  float4 x_v[kXVecs];  // x into registers first: in flight while warp 0 selects
#pragma unroll
  for (int t = 0; t < kXVecs; ++t)
    x_v[t] = reinterpret_cast<const float4*>(p.x)[threadIdx.x + t * kExpertThreads];
  if (!shared && p.router_logits) {
    if (threadIdx.x < 32) {
      const RouteChoice choice = warp_route_top_k<8>(p.router_logits, p.n_experts, p.top_k);
      if (threadIdx.x == slot) expert_s = choice.idx;
      if (blockIdx.x == 0 && slot == 0 && threadIdx.x < p.top_k) {
        p.topk_idx_out[threadIdx.x] = choice.idx, p.topk_w_out[threadIdx.x] = choice.weight;
      }
    }
  } else if (!shared && threadIdx.x == 0) {
    expert_s = p.topk_idx[slot];
  }
#pragma unroll
  for (int t = 0; t < kXVecs; ++t) {
    const int i = threadIdx.x + t * kExpertThreads;
    *reinterpret_cast<float4*>(x_s + xpad(4 * i)) = x_v[t];
  }
  __syncthreads();
  if (!shared) load(p.gate.expert(expert_s), p.up.expert(expert_s));

  float part[Lay::kPasses];
  c.dot(x_s, lane, part);
  group_reduce_scatter<Lay::kPasses, 32>(part, lane);
  // Lane j holds pass j / kLanesPerValue: gate of pair i in the lower half-warp, its up 16 lanes higher.
  const float up_dot = __shfl_down_sync(0xffffffffu, part[0], 16);
  const int pair = pair0 + lane / Lay::kLanesPerValue;
  if (lane < 16 && lane % Lay::kLanesPerValue == 0 && pair < n_rows) {
    p.act[static_cast<size_t>(slot) * n_rows + pair] = siluf_(part[0]) * up_dot;
  }
}

template <int H>
__global__ void __launch_bounds__(kExpertThreads) moe_expert_in_kernel(const __grid_constant__ MoeExpertInParams p) {
  moe_expert_in_body<H>(p);
}
// The several-row instance holds its row's parameters in more registers (128 a thread: 4 blocks an SM, which left
// a 4,608-block grid at ~7 us a block, 2026-12-02); held to 5 blocks an SM.
template <int H>
__global__ void __launch_bounds__(kExpertThreads, 5)
    moe_expert_in_rows_kernel(const __grid_constant__ RowBatch<MoeExpertInParams> b) {
  moe_expert_in_body<H>(b);
}
template <int H, class Src>
constexpr auto expert_in_kernel() {
  if constexpr (std::is_same_v<Src, MoeExpertInParams>) return moe_expert_in_kernel<H>;
  else return moe_expert_in_rows_kernel<H>;
}

// ---- moe_expert_out ------------------------------------------------------------------------------------------

template <int I, class Src>
__global__ void __launch_bounds__(32 * (kMaxTopK + 1)) moe_expert_out_kernel(const __grid_constant__ Src args) {
  const trace::BlockTrace trace_block(trace::kMoeExpertOut);
  const MoeExpertOutParams& p = row_of(args);
  using Lay = Q4Layout<I>;
  static_assert(Lay::kVecsPerLane == 1, "one 16-byte vector of the row per lane");
  __shared__ float part_s[kMaxTopK + 1][Lay::kRowsPerChunk];
  __shared__ float w_s[kMaxTopK];
  const int slot = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int j = lane % Lay::kLanesPerRow, sub = lane / Lay::kLanesPerRow;
  const int row0 = blockIdx.x * Lay::kRowsPerChunk, n_rows = p.down.rows;
  const bool shared = slot == p.top_k;
  pdl_launch_dependents();
  Q4Chunk<I> c;
  auto load = [&](const QMatrix& down) {
#pragma unroll
    for (int pass = 0; pass < Lay::kPasses; ++pass) {
      const int row = row0 + pass * Lay::kRowsPerPass + sub;
      c.load(pass, down, row, row < n_rows, j);
    }
  };
  if (shared) load(p.shared_down);  // independent of the routing: before waiting for the previous kernels
  // The selection (moe_route's or moe_expert_in's) is complete once the wait returns. Selecting here from the
  // logits instead put the 8-round top-k on the critical path (2026-11-30: 4K step 1.587 -> 1.548 ms reading it).
  pdl_wait();
  if (!shared) load(p.down.expert(p.topk_idx[slot]));
  if (threadIdx.x < p.top_k) w_s[threadIdx.x] = p.topk_w[threadIdx.x];  // published by the barrier below
  const int out_row = row0 + static_cast<int>(threadIdx.x);
  const bool writer = threadIdx.x < Lay::kRowsPerChunk && out_row < n_rows;
  const float h_old = writer ? p.h[out_row] : 0.0f;
  // This lane's slice of act[slot] (vector j), in registers for all its rows.
  const float4* act_v = reinterpret_cast<const float4*>(p.act + static_cast<size_t>(slot) * I) + j * 8;
  float x[32];
  float x_sum = 0.0f;
#pragma unroll
  for (int t = 0; t < 8; ++t) {
    const float4 v = act_v[t];
    x[4 * t] = v.x, x[4 * t + 1] = v.y, x[4 * t + 2] = v.z, x[4 * t + 3] = v.w;
    x_sum += (v.x + v.y) + (v.z + v.w);
  }
  float part[Lay::kPasses];
#pragma unroll
  for (int pass = 0; pass < Lay::kPasses; ++pass) {
    part[pass] = q4_group_term(dot_q4_vec(c.w[pass][0], x), x_sum, c.s[pass][0], c.b[pass][0]);
  }
  group_reduce_scatter<Lay::kPasses, Lay::kLanesPerRow>(part, lane);
  if (j % Lay::kLanesPerValue == 0) part_s[slot][(j / Lay::kLanesPerValue) * Lay::kRowsPerPass + sub] = part[0];
  __syncthreads();
  if (writer) {
    float total = 0.0f;
    for (int s = 0; s < p.top_k; ++s) total += w_s[s] * part_s[s][threadIdx.x];
    total += *p.shared_gate_value * part_s[p.top_k][threadIdx.x];
    p.h[out_row] = h_old + total;
  }
}

// ---- launchers -----------------------------------------------------------------------------------------------

// Either router logits to select from (E <= 256: warp_route_top_k<8>) or the selected expert ids.
bool valid_selection(const float* logits, int n_experts, int top_k, const int* topk_idx) {
  return logits ? n_experts >= top_k && n_experts <= 256 : topk_idx != nullptr;
}

bool is_q(const QMatrix& m, int bits, int rows, int cols) {
  return m.w && m.scales && m.biases && m.bits == bits && m.rows == rows && m.cols == cols &&
         reinterpret_cast<uintptr_t>(m.w) % 16 == 0;
}

cudaError_t check(const MoeRouteParams& p) {
  const int n_experts = p.router.rows, hidden = p.router.cols;
  if (!is_q(p.router, 8, n_experts, hidden) || !is_q(p.shared_gate, 8, 1, hidden)) return cudaErrorInvalidValue;
  if (n_experts < 1 || n_experts > kMaxExperts || hidden <= 0 || hidden % 512) return cudaErrorInvalidValue;
  if (p.top_k < 1 || p.top_k > kMaxTopK || p.top_k > n_experts) return cudaErrorInvalidValue;
  if (!p.h || !p.norm_w || !p.x || !p.logits || !p.shared_gate_value) return cudaErrorInvalidValue;
  if (p.select_top_k && (!p.counter || !p.topk_idx || !p.topk_w)) return cudaErrorInvalidValue;
  return cudaSuccess;
}

cudaError_t check(const MoeExpertInParams& p) {
  const int n_rows = p.gate.rows, hidden = p.gate.cols;
  if (p.top_k < 1 || p.top_k > kMaxTopK || !p.x || !p.act || !aligned16(p.x)) return cudaErrorInvalidValue;
  if (!valid_selection(p.router_logits, p.n_experts, p.top_k, p.topk_idx)) return cudaErrorInvalidValue;
  if (p.router_logits && (!p.topk_idx_out || !p.topk_w_out))
    return cudaErrorInvalidValue;  // where the selection is made, it is written for moe_expert_out
  if (!is_q(p.gate, 4, n_rows, hidden) || !is_q(p.up, 4, n_rows, hidden)) return cudaErrorInvalidValue;
  if (!is_q(p.shared_gate, 4, n_rows, hidden) || !is_q(p.shared_up, 4, n_rows, hidden)) {
    return cudaErrorInvalidValue;  // the shared expert must have the routed experts' shape (Is == I)
  }
  if (hidden != 1024 && hidden != 2048 && hidden != 4096) return cudaErrorInvalidValue;
  return cudaSuccess;
}

cudaError_t check(const MoeExpertOutParams& p) {
  const int n_rows = p.down.rows, inter = p.down.cols;
  if (p.top_k < 1 || p.top_k > kMaxTopK || !p.act || !p.shared_gate_value || !p.h) return cudaErrorInvalidValue;
  if (!p.topk_idx || !p.topk_w) return cudaErrorInvalidValue;
  if (!is_q(p.down, 4, n_rows, inter) || !is_q(p.shared_down, 4, n_rows, inter)) return cudaErrorInvalidValue;
  if (inter != 512 && inter != 1024) return cudaErrorInvalidValue;
  return cudaSuccess;
}

// The launch of each kernel for n rows (grid z; n == 1 launches the single-row instance with p alone).
template <class Src>
cudaError_t launch_route(const MoeRouteParams& p, int n, const Src& src, cudaStream_t stream) {
  const int n_experts = p.router.rows, hidden = p.router.cols;
  const size_t smem = xpad_floats(hidden) * sizeof(float);
  if (smem > 48 * 1024) {
    CUDA_TRY(cudaFuncSetAttribute(moe_route_kernel<Src>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  }
  const int blocks = (n_experts + 1 + kRouteWarps - 1) / kRouteWarps;
  return launch_pdl(moe_route_kernel<Src>, dim3(blocks, 1, n), dim3(kRouteThreads), smem, stream, src);
}

template <class Src>
cudaError_t launch_expert_in(const MoeExpertInParams& p, int n, const Src& src, cudaStream_t stream) {
  const int n_rows = p.gate.rows;
  auto launch = [&](auto kernel, int pairs_per_warp) {
    const int pairs_per_block = kExpertWarps * pairs_per_warp;
    const dim3 grid((n_rows + pairs_per_block - 1) / pairs_per_block, p.top_k + 1, n);
    return launch_pdl(kernel, grid, dim3(kExpertThreads), 0, stream, src);
  };
  switch (p.gate.cols) {
    case 1024: return launch(expert_in_kernel<1024, Src>(), Q4Layout<1024>::kPasses / 2);
    case 2048: return launch(expert_in_kernel<2048, Src>(), Q4Layout<2048>::kPasses / 2);
    default: return launch(expert_in_kernel<4096, Src>(), Q4Layout<4096>::kPasses / 2);
  }
}

template <class Src>
cudaError_t launch_expert_out(const MoeExpertOutParams& p, int n, const Src& src, cudaStream_t stream) {
  const int n_rows = p.down.rows;
  const int threads = 32 * (p.top_k + 1);
  auto launch = [&](auto kernel, int rows_per_block) {
    return launch_pdl(kernel, dim3((n_rows + rows_per_block - 1) / rows_per_block, 1, n), dim3(threads), 0,
                      stream, src);
  };
  if (p.down.cols == 512) return launch(moe_expert_out_kernel<512, Src>, Q4Layout<512>::kRowsPerChunk);
  return launch(moe_expert_out_kernel<1024, Src>, Q4Layout<1024>::kRowsPerChunk);
}

// Rows of one launch share the weights and the shape; each is checked as a single launch would be.
bool same_shape(const MoeRouteParams& a, const MoeRouteParams& b) {
  return a.router.w == b.router.w && a.top_k == b.top_k && a.select_top_k == b.select_top_k;
}
bool same_shape(const MoeExpertInParams& a, const MoeExpertInParams& b) {
  return a.gate.w == b.gate.w && a.top_k == b.top_k && (a.router_logits == nullptr) == (b.router_logits == nullptr);
}
bool same_shape(const MoeExpertOutParams& a, const MoeExpertOutParams& b) {
  return a.down.w == b.down.w && a.top_k == b.top_k;
}

}  // namespace

cudaError_t moe_route(const MoeRouteParams& p, cudaStream_t stream) { return moe_route_rows(&p, 1, stream); }
cudaError_t moe_expert_in(const MoeExpertInParams& p, cudaStream_t stream) { return moe_expert_in_rows(&p, 1, stream); }
cudaError_t moe_expert_out(const MoeExpertOutParams& p, cudaStream_t stream) {
  return moe_expert_out_rows(&p, 1, stream);
}

cudaError_t moe_route_rows(const MoeRouteParams* rows, int n, cudaStream_t stream) {
  return launch_row_batch(rows, n, check, same_shape,
                          [&](const auto& p, const auto& src) { return launch_route(p, n, src, stream); });
}
cudaError_t moe_expert_in_rows(const MoeExpertInParams* rows, int n, cudaStream_t stream) {
  return launch_row_batch(rows, n, check, same_shape,
                          [&](const auto& p, const auto& src) { return launch_expert_in(p, n, src, stream); });
}
cudaError_t moe_expert_out_rows(const MoeExpertOutParams* rows, int n, cudaStream_t stream) {
  return launch_row_batch(rows, n, check, same_shape,
                          [&](const auto& p, const auto& src) { return launch_expert_out(p, n, src, stream); });
}

}  // namespace lily::cuda
