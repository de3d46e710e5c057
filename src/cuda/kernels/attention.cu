// Gated full attention for batch-1 decode (eqs 7-12 of shared/MODEL.md): attn_prep, attn_decode, attn_combine.
//
// attn_prep (eqs 9-10 + KV append): one block per head, one thread per dim. Blocks 0..nq-1 take query head j
//   (proj[j*2*D .. +D]): q = RMSNorm(qt) * q_norm, NeoX RoPE on dims 0..rot-1 (pairs (i, i+rot/2), inv_freq rounded
//   to fp32 from 1/theta^(2i/rot) in double, angle = float(pos) * inv_freq in fp32, exactly as the CPU reference).
//   Blocks nq..nq+nkv-1 take kv head m: the same for k with k_norm, then k and v go to row pos of the caches (bf16).
//
// attn_decode (eq 11, flash-decoding): grid (nkv, n_splits), 4 warps. Block (m, s) takes cache rows
//   [s*chunk, min((s+1)*chunk, n)) with n = pos+1, chunk = ceil(n/n_splits) rounded up to kTileRows; an empty
//   range writes max = -inf, sum = 0, o = 0. GQA packing: the block serves the group = nq/nkv <= 8 query heads of
//   kv head m, so each K/V row is read once. Warps take 16-row tiles round-robin, each with its own 3-stage cp.async
//   pipeline (16-byte coalesced loads: one 512-byte row per warp instruction), and run both products on the tensor
//   cores (mma.sync m16n8k16 bf16, fp32 accumulate):
//     S[h, r] = q_h . K_r:  A = [q_hi; q_lo] (16 x 256, q pre-scaled by scale*log2(e) and split into two bf16 so
//                           that q_hi + q_lo carries 16 mantissa bits), B = K tile (bf16 exactly as cached).
//                           C rows h and h+8 are the hi and lo products; their sum is the fp32-accurate score.
//     O^T[:, h] += V^T P^T: A = V^T (ldmatrix.trans of the V tile), B = p_hi^T then p_lo^T into the same fp32
//                           accumulators; B comes straight from the S accumulators (no shuffles), and O^T takes
//                           64 registers a lane instead of 128 for O = [p_hi; p_lo] V.
//   K and V are exact bf16, so the only rounding beyond fp32 accumulation is the 2^-17 relative split error.
//   Online softmax in log2 units per warp (O rescaled only when a max grew); the 4 warps merge in shared memory;
//   the block writes its unnormalised o [group, D] and (max, sum) with the max back in natural-log units.
//   Memory-bound: moves n * nkv * D * 2 bytes * 2 (K and V); target >= 85% of 4.27 TB/s at long context.
//   Measured (H200, graph replay, cold L2, decode + combine): 128K rows 78.7 us = 3.41 TB/s (80%; decode alone
//   75.0 us), 32K 30.0 us (2.23 TB/s), 4K 12.7 us, 1K 10.7 us at n_splits 64-66 (= SMs / nkv), which is within 5%
//   of the best split count at every context; a single block streams only ~60 GB/s, so splits must fill the SMs.
//   158 registers, no spills; 211,200 B of shared memory (1 block per SM).
//   Programmatic dependent launch: with prefetch_cache, pos and the first tiles of rows < pos are fetched before
//   waiting for attn_prep (the tile holding row pos, only ever a warp's last, after it); q always after it.
//
// attn_combine (eqs 11-12): grid (nq, D/32); merges the splits with exp(m_s - M) weights, divides by the sum and
//   multiplies by sigmoid(gate). Moves n_splits * nq * D * 4 bytes of partials.
#include <cmath>

#include "cuda/kernels/attention.cuh"
#include "cuda/kernels/attention_util.cuh"

