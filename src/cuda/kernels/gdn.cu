// Gated DeltaNet decode step for one token, eqs 14-18 of docs/MODEL.md, fused in one kernel.
//
// Grid: n_v * (d_v / kCols) blocks, 256 threads. Block (h, c) owns columns j0 = c*kCols .. j0+kCols-1 of value head
// h (columns of S are independent in the delta rule) and recomputes what it needs of the rest (cheap):
//   eq 14  conv + SiLU of its key head kh = h / (n_v/n_k): q and k (d_k channels each) and v (its kCols channels):
//          cc[ch] = silu(sum_k w[ch,k] * c_{pos-K+1+k}[ch]); history c_{pos-K+1..pos-1} from ring slots (pos+1+k) % K,
//          the current c from proj; the current c is written to slot pos % K (never read in this step; q/k channels
//          are written by every block of kh with identical values).
//   eq 16  q_hat = q / sqrt(|q|^2 + 1e-6) / sqrt(d_k);  k_hat = k / sqrt(|k|^2 + 1e-6).
//   eq 17  beta = sigmoid(b_h);  decay = exp(-exp(A_log_h) * softplus(a_h + dt_bias_h)).
//   eq 18  S' = decay * S;  e = (v - S'^T k_hat) * beta;  S = S' + k_hat e^T;  o = S^T q_hat
//          = S'^T q_hat + e (k_hat . q_hat), so one pass over S' gives both reductions over d_k.
// Layout: S [n_v, d_k, d_v] fp32 (j contiguous). Thread (warp w, lane j) holds rows w*16 .. w*16+15 of column
//   j0 + j in registers: each warp load/store is a coalesced 128-byte row segment. Reductions over d_k go through
//   shared memory ([8 warps][kCols] partials).
// Programmatic dependent launch: conv weights and gate constants (and with prefetch_state, pos, S and the ring
//   history) are loaded before waiting for the previous kernel; proj after.
// Memory-bound: reads and writes S, n_v * d_k * d_v * 8 bytes (4 MiB at full size), plus ~0.2 MiB of proj/ring/
//   conv weights: floor 0.98 us at 4.27 TB/s. Measured (H200, graph replay, 48 rotating states): 4.1 us a step
//   launched plainly (1.0 TB/s: launch plus one dependent load round trip dominate at this size); with programmatic
//   dependent launch 4.56 us, 3.18 us with prefetch_state. 64 registers, no spills.
// Eq 19 fused (norm_w set): block (h, c) is rank c of a cluster of the d_v / kCols blocks of head h; warp 0 sends
//   its sum of o^2 over its kCols columns to every block of the cluster (distributed shared memory, slot = its
//   rank; after a split arrive/wait cluster barrier that guarantees every block has started), one cluster
//   barrier, then each block sums the slots in rank order (the same bits everywhere) and writes
//   x = norm_w * (o / RMS) * silu(z) for its columns. No block touches remote memory after that barrier, so none
//   waits for the others to exit.
#include <cooperative_groups.h>

#include <cmath>
#include <type_traits>

#include "cuda/kernels/gdn.cuh"

