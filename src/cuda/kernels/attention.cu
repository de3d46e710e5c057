// Gated full attention for batch-1 decode (eqs 7-12 of docs/MODEL.md): attn_prep, attn_decode, attn_combine.
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
#include <type_traits>

#include "cuda/kernels/attention.cuh"
#include "cuda/kernels/attention_util.cuh"

namespace lily::cuda {

namespace {

using namespace attn_util;
using namespace attn_util::decode;  // constants, tiles, the online softmax and the combine: attention_util.cuh

// ---- attn_prep -----------------------------------------------------------------------------------------------

template <class Src>
__global__ void attn_prep_kernel(const __grid_constant__ Src args) {
  const trace::BlockTrace trace_block(trace::kAttnPrep);
  const AttnPrepParams& p = row_of(args);
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

template <class Src>
__global__ void __launch_bounds__(kWarps * 32, 1) attn_decode_kernel(const __grid_constant__ Src args) {
  const trace::BlockTrace trace_block(trace::kAttnDecode);
  const AttnDecodeParams& p = row_of(args);
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
  for (int u = 0; u < kQVecs; ++u) store_q_split(q_s, (threadIdx.x + u * kWarps * 32) * 4, q_reg[u], q_mul);
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

template <class Src>
__global__ void __launch_bounds__(kCombineThreads) attn_combine_kernel(const __grid_constant__ Src args) {
  const trace::BlockTrace trace_block(trace::kAttnCombine);
  const AttnCombineParams& p = row_of(args);
  extern __shared__ float ml_s[];  // [n_splits][2]: (max, sum), then (weight exp(m_s - M), sum)
  __shared__ float scratch[32];
  __shared__ float acc_s[kCombineThreads / 32][32];
  const int j = blockIdx.x, D = p.head_dim, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int d = blockIdx.y * 32 + lane;
  pdl_launch_dependents();
  pdl_wait();  // everything read here comes from attn_decode or earlier kernels
  combine_slice(p, j, D, warp, lane, d, ml_s, scratch, acc_s);
}



// ---- launchers -----------------------------------------------------------------------------------------------

cudaError_t check(const AttnPrepParams& p) {
  if (!p.proj || !p.q_norm || !p.k_norm || !p.pos || !p.q || !p.k_cache || !p.v_cache) return cudaErrorInvalidValue;
  if (p.nq <= 0 || p.nkv <= 0 || p.head_dim <= 0 || p.head_dim > 1024 || p.head_dim % 32 != 0) return cudaErrorInvalidValue;
  if (p.rotary_dim < 0 || p.rotary_dim % 2 != 0 || p.rotary_dim > p.head_dim) return cudaErrorInvalidValue;
  return cudaSuccess;
}
bool same_shape(const AttnPrepParams& a, const AttnPrepParams& b) {
  return a.nq == b.nq && a.nkv == b.nkv && a.head_dim == b.head_dim;
}
dim3 grid_of(const AttnPrepParams& p, int n) { return dim3(p.nq + p.nkv, 1, n); }
dim3 block_of(const AttnPrepParams& p) { return dim3(p.head_dim); }
size_t smem_of(const AttnPrepParams&) { return 0; }
template <class Src>
auto kernel_of(const AttnPrepParams&) { return attn_prep_kernel<Src>; }

cudaError_t check(const AttnDecodeParams& p) {
  if (!p.q || !p.k_cache || !p.v_cache || !p.pos || !p.part_o || !p.part_ml) return cudaErrorInvalidValue;
  if (p.head_dim != kHeadDim || p.nkv <= 0 || p.nq % p.nkv != 0 || p.nq / p.nkv > kMaxGroup) return cudaErrorInvalidValue;
  if (p.n_splits < 1 || p.n_splits > kMaxSplits) return cudaErrorInvalidValue;
  if (reinterpret_cast<uintptr_t>(p.q) % 16 != 0) return cudaErrorInvalidValue;  // float4 loads of q
  return cudaSuccess;
}
bool same_shape(const AttnDecodeParams& a, const AttnDecodeParams& b) {
  return a.nq == b.nq && a.nkv == b.nkv && a.n_splits == b.n_splits;
}
dim3 grid_of(const AttnDecodeParams& p, int n) { return dim3(p.nkv, p.n_splits, n); }
dim3 block_of(const AttnDecodeParams&) { return dim3(kWarps * 32); }
size_t smem_of(const AttnDecodeParams&) { return kDecodeSmemBytes; }
template <class Src>
auto kernel_of(const AttnDecodeParams&) {
  return attn_decode_kernel<Src>;
}

cudaError_t check(const AttnCombineParams& p) {
  if (!p.part_o || !p.part_ml || !p.proj || !p.out) return cudaErrorInvalidValue;
  if (p.nq <= 0 || p.head_dim <= 0 || p.head_dim % 32 != 0) return cudaErrorInvalidValue;
  if (p.n_splits < 1 || p.n_splits > kMaxSplits) return cudaErrorInvalidValue;
  return cudaSuccess;
}
bool same_shape(const AttnCombineParams& a, const AttnCombineParams& b) {
  return a.nq == b.nq && a.head_dim == b.head_dim && a.n_splits == b.n_splits;
}
dim3 grid_of(const AttnCombineParams& p, int n) { return dim3(p.nq, p.head_dim / 32, n); }
dim3 block_of(const AttnCombineParams&) { return dim3(kCombineThreads); }
size_t smem_of(const AttnCombineParams& p) { return 2 * p.n_splits * sizeof(float); }
template <class Src>
auto kernel_of(const AttnCombineParams&) {
  return attn_combine_kernel<Src>;
}

// One launch of the kernel of P for n rows (n == 1: the single-row instance).
template <class P>
cudaError_t launch_rows(const P* rows, int n, cudaStream_t stream) {
  return launch_row_batch(rows, n, check, same_shape, [&](const P& p, const auto& src) {
    using Src = std::decay_t<decltype(src)>;
    auto kernel = kernel_of<Src>(p);
    const size_t smem = smem_of(p);
    if (smem > 48 * 1024)
      CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    return launch_pdl(kernel, grid_of(p, n), block_of(p), smem, stream, src);
  });
}

}  // namespace

cudaError_t attn_prep(const AttnPrepParams& p, cudaStream_t stream) { return launch_rows(&p, 1, stream); }
cudaError_t attn_decode(const AttnDecodeParams& p, cudaStream_t stream) { return launch_rows(&p, 1, stream); }
cudaError_t attn_combine(const AttnCombineParams& p, cudaStream_t stream) { return launch_rows(&p, 1, stream); }
cudaError_t attn_prep_rows(const AttnPrepParams* rows, int n, cudaStream_t stream) {
  return launch_rows(rows, n, stream);
}
cudaError_t attn_decode_rows(const AttnDecodeParams* rows, int n, cudaStream_t stream) {
  return launch_rows(rows, n, stream);
}
cudaError_t attn_combine_rows(const AttnCombineParams* rows, int n, cudaStream_t stream) {
  return launch_rows(rows, n, stream);
}

}  // namespace lily::cuda