namespace lily::cuda {

namespace {

using namespace attn_util;

constexpr int kHeadDim = 256;
constexpr int kMaxGroup = 8;    // query heads per block: rows 0-7 (hi) and 8-15 (lo) of the A operand
constexpr int kTileRows = 16;   // cache rows per warp iteration = one k-step of the P V product
constexpr int kWarps = 4;
constexpr int kStages = 3;
constexpr int kRowPitch = kHeadDim + 8;  // bf16 per smem row; the extra 16 B make ldmatrix conflict-free
constexpr int kTileElems = kTileRows * kRowPitch;
constexpr int kOutPitch = kHeadDim + 8;  // floats per row of the warp-merge buffer
constexpr size_t kQBytes = 2 * kMaxGroup * kRowPitch * sizeof(__nv_bfloat16);
constexpr size_t kDecodeSmemBytes = kQBytes + size_t{kWarps} * kStages * 2 * kTileElems * sizeof(__nv_bfloat16);
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kMaxSplits = 4096;  // the combine keeps (max, sum) of every split in 32 KiB of shared memory

static_assert(size_t{kWarps} * kMaxGroup * (kOutPitch + 2) * sizeof(float) <= kDecodeSmemBytes - kQBytes);

// ---- helpers (the rest: attention_util.cuh) --------------------------------------------------------------------

// (x0, x1) -> packed bf16 pairs hi and lo with x ~= hi + lo to 2^-17 relative; x0 in the low half.
__device__ __forceinline__ void split_bf16x2(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
  const float2 hf = __bfloat1622float2(h);
  const __nv_bfloat162 l = __floats2bfloat162_rn(x0 - hf.x, x1 - hf.y);
  hi = *reinterpret_cast<const uint32_t*>(&h);
  lo = *reinterpret_cast<const uint32_t*>(&l);
}

// ---- attn_prep -----------------------------------------------------------------------------------------------

__global__ void attn_prep_kernel(const __grid_constant__ AttnPrepParams p) {
  __shared__ float y_s[1024];
  __shared__ float scratch[32];
  const int D = p.head_dim, d = threadIdx.x, b = blockIdx.x;
  const bool is_q = b < p.nq;
  const int m = b - p.nq;  // kv head for the k/v blocks
  const float* src = is_q ? p.proj + static_cast<size_t>(b) * 2 * D : p.proj + static_cast<size_t>(p.nq) * 2 * D + m * D;
  const float* w = is_q ? p.q_norm : p.k_norm;
  pdl_launch_dependents();
  const float w_d = w[d];  // a weight: before waiting for the projection GEMV
  pdl_wait();
  const int pos = *p.pos;

  // Eq 9 (multiplier form, as cpu::rms_norm): y = x * (1 / sqrt(mean x^2 + eps)) * w.
  const float x = src[d];
  const float ss = block_sum(x * x, scratch);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(D) + p.eps);
  float y = __fmul_rn(__fmul_rn(x, inv), w_d);
  y_s[d] = y;
  __syncthreads();

  y = rope_element(y_s, d, p.rotary_dim, p.rope_theta, pos);  // eq 10

