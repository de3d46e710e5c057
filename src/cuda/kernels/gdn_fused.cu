// gdn_fused (gdn.cuh): the Gated DeltaNet decode layer (eqs 1-2 for input_layernorm, 13-20) as ONE persistent
// kernel instead of gemv gdn_in + gdn_step + gemv gdn_out; the two data dependences (in_proj complete -> step, step
// complete -> out_proj) are grid-wide barriers (grid_barrier.cuh), not kernel boundaries (each of those costs
// ~3-4 us in the decode graph: docs/PERF_NOTES.md).
//
// Grid: 512 threads a block, every block that can be resident (one a SM: 217 KiB of shared memory and 128
// registers a thread), so a barrier never waits for a block that has no place to run. Warp rank
// warp * gridDim.x + block: consecutive ranks sit in different blocks.
// Before the predecessor's wait: each warp starts the cp.async copies of its first two in_proj chunks into its
//   two-stage ring (gemv.cu's asynchronous kernel, same layout) and prefetches its out_proj rows into L2; with
//   prefetch_state, block b < n_v also starts one bulk copy (cp.async.bulk, completion on an mbarrier) of value
//   head b's 64 KB state into shared memory and loads the head's conv history into registers. The state does not
//   depend on the in_proj, so it lands while phase A runs: the step no longer waits for it.
// Phase A: x = RMSNorm(h) * input_norm with the summation order of the chain GEMV's prologue at that GEMV's block
//   size (gemv_q4_async_threads: the same x bits), then the in_proj chunks (dot_stage, group_reduce_scatter: the
//   same proj bits), written to proj.
// Barrier 1, then griddepcontrol.launch_dependents (every block has arrived, so all are resident: a dependent's
//   blocks cannot take the place of one the barriers wait for).
// Phase B: block b steps value head b (then b + gridDim.x, ... on small grids) with all 512 threads, the head's
//   whole state in shared memory: eq 14 (conv + SiLU, threads 0-383: q, k of the key head and the head's v), eq 16
//   (warps 0-2), eq 17, eq 18 with warp w holding columns 32 (w % 4) + lane, rows 16 (w / 4) + r and 16 (w / 4 + 4)
//   + r: the eight 16-row partial sums of S'^T k and S'^T q are those of gdn_step's eight warps, summed in the
//   same order; eq 19 over the head's four 32-column strips in strip order, as gdn_step's cluster sums its four
//   blocks. So o and S carry gdn_step's bits (up to FMA contraction). The new S goes back to shared memory, the
//   normalised o to global memory (the out_proj input).
// Barrier 2. The head's new state leaves shared memory by one bulk copy (cp.async.bulk shared -> global),
//   off the critical path. Phase C: warps first in blocks without a head (their out_proj chunk and residual are
//   loaded before the barrier), the block copies o into shared memory, dot + reduce as gemv.cu, one lane writes
//   h[row] = h[row] + W_out o: each element once, a fixed order, the chain's bits.
// Why a head a block and not gdn_step's four blocks a head (a cluster): in one block the gated norm needs no
// cluster barrier, the state can be prefetched with one bulk copy before the grid barrier, and 32 heads on 132
// blocks leave 100 blocks to arrive early at barrier 2 with their phase C loads in flight.
// Bytes: in_proj 14.2 MB + out_proj 4.7 MB (4-bit with scales and biases) + the state read and written (4.19 MB) at
// full size: 23.1 MB, 5.4 us at 4.27 TB/s.
#include "cuda/kernels/gdn.cuh"
#include "cuda/kernels/gemv.cuh"
#include "cuda/kernels/grid_barrier.cuh"
#include "cuda/kernels/quant_dot.cuh"