namespace lily::cuda {

namespace {

constexpr int kDk = 128;
constexpr int kCols = 32;
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kRowsPerThread = kDk / kWarps;
constexpr int kConvChannels = 2 * kDk + kCols;  // q and k of the key head, this block's v columns
constexpr int kChannelsPerThread = (kConvChannels + kThreads - 1) / kThreads;
constexpr int kMaxClusterBlocks = 8;  // portable cluster size: d_v <= 8 * kCols

// Eq 14's inputs for the channels this block needs: conv weights, the K-1 history vectors from the ring and the
// current pre-conv value, all loaded before anything is stored (one memory round trip, no aliasing stalls).
template <int K>
struct ConvInputs {
  int ch[kChannelsPerThread];
  float w[kChannelsPerThread][K];
  float x[kChannelsPerThread][K];  // x[.][K-1] is the current vector (from proj)
};

// The channels and conv weights (never written by kernels: fetched before waiting for the predecessor).
template <int K>
__device__ __forceinline__ void load_conv_weights(const GdnStepParams& p, int h, int kh, int j0,
                                                  ConvInputs<K>& in) {
  const int key_dim = p.n_k * kDk;
#pragma unroll
  for (int u = 0; u < kChannelsPerThread; ++u) {
    const int c = threadIdx.x + u * kThreads;
    if (c >= kConvChannels) continue;
    const int ch = c < kDk ? kh * kDk + c : c < 2 * kDk ? key_dim + kh * kDk + (c - kDk) : 2 * key_dim + h * p.d_v + j0 + (c - 2 * kDk);
    in.ch[u] = ch;
#pragma unroll
    for (int k = 0; k < K; ++k) in.w[u][k] = p.conv_w[static_cast<size_t>(ch) * K + k];
  }
}

// The K-1 history vectors from the ring: position pos-K+1+k lives in slot (pos+1+k) % K.
template <int K>
__device__ __forceinline__ void load_conv_history(const GdnStepParams& p, int pos, ConvInputs<K>& in) {
  const int conv_dim = 2 * p.n_k * kDk + p.n_v * p.d_v;
#pragma unroll
  for (int u = 0; u < kChannelsPerThread; ++u) {
    if (threadIdx.x + u * kThreads >= kConvChannels) continue;
#pragma unroll
    for (int k = 0; k < K - 1; ++k)
      in.x[u][k] = p.conv_ring[static_cast<size_t>((pos + 1 + k) % K) * conv_dim + in.ch[u]];
  }
}

// Eq 14: conv + SiLU into q_s / k_s / v_s; the current vector goes to ring slot pos % K (read by no block now), or
// with ring_out the whole window (history and current vector) to ring_out.
template <int K>
__device__ __forceinline__ void conv_step(const GdnStepParams& p, const ConvInputs<K>& in, int pos, float* q_s,
                                          float* k_s, float* v_s) {
  const int conv_dim = 2 * p.n_k * kDk + p.n_v * p.d_v;
#pragma unroll
  for (int u = 0; u < kChannelsPerThread; ++u) {
    const int c = threadIdx.x + u * kThreads;
    if (c >= kConvChannels) continue;
    float acc = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) acc += in.w[u][k] * in.x[u][k];
    if (p.ring_out) {
#pragma unroll
      for (int k = 0; k < K - 1; ++k) p.ring_out[static_cast<size_t>((pos + 1 + k) % K) * conv_dim + in.ch[u]] = in.x[u][k];
      p.ring_out[static_cast<size_t>(pos % K) * conv_dim + in.ch[u]] = in.x[u][K - 1];
    } else {
      p.conv_ring[static_cast<size_t>(pos % K) * conv_dim + in.ch[u]] = in.x[u][K - 1];
    }
    const float y = gdn_silu(acc);
    if (c < kDk) q_s[c] = y;
    else if (c < 2 * kDk) k_s[c - kDk] = y;
    else v_s[c - 2 * kDk] = y;
  }
}

template <int K, class Src>
__global__ void __launch_bounds__(kThreads) gdn_step_kernel(const __grid_constant__ Src args) {
  const trace::BlockTrace trace_block(trace::kGdnStep);
  const GdnStepParams& p = row_of(args);
  __shared__ float q_s[kDk], k_s[kDk], v_s[kCols];
  __shared__ float norm_s[3];  // 1/|q|, 1/|k|, raw q.k
  __shared__ float part_s[2][kWarps][kCols];
  __shared__ float ss_s[kMaxClusterBlocks];  // eq 19: the cluster's per-block sums of o^2
  const int col_blocks = p.d_v / kCols;
  const int h = blockIdx.x / col_blocks, j0 = (blockIdx.x % col_blocks) * kCols;
  const int kh = h / (p.n_v / p.n_k);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  // Every load first: the state strip (the bulk of the traffic), the conv inputs and the gate scalars; what no
  // kernel writes (and, with prefetch_state, the state) before waiting for the predecessor, proj after.
  pdl_launch_dependents();
  // Eq 19 fused: arrive now on the cluster barrier that must precede any distributed shared memory access (every
  // block of the cluster has started), wait for it just before the access (by then it costs nothing).
#if defined(LILY_SM90_PASS)
  if (p.norm_w) asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
  const size_t strip = (static_cast<size_t>(h) * kDk + warp * kRowsPerThread) * p.d_v + j0 + lane;
  const float* S = p.S + strip;
  float* S_w = (p.S_out ? p.S_out : p.S) + strip;
  float s_reg[kRowsPerThread];
  ConvInputs<K> in;
  load_conv_weights<K>(p, h, kh, j0, in);
  const float dt_bias = p.dt_bias[h], A_log = p.A_log[h];
  const size_t col = static_cast<size_t>(h) * p.d_v + j0 + lane;  // this lane's output column
  const float w_norm = p.norm_w && warp == 0 ? p.norm_w[j0 + lane] : 0.0f;
  int pos = 0;
  auto load_state = [&]() {
    pos = *p.pos;
#pragma unroll
    for (int r = 0; r < kRowsPerThread; ++r) s_reg[r] = S[static_cast<size_t>(r) * p.d_v];
    load_conv_history<K>(p, pos, in);
  };
  if (p.prefetch_state) load_state();
  pdl_wait();
  if (!p.prefetch_state) load_state();
#pragma unroll
  for (int u = 0; u < kChannelsPerThread; ++u) {
    if (threadIdx.x + u * kThreads < kConvChannels) in.x[u][K - 1] = p.proj[in.ch[u]];
  }
  const float* gates = p.proj + 2 * p.n_k * kDk + 2 * p.n_v * p.d_v;  // [b (n_v) | a (n_v)] after q|k|v and z
  const float b_logit = gates[h], a_in = gates[p.n_v + h] + dt_bias;
  const float z = p.norm_w && warp == 0 ? p.gate_z[col] : 0.0f;

  conv_step<K>(p, in, pos, q_s, k_s, v_s);
  __syncthreads();

  // Eq 16: warps 0 and 1 take |q|^2 and |k|^2, warp 2 the raw q.k (scaled afterwards).
  if (warp < 3) {
    float acc = 0.0f;
    for (int i = lane; i < kDk; i += 32) acc += warp == 0 ? q_s[i] * q_s[i] : warp == 1 ? k_s[i] * k_s[i] : q_s[i] * k_s[i];
    acc = warp_sum(acc);
    if (lane == 0) norm_s[warp] = warp == 2 ? acc : 1.0f / sqrtf(acc + 1e-6f);
  }
  // Eq 17 (every thread; scalars).
  float beta, decay;
  gdn_gates(b_logit, a_in, A_log, beta, decay);
  __syncthreads();
  const float q_inv = norm_s[0] * (1.0f / sqrtf(static_cast<float>(kDk))), k_inv = norm_s[1];
  const float kq = norm_s[2] * q_inv * k_inv;  // k_hat . q_hat
  if (threadIdx.x < kDk) {
    q_s[threadIdx.x] *= q_inv;
    k_s[threadIdx.x] *= k_inv;
  }
  __syncthreads();  // normalised q_s, k_s visible

  // Eq 18: one pass over S' gives the partial sums of S'^T k_hat and S'^T q_hat for this thread's rows.
  float sk = 0.0f, sq = 0.0f;
#pragma unroll
  for (int r = 0; r < kRowsPerThread; ++r) {
    const int i = warp * kRowsPerThread + r;
    s_reg[r] *= decay;
    sk += s_reg[r] * k_s[i];
    sq += s_reg[r] * q_s[i];
  }
  part_s[0][warp][lane] = sk;
  part_s[1][warp][lane] = sq;
  __syncthreads();
  float kv = 0.0f, sqv = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    kv += part_s[0][w][lane];
    sqv += part_s[1][w][lane];
  }
  const float e = (v_s[lane] - kv) * beta;
#pragma unroll
  for (int r = 0; r < kRowsPerThread; ++r) S_w[static_cast<size_t>(r) * p.d_v] = s_reg[r] + k_s[warp * kRowsPerThread + r] * e;
  const float o = sqv + e * kq;
  if (!p.norm_w) {
    if (warp == 0) p.o[col] = o;
    return;
  }
#if defined(LILY_SM90_PASS)
  // Eq 19 over the cluster (header).
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const unsigned n_blocks = cluster.num_blocks();
  const float ss = warp_sum(o * o);  // every warp holds the same o
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");  // the arrival at the top: all blocks started
  if (threadIdx.x < n_blocks) cluster.map_shared_rank(ss_s, threadIdx.x)[cluster.block_rank()] = ss;
  cluster.sync();
  float total = 0.0f;
  for (unsigned r = 0; r < n_blocks; ++r) total += ss_s[r];
  const float inv_rms = rsqrtf(total / static_cast<float>(p.d_v) + p.eps);
  if (warp == 0) p.o[col] = w_norm * (o * inv_rms) * siluf_(z);
#else
  (void)w_norm, (void)z, (void)ss_s;  // no clusters before sm_90: the launcher refuses norm_w (gdn_step)
#endif
}