  if (is_q) {
    p.q[static_cast<size_t>(b) * D + d] = y;
  } else {
    const size_t row = (static_cast<size_t>(pos) * p.nkv + m) * D + d;
    p.k_cache[row] = __float2bfloat16_rn(y);
    const float* v_src = p.proj + static_cast<size_t>(p.nq) * 2 * D + static_cast<size_t>(p.nkv + m) * D;
    p.v_cache[row] = __float2bfloat16_rn(v_src[d]);
  }
}

// ---- attn_decode ---------------------------------------------------------------------------------------------

// Online-softmax state of one warp. Lane (g = lane/4, t = lane%4) owns the softmax of head g (m_run, and a partial
// l_run over its rows; the 4 lanes of a head are summed at the end) and, for O^T [D, 8 heads] in m16n8 accumulator
// layout, o[mt][0..1] = dim 16mt + g, heads 2t, 2t+1 and o[mt][2..3] = dim 16mt + 8 + g, heads 2t, 2t+1.
struct WarpAttnState {
  float o[kHeadDim / 16][4];
  float m_run;  // running max of head g, log2 units
  float l_run;  // this lane's part of sum exp2(s - m_run) for head g
};

__device__ __forceinline__ void cp_async_16_full(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}

// Issue the cp.async copies of one 16-row K and V tile (one 512-byte row per warp instruction); rows >= row_end
// (only in the last tile of a range) are zero-filled and never read from memory.
__device__ __forceinline__ void load_tile(const AttnDecodeParams& p, int m, int r0, int row_end, __nv_bfloat16* k_dst,
                                          __nv_bfloat16* v_dst, int lane) {
  const size_t row_stride = static_cast<size_t>(p.nkv) * kHeadDim;
  const size_t base = (static_cast<size_t>(r0) * p.nkv + m) * kHeadDim + lane * 8;
  const __nv_bfloat16* k_src = p.k_cache + base;
  const __nv_bfloat16* v_src = p.v_cache + base;
  const uint32_t k_s = smem_u32(k_dst + lane * 8), v_s = smem_u32(v_dst + lane * 8);
  if (r0 + kTileRows <= row_end) {
#pragma unroll
    for (int it = 0; it < kTileRows; ++it) {
      cp_async_16_full(k_s + it * kRowPitch * 2, k_src + it * row_stride);
      cp_async_16_full(v_s + it * kRowPitch * 2, v_src + it * row_stride);
    }
  } else {
    for (int it = 0; it < kTileRows; ++it) {
      const bool valid = r0 + it < row_end;
      const size_t off = valid ? it * row_stride : 0;
      cp_async_16(k_s + it * kRowPitch * 2, k_src + off, valid);
      cp_async_16(v_s + it * kRowPitch * 2, v_src + off, valid);
    }
  }
}

// One tile: scores on the tensor cores, online-softmax update, O^T += V^T P^T on the tensor cores.
__device__ __forceinline__ void attend_tile(WarpAttnState& st, uint32_t q_addr, uint32_t k_addr, uint32_t v_addr,
                                            int r0, int row_end, int lane) {
  const int t = lane % 4;
  // S = [q_hi; q_lo] K^T for rows r0..r0+15 (two n-tiles of 8 rows); even/odd k-steps in separate accumulators
  // so that the dependent mma chains are half as long. C rows g / g+8 = hi / lo part of head g.
  float s_acc[2][2][4] = {};
#pragma unroll
  for (int kk = 0; kk < kHeadDim / 16; ++kk) {
    uint32_t a[4], b[4];
    ldmatrix_x4(a, q_addr + kk * 32);
    ldmatrix_x4(b, k_addr + kk * 32);
    mma_bf16(s_acc[kk & 1][0], a, b[0], b[1]);
    mma_bf16(s_acc[kk & 1][1], a, b[2], b[3]);
  }
  float s[2][2];  // [n-tile][e]: head g, row r0 + 8*n-tile + 2t + e
  float tile_max = -INFINITY;
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float v = (s_acc[0][nt][e] + s_acc[0][nt][e + 2]) + (s_acc[1][nt][e] + s_acc[1][nt][e + 2]);
      s[nt][e] = r0 + nt * 8 + 2 * t + e < row_end ? v : -INFINITY;
      tile_max = fmaxf(tile_max, s[nt][e]);
    }
  tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
  tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
  const float m_new = fmaxf(st.m_run, tile_max);                       // finite: row r0 is always in range
  const float alpha = m_new > st.m_run ? exp2f(st.m_run - m_new) : 1.0f;  // 0 on the first tile (m_run = -inf)
  st.m_run = m_new;
  float pr[2][2];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) pr[nt][e] = exp2f(s[nt][e] - m_new);
  st.l_run = st.l_run * alpha + (pr[0][0] + pr[0][1]) + (pr[1][0] + pr[1][1]);
  // Rescale O only when some head's max grew (rare after the first tiles). Lane (g, t) holds heads 2t and 2t+1,
  // whose alphas live in lanes 8t and 8t + 4.
  if (__any_sync(0xffffffffu, alpha != 1.0f)) {
    const float a0 = __shfl_sync(0xffffffffu, alpha, 8 * t), a1 = __shfl_sync(0xffffffffu, alpha, 8 * t + 4);
#pragma unroll
    for (int mt = 0; mt < kHeadDim / 16; ++mt) {
      st.o[mt][0] *= a0;
      st.o[mt][2] *= a0;
      st.o[mt][1] *= a1;
      st.o[mt][3] *= a1;
    }
  }
  // B = P^T (16 rows x 8 heads) straight from the S accumulators: b0 = rows 2t, 2t+1, b1 = rows 8+2t, 9+2t of head g.
  // The hi and lo parts accumulate into the same O^T.
  uint32_t b_hi[2], b_lo[2];
  split_bf16x2(pr[0][0], pr[0][1], b_hi[0], b_lo[0]);
  split_bf16x2(pr[1][0], pr[1][1], b_hi[1], b_lo[1]);
#pragma unroll
  for (int mt = 0; mt < kHeadDim / 16; ++mt) {
    uint32_t a[4];  // A = V^T (dims 16mt..16mt+15 x the 16 rows)
    ldmatrix_x4_trans(a, v_addr + mt * 32);
    mma_bf16(st.o[mt], a, b_hi[0], b_hi[1]);
    mma_bf16(st.o[mt], a, b_lo[0], b_lo[1]);
  }
}

