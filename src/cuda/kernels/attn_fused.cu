// attn_fused (attention.cuh): the full-attention decode layer (eqs 2 and 5 for input_layernorm and the residual,
// 7-12) as ONE persistent kernel instead of gemv attn_in + attn_prep + attn_decode + attn_combine + gemv attn_out;
// the three data dependences that need the whole grid (in_proj complete -> prep, partials complete -> combine,
// combine complete -> out_proj) are grid-wide barriers (grid_barrier.cuh), not kernel boundaries (each of those
// costs ~3-4 us in the decode graph: docs/PERF_NOTES.md).
//
// Grid: 256 threads a block (8 warps; attn_combine's block size), every block that can be resident (one a SM:
// attn_decode's 211 KB of shared memory), so a barrier never waits for a block that has no place to run.
// Warp rank warp * gridDim.x + block: consecutive ranks sit in different blocks.
// Before the predecessor's wait: each warp starts the cp.async copies of its first three in_proj chunks into its
//   three-stage ring (gemv.cu's chunk layout and code; at full size that is every chunk of the warp) and
//   prefetches its out_proj rows into L2; with prefetch_cache, warps 0-3 read pos and prefetch into L2 the first
//   tiles of the block's first split-KV unit that hold only rows < pos (written in earlier steps), and the block
//   computes eq 10's cos / sin table for pos (rope_table: rope_element's arithmetic, once instead of per element).
// Phase A: x = RMSNorm(h) * input_norm with the summation order of the chain GEMV's prologue at that GEMV's block
//   size (gemv_q4_async_threads: the same x bits), then the in_proj chunks (dot_stage, group_reduce_scatter: the
//   same proj bits), written to proj. Then the block's rings are free: warps 0-3 start the cp.async copies of
//   their first tiles of rows < pos into attn_decode's tile ring (which overlays the rings), before barrier 1.
// Barrier 1, then griddepcontrol.launch_dependents (every block has arrived, so all are resident: a dependent's
//   blocks cannot take the place of one the barriers wait for).
// Phase B+C: block b takes units u = b, b + gridDim.x, ... of nkv * n_splits (unit u = kv head u % nkv, split
//   u / nkv: attn_decode's block (m, s)). Prep: the 8 warps take the group's query heads (and, in the one unit
//   whose rows hold pos, k and v of head m): attn_prep's eq 9 norm (the same eight 32-element partial sums, added
//   in the same order) and eq 10 RoPE (rope_element's rotation), q straight into attn_decode's split bf16 A
//   operand; k and v go to cache row pos as bf16 and are made visible (__threadfence, block barrier) before any
//   warp of the block copies the tile that holds row pos. No other unit reads row pos in this step (its rows are
//   < pos), so the append needs no grid barrier. Then warps 0-3 run attn_decode's tile loop (the same tiles, the
//   same warps, attention_util.cuh's code) and the block writes the unit's partials: attn_decode's bits.
// Barrier 2, then attn_combine's code (attention_util.cuh combine_slice, partials and gate read through L2) for
//   units (query head j, 32 dims) b, b + gridDim.x, ...: attn_combine's bits, to attn_out.
// Barrier 3, phase D: the block copies attn_out into shared memory, the out_proj chunks (loaded into registers
//   before barrier 2, weights prefetched into L2 at the start; warps of the blocks with no split-KV unit first)
//   go through gemv.cu's dot and reduction, one lane writes h[row] = h[row] + W_o x: each element once, a fixed
//   order, the chain's bits.
// Barrier counter: three barriers a launch flip its top bit (grid_barrier.cuh), so it alternates between 0 and
// 2^31 from launch to launch; the barrier needs only its low 31 bits at zero, which every launch leaves them.
// Bytes: in_proj 10.6 MB + out_proj 4.7 MB (4-bit with scales and biases) + (pos + 1) * nkv * D * 2 * 2 of KV
// cache at full size: 15.3 MB + 2 KiB a row (23.7 MB at 4K).
#include "cuda/kernels/attention.cuh"
#include "cuda/kernels/attention_util.cuh"
#include "cuda/kernels/gemv.cuh"
#include "cuda/kernels/grid_barrier.cuh"
#include "cuda/kernels/quant_dot.cuh"