cudaError_t check_params(const GdnStepParams& p) {
  if (!p.proj || !p.conv_ring || !p.conv_w || !p.A_log || !p.dt_bias || !p.S || !p.pos || !p.o) return cudaErrorInvalidValue;
  if (p.d_k != kDk || p.d_v <= 0 || p.d_v % kCols != 0) return cudaErrorInvalidValue;
  if (p.n_k <= 0 || p.n_v <= 0 || p.n_v % p.n_k != 0) return cudaErrorInvalidValue;
  if (p.kernel != 4) return cudaErrorInvalidValue;  // linear_conv_kernel_dim of the model; one instance
  const int col_blocks = p.d_v / kCols;
  if (p.norm_w && (!p.gate_z || col_blocks > kMaxClusterBlocks)) return cudaErrorInvalidValue;
  if (p.norm_w && !sm90_code_built()) return cudaErrorInvalidDeviceFunction;  // eq 19 needs clusters
  return cudaSuccess;
}

// The rows of one launch: one geometry and one fused-norm choice.
bool same_shape(const GdnStepParams& a, const GdnStepParams& b) {
  return a.n_k == b.n_k && a.n_v == b.n_v && a.d_v == b.d_v && (a.norm_w == nullptr) == (b.norm_w == nullptr);
}

}  // namespace

cudaError_t gdn_step(const GdnStepParams& p, cudaStream_t stream) { return gdn_step_rows(&p, 1, stream); }

cudaError_t gdn_step_rows(const GdnStepParams* rows, int n, cudaStream_t stream) {
  return launch_row_batch(rows, n, check_params, same_shape, [&](const GdnStepParams& p, const auto& src) {
    const int col_blocks = p.d_v / kCols;
    return launch_pdl(gdn_step_kernel<4, std::decay_t<decltype(src)>>, dim3(p.n_v * col_blocks, 1, n),
                      dim3(kThreads), 0, stream, src, p.norm_w ? col_blocks : 1);
  });
}

}  // namespace lily::cuda