// The warps' (m, l, o) merged in shared memory and written as this split's partials.
__device__ __forceinline__ void write_partials(const AttnDecodeParams& p, WarpAttnState& st, float* merge_s, int m,
                                               int split, int group) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  st.l_run += __shfl_xor_sync(0xffffffffu, st.l_run, 1);
  st.l_run += __shfl_xor_sync(0xffffffffu, st.l_run, 2);
  float* o_w = merge_s + warp * kMaxGroup * kOutPitch;     // [kMaxGroup][kOutPitch]
  float* ml_s = merge_s + kWarps * kMaxGroup * kOutPitch;  // [kWarps][kMaxGroup][2]
#pragma unroll
  for (int mt = 0; mt < kHeadDim / 16; ++mt) {
    o_w[(2 * t) * kOutPitch + 16 * mt + g] = st.o[mt][0];
    o_w[(2 * t + 1) * kOutPitch + 16 * mt + g] = st.o[mt][1];
    o_w[(2 * t) * kOutPitch + 16 * mt + 8 + g] = st.o[mt][2];
    o_w[(2 * t + 1) * kOutPitch + 16 * mt + 8 + g] = st.o[mt][3];
  }
  if (t == 0) {
    ml_s[(warp * kMaxGroup + g) * 2] = st.m_run;
    ml_s[(warp * kMaxGroup + g) * 2 + 1] = st.l_run;
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < group * kHeadDim; idx += blockDim.x) {
    const int h = idx / kHeadDim, d = idx % kHeadDim;
    float mx = -INFINITY;
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, ml_s[(w * kMaxGroup + h) * 2]);
    float o = 0.0f, l = 0.0f;
    for (int w = 0; w < kWarps; ++w) {
      const float mw = ml_s[(w * kMaxGroup + h) * 2];
      const float f = mw == -INFINITY ? 0.0f : exp2f(mw - mx);  // warps without rows contribute nothing
      o += f * merge_s[(w * kMaxGroup + h) * kOutPitch + d];
      l += f * ml_s[(w * kMaxGroup + h) * 2 + 1];
    }
    const size_t head = static_cast<size_t>(split) * p.nq + static_cast<size_t>(m) * group + h;
    p.part_o[head * kHeadDim + d] = o;
    if (d == 0) {
      p.part_ml[head * 2] = mx * kLn2;  // -inf stays -inf
      p.part_ml[head * 2 + 1] = l;
    }
  }
}

__global__ void __launch_bounds__(kWarps * 32, 1) attn_decode_kernel(const __grid_constant__ AttnDecodeParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  __nv_bfloat16* q_s = reinterpret_cast<__nv_bfloat16*>(smem);  // [16][kRowPitch]: rows 0-7 q_hi, 8-15 q_lo
  __nv_bfloat16* tiles_s = q_s + 2 * kMaxGroup * kRowPitch;      // [kWarps][kStages][K, V][kTileElems]
  const int m = blockIdx.x, split = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = p.nq / p.nkv;
  pdl_launch_dependents();
  if (!p.prefetch_cache) pdl_wait();
  const int pos = *p.pos, n = pos + 1;
  const int chunk = ((n + p.n_splits - 1) / p.n_splits + kTileRows - 1) / kTileRows * kTileRows;
  const int row_begin = min(split * chunk, n), row_end = min(row_begin + chunk, n);

  // Start the first tiles' copies before anything else so that their latency overlaps the q staging (and, with
  // prefetch_cache, attn_prep). A tile holding row pos (appended by attn_prep; only the warp's last tile can) is
  // deferred until after the wait, in a commit group of its own: its iteration waits for all groups.
  __nv_bfloat16* warp_tiles = tiles_s + static_cast<size_t>(warp) * kStages * 2 * kTileElems;
  const int n_tiles = (row_end - row_begin + kTileRows - 1) / kTileRows;
  const int my_tiles = warp < n_tiles ? (n_tiles - warp + kWarps - 1) / kWarps : 0;
  auto tile_row = [&](int i) { return row_begin + (warp + i * kWarps) * kTileRows; };
  int deferred = -1;
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) {
    if (i < my_tiles) {
      if (!p.prefetch_cache || min(tile_row(i) + kTileRows, row_end) <= pos) {
        load_tile(p, m, tile_row(i), row_end, warp_tiles + i * 2 * kTileElems,
                  warp_tiles + (i * 2 + 1) * kTileElems, lane);
      } else {
        deferred = i;
      }
    }
    cp_async_commit();
  }
  if (p.prefetch_cache) pdl_wait();
  if (deferred >= 0) {
    load_tile(p, m, tile_row(deferred), row_end, warp_tiles + deferred * 2 * kTileElems,
              warp_tiles + (deferred * 2 + 1) * kTileElems, lane);
    cp_async_commit();
  }
  // q of the group into registers (16-byte loads, all issued before use): a load-convert-store loop would make
  // one dependent L2 round trip per iteration (SASS of the first version: 16 of them, ~5 us at every context).
  constexpr int kQVecs = kMaxGroup * kHeadDim / 4 / (kWarps * 32);
  float4 q_reg[kQVecs];