namespace lily::cuda {

namespace {

using namespace gemv_q4;
namespace ad = attn_util::decode;

constexpr int kThreads = ad::kCombineThreads;  // combine_slice runs on the whole block
constexpr int kBlockWarps = kThreads / 32;
constexpr int kStagesA = 3;                     // in_proj chunks in flight a warp
constexpr int kRingBytes = kBlockWarps * kStagesA * kStageBytes;
constexpr int kVirtual = 2;                     // x's summation emulates blocks of up to kVirtual * kThreads threads
constexpr int kElemsPerLane = ad::kHeadDim / 32;  // prep: a warp holds a head, lane l its elements l + 32 i

static_assert(ad::kWarps <= kBlockWarps, "attn_decode's warps are warps 0..kWarps-1 of the block");

// Dynamic shared memory: phase A [rings | x]; phase C attn_decode's [q | tiles] (the tiles overlay the rings: they
// are copied only after the block's phase A); combine: 2 n_splits floats; phase D: x of the out_proj.
__host__ __device__ constexpr size_t max2(size_t a, size_t b) { return a > b ? a : b; }
__host__ __device__ constexpr size_t fused_smem_bytes(int hidden, int out_cols) {
  return max2(max2(static_cast<size_t>(kRingBytes) + xpad_floats(hidden) * sizeof(float), ad::kDecodeSmemBytes),
              max2(2 * ad::kMaxSplits * sizeof(float), xpad_floats(out_cols) * sizeof(float)));
}

// block_load_x's fast path (quant_dot.cuh) as a block of `threads` threads would run it (threads a multiple of 32,
// <= kVirtual * blockDim.x; cols <= 16 * threads): virtual thread t (real thread t % blockDim.x) loads the float4s
// t, t + threads, ... and sums their squares, each virtual warp sums by the same butterfly, and the warp sums are
// added in warp order. So x has the bits of the chain GEMV's prologue at its block size. Ends with __syncthreads.
__device__ __forceinline__ void block_load_x_virtual(const float* in, const float* norm_w, float eps, int cols,
                                                     float* x_s, float* red_s, int threads) {
  constexpr int kVecsPerThread = 4;
  const int n_vecs = cols / 4;
  const float4* in4 = reinterpret_cast<const float4*>(in);
  const float4* w4 = reinterpret_cast<const float4*>(norm_w);
  float4 v[kVirtual][kVecsPerThread], w[kVirtual][kVecsPerThread];
#pragma unroll
  for (int k = 0; k < kVirtual; ++k) {
    const int vt = threadIdx.x + k * blockDim.x;
#pragma unroll
    for (int t = 0; t < kVecsPerThread; ++t) {
      const int i = vt + t * threads;
      const bool valid = vt < threads && i < n_vecs;
      v[k][t] = valid ? in4[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      w[k][t] = valid ? w4[i] : make_float4(1.0f, 1.0f, 1.0f, 1.0f);
    }
  }
#pragma unroll
  for (int k = 0; k < kVirtual; ++k) {
    const int vt = threadIdx.x + k * blockDim.x;
    float ss = 0.0f;
#pragma unroll
    for (int t = 0; t < kVecsPerThread; ++t)
      ss += (v[k][t].x * v[k][t].x + v[k][t].y * v[k][t].y) + (v[k][t].z * v[k][t].z + v[k][t].w * v[k][t].w);
    ss = warp_sum(ss);
    if (vt < threads && (threadIdx.x & 31) == 0) red_s[vt >> 5] = ss;  // vt < threads is warp-uniform
  }
  __syncthreads();
  float total = 0.0f;
  for (int i = 0; i < threads / 32; ++i) total += red_s[i];
  const float inv_rms = rsqrtf(total / static_cast<float>(cols) + eps);
#pragma unroll
  for (int k = 0; k < kVirtual; ++k) {
    const int vt = threadIdx.x + k * blockDim.x;
#pragma unroll
    for (int t = 0; t < kVecsPerThread; ++t) {
      const int i = vt + t * threads;
      if (vt < threads && i < n_vecs) {  // 4 consecutive elements stay contiguous in the padded layout
        *reinterpret_cast<float4*>(x_s + xpad(4 * i)) =
            make_float4(v[k][t].x * inv_rms * w[k][t].x, v[k][t].y * inv_rms * w[k][t].y,
                        v[k][t].z * inv_rms * w[k][t].z, v[k][t].w * inv_rms * w[k][t].w);
      }
    }
  }
  __syncthreads();
}

// Eq 10's cos and sin of pos * theta_i for i < rotary_dim / 2 (cs[0][i], cs[1][i]), computed exactly as
// rope_element (common.cuh) computes them per element: inv_freq rounded to fp32 from a double power, the angle's
// product in fp32, sincosf. The same for every head and every unit, so the block computes them once, before the
// predecessor wait when pos is known then (prefetch_cache): the double pow and sincosf leave the critical path.
__device__ __forceinline__ void rope_table(int rotary_dim, float rope_theta, int pos, float (*cs)[ad::kHeadDim / 2]) {
  for (int i = threadIdx.x; i < rotary_dim / 2; i += blockDim.x) {
    const float inv_freq = static_cast<float>(1.0 / pow(static_cast<double>(rope_theta), (2.0 * i) / rotary_dim));
    sincosf(static_cast<float>(pos) * inv_freq, &cs[1][i], &cs[0][i]);
  }
}

// Eqs 9-10 for one head of 256 by one warp, as attn_prep_kernel's block of 256 threads computes it: lane l holds
// elements l + 32 i of src (read through L2: written by other blocks), the sum of squares is the eight 32-element
// warp sums added in order (attn_util::block_sum over 8 warps), y = x * (1 / sqrt(mean + eps)) * w with the same
// roundings (w_s: the multiplier in shared memory), then rope_element's rotation with the table's cos and sin, on
// the head in rope_s (this warp's 256 floats). Leaves y in y[i].
__device__ __forceinline__ void prep_head(const float* src, const float* w_s, int D, float eps, int rotary_dim,
                                          const float (*cs)[ad::kHeadDim / 2], float* rope_s, int lane,
                                          float (&y)[kElemsPerLane]) {
  float x[kElemsPerLane], part[kElemsPerLane];
#pragma unroll
  for (int i = 0; i < kElemsPerLane; ++i) x[i] = __ldcg(src + lane + 32 * i);
#pragma unroll
  for (int i = 0; i < kElemsPerLane; ++i) part[i] = warp_sum(x[i] * x[i]);
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < kElemsPerLane; ++i) ss += part[i];
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(D) + eps);
#pragma unroll
  for (int i = 0; i < kElemsPerLane; ++i) rope_s[lane + 32 * i] = __fmul_rn(__fmul_rn(x[i], inv), w_s[lane + 32 * i]);
  __syncwarp();
  const int half = rotary_dim / 2;
#pragma unroll
  for (int i = 0; i < kElemsPerLane; ++i) {
    const int d = lane + 32 * i;
    if (d >= rotary_dim) {
      y[i] = rope_s[d];
    } else {
      const int f = d < half ? d : d - half;
      const float c = cs[0][f], sn = cs[1][f];
      y[i] = d < half ? __fsub_rn(__fmul_rn(rope_s[d], c), __fmul_rn(rope_s[d + half], sn))
                      : __fadd_rn(__fmul_rn(rope_s[d], c), __fmul_rn(rope_s[d - half], sn));
    }
  }
  __syncwarp();  // rope_s may be overwritten
}

struct FusedArgs {
  AttnFusedParams p;
  int x_threads;  // block size of the chain's in_proj GEMV (its prologue's summation order)
};

// One split-KV unit: attn_decode's block (m, split) over rows [row_begin, row_end) of n = pos + 1.
struct Unit {
  int m = 0, split = 0, row_begin = 0, row_end = 0, my_tiles = 0;
  __device__ Unit(int u, int nkv, int n_splits, int pos, int warp) {
    m = u % nkv, split = u / nkv;
    const int n = pos + 1;
    const int chunk = ((n + n_splits - 1) / n_splits + ad::kTileRows - 1) / ad::kTileRows * ad::kTileRows;
    row_begin = min(split * chunk, n), row_end = min(row_begin + chunk, n);
    const int n_tiles = (row_end - row_begin + ad::kTileRows - 1) / ad::kTileRows;
    my_tiles = warp < n_tiles ? (n_tiles - warp + ad::kWarps - 1) / ad::kWarps : 0;
  }
  __device__ int tile_row(int warp, int i) const { return row_begin + (warp + i * ad::kWarps) * ad::kTileRows; }
  __device__ bool holds_pos(int pos) const { return row_begin <= pos && pos < row_end; }
};

template <int H, int OD>
__global__ void __launch_bounds__(kThreads, 1) attn_fused_kernel(const __grid_constant__ FusedArgs args) {
  const trace::BlockTrace trace_block(trace::kFused);
  const AttnFusedParams& p = args.p;
  using LayA = Q4Layout<H>;
  using LayD = Q4Layout<OD>;
  extern __shared__ __align__(128) char smem[];
  float* xa_s = reinterpret_cast<float*>(smem + kRingBytes);                        // phase A
  __nv_bfloat16* q_s = reinterpret_cast<__nv_bfloat16*>(smem);                      // phase C: [16][kRowPitch]
  __nv_bfloat16* tiles_s = q_s + 2 * ad::kMaxGroup * ad::kRowPitch;                 // [kWarps][kStages][K, V][..]
  float* ml_s = reinterpret_cast<float*>(smem);                                     // combine
  float* xd_s = reinterpret_cast<float*>(smem);                                     // phase D
  __shared__ float red_s[32], scratch[32];
  __shared__ float acc_s[kThreads / 32][32];
  __shared__ __align__(16) float rope_s[kBlockWarps][ad::kHeadDim];
  __shared__ float qn_s[ad::kHeadDim], kn_s[ad::kHeadDim];  // the q_norm and k_norm multipliers
  __shared__ float rope_cs[2][ad::kHeadDim / 2];              // eq 10's cos and sin (rope_table)

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, G = gridDim.x;
  const int n_warps = G * kBlockWarps, rank = warp * G + blockIdx.x;
  const int D = p.head_dim, group = p.nq / p.nkv, n_units = p.nkv * p.n_splits;
  const int n_a = (p.in_proj.rows + LayA::kRowsPerChunk - 1) / LayA::kRowsPerChunk;
  constexpr int n_d = H / LayD::kRowsPerChunk;
  // Phase D ranks: the warps of blocks without a split-KV unit first (they reach barrier 2 early).
  const int unit_blocks = min(n_units, G), free_blocks = G - unit_blocks;
  const int rank_d = blockIdx.x >= unit_blocks ? warp * free_blocks + (blockIdx.x - unit_blocks)
                                               : kBlockWarps * free_blocks + warp * unit_blocks + blockIdx.x;
  char* ring = smem + warp * kStagesA * kStageBytes;
  __nv_bfloat16* warp_tiles = tiles_s + static_cast<size_t>(warp) * ad::kStages * 2 * ad::kTileElems;

  // Weights first (no kernel writes them): the in_proj ring, the out_proj rows into L2, the norm multipliers.
#pragma unroll
  for (int k = 0; k < kStagesA; ++k) {
    if (rank + k * n_warps < n_a) issue_chunk<H>(p.in_proj, rank + k * n_warps, lane, ring + k * kStageBytes);
    cp_async_commit();
  }
  for (int u = rank_d; u < n_d; u += n_warps) prefetch_q4_chunk_l2<OD>(p.out_proj, u, lane);
  for (int i = threadIdx.x; i < ad::kHeadDim; i += kThreads) qn_s[i] = p.q_norm[i], kn_s[i] = p.k_norm[i];

  // The KV rows < pos of the block's first unit (appended in earlier steps) into L2, as attn_decode's
  // prefetch_cache; the tile holding row pos (appended below) is never fetched before it is written.
  AttnDecodeParams dp;
  dp.k_cache = p.k_cache, dp.v_cache = p.v_cache, dp.nq = p.nq, dp.nkv = p.nkv, dp.head_dim = D;
  dp.n_splits = p.n_splits, dp.scale = p.scale, dp.part_o = p.part_o, dp.part_ml = p.part_ml;
  auto first_tiles = [&](const Unit& un, int pos, bool copy) {  // copy: cp.async into the ring, else L2 prefetch
    int deferred = -1;
#pragma unroll
    for (int i = 0; i < ad::kStages - 1; ++i) {
      if (i < un.my_tiles) {
        const int r0 = un.tile_row(warp, i);
        if (min(r0 + ad::kTileRows, un.row_end) > pos) {
          deferred = i;
        } else if (copy) {
          ad::load_tile(dp, un.m, r0, un.row_end, warp_tiles + i * 2 * ad::kTileElems,
                        warp_tiles + (i * 2 + 1) * ad::kTileElems, lane);
        } else if ((lane & 7) == 0) {  // one 128-byte line a lane, 4 a row
          for (int r = r0; r < r0 + ad::kTileRows; ++r) {
            const size_t off = (static_cast<size_t>(r) * p.nkv + un.m) * ad::kHeadDim + lane * 8;
            prefetch_l2(p.k_cache + off);
            prefetch_l2(p.v_cache + off);
          }
        }
      }
      if (copy) attn_util::cp_async_commit();
    }
    return deferred;
  };
  int pos = 0;
  if (p.prefetch_cache) {
    pos = *p.pos;
    if (warp < ad::kWarps && blockIdx.x < n_units)
      first_tiles(Unit(blockIdx.x, p.nkv, p.n_splits, pos, warp), pos, false);
    rope_table(p.rotary_dim, p.rope_theta, pos, rope_cs);
  }
  pdl_wait();
  if (!p.prefetch_cache) {
    pos = *p.pos;
    rope_table(p.rotary_dim, p.rope_theta, pos, rope_cs);
  }

  // ---- phase A: x = RMSNorm(h), proj = W_in x ----
  block_load_x_virtual(p.h, p.input_norm, p.eps, p.in_proj.cols, xa_s, red_s, args.x_threads);
  for (int k = 0, chunk = rank; chunk < n_a; ++k, chunk += n_warps) {
    char* stage = ring + (k % kStagesA) * kStageBytes;
    cp_async_wait<kStagesA - 1>();  // this lane's copies of the chunk have landed
    __syncwarp();                   // ... and every lane's
    float part[LayA::kPasses];
    dot_stage<H>(stage, xa_s, lane, part);
    __syncwarp();  // the stage is free again
    if (chunk + kStagesA * n_warps < n_a) issue_chunk<H>(p.in_proj, chunk + kStagesA * n_warps, lane, stage);
    cp_async_commit();
    group_reduce_scatter<LayA::kPasses, LayA::kLanesPerRow>(part, lane);
    const int row = out_row<H>(chunk, lane);
    if (writes_row<H>(lane) && row < p.in_proj.rows) p.proj[row] = part[0];
  }
  cp_async_wait<0>();
  __syncthreads();  // the rings and x are free: the first unit's tiles of rows < pos may land there

  int deferred = -1;
  if (warp < ad::kWarps && blockIdx.x < n_units)
    deferred = first_tiles(Unit(blockIdx.x, p.nkv, p.n_splits, pos, warp), pos, true);

  grid_barrier(p.barrier);
  pdl_launch_dependents();

  // ---- phases B and C: prep and split-KV attention, a unit at a time ----
  const float q_mul = p.scale * ad::kLog2e;  // scores in log2 units, as attn_decode
  for (int u = blockIdx.x; u < n_units; u += G) {
    const Unit un(u, p.nkv, p.n_splits, pos, warp);
    if (u != static_cast<int>(blockIdx.x)) {
      __syncthreads();  // the previous unit's merge buffer (the tile area) has been read
      if (warp < ad::kWarps) deferred = first_tiles(un, pos, true);
    }
    // Prep: query heads m * group + h of the unit's kv head (none for an empty unit, whose tile loop reads no q);
    // item `group` (only where the rows hold pos): k and v.
    const int items = un.row_begin < un.row_end ? group + (un.holds_pos(pos) ? 1 : 0) : 0;
    for (int item = warp; item < items; item += kBlockWarps) {
      float y[kElemsPerLane];
      if (item < group) {
        const int j = un.m * group + item;
        prep_head(p.proj + static_cast<size_t>(j) * 2 * D, qn_s, D, p.eps, p.rotary_dim, rope_cs, rope_s[warp],
                  lane, y);
#pragma unroll
        for (int i = 0; i < kElemsPerLane; ++i) rope_s[warp][lane + 32 * i] = y[i];
        __syncwarp();
#pragma unroll
        for (int i = 0; i < ad::kHeadDim / 4 / 32; ++i) {
          const int e = 4 * (lane + 32 * i);
          ad::store_q_split(q_s, item * ad::kHeadDim + e, *reinterpret_cast<const float4*>(&rope_s[warp][e]), q_mul);
        }
        __syncwarp();
      } else {  // attn_prep's k/v block: row pos of both caches (bf16)
        const float* k_src = p.proj + static_cast<size_t>(p.nq) * 2 * D + static_cast<size_t>(un.m) * D;
        const float* v_src = p.proj + static_cast<size_t>(p.nq) * 2 * D + static_cast<size_t>(p.nkv + un.m) * D;
        prep_head(k_src, kn_s, D, p.eps, p.rotary_dim, rope_cs, rope_s[warp], lane, y);
        const size_t row = (static_cast<size_t>(pos) * p.nkv + un.m) * D;
#pragma unroll
        for (int i = 0; i < kElemsPerLane; ++i) {
          p.k_cache[row + lane + 32 * i] = __float2bfloat16_rn(y[i]);
          p.v_cache[row + lane + 32 * i] = __float2bfloat16_rn(__ldcg(v_src + lane + 32 * i));
        }
        __threadfence();  // row pos reaches L2 (where cp.async.cg reads it) before the block barrier below
      }
    }
    for (int idx = threadIdx.x; idx < (ad::kMaxGroup - group) * ad::kHeadDim / 4; idx += kThreads)  // unused heads
      ad::store_q_split(q_s, group * ad::kHeadDim + 4 * idx, make_float4(0.0f, 0.0f, 0.0f, 0.0f), q_mul);
    __syncthreads();  // q staged; row pos appended

    ad::WarpAttnState st;
    if (warp < ad::kWarps) {  // attn_decode's tile loop, unchanged
      if (deferred >= 0) {
        ad::load_tile(dp, un.m, un.tile_row(warp, deferred), un.row_end, warp_tiles + deferred * 2 * ad::kTileElems,
                      warp_tiles + (deferred * 2 + 1) * ad::kTileElems, lane);
        attn_util::cp_async_commit();
      }
#pragma unroll
      for (int mt = 0; mt < ad::kHeadDim / 16; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) st.o[mt][e] = 0.0f;
      st.m_run = -INFINITY;
      st.l_run = 0.0f;
      const int a_off = ((lane & 7) + ((lane >> 3) & 1) * 8) * ad::kRowPitch + (lane >> 4) * 8;
      const int kv_off = ((lane & 7) + (lane >> 4) * 8) * ad::kRowPitch + ((lane >> 3) & 1) * 8;
      const uint32_t q_addr = attn_util::smem_u32(q_s + a_off);
      for (int i = 0; i < un.my_tiles; ++i) {
        if (i == un.my_tiles - 1) {
          attn_util::cp_async_wait<0>();  // the last tile (possibly the deferred one) has landed ...
        } else {
          attn_util::cp_async_wait<ad::kStages - 2>();  // tile i has landed (this lane's copies) ...
        }
        __syncwarp();  // ... and every lane's; stage (i-1) % kStages is free again
        const int next = i + ad::kStages - 1;
        if (next < un.my_tiles) {
          __nv_bfloat16* dst = warp_tiles + (next % ad::kStages) * 2 * ad::kTileElems;
          ad::load_tile(dp, un.m, un.tile_row(warp, next), un.row_end, dst, dst + ad::kTileElems, lane);
        }
        attn_util::cp_async_commit();
        const __nv_bfloat16* k_t = warp_tiles + (i % ad::kStages) * 2 * ad::kTileElems;
        ad::attend_tile(st, q_addr, attn_util::smem_u32(k_t + kv_off),
                        attn_util::smem_u32(k_t + ad::kTileElems + kv_off), un.tile_row(warp, i), un.row_end, lane);
      }
      attn_util::cp_async_wait<0>();
    }
    deferred = -1;
    __syncthreads();  // every warp is done with its tiles: the tile area becomes the merge buffer
    float* merge_s = reinterpret_cast<float*>(tiles_s);
    if (warp < ad::kWarps) ad::stash_warp_state(st, merge_s, warp, lane);
    __syncthreads();
    ad::merge_partials(dp, merge_s, un.m, un.split, group);
  }

  // Phase D's first unit: weights (L2 hits) and residual into registers before the barriers.
  Q4Chunk<OD> wc;
  float res = 0.0f;
  auto load_d = [&](int u) {
    load_chunk<OD>(p.out_proj, u, lane, wc);
    res = writes_row<OD>(lane) ? p.h[out_row<OD>(u, lane)] : 0.0f;
  };
  if (rank_d < n_d) load_d(rank_d);

  grid_barrier(p.barrier);

  // ---- combine (eqs 11-12): attn_out = merged partials * sigmoid(gate) ----
  AttnCombineParams cp;
  cp.part_o = p.part_o, cp.part_ml = p.part_ml, cp.n_splits = p.n_splits, cp.nq = p.nq, cp.head_dim = D;
  cp.proj = p.proj, cp.out = p.attn_out;
  const int slices = D / 32;
  for (int c = blockIdx.x; c < p.nq * slices; c += G)
    ad::combine_slice<true>(cp, c / slices, D, warp, lane, (c % slices) * 32 + lane, ml_s, scratch, acc_s);

  grid_barrier(p.barrier);

  // ---- phase D: h += W_o attn_out ----
  for (int i = threadIdx.x; i < OD / 4; i += kThreads) {  // 4 consecutive elements stay contiguous when padded
    *reinterpret_cast<float4*>(xd_s + xpad(4 * i)) = __ldcg(reinterpret_cast<const float4*>(p.attn_out) + i);
  }
  __syncthreads();
  for (int u = rank_d; u < n_d; u += n_warps) {
    if (u != rank_d) load_d(u);
    float part[LayD::kPasses];
    wc.dot(xd_s, lane % LayD::kLanesPerRow, part);
    group_reduce_scatter<LayD::kPasses, LayD::kLanesPerRow>(part, lane);
    if (writes_row<OD>(lane)) p.h[out_row<OD>(u, lane)] = res + part[0];
  }
}

// ---- launcher --------------------------------------------------------------------------------------------------

template <int H, int OD>
cudaError_t launch_fused(const AttnFusedParams& p, cudaStream_t stream) {
  auto kernel = attn_fused_kernel<H, OD>;
  const size_t smem = fused_smem_bytes(H, OD);
  CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  int blocks = 0, sms = 0;
  CUDA_TRY(persistent_grid(kernel, kThreads, smem, p.grid_blocks, blocks, sms));
  const int x_threads = gemv_q4_async_threads(p.in_proj, sms);
  if (x_threads > kVirtual * kThreads || H > 16 * x_threads) return cudaErrorInvalidValue;  // block_load_x_virtual
  return launch_pdl(kernel, dim3(blocks), dim3(kThreads), smem, stream, FusedArgs{p, x_threads});
}

template <int H>
cudaError_t launch_for_out_cols(const AttnFusedParams& p, cudaStream_t stream) {
  switch (p.nq * p.head_dim) {
    case 2048: return launch_fused<H, 2048>(p, stream);
    case 4096: return launch_fused<H, 4096>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

bool attn_fused_supported(const AttnFusedParams& p) {
  const int H = p.in_proj.cols, D = p.head_dim, OD = p.nq * D;
  if (H != 1024 && H != 2048) return false;
  if (D != ad::kHeadDim || p.nkv <= 0 || p.nq % p.nkv != 0 || p.nq / p.nkv > ad::kMaxGroup) return false;
  if (OD != 2048 && OD != 4096) return false;
  if (p.rotary_dim < 0 || p.rotary_dim % 2 != 0 || p.rotary_dim > D) return false;
  if (p.n_splits < 1 || p.n_splits > ad::kMaxSplits) return false;
  if (!is_q4(p.in_proj, p.nq * 2 * D + 2 * p.nkv * D, H) || !is_q4(p.out_proj, H, OD)) return false;
  return p.h && aligned16(p.h) && p.input_norm && aligned16(p.input_norm) && p.q_norm && p.k_norm && p.pos &&
         p.k_cache && p.v_cache && p.proj && p.part_o && p.part_ml && p.attn_out && aligned16(p.attn_out) &&
         p.barrier && p.grid_blocks >= 0;
}

cudaError_t attn_fused(const AttnFusedParams& p, cudaStream_t stream) {
  if (!attn_fused_supported(p)) return cudaErrorInvalidValue;
  switch (p.in_proj.cols) {
    case 1024: return launch_for_out_cols<1024>(p, stream);
    case 2048: return launch_for_out_cols<2048>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace lily::cuda