namespace lily::cuda {

namespace {

using namespace gemv_q4;

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kD = 128;                        // d_k = d_v
constexpr int kK = 4;                          // conv kernel
constexpr int kStrips = kD / 32;               // 32-column strips of a head (gdn_step's blocks)
constexpr int kRowGroups = 8;                  // 16-row groups of a head (gdn_step's warps)
constexpr int kConvChannels = 3 * kD;          // q and k of the key head, the head's v
constexpr int kStateBytes = kD * kD * 4;       // one head's state
constexpr int kRingBytes = kWarps * kStages * kStageBytes;

// Dynamic shared memory: [state | per-warp rings (phase C: o) | x of phase A (phase B: partial sums)].
__host__ __device__ constexpr int xa_floats(int hidden) {
  return xpad_floats(hidden) > 2 * kRowGroups * kD ? xpad_floats(hidden) : 2 * kRowGroups * kD;
}
__host__ __device__ constexpr size_t fused_smem_bytes(int hidden) {
  return static_cast<size_t>(kStateBytes) + kRingBytes + static_cast<size_t>(xa_floats(hidden)) * 4;
}

// ---- mbarrier and bulk copies (sm_90) ----
__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(unsigned long long* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// One thread: expect `bytes` on bar and copy them global -> shared (both 16-byte aligned).
__device__ __forceinline__ void bulk_load(void* dst_s, const void* src, unsigned bytes, unsigned long long* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(dst_s)),
               "l"(src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
  const unsigned long long start = global_ns();
  for (;;) {
    unsigned done;
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
    if (done) return;
    if (global_ns() - start > kBarrierTimeoutNs) __trap();
  }
}
// One thread: copy shared -> global (bulk group); bulk_wait_read before the shared memory is written again.
__device__ __forceinline__ void bulk_store(void* dst, const void* src_s, unsigned bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(smem_addr(src_s)),
               "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
// Generic-proxy writes to shared memory made visible to a later bulk copy (each writing thread, then a barrier).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// block_load_x's fast path (quant_dot.cuh) as a block of `threads` threads would run it (threads <= blockDim.x,
// a multiple of 32, cols <= 16 * threads): thread t < threads loads the float4s t, t + threads, ... and sums their
// squares, warps sum by the same butterfly, and the warp sums of the first threads / 32 warps are added in warp
// order. So x has the bits of the chain GEMV's prologue at its block size. Ends with __syncthreads.
__device__ __forceinline__ void block_load_x_as(const float* in, const float* norm_w, float eps, int cols, float* x_s,
                                                float* red_s, int threads) {
  constexpr int kVecsPerThread = 4;
  const int n_vecs = cols / 4;
  const float4* in4 = reinterpret_cast<const float4*>(in);
  const float4* w4 = reinterpret_cast<const float4*>(norm_w);
  const bool active = static_cast<int>(threadIdx.x) < threads;
  float4 v[kVecsPerThread], w[kVecsPerThread];
  float ss = 0.0f;
#pragma unroll
  for (int t = 0; t < kVecsPerThread; ++t) {
    const int i = threadIdx.x + t * threads;
    const bool valid = active && i < n_vecs;
    v[t] = valid ? in4[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    w[t] = valid ? w4[i] : make_float4(1.0f, 1.0f, 1.0f, 1.0f);
    ss += (v[t].x * v[t].x + v[t].y * v[t].y) + (v[t].z * v[t].z + v[t].w * v[t].w);
  }
  ss = warp_sum(ss);
  if ((threadIdx.x & 31) == 0) red_s[threadIdx.x >> 5] = ss;
  __syncthreads();
  float total = 0.0f;
  for (int i = 0; i < threads / 32; ++i) total += red_s[i];
  const float inv_rms = rsqrtf(total / static_cast<float>(cols) + eps);
#pragma unroll
  for (int t = 0; t < kVecsPerThread; ++t) {
    const int i = threadIdx.x + t * threads;
    if (active && i < n_vecs) {
      *reinterpret_cast<float4*>(x_s + xpad(4 * i)) = make_float4(v[t].x * inv_rms * w[t].x, v[t].y * inv_rms * w[t].y,
                                                                  v[t].z * inv_rms * w[t].z, v[t].w * inv_rms * w[t].w);
    }
  }
  __syncthreads();
}

struct FusedArgs {
  GdnFusedParams p;
  int x_threads;  // block size of the chain's in_proj GEMV (its prologue's summation order)
};

// A thread's inputs of a head that no kernel writes: eq 14's channel, conv weights and K-1 history values (threads
// < kConvChannels; x[kK - 1], the current value, comes from proj after barrier 1), eq 17's constants and eq 19's
// multiplier of the thread's column.
struct HeadIn {
  int ch = 0;
  float w[kK] = {}, x[kK] = {};
  float A_log = 0.0f, dt_bias = 0.0f, norm_w = 0.0f;
};

template <int H, int VD>
__global__ void __launch_bounds__(kThreads, 1) gdn_fused_kernel(const __grid_constant__ FusedArgs args) {
  const trace::BlockTrace trace_block(trace::kFused);
  const GdnFusedParams& p = args.p;
  using LayA = Q4Layout<H>;
  using LayC = Q4Layout<VD>;
  extern __shared__ __align__(128) char smem[];
  float* S_s = reinterpret_cast<float*>(smem);
  float* o_s = reinterpret_cast<float*>(smem + kStateBytes);  // phase C, over the rings
  float* xa_s = reinterpret_cast<float*>(smem + kStateBytes + kRingBytes);
  float* part_s = xa_s;  // phase B: [2][kRowGroups][kD] partial sums of S'^T k and S'^T q
  __shared__ float q_s[kD], k_s[kD], v_s[kD];
  __shared__ float red_s[32], norm_s[3], ss_s[kStrips];
  __shared__ __align__(8) unsigned long long state_bar;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, G = gridDim.x;
  const int n_warps = G * kWarps, rank = warp * G + blockIdx.x;
  const int key_dim = p.n_k * kD, conv_dim = 2 * key_dim + VD;
  const int n_a = (p.in_proj.rows + LayA::kRowsPerChunk - 1) / LayA::kRowsPerChunk;
  constexpr int n_c = H / LayC::kRowsPerChunk;
  // Phase C ranks: the warps of blocks without a head first (they reach barrier 2 early, loads in flight).
  const int head_blocks = min(p.n_v, G), free_blocks = G - head_blocks;
  const int rank_c = blockIdx.x >= head_blocks ? warp * free_blocks + (blockIdx.x - head_blocks)
                                               : kWarps * free_blocks + warp * head_blocks + blockIdx.x;
  char* ring = smem + kStateBytes + warp * kStages * kStageBytes;
  const int strip = warp % kStrips, g0 = warp / kStrips, col = strip * 32 + lane;  // phase B

  if (threadIdx.x == 0) mbar_init(&state_bar);
  // Weights first (no kernel writes them): the in_proj ring, the out_proj rows into L2.
#pragma unroll
  for (int k = 0; k < kStages; ++k) {
    if (rank + k * n_warps < n_a) issue_chunk<H>(p.in_proj, rank + k * n_warps, lane, ring + k * kStageBytes);
    cp_async_commit();
  }
  for (int u = rank_c; u < n_c; u += n_warps) prefetch_q4_chunk_l2<VD>(p.out_proj, u, lane);
  __syncthreads();  // state_bar initialised

  // Head h's inputs: the state (bulk copy into S_s, one thread), this thread's conv channel, weights and history.
  HeadIn cin;
  int pos = 0;
  auto conv_channel = [&](int h) {
    const int c = threadIdx.x, kh = h / (p.n_v / p.n_k);
    return c < kD ? kh * kD + c : c < 2 * kD ? key_dim + kh * kD + (c - kD) : 2 * key_dim + h * kD + (c - 2 * kD);
  };
  auto fetch_weights = [&](int h) {
    cin.A_log = p.A_log[h], cin.dt_bias = p.dt_bias[h], cin.norm_w = warp < kStrips ? p.norm_w[col] : 0.0f;
    if (threadIdx.x >= kConvChannels) return;
    cin.ch = conv_channel(h);
#pragma unroll
    for (int k = 0; k < kK; ++k) cin.w[k] = p.conv_w[static_cast<size_t>(cin.ch) * kK + k];
  };
  auto fetch_state = [&](int h) {
    if (threadIdx.x == 0) bulk_load(S_s, p.S + static_cast<size_t>(h) * kD * kD, kStateBytes, &state_bar);
    pos = *p.pos;
    if (threadIdx.x >= kConvChannels) return;
#pragma unroll
    for (int k = 0; k < kK - 1; ++k)  // position pos - K + 1 + k lives in slot (pos + 1 + k) % K
      cin.x[k] = p.conv_ring[static_cast<size_t>((pos + 1 + k) % kK) * conv_dim + cin.ch];
  };
  const bool has_head = blockIdx.x < p.n_v;
  if (has_head) fetch_weights(blockIdx.x);
  if (has_head && p.prefetch_state) fetch_state(blockIdx.x);
  pdl_wait();
  if (has_head && !p.prefetch_state) fetch_state(blockIdx.x);

  // ---- phase A: x = RMSNorm(h), proj = W_in x ----
  block_load_x_as(p.h, p.input_norm, p.eps, H, xa_s, red_s, args.x_threads);
  for (int k = 0, chunk = rank; chunk < n_a; ++k, chunk += n_warps) {
    char* stage = ring + (k % kStages) * kStageBytes;
    cp_async_wait<kStages - 1>();  // this lane's copies of the chunk have landed
    __syncwarp();                  // ... and every lane's
    float part[LayA::kPasses];
    dot_stage<H>(stage, xa_s, lane, part);
    __syncwarp();  // the stage is free again
    if (chunk + kStages * n_warps < n_a) issue_chunk<H>(p.in_proj, chunk + kStages * n_warps, lane, stage);
    cp_async_commit();
    group_reduce_scatter<LayA::kPasses, LayA::kLanesPerRow>(part, lane);
    const int row = out_row<H>(chunk, lane);
    if (writes_row<H>(lane) && row < p.in_proj.rows) p.proj[row] = part[0];
  }
  cp_async_wait<0>();

  grid_barrier(p.barrier);
  // Every block has arrived, so all are resident: blocks of a dependent launched now can only take room no block
  // of this grid is waiting for.
  pdl_launch_dependents();

  // ---- phase B: the recurrent step, a value head a block ----
  const float* gates = p.proj + conv_dim + VD;  // [b (n_v) | a (n_v)] after q|k|v and z
  int last_head = -1;
  for (int h = blockIdx.x, i = 0; h < p.n_v; h += G, ++i) {
    if (i > 0) {  // grids smaller than n_v: write the previous head back, fetch this one
      if (threadIdx.x == 0) {
        bulk_store(p.S + static_cast<size_t>(last_head) * kD * kD, S_s, kStateBytes);
        bulk_wait_read();
      }
      fetch_weights(h);
      fetch_state(h);
    }
    // Eq 14: conv + SiLU of the current vector; it goes to ring slot pos % K (read by no block in this step).
    if (threadIdx.x < kConvChannels) {
      cin.x[kK - 1] = __ldcg(p.proj + cin.ch);
      float acc = 0.0f;
#pragma unroll
      for (int k = 0; k < kK; ++k) acc += cin.w[k] * cin.x[k];
      p.conv_ring[static_cast<size_t>(pos % kK) * conv_dim + cin.ch] = cin.x[kK - 1];
      const float y = gdn_silu(acc);
      const int c = threadIdx.x;
      if (c < kD) q_s[c] = y;
      else if (c < 2 * kD) k_s[c - kD] = y;
      else v_s[c - 2 * kD] = y;
    }
    const float b_logit = __ldcg(gates + h), a_in = __ldcg(gates + p.n_v + h) + cin.dt_bias;
    const float z = warp < kStrips ? __ldcg(p.proj + conv_dim + static_cast<size_t>(h) * kD + col) : 0.0f;
    __syncthreads();
    // Eq 16: warps 0 and 1 take |q|^2 and |k|^2, warp 2 the raw q.k (scaled afterwards), as gdn_step.
    if (warp < 3) {
      float acc = 0.0f;
      for (int i2 = lane; i2 < kD; i2 += 32)
        acc += warp == 0 ? q_s[i2] * q_s[i2] : warp == 1 ? k_s[i2] * k_s[i2] : q_s[i2] * k_s[i2];
      acc = warp_sum(acc);
      if (lane == 0) norm_s[warp] = warp == 2 ? acc : 1.0f / sqrtf(acc + 1e-6f);
    }
    float beta, decay;
    gdn_gates(b_logit, a_in, cin.A_log, beta, decay);  // eq 17
    __syncthreads();
    const float q_inv = norm_s[0] * (1.0f / sqrtf(static_cast<float>(kD))), k_inv = norm_s[1];
    const float kq = norm_s[2] * q_inv * k_inv;  // k_hat . q_hat
    if (threadIdx.x < kD) {
      q_s[threadIdx.x] *= q_inv;
      k_s[threadIdx.x] *= k_inv;
    }
    __syncthreads();  // normalised q_s, k_s visible
    mbar_wait(&state_bar, static_cast<unsigned>(i & 1));

    // Eq 18: row groups g0 and g0 + 4 of column col, one pass over S' for both reductions over d_k.
    float s_reg[2][16];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int g = g0 + 4 * half;
      float sk = 0.0f, sq = 0.0f;
#pragma unroll
      for (int r = 0; r < 16; ++r) {
        const int row = g * 16 + r;
        s_reg[half][r] = S_s[row * kD + col];
        s_reg[half][r] *= decay;
        sk += s_reg[half][r] * k_s[row];
        sq += s_reg[half][r] * q_s[row];
      }
      part_s[g * kD + col] = sk;
      part_s[(kRowGroups + g) * kD + col] = sq;
    }
    __syncthreads();
    float kv = 0.0f, sqv = 0.0f;
#pragma unroll
    for (int g = 0; g < kRowGroups; ++g) {
      kv += part_s[g * kD + col];
      sqv += part_s[(kRowGroups + g) * kD + col];
    }
    const float e = (v_s[col] - kv) * beta;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int r = 0; r < 16; ++r) {
        const int row = (g0 + 4 * half) * 16 + r;
        S_s[row * kD + col] = s_reg[half][r] + k_s[row] * e;
      }
    }
    const float o = sqv + e * kq;
    // Eq 19: the head's sum of o^2 strip by strip, in strip order (gdn_step's cluster ranks).
    if (warp < kStrips) {
      const float ss = warp_sum(o * o);
      if (lane == 0) ss_s[warp] = ss;
    }
    fence_proxy_async();  // S_s is read by the bulk copy back to global memory
    __syncthreads();
    float total = 0.0f;
    for (int r = 0; r < kStrips; ++r) total += ss_s[r];
    const float inv_rms = rsqrtf(total / static_cast<float>(kD) + p.eps);
    if (warp < kStrips) p.o[static_cast<size_t>(h) * kD + col] = cin.norm_w * (o * inv_rms) * siluf_(z);
    last_head = h;
  }

  // Phase C's first unit: weights (L2 hits) and residual before the barrier.
  Q4Chunk<VD> wc;
  float res = 0.0f;
  auto load_c = [&](int u) {
    load_chunk<VD>(p.out_proj, u, lane, wc);
    const int row = out_row<VD>(u, lane);
    res = writes_row<VD>(lane) ? p.h[row] : 0.0f;
  };
  if (rank_c < n_c) load_c(rank_c);

  grid_barrier(p.barrier);

  // ---- phase C: h += W_out o ----
  if (threadIdx.x == 0 && last_head >= 0) {
    bulk_store(p.S + static_cast<size_t>(last_head) * kD * kD, S_s, kStateBytes);
  }
  for (int i = threadIdx.x; i < VD / 4; i += kThreads) {  // 4 consecutive elements stay contiguous when padded
    *reinterpret_cast<float4*>(o_s + xpad(4 * i)) = __ldcg(reinterpret_cast<const float4*>(p.o) + i);
  }
  __syncthreads();
  for (int u = rank_c; u < n_c; u += n_warps) {
    if (u != rank_c) load_c(u);
    float part[LayC::kPasses];
    wc.dot(o_s, lane % LayC::kLanesPerRow, part);
    group_reduce_scatter<LayC::kPasses, LayC::kLanesPerRow>(part, lane);
    if (writes_row<VD>(lane)) p.h[out_row<VD>(u, lane)] = res + part[0];
  }
  if (threadIdx.x == 0 && last_head >= 0) bulk_wait_all();  // the state is in global memory before the grid ends
}

// ---- launcher --------------------------------------------------------------------------------------------------

template <int H, int VD>
cudaError_t launch_fused(const GdnFusedParams& p, cudaStream_t stream) {
  auto kernel = gdn_fused_kernel<H, VD>;
  const size_t smem = fused_smem_bytes(H);
  CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  int blocks = 0, sms = 0;
  CUDA_TRY(persistent_grid(kernel, kThreads, smem, p.grid_blocks, blocks, sms));
  const int x_threads = gemv_q4_async_threads(p.in_proj, sms);
  if (x_threads > kThreads || H > 16 * x_threads) return cudaErrorInvalidValue;  // block_load_x_as's fast path
  return launch_pdl(kernel, dim3(blocks), dim3(kThreads), smem, stream, FusedArgs{p, x_threads});
}

template <int H>
cudaError_t launch_for_value_dim(const GdnFusedParams& p, cudaStream_t stream) {
  switch (p.n_v * p.d_v) {
    case 2048: return launch_fused<H, 2048>(p, stream);
    case 4096: return launch_fused<H, 4096>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

bool gdn_fused_supported(const GdnFusedParams& p) {
  const int H = p.in_proj.cols, VD = p.n_v * p.d_v;
  if (H != 1024 && H != 2048) return false;
  if (p.d_k != kD || p.d_v != kD || p.kernel != kK || VD != 2048 && VD != 4096) return false;
  if (p.n_k <= 0 || p.n_v % p.n_k != 0) return false;
  const int conv_dim = 2 * p.n_k * kD + VD;
  if (!is_q4(p.in_proj, conv_dim + VD + 2 * p.n_v, H) || !is_q4(p.out_proj, H, VD)) return false;
  return p.h && aligned16(p.h) && p.input_norm && aligned16(p.input_norm) && p.conv_w && p.A_log && p.dt_bias &&
         p.norm_w && p.conv_ring && p.S && aligned16(p.S) && p.pos && p.proj && p.o && aligned16(p.o) && p.barrier &&
         p.grid_blocks >= 0;
}

cudaError_t gdn_fused(const GdnFusedParams& p, cudaStream_t stream) {
  if (!gdn_fused_supported(p)) return cudaErrorInvalidValue;
  switch (p.in_proj.cols) {
    case 1024: return launch_for_value_dim<1024>(p, stream);
    case 2048: return launch_for_value_dim<2048>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace lily::cuda