#pragma unroll
  for (int u = 0; u < kQVecs; ++u) {
    const int idx = (threadIdx.x + u * kWarps * 32) * 4;
    q_reg[u] = idx / kHeadDim < group
                   ? *reinterpret_cast<const float4*>(p.q + static_cast<size_t>(m) * group * kHeadDim + idx)
                   : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }

  const float q_mul = p.scale * kLog2e;  // scores in log2 units: softmax via exp2
#pragma unroll
  for (int u = 0; u < kQVecs; ++u) {
    const int idx = (threadIdx.x + u * kWarps * 32) * 4, h = idx / kHeadDim, d = idx % kHeadDim;
    uint32_t hi[2], lo[2];
    split_bf16x2(q_reg[u].x * q_mul, q_reg[u].y * q_mul, hi[0], lo[0]);
    split_bf16x2(q_reg[u].z * q_mul, q_reg[u].w * q_mul, hi[1], lo[1]);
    *reinterpret_cast<uint2*>(q_s + h * kRowPitch + d) = make_uint2(hi[0], hi[1]);
    *reinterpret_cast<uint2*>(q_s + (kMaxGroup + h) * kRowPitch + d) = make_uint2(lo[0], lo[1]);
  }
  __syncthreads();

  WarpAttnState st;
#pragma unroll
  for (int mt = 0; mt < kHeadDim / 16; ++mt)
#pragma unroll
    for (int e = 0; e < 4; ++e) st.o[mt][e] = 0.0f;
  st.m_run = -INFINITY;
  st.l_run = 0.0f;

  // ldmatrix lane addresses (matrix j = lane/8 of an x4 load): the A operand q takes rows (j&1)*8 + lane%8,
  // cols (j>>1)*8; K (B, non-transposed) and V (A = V^T, transposed) take rows (j>>1)*8 + lane%8, cols (j&1)*8.
  const int a_off = ((lane & 7) + ((lane >> 3) & 1) * 8) * kRowPitch + (lane >> 4) * 8;
  const int kv_off = ((lane & 7) + (lane >> 4) * 8) * kRowPitch + ((lane >> 3) & 1) * 8;
  const uint32_t q_addr = smem_u32(q_s + a_off);
  for (int i = 0; i < my_tiles; ++i) {
    if (i == my_tiles - 1) {
      cp_async_wait<0>();  // the last tile (possibly the deferred one, committed out of order) has landed ...
    } else {
      cp_async_wait<kStages - 2>();  // tile i has landed (this lane's copies) ...
    }
    __syncwarp();  // ... and every lane's; stage (i-1) % kStages is free again
    const int next = i + kStages - 1;
    if (next < my_tiles) {
      __nv_bfloat16* dst = warp_tiles + (next % kStages) * 2 * kTileElems;
      load_tile(p, m, tile_row(next), row_end, dst, dst + kTileElems, lane);
    }
    cp_async_commit();
    const __nv_bfloat16* k_s = warp_tiles + (i % kStages) * 2 * kTileElems;
    attend_tile(st, q_addr, smem_u32(k_s + kv_off), smem_u32(k_s + kTileElems + kv_off), tile_row(i), row_end, lane);
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with its tiles: the tile area becomes the merge buffer
  write_partials(p, st, reinterpret_cast<float*>(tiles_s), m, split, group);
}

// ---- attn_combine --------------------------------------------------------------------------------------------

constexpr int kCombineThreads = 256;

