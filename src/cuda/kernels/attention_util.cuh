// Device helpers shared by the attention kernels (attention.cu: decode; attn_prefill.cu: prefill): a block-wide
// sum, 16-byte cp.async into shared memory, ldmatrix and the bf16 m16n8k16 tensor-core product; and, in
// attn_util::decode, attn_decode's tiles, online softmax and merge and attn_combine's merge. In their own namespace so that they never collide with the GEMV/MoE helpers of
// quant_dot.cuh.
#pragma once
#include "cuda/kernels/attention.cuh"
#include "cuda/kernels/common.cuh"

namespace lily::cuda::attn_util {

__device__ __forceinline__ float block_sum(float v, float* scratch) {
  v = warp_sum(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, n_warps = blockDim.x / 32;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < n_warps; ++w) total += scratch[w];
  __syncthreads();  // scratch may be reused right after
  return total;
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy; src_bytes = 0 zero-fills the destination (rows past the range end).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// c += A (16x16, row) * B (16x8, col), bf16 in, fp32 accumulate.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- attn_decode / attn_combine device code (attention.cu) -----------------------------------------------------
namespace decode {

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
constexpr int kCombineThreads = 256;

static_assert(size_t{kWarps} * kMaxGroup * (kOutPitch + 2) * sizeof(float) <= kDecodeSmemBytes - kQBytes);

// (x0, x1) -> packed bf16 pairs hi and lo with x ~= hi + lo to 2^-17 relative; x0 in the low half.
__device__ __forceinline__ void split_bf16x2(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
  const float2 hf = __bfloat1622float2(h);
  const __nv_bfloat162 l = __floats2bfloat162_rn(x0 - hf.x, x1 - hf.y);
  hi = *reinterpret_cast<const uint32_t*>(&h);
  lo = *reinterpret_cast<const uint32_t*>(&l);
}

// Elements idx..idx+3 (of one head: idx = h * kHeadDim + d, d % 4 == 0) of the group's q, pre-scaled by q_mul and
// split, into the A operand in shared memory: row h takes the hi parts, row kMaxGroup + h the lo parts.
__device__ __forceinline__ void store_q_split(__nv_bfloat16* q_s, int idx, float4 q, float q_mul) {
  const int h = idx / kHeadDim, d = idx % kHeadDim;
  uint32_t hi[2], lo[2];
  split_bf16x2(q.x * q_mul, q.y * q_mul, hi[0], lo[0]);
  split_bf16x2(q.z * q_mul, q.w * q_mul, hi[1], lo[1]);
  *reinterpret_cast<uint2*>(q_s + h * kRowPitch + d) = make_uint2(hi[0], hi[1]);
  *reinterpret_cast<uint2*>(q_s + (kMaxGroup + h) * kRowPitch + d) = make_uint2(lo[0], lo[1]);
}

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

// The first half of write_partials: warp `warp`'s (m, l, o) into the merge buffer (the tile area).
__device__ __forceinline__ void stash_warp_state(WarpAttnState& st, float* merge_s, int warp, int lane) {
  const int g = lane / 4, t = lane % 4;
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
}

// The second half (after a block barrier): the kWarps warps' states merged, in warp order, and written as split
// `split`'s partials of kv head m; any thread count (elements stride over the block).
__device__ __forceinline__ void merge_partials(const AttnDecodeParams& p, const float* merge_s, int m, int split,
                                               int group) {
  const float* ml_s = merge_s + kWarps * kMaxGroup * kOutPitch;
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

// The warps' (m, l, o) merged in shared memory and written as this split's partials.
__device__ __forceinline__ void write_partials(const AttnDecodeParams& p, WarpAttnState& st, float* merge_s, int m,
                                               int split, int group) {
  stash_warp_state(st, merge_s, threadIdx.x / 32, threadIdx.x % 32);
  __syncthreads();
  merge_partials(p, merge_s, m, split, group);
}

// attn_combine's work for query head j, dims d - lane .. +31 (d = 32 * slice + lane; D = p.head_dim), on
// kCombineThreads threads (warp, lane of threadIdx.x): merges the splits with
// exp(m_s - M) weights, divides by the sum and multiplies by sigmoid(gate). ml_s: 2 * n_splits floats of shared
// memory. The partials and the gate were written by an earlier kernel: plain loads.
__device__ __forceinline__ void combine_slice(const AttnCombineParams& p, int j, int D, int warp, int lane, int d,
                                              float* ml_s, float* scratch, float (*acc_s)[32]) {
  float mx = -INFINITY;
  for (int s = threadIdx.x; s < p.n_splits; s += blockDim.x) {
    const float2* src = reinterpret_cast<const float2*>(p.part_ml + (static_cast<size_t>(s) * p.nq + j) * 2);
    const float2 ml = *src;
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
    const float* gate_p = p.proj + static_cast<size_t>(j) * 2 * D + D + d;
    const float gate = *gate_p;
    p.out[static_cast<size_t>(j) * D + d] = o / l * (1.0f / (1.0f + expf(-gate)));
  }
}

}  // namespace decode

}  // namespace lily::cuda::attn_util