__global__ void __launch_bounds__(kCombineThreads) attn_combine_kernel(const __grid_constant__ AttnCombineParams p) {
  extern __shared__ float ml_s[];  // [n_splits][2]: (max, sum), then (weight exp(m_s - M), sum)
  __shared__ float scratch[32];
  __shared__ float acc_s[kCombineThreads / 32][32];
  const int j = blockIdx.x, D = p.head_dim, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int d = blockIdx.y * 32 + lane;
  pdl_launch_dependents();
  pdl_wait();  // everything read here comes from attn_decode or earlier kernels

  float mx = -INFINITY;
  for (int s = threadIdx.x; s < p.n_splits; s += blockDim.x) {
    const float2 ml = *reinterpret_cast<const float2*>(p.part_ml + (static_cast<size_t>(s) * p.nq + j) * 2);
    ml_s[2 * s] = ml.x;
    ml_s[2 * s + 1] = ml.y;
    mx = fmaxf(mx, ml.x);
  }
  mx = warp_max(mx);
  if (lane == 0) scratch[warp] = mx;
  __syncthreads();
  mx = scratch[0];
  for (int w = 1; w < kCombineThreads / 32; ++w) mx = fmaxf(mx, scratch[w]);
  __syncthreads();

  float l = 0.0f;
  for (int s = threadIdx.x; s < p.n_splits; s += blockDim.x) {  // the same thread wrote slot s above
    const float w = ml_s[2 * s] == -INFINITY ? 0.0f : expf(ml_s[2 * s] - mx);  // empty splits weigh nothing
    ml_s[2 * s] = w;
    l += w * ml_s[2 * s + 1];
  }
  l = block_sum(l, scratch);  // its barriers also publish the weights

  float acc = 0.0f;
#pragma unroll 4
  for (int s = warp; s < p.n_splits; s += kCombineThreads / 32)
    acc += ml_s[2 * s] * p.part_o[(static_cast<size_t>(s) * p.nq + j) * D + d];
  acc_s[warp][lane] = acc;
  __syncthreads();
  if (warp == 0) {
    float o = 0.0f;
    for (int w = 0; w < kCombineThreads / 32; ++w) o += acc_s[w][lane];
    const float gate = p.proj[static_cast<size_t>(j) * 2 * D + D + d];
    p.out[static_cast<size_t>(j) * D + d] = o / l * (1.0f / (1.0f + expf(-gate)));
  }
}

}  // namespace

// ---- launchers -----------------------------------------------------------------------------------------------

cudaError_t attn_prep(const AttnPrepParams& p, cudaStream_t stream) {
  if (!p.proj || !p.q_norm || !p.k_norm || !p.pos || !p.q || !p.k_cache || !p.v_cache) return cudaErrorInvalidValue;
  if (p.nq <= 0 || p.nkv <= 0 || p.head_dim <= 0 || p.head_dim > 1024 || p.head_dim % 32 != 0) return cudaErrorInvalidValue;
  if (p.rotary_dim < 0 || p.rotary_dim % 2 != 0 || p.rotary_dim > p.head_dim) return cudaErrorInvalidValue;
  return launch_pdl(attn_prep_kernel, dim3(p.nq + p.nkv), dim3(p.head_dim), 0, stream, p);
}

cudaError_t attn_decode(const AttnDecodeParams& p, cudaStream_t stream) {
  if (!p.q || !p.k_cache || !p.v_cache || !p.pos || !p.part_o || !p.part_ml) return cudaErrorInvalidValue;
  if (p.head_dim != kHeadDim || p.nkv <= 0 || p.nq % p.nkv != 0 || p.nq / p.nkv > kMaxGroup) return cudaErrorInvalidValue;
  if (p.n_splits < 1 || p.n_splits > kMaxSplits) return cudaErrorInvalidValue;
  if (reinterpret_cast<uintptr_t>(p.q) % 16 != 0) return cudaErrorInvalidValue;  // float4 loads of q
  CUDA_TRY(cudaFuncSetAttribute(attn_decode_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                static_cast<int>(kDecodeSmemBytes)));
  return launch_pdl(attn_decode_kernel, dim3(p.nkv, p.n_splits), dim3(kWarps * 32), kDecodeSmemBytes, stream,
                    p);
}

cudaError_t attn_combine(const AttnCombineParams& p, cudaStream_t stream) {
  if (!p.part_o || !p.part_ml || !p.proj || !p.out) return cudaErrorInvalidValue;
  if (p.nq <= 0 || p.head_dim <= 0 || p.head_dim % 32 != 0) return cudaErrorInvalidValue;
  if (p.n_splits < 1 || p.n_splits > kMaxSplits) return cudaErrorInvalidValue;
  return launch_pdl(attn_combine_kernel, dim3(p.nq, p.head_dim / 32), dim3(kCombineThreads),
                    2 * p.n_splits * sizeof(float), stream, p);
}

}  // namespace lily::cuda
