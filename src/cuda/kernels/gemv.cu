// Row-parallel quantized GEMV for decode: y = W x (+ residual) for 1 .. 8 activation rows, W an MLX QMatrix
// [rows, cols] used in its checkpoint layout (no repacking), x built from `in` by an optional prologue (gemv.cuh).
//
// Memory-bound at one row: moves rows * (cols * bits / 8 + cols / 16) bytes (weights + bf16 scales and biases per
// group of 64); target >= 85% of 4.27 TB/s on large matrices (lm_head [248320, 2048]: 286 MB, 67 us at the floor).
//
// 4-bit, 4,096 columns (the out projections), scales and biases 16-byte aligned: gemv_mma_kernel, the weights on
// the tensor cores (mma.sync, the activation rows on the N side), so that 8 rows cost about what one does; one
// kernel for any row count, so a row's result does not depend on the others (see mma:: below). Measured against
// the register kernels below (H200, 4K context, 2026-12-03): one decode row 1.596 -> 1.566 ms, 8 rows 5.998 ->
// 5.710; with the 2,048-column matrices (gdn_in, attn_in, lm_head) on it too, 1.622 / 4.715, and with those alone
// 1.647 / 5.002: at 2,048 columns its longer post-wait path (the fp16 x, the team reduction) costs more at one row
// than it saves, so they stay on the register kernels.
// 4-bit, other widths: a chunk is 8192 weights = 8192 / cols consecutive rows (4 KiB of packed weights + 256 B of
// scales + 256 B of biases, all contiguous). A group of L = min(32, cols / 32 / V) lanes covers a row with V
// 16-byte vectors per lane (V = 2 from cols 2048 up): cols 512 puts two rows in a warp (half-warps), cols 4096
// gives 4 vectors per lane. A lane always handles the same vector positions of a row, so its 32-float slices of
// x are read from shared memory once per chunk for all the chunk's rows; the partial sums of the chunk's P
// row-passes are reduced by one reduce-scatter butterfly. Dequantisation: quant_dot.cuh.
//  gemv_q4_async_kernel (scales/biases 16-byte aligned): each warp streams its chunks through a 2-stage ring in
//    shared memory with cp.async (no registers held by loads in flight: ~147 KB in flight per SM), issued
//    before the prologue and, with programmatic dependent launch, before the previous kernel has finished.
//    Several rows (2,048 and 4,096 columns): gemv_q4_rows_kernel, each row bit-identical to it.
//  gemv_q4_kernel (any alignment): the same chunks loaded straight into registers, 8 x 16 B per lane.
// The grids are persistent (one block per SM or fewer; warps grid-stride over chunks), so the prologue (the norm
// of `in`) runs once per block, overlapped with the first chunks' weight loads. The residual of a lane's next
// output row is loaded a chunk ahead (the first with the prologue's inputs), never after the dot product.
// Other widths and 8-bit (gemv_generic_kernel): a warp per row, x from shared memory; for small matrices.
#include "cuda/kernels/gemv.cuh"
#include "cuda/kernels/qgemm_util.cuh"
#include "cuda/kernels/quant_dot.cuh"

#include <algorithm>

namespace lily::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kAsyncMaxWarps = 16;

// The dynamic shared memory a block may opt in to on the current device (227 KiB on Hopper, 163 on A100, 99 on
// sm_86 / sm_89 / sm_120).
size_t device_smem_optin() {
  int device = 0, optin = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess)
    return 48 * 1024;
  return static_cast<size_t>(optin);
}

using namespace gemv_q4;  // the 4-bit chunk helpers (gemv.cuh)

// Where this block's x comes from (gemv.cuh prologues).
// red_s: >= 32 floats (block sums).
__device__ __forceinline__ void build_x(const GemvParams& p, float* x_s, float* red_s) {
  if (p.prologue == GemvPrologue::gated_rms_norm) {
    block_load_x_gated(p.in, p.gate_z, p.norm_w, p.head_dim, p.eps, p.m.cols, x_s);
  } else {
    block_load_x(p.in, p.prologue == GemvPrologue::rms_norm ? p.norm_w : nullptr, p.eps, p.m.cols, x_s, red_s);
  }
}

// The residual of this lane's output row in chunk `chunk` (0 without a residual or outside the matrix). Issued a
// chunk ahead (the first one together with the prologue's loads), so that it costs no extra round trip. y may
// alias the residual: a chunk's residual rows are read before any lane writes them and by the lane that does.
template <int COLS>
__device__ __forceinline__ float load_residual(const GemvParams& p, int chunk, int n_chunks, int lane) {
  const int row = out_row<COLS>(chunk, lane);
  return p.residual && chunk < n_chunks && writes_row<COLS>(lane) && row < p.m.rows ? p.residual[row] : 0.0f;
}

template <int COLS>
__global__ void __launch_bounds__(kThreads, 2) gemv_q4_kernel(const __grid_constant__ GemvParams p) {
  const trace::BlockTrace trace_block(trace::kGemv);
  using Lay = Q4Layout<COLS>;
  __shared__ __align__(16) float x_s[xpad_floats(COLS)];
  __shared__ float red_s[32];
  const int lane = threadIdx.x & 31;
  const int j = lane % Lay::kLanesPerRow;
  const int n_chunks = (p.m.rows + Lay::kRowsPerChunk - 1) / Lay::kRowsPerChunk;
  const int warp_stride = gridDim.x * kWarps;
  int chunk = blockIdx.x * kWarps + (threadIdx.x >> 5);

  pdl_launch_dependents();
  Q4Chunk<COLS> c;
  if (chunk < n_chunks) load_chunk<COLS>(p.m, chunk, lane, c);  // in flight during the prologue
  pdl_wait();
  float res_next = load_residual<COLS>(p, chunk, n_chunks, lane);
  build_x(p, x_s, red_s);

  for (; chunk < n_chunks; chunk += warp_stride) {
    const float res = res_next;
    res_next = load_residual<COLS>(p, chunk + warp_stride, n_chunks, lane);
    float part[Lay::kPasses];
    c.dot(x_s, j, part);
    group_reduce_scatter<Lay::kPasses, Lay::kLanesPerRow>(part, lane);
    const int row = out_row<COLS>(chunk, lane);
    if (writes_row<COLS>(lane) && row < p.m.rows) p.y[row] = res + part[0];
    if (chunk + warp_stride < n_chunks) load_chunk<COLS>(p.m, chunk + warp_stride, lane, c);
  }
}

template <int COLS>
__global__ void __launch_bounds__(32 * kAsyncMaxWarps, 1) gemv_q4_async_kernel(const __grid_constant__ GemvParams p) {
  const trace::BlockTrace trace_block(trace::kGemv);
  using Lay = Q4Layout<COLS>;
  extern __shared__ __align__(16) char smem[];
  __shared__ float red_s[32];
  float* x_s = reinterpret_cast<float*>(smem);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n_warps = blockDim.x >> 5;
  char* ring = smem + xpad_floats(COLS) * sizeof(float) + warp * kStages * kStageBytes;
  const int n_chunks = (p.m.rows + Lay::kRowsPerChunk - 1) / Lay::kRowsPerChunk;
  const int first = blockIdx.x * n_warps + warp, stride = gridDim.x * n_warps;

  pdl_launch_dependents();
#pragma unroll
  for (int k = 0; k < kStages; ++k) {  // weights first: they do not depend on the previous kernel
    if (first + k * stride < n_chunks) issue_chunk<COLS>(p.m, first + k * stride, lane, ring + k * kStageBytes);
    cp_async_commit();
  }
  pdl_wait();
  float res_next = load_residual<COLS>(p, first, n_chunks, lane);
  build_x(p, x_s, red_s);

  for (int k = 0, chunk = first; chunk < n_chunks; ++k, chunk += stride) {
    char* stage = ring + (k % kStages) * kStageBytes;
    const float res = res_next;
    res_next = load_residual<COLS>(p, chunk + stride, n_chunks, lane);
    cp_async_wait<kStages - 1>();  // this lane's copies of chunk k have landed
    __syncwarp();                  // ... and every lane's
    float part[Lay::kPasses];
    dot_stage<COLS>(stage, x_s, lane, part);
    __syncwarp();  // the stage is free again
    if (chunk + kStages * stride < n_chunks) issue_chunk<COLS>(p.m, chunk + kStages * stride, lane, stage);
    cp_async_commit();
    group_reduce_scatter<Lay::kPasses, Lay::kLanesPerRow>(part, lane);
    const int row = out_row<COLS>(chunk, lane);
    if (writes_row<COLS>(lane) && row < p.m.rows) p.y[row] = res + part[0];
  }
  cp_async_wait<0>();
}

// ---- several rows (gemv_rows) ---------------------------------------------------------------------------------
// The asynchronous kernel with n_rows <= kMaxBatchRows activation rows: x_s holds every row's padded x, a chunk's
// weights are read from the stage once per group of 4 rows and the dot products, reductions and stores are the
// single-row kernel's per row, so each row is bit-identical to gemv() alone. Compute grows with the rows (~2.6
// instructions per weight and row), the weight traffic does not; the rows' FMA chains are independent, so a
// compile-time row count lets them interleave (a runtime count with a branch per row ran at ~5-10 weight-rows a
// clock per SM, 2026-12-02).

constexpr int kRowsMax = kMaxBatchRows;

// The prologue for every row. rms_norm and none: block_load_x's fast path (the launcher checks its conditions)
// with the loads of all rows first; per row the same per-thread terms (the zero terms of absent vectors left
// out: adding +0 changes nothing) and block_sum's reduction order (warp sums, then warps in order).
__device__ void build_x_rows(const GemvParams& p, float* x_s, float* red_s) {
  const int n = p.n_rows, cols = p.m.cols, n_vecs = cols / 4, xf = xpad_floats(cols);
  if (p.prologue == GemvPrologue::gated_rms_norm) {
    for (int r = 0; r < n; ++r)
      block_load_x_gated(p.in + static_cast<size_t>(r) * p.in_stride, p.gate_z + static_cast<size_t>(r) * p.z_stride,
                         p.norm_w, p.head_dim, p.eps, cols, x_s + r * xf);
    return;
  }
  const float* norm_w = p.prologue == GemvPrologue::rms_norm ? p.norm_w : nullptr;
  if (!norm_w) {
    for (int i = threadIdx.x; i < n_vecs; i += blockDim.x) {
#pragma unroll
      for (int r = 0; r < kRowsMax; ++r) {
        if (r < n) {
          const float4 v = reinterpret_cast<const float4*>(p.in + static_cast<size_t>(r) * p.in_stride)[i];
          *reinterpret_cast<float4*>(x_s + r * xf + xpad(4 * i)) = v;
        }
      }
    }
    __syncthreads();
    return;
  }
  constexpr int kVecs = 2;  // per thread and row (the launcher: n_vecs <= 2 * blockDim)
  float4 v[kRowsMax][kVecs], w[kVecs];
  float ss[kRowsMax];
#pragma unroll
  for (int t = 0; t < kVecs; ++t) {
    const int i = threadIdx.x + t * blockDim.x;
    w[t] = i < n_vecs ? reinterpret_cast<const float4*>(norm_w)[i] : make_float4(1.0f, 1.0f, 1.0f, 1.0f);
  }
#pragma unroll
  for (int r = 0; r < kRowsMax; ++r) {
#pragma unroll
    for (int t = 0; t < kVecs; ++t) {
      const int i = threadIdx.x + t * blockDim.x;
      v[r][t] = r < n && i < n_vecs ? reinterpret_cast<const float4*>(p.in + static_cast<size_t>(r) * p.in_stride)[i]
                                    : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
  }
#pragma unroll
  for (int r = 0; r < kRowsMax; ++r) {
    ss[r] = 0.0f;
#pragma unroll
    for (int t = 0; t < kVecs; ++t) {
      if (threadIdx.x + t * blockDim.x < n_vecs) ss[r] += x4_sum_squares(v[r][t]);
    }
  }
  // block_sum for every row at once
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n_warps = blockDim.x >> 5;
#pragma unroll
  for (int r = 0; r < kRowsMax; ++r) ss[r] = r < n ? warp_sum(ss[r]) : 0.0f;
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < kRowsMax; ++r) red_s[r * 32 + warp] = ss[r];
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < kRowsMax; ++r) {
    if (r >= n) continue;
    float total = 0.0f;
    for (int k = 0; k < n_warps; ++k) total += red_s[r * 32 + k];
    const float inv_rms = rsqrtf(total / static_cast<float>(cols) + p.eps);
#pragma unroll
    for (int t = 0; t < kVecs; ++t) {
      const int i = threadIdx.x + t * blockDim.x;
      if (i < n_vecs) *reinterpret_cast<float4*>(x_s + r * xf + xpad(4 * i)) = x4_normalised(v[r][t], inv_rms, w[t]);
    }
  }
  __syncthreads();
}

// dot_stage for rows r0 and r0 + 1 (G = 2, no branches: the rows' FMA chains interleave): the stage's weights of
// a vector are read and decoded once for both rows (dot_q4_vec2), each row's sums as dot_stage's.
template <int COLS, int G>
__device__ __forceinline__ void dot_stage_rows(const char* stage, const float* x_s, int lane,
                                               float (&part)[G][Q4Layout<COLS>::kPasses]) {
  using Lay = Q4Layout<COLS>;
  constexpr int XF = xpad_floats(COLS);
  const int j = lane % Lay::kLanesPerRow, sub = lane / Lay::kLanesPerRow;
  const unsigned short* s_s = reinterpret_cast<const unsigned short*>(stage + kChunkWeightBytes);
  const unsigned short* b_s = s_s + kChunkScaleBytes / 2;
#pragma unroll
  for (int r = 0; r < G; ++r)
#pragma unroll
    for (int pass = 0; pass < Lay::kPasses; ++pass) part[r][pass] = 0.0f;
#pragma unroll
  for (int v = 0; v < Lay::kVecsPerLane; ++v) {
    const int vec = v * Lay::kLanesPerRow + j;
    uint4 w[Lay::kPasses];
    unsigned short sb[Lay::kPasses], bb[Lay::kPasses];
#pragma unroll
    for (int pass = 0; pass < Lay::kPasses; ++pass) {
      const int r = pass * Lay::kRowsPerPass + sub;
      w[pass] = *reinterpret_cast<const uint4*>(stage + (r * Lay::kVecsPerRow + vec) * 16);
      const int g = r * (COLS / 64) + vec / 2;
      sb[pass] = s_s[g], bb[pass] = b_s[g];
    }
    static_assert(G == 2, "rows in pairs: dot_q4_vec2");
    float x0[32], x1[32];
    const float x_sum0 = load_x_vec(x_s, vec, x0), x_sum1 = load_x_vec(x_s + XF, vec, x1);
#pragma unroll
    for (int pass = 0; pass < Lay::kPasses; ++pass) {
      float d0, d1;
      dot_q4_vec2(w[pass], x0, x1, d0, d1);
      part[0][pass] += q4_group_term(d0, x_sum0, sb[pass], bb[pass]);
      part[1][pass] += q4_group_term(d1, x_sum1, sb[pass], bb[pass]);
    }
  }
}

// R rows of shared memory for x (the launch's n_rows <= R are real; the others compute and are not written).
template <int COLS, int R>
__global__ void __launch_bounds__(32 * kAsyncMaxWarps, 1) gemv_q4_rows_kernel(const __grid_constant__ GemvParams p) {
  const trace::BlockTrace trace_block(trace::kGemv);
  using Lay = Q4Layout<COLS>;
  constexpr int XF = xpad_floats(COLS);
  constexpr int G = 2;  // rows a pass over the stage (4 spilled at 128 registers a thread)
  extern __shared__ __align__(16) char smem[];
  __shared__ float red_s[32 * kRowsMax];
  const int n = p.n_rows;
  float* x_s = reinterpret_cast<float*>(smem);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n_warps = blockDim.x >> 5;
  char* ring = smem + static_cast<size_t>(R) * XF * sizeof(float) + warp * kStages * kStageBytes;
  const int n_chunks = (p.m.rows + Lay::kRowsPerChunk - 1) / Lay::kRowsPerChunk;
  const int first = blockIdx.x * n_warps + warp, stride = gridDim.x * n_warps;

  pdl_launch_dependents();
#pragma unroll
  for (int k = 0; k < kStages; ++k) {
    if (first + k * stride < n_chunks) issue_chunk<COLS>(p.m, first + k * stride, lane, ring + k * kStageBytes);
    cp_async_commit();
  }
  pdl_wait();
  build_x_rows(p, x_s, red_s);

  for (int k = 0, chunk = first; chunk < n_chunks; ++k, chunk += stride) {
    char* stage = ring + (k % kStages) * kStageBytes;
    const int row = out_row<COLS>(chunk, lane);
    const bool writes = writes_row<COLS>(lane) && row < p.m.rows;
    cp_async_wait<kStages - 1>();
    __syncwarp();
#pragma unroll 1
    for (int r0 = 0; r0 < R; r0 += G) {
      float res[G];  // issued before the dot products, used after them
#pragma unroll
      for (int r = 0; r < G; ++r)
        res[r] = p.residual && writes && r0 + r < n ? p.residual[static_cast<size_t>(r0 + r) * p.out_stride + row] : 0.0f;
      float part[G][Lay::kPasses];
      dot_stage_rows<COLS, G>(stage, x_s + r0 * XF, lane, part);
#pragma unroll
      for (int r = 0; r < G; ++r) {
        group_reduce_scatter<Lay::kPasses, Lay::kLanesPerRow>(part[r], lane);
        if (writes && r0 + r < n) p.y[static_cast<size_t>(r0 + r) * p.out_stride + row] = res[r] + part[r][0];
      }
    }
    __syncwarp();  // the stage is free again
    if (chunk + kStages * stride < n_chunks) issue_chunk<COLS>(p.m, chunk + kStages * stride, lane, stage);
    cp_async_commit();
  }
  cp_async_wait<0>();
}

// Any cols (multiple of 512), 4 or 8 bits: a warp per row, lanes stride over the row's 16-byte vectors.

// ---- the tensor-core kernel: 4-bit, 4,096 columns, 1 .. 8 activation rows --------------------------------------
// y[n] = W x[n] for the launch's n_rows activation rows on mma.sync m16n8k16: the weights are the A operand (16
// rows x 16 k a fragment), the activation rows the N side (8 an mma: lane group g = lane / 4 feeds row g of x).
// A team of warps takes one 16-row group, warp `part` of the team 256 or 512 of its columns (halves_for), and
// streams them in halves (16 rows x 256 columns: 2 KiB of nibbles + 4 groups of bf16 scales and biases) through
// a per-warp cp.async ring of 2 or 4 halves (issued before pdl_wait, as the one-row kernel did).
//  - A: a thread's 16 nibbles of a group row are k = 16c .. 16c + 15 (c = lane & 3), expanded by one LOP3 a pair
//    (expand_word) to fp16 1024 + q, or 1024 + 16 q for every second pair (exact; one shift a word instead of
//    three), in the k order of moe_prefill_few.cu (the pair (q_i, q_{i+4}) of a word; B takes x_i and x_{i+4}):
//    the dot product over a fragment is the same sum in another order.
//  - B: x as fp16 (round to nearest; x / 16 where A holds 16 q), built once a block straight from the inputs in
//    the fragments' order (build_x16), two LDS.128 a group.
//  - Per group (64 k = 4 mmas) the scale and bias go on the fp32 result, not on the weights:
//    sum_k (s q_k + b) x_k = s acc + b xs, where acc starts at -1024 sum_k x'_k (x' the B values), so that it ends
//    at sum_k q_k x_k, and xs = sum_k x_k (both sums fp32, once a block). The groups accumulate in order in fp32;
//    the team's parts are summed in order by the team's first warp through shared memory.
// Every row's arithmetic is the same whatever n_rows is (an mma's column depends only on its own B column; the
// block size depends only on the matrix), so a row's result is bit-identical alone or beside others.
// Error against exact arithmetic: x rounded to fp16 (2^-11 relative a term), the rest fp32.
namespace mma {

using qgemm_util::mma_f16;
using qgemm_util::pack_f16;

constexpr int kUnitRows = 16;
constexpr int kHalfGroups = 4;  // a half: 256 columns
constexpr int kHalfCols = kHalfGroups * 64;
// A unit travels as two halves of 4 groups (so that a half's slot is refilled while the other half computes):
// weights [row][128 bytes] with the 16-byte pieces XOR-swizzled by row (a warp's copies are whole-line L2
// requests; a thread's 8-byte reads of a group row stay free of bank conflicts), scales [row][4], biases [row][4].
constexpr int kHalfWeightBytes = kUnitRows * kHalfGroups * 32;                 // 2048
constexpr int kHalfBytes = kHalfWeightBytes + 2 * kUnitRows * kHalfGroups * 2;  // 2304
constexpr int kRows = kMaxBatchRows;                                            // mma N: 8

// x rows as fp16 B fragments (build_x16) in shared memory, bytes apart: 16 more than the row, so rows n and n + 1
// of a quarter warp's 16-byte loads fall on other banks.
__host__ __device__ constexpr int x16_row_bytes(int cols) { return 2 * cols + 16; }
// ... all rows, rounded up to 128 bytes: the regions after them (and the rings) 128-byte aligned. (At 16 bytes
// off, one row's lm_head, when it ran on this kernel, took 123.7 us against 86.4 for two rows, whose offset was
// 32: MIO and scoreboard stalls on the ring's and the sums' loads, ncu 2026-12-03.)
__host__ __device__ constexpr size_t x16_bytes(int cols, int n_rows) {
  return (static_cast<size_t>(n_rows) * x16_row_bytes(cols) + 127) / 128 * 128;
}

__device__ __forceinline__ void cp_async_8(void* dst_s, const void* src, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(dst_s));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(dst), "l"(src), "r"(valid ? 8 : 0) : "memory");
}

// Copies half hb (columns 256 hb .. +255) of row group rg of m into `slot`. Rows past the end are zero-filled
// (zero scales and biases: they contribute 0).
template <int COLS>
__device__ __forceinline__ void issue_half(const QMatrix& m, int rg, int hb, int lane, char* slot) {
  const char* w = reinterpret_cast<const char*>(m.w) + hb * (kHalfCols / 2);
#pragma unroll
  for (int it = 0; it < 4; ++it) {
    const int piece = it * 32 + lane, r = piece >> 3, pir = piece & 7;  // 8 pieces of 16 bytes a row
    const int row = rg * kUnitRows + r;
    const bool valid = row < m.rows;
    cp_async_16(slot + r * 128 + ((pir ^ (r & 7)) * 16),  // a row's 128 bytes together, 16-byte pieces swizzled
                w + static_cast<size_t>(valid ? row : 0) * (COLS / 2) + pir * 16, valid);
  }
  const int r = lane & 15, row = rg * kUnitRows + r;
  const bool valid = row < m.rows;
  const __nv_bfloat16* src = (lane < 16 ? m.scales : m.biases) + static_cast<size_t>(valid ? row : 0) * (COLS / 64) +
                             hb * kHalfGroups;
  cp_async_8(slot + kHalfWeightBytes + (lane < 16 ? 0 : kUnitRows * 8) + r * 8, src, valid);
}

// x as fp16 B fragments: row r, group G, lane quarter c at x16 + r x16_row_bytes + (4 G + c) 32 bytes holds the
// pairs (x_i, x_{i+4}) of k = 16c .. 16c + 15 in the order the mma steps take them (moe_prefill_few.cu's order);
// each step's second pair (i = 1, 3 of a word: the nibbles expand_word puts at 1024 + 16 q) as x / 16. So the mma
// of (1024 + m q) by those values x' is sum_k q_k xe_k + 1024 sum_k x'_k, with xe = m x' the effective x (x16
// rounded, its factor 16 restored). Per group and row: xe_s = 1024 sum x' (the accumulator starts at -xe_s) and
// xs_s = sum xe (the bias's sum), each thread its 16 values, then the group's 4 threads by a butterfly (fixed order).
struct X16Item {
  uint4 u0, u1;
  float xs, xe;
};
__device__ __forceinline__ X16Item x16_item(const float4 (&f)[4]) {
  constexpr float kSixteenth = 0.0625f;
  X16Item it;
  it.u0 = make_uint4(pack_f16(f[0].x, f[1].x), pack_f16(f[0].y * kSixteenth, f[1].y * kSixteenth),
                     pack_f16(f[0].z, f[1].z), pack_f16(f[0].w * kSixteenth, f[1].w * kSixteenth));
  it.u1 = make_uint4(pack_f16(f[2].x, f[3].x), pack_f16(f[2].y * kSixteenth, f[3].y * kSixteenth),
                     pack_f16(f[2].z, f[3].z), pack_f16(f[2].w * kSixteenth, f[3].w * kSixteenth));
  const uint32_t lo[4] = {it.u0.x, it.u0.z, it.u1.x, it.u1.z}, hi[4] = {it.u0.y, it.u0.w, it.u1.y, it.u1.w};
  float s_lo = 0.0f, s_hi = 0.0f;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 a = __half22float2(qgemm_util::bits_h2(lo[k])), b = __half22float2(qgemm_util::bits_h2(hi[k]));
    s_lo += a.x, s_lo += a.y, s_hi += b.x, s_hi += b.y;
  }
#pragma unroll
  for (int m = 1; m <= 2; m <<= 1) {  // every lane calls (full-warp shuffles)
    s_lo += __shfl_xor_sync(0xffffffffu, s_lo, m);
    s_hi += __shfl_xor_sync(0xffffffffu, s_hi, m);
  }
  it.xs = s_lo + 16.0f * s_hi;
  it.xe = 1024.0f * (s_lo + s_hi);
  return it;
}
template <int COLS>
__device__ __forceinline__ void x16_store(const X16Item& it, int i, char* x16, float* xs_s, float* xe_s, int r) {
  uint4* dst = reinterpret_cast<uint4*>(x16 + r * x16_row_bytes(COLS)) + 2 * i;
  dst[0] = it.u0, dst[1] = it.u1;
  if ((i & 3) == 0) xs_s[(i >> 2) * kRows + r] = it.xs, xe_s[(i >> 2) * kRows + r] = it.xe;
}
__device__ __forceinline__ void load16(const float* src, float4 (&f)[4]) {
  const float4* s4 = reinterpret_cast<const float4*>(src);
#pragma unroll
  for (int q = 0; q < 4; ++q) f[q] = s4[q];
}

// Whether build_x16 takes p's prologue: 16-byte aligned rows, and for the gated one heads of 16 L columns with L a
// power of two <= 32 (a head is L adjacent lanes).
bool x16_takes(const GemvParams& p) {
  if (!aligned16(p.in) || (p.n_rows > 1 && p.in_stride % 4)) return false;
  switch (p.prologue) {
    case GemvPrologue::none: return true;
    case GemvPrologue::rms_norm: return aligned16(p.norm_w);
    case GemvPrologue::gated_rms_norm: {
      const int lanes = p.head_dim / 16;
      return aligned16(p.norm_w) && aligned16(p.gate_z) && (p.n_rows == 1 || p.z_stride % 4 == 0) &&
             p.head_dim % 16 == 0 && lanes <= 32 && (lanes & (lanes - 1)) == 0;
    }
  }
  return false;
}

// The prologue: x16, xs_s and xe_s for every row, straight from the inputs in registers (no fp32 copy in shared
// memory). Thread i takes the items i, i + blockDim, ... (item i: the 16 columns 16 i ..; group i / 4, quarter
// i % 4). A row's values depend only on that row and the block size (the matrix's), so a row gets the same bits
// alone or beside others.
//  rms_norm (eqs 1-2): the sum of squares a thread over its items in order, warp sums, then the warps in order.
//  gated_rms_norm (eq 19): a head of head_dim = 16 L columns is L adjacent lanes, summed by shuffles.
template <int COLS>
__device__ void build_x16(const GemvParams& p, char* x16, float* xs_s, float* xe_s, float* red_s) {
  constexpr int kItems = COLS / 16;  // a multiple of 32: the item loops are warp-uniform
  const int n = p.n_rows, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n_warps = blockDim.x >> 5;
  for (int k = threadIdx.x; k < (COLS / 64) * kRows; k += blockDim.x) {
    if (k % kRows >= n) xs_s[k] = xe_s[k] = 0.0f;
  }
  if (p.prologue == GemvPrologue::rms_norm) {
    for (int r = 0; r < n; ++r) {
      float ss = 0.0f;
      for (int i = threadIdx.x; i < kItems; i += blockDim.x) {
        float4 f[4];
        load16(p.in + static_cast<size_t>(r) * p.in_stride + 16 * i, f);
        if (r == 0) asm volatile("prefetch.global.L1 [%0];" ::"l"(p.norm_w + 16 * i));  // read after the barrier
#pragma unroll
        for (int q = 0; q < 4; ++q) ss += x4_sum_squares(f[q]);
      }
      ss = warp_sum(ss);
      if (lane == 0) red_s[r * 32 + warp] = ss;
    }
    __syncthreads();
  }
  for (int r = 0; r < n; ++r) {
    const float* in = p.in + static_cast<size_t>(r) * p.in_stride;
    float inv_rms = 1.0f;
    if (p.prologue == GemvPrologue::rms_norm) {
      float total = 0.0f;
      for (int k = 0; k < n_warps; ++k) total += red_s[r * 32 + k];
      inv_rms = rsqrtf(total / static_cast<float>(COLS) + p.eps);
    }
    for (int i = threadIdx.x; i < kItems; i += blockDim.x) {
      float4 f[4];
      load16(in + 16 * i, f);
      if (p.prologue == GemvPrologue::rms_norm) {
        float4 w[4];
        load16(p.norm_w + 16 * i, w);
#pragma unroll
        for (int q = 0; q < 4; ++q) f[q] = x4_normalised(f[q], inv_rms, w[q]);
      } else if (p.prologue == GemvPrologue::gated_rms_norm) {
        float4 z[4], w[4];
        load16(p.gate_z + static_cast<size_t>(r) * p.z_stride + 16 * i, z);
        load16(p.norm_w + ((16 * i) & (p.head_dim - 1)), w);
        float ss = 0.0f;
#pragma unroll
        for (int q = 0; q < 4; ++q) ss += x4_sum_squares(f[q]);
        for (int m = 1; m < p.head_dim / 16; m <<= 1) ss += __shfl_xor_sync(0xffffffffu, ss, m);
        const float inv = rsqrtf(ss / static_cast<float>(p.head_dim) + p.eps);
#pragma unroll
        for (int q = 0; q < 4; ++q) f[q] = x4_gated(f[q], inv, w[q], z[q]);
      }
      x16_store<COLS>(x16_item(f), i, x16, xs_s, xe_s, r);
    }
  }
  __syncthreads();
}

// The four fp16 pairs of a word of 8 nibbles in the B order above: (1024 + q0, 1024 + q4), (1024 + 16 q1,
// 1024 + 16 q5), (1024 + q2, 1024 + q6), (1024 + 16 q3, 1024 + 16 q7) (exact: 1024 + 16 q < 2048), one LOP3 a
// pair and one shift a word.
__device__ __forceinline__ void expand_word(uint32_t w, uint32_t (&o)[4]) {
  constexpr uint32_t kLo = 0x000F000Fu, kHi = 0x00F000F0u;
  const uint32_t w8 = w >> 8;
  o[0] = qgemm_util::and_or(w, kLo, qgemm_util::kF16Magic1024);
  o[1] = qgemm_util::and_or(w, kHi, qgemm_util::kF16Magic1024);
  o[2] = qgemm_util::and_or(w8, kLo, qgemm_util::kF16Magic1024);
  o[3] = qgemm_util::and_or(w8, kHi, qgemm_util::kF16Magic1024);
}

// bf16 j (0..3) of 4 packed in a uint2, as a float.
template <int j>
__device__ __forceinline__ float bf16_of(uint2 v) {
  const uint32_t w = j < 2 ? v.x : v.y;
  return __uint_as_float(j % 2 == 0 ? w << 16 : w & 0xFFFF0000u);
}

// out[0..3] += half hb of this warp's row group: rows g, g + 8 x activation rows 2c, 2c + 1 (the C fragment).
// Lanes of activation rows >= n read row n - 1 (their columns are not stored; a column never affects another).
template <int COLS>
__device__ __forceinline__ void dot_half(const char* slot, const char* x16_s, const float* xs_s, const float* xe_s,
                                         int hb, int n, int lane, float (&out)[4]) {
  constexpr int X16_BYTES = x16_row_bytes(COLS);
  const int g = lane >> 2, c = lane & 3, G0 = hb * kHalfGroups;
  const uint2* sb_s = reinterpret_cast<const uint2*>(slot + kHalfWeightBytes);  // [row] 4 scales, then [row] 4 biases
  const char* w_s = slot + g * 128 + 8 * (c & 1);
  const uint4* x_l = reinterpret_cast<const uint4*>(x16_s + min(g, n - 1) * X16_BYTES) + (G0 * 4 + c) * 2;
  float acc[kHalfGroups][4];  // the groups' mma chains first (independent), then the folds in order
#pragma unroll
  for (int j = 0; j < kHalfGroups; ++j) {
    const int piece = ((2 * j + (c >> 1)) ^ g) * 16;  // rows g and g + 8 share the swizzle
    const uint2 qa = *reinterpret_cast<const uint2*>(w_s + piece);
    const uint2 qb = *reinterpret_cast<const uint2*>(w_s + 8 * 128 + piece);
    const uint4 u0 = x_l[j * 8], u1 = x_l[j * 8 + 1];
    const float2 xe = *reinterpret_cast<const float2*>(xe_s + (G0 + j) * kRows + 2 * c);
    const uint32_t b[4][2] = {{u0.x, u0.y}, {u0.z, u0.w}, {u1.x, u1.y}, {u1.z, u1.w}};
    uint32_t ea[4], eb[4], fa[4], fb[4];
    expand_word(qa.x, ea), expand_word(qb.x, eb), expand_word(qa.y, fa), expand_word(qb.y, fb);
    const uint32_t a[4][4] = {{ea[0], eb[0], ea[1], eb[1]},
                              {ea[2], eb[2], ea[3], eb[3]},
                              {fa[0], fb[0], fa[1], fb[1]},
                              {fa[2], fb[2], fa[3], fb[3]}};
    acc[j][0] = -xe.x, acc[j][1] = -xe.y, acc[j][2] = -xe.x, acc[j][3] = -xe.y;
#pragma unroll
    for (int s = 0; s < 4; ++s) mma_f16(acc[j], a[s], b[s][0], b[s][1]);
  }
  const uint2 sa = sb_s[g], sb = sb_s[g + 8], ba = sb_s[kUnitRows + g], bb = sb_s[kUnitRows + g + 8];
  const float ssa[4] = {bf16_of<0>(sa), bf16_of<1>(sa), bf16_of<2>(sa), bf16_of<3>(sa)};
  const float ssb[4] = {bf16_of<0>(sb), bf16_of<1>(sb), bf16_of<2>(sb), bf16_of<3>(sb)};
  const float sba[4] = {bf16_of<0>(ba), bf16_of<1>(ba), bf16_of<2>(ba), bf16_of<3>(ba)};
  const float sbb[4] = {bf16_of<0>(bb), bf16_of<1>(bb), bf16_of<2>(bb), bf16_of<3>(bb)};
#pragma unroll
  for (int j = 0; j < kHalfGroups; ++j) {
    const float2 xs = *reinterpret_cast<const float2*>(xs_s + (G0 + j) * kRows + 2 * c);
    out[0] = fmaf(ssa[j], acc[j][0], fmaf(sba[j], xs.x, out[0]));
    out[1] = fmaf(ssa[j], acc[j][1], fmaf(sba[j], xs.y, out[1]));
    out[2] = fmaf(ssb[j], acc[j][2], fmaf(sbb[j], xs.x, out[2]));
    out[3] = fmaf(ssb[j], acc[j][3], fmaf(sbb[j], xs.y, out[3]));
  }
}

__device__ __forceinline__ void team_sync(int team, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(team + 1), "r"(threads) : "memory");
}

// The residuals of the C fragment's outputs (rows row_a / row_a + 8 x activation rows 2c, 2c + 1), and the store.
__device__ __forceinline__ void load_residuals(const GemvParams& p, int row_a, int c, float (&res)[4]) {
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int row = q < 2 ? row_a : row_a + 8, col = 2 * c + (q & 1);
    res[q] = p.residual && col < p.n_rows && row < p.m.rows ? p.residual[static_cast<size_t>(col) * p.out_stride + row]
                                                            : 0.0f;
  }
}
__device__ __forceinline__ void store_outputs(const GemvParams& p, int row_a, int c, const float (&res)[4],
                                              const float (&v)[4]) {
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int row = q < 2 ? row_a : row_a + 8, col = 2 * c + (q & 1);
    if (col < p.n_rows && row < p.m.rows) p.y[static_cast<size_t>(col) * p.out_stride + row] = res[q] + v[q];
  }
}

// A team of COLS / (256 HALVES) warps takes a 16-row group, warp `part` of the team its columns
// 256 HALVES part .. (a unit of HALVES halves); the team's first warp sums the parts in order through shared
// memory (one team barrier a unit, the parts double-buffered) and stores. HALVES (1 or 2) is chosen by the
// matrix alone (halves_for).
// (A split where each warp takes a group's columns in order, unit after unit, without barriers, measured the
// same on lm_head and 1.3x / 1.6x slower on gdn_in / attn_in, 2026-12-02.)
template <int COLS, int HALVES, int SLOTS>
__global__ void __launch_bounds__(32 * kAsyncMaxWarps, 1) gemv_mma_kernel(const __grid_constant__ GemvParams p) {
  const trace::BlockTrace trace_block(trace::kGemv);
  constexpr int kParts = COLS / (kHalfCols * HALVES);
  constexpr int kGroups = COLS / 64;
  extern __shared__ __align__(16) char smem[];
  __shared__ float red_s[32 * kRows];
  const int n = p.n_rows;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n_warps = blockDim.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  char* x16_s = smem;                                                  // [n][x16_row_bytes]
  float* xs_s = reinterpret_cast<float*>(smem + x16_bytes(COLS, n));  // [group][kRows]
  float* xe_s = xs_s + kGroups * kRows;                               // [group][kRows]
  float* acc_s = xe_s + kGroups * kRows;                              // [2][warp][128]: units alternate
  char* ring = reinterpret_cast<char*>(acc_s + 2 * n_warps * 128) + warp * SLOTS * kHalfBytes;
  const int n_rg = (p.m.rows + kUnitRows - 1) / kUnitRows;
  const int teams = n_warps / kParts, team = warp / kParts, part = warp % kParts;
  const int rg0 = blockIdx.x * teams + team, rg_stride = gridDim.x * teams;
  // half t of the warp: unit t / HALVES, half t % HALVES of the unit
  const int n_halves = rg0 < n_rg ? ((n_rg - 1 - rg0) / rg_stride + 1) * HALVES : 0;

  pdl_launch_dependents();
#pragma unroll
  for (int t = 0; t < SLOTS; ++t) {  // weights first: they do not depend on the previous kernel
    if (t < n_halves)
      issue_half<COLS>(p.m, rg0 + (t / HALVES) * rg_stride, part * HALVES + t % HALVES, lane, ring + t * kHalfBytes);
    cp_async_commit();
  }
  pdl_wait();
  build_x16<COLS>(p, x16_s, xs_s, xe_s, red_s);

  float out[4] = {0.0f, 0.0f, 0.0f, 0.0f}, res[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int t = 0; t < n_halves; ++t) {
    char* slot = ring + (t % SLOTS) * kHalfBytes;
    const int h = t % HALVES, rg = rg0 + (t / HALVES) * rg_stride, row_a = rg * kUnitRows + g;
    if (h == 0) {
      out[0] = out[1] = out[2] = out[3] = 0.0f;
      if (part == 0) load_residuals(p, row_a, c, res);  // used after the dot products
    }
    cp_async_wait<SLOTS - 1>();  // this lane's copies of half t have landed
    __syncwarp();                 // ... and every lane's
    dot_half<COLS>(slot, x16_s, xs_s, xe_s, part * HALVES + h, n, lane, out);
    __syncwarp();  // the slot is free again
    if (t + SLOTS < n_halves)
      issue_half<COLS>(p.m, rg0 + ((t + SLOTS) / HALVES) * rg_stride, part * HALVES + (t + SLOTS) % HALVES, lane,
                       slot);
    cp_async_commit();
    if (h == HALVES - 1) {
      // One barrier a unit: unit u's parts go to buffer u % 2, which its first warp read for unit u - 2 before it
      // reached unit u - 1's barrier, which the other parts passed before writing unit u's.
      float* parts_s = acc_s + ((t / HALVES) & 1) * n_warps * 128;
      if (part > 0)
        *reinterpret_cast<float4*>(parts_s + warp * 128 + 4 * lane) = make_float4(out[0], out[1], out[2], out[3]);
      team_sync(team, kParts * 32);
      if (part == 0) {
        float v[4] = {out[0], out[1], out[2], out[3]};
#pragma unroll
        for (int q = 1; q < kParts; ++q) {  // the parts in order
          const float4 o = *reinterpret_cast<const float4*>(parts_s + (warp + q) * 128 + 4 * lane);
          v[0] += o.x, v[1] += o.y, v[2] += o.z, v[3] += o.w;
        }
        store_outputs(p, row_a, c, res, v);
      }
    }
  }
  cp_async_wait<0>();
}

// Halves a unit: 2 (512 columns a warp) where the 512-column units fill 16 warps an SM, else 1 (the out
// projections on the H200: 128 row groups, so more warps share a group's columns and its dot products end
// sooner; on GPUs of 64 SMs or fewer the out projections take 2).
// Measured (H200, us, one row, forced 1 / forced 2 / this rule): gdn_in 9.08 / 8.81 / 8.75, gdn_out 5.66 / 6.18 /
// 5.65, lm_head 105.4 / 85.4 / 85.0.
int halves_for(const QMatrix& m, int n_sms) {
  const int n_rg = (m.rows + kUnitRows - 1) / kUnitRows;
  return n_rg * (m.cols / (2 * kHalfCols)) >= kAsyncMaxWarps * n_sms ? 2 : 1;
}

// Shared memory of a block of `warps` warps, `slots` halves in flight a warp: x16 (x16_bytes), xs and xe
// [groups][8], the team reduction [2][warps][128] floats, the rings.
size_t smem_bytes(int cols, int n_rows, int warps, int slots) {
  return x16_bytes(cols, n_rows) +
         (static_cast<size_t>(cols / 64) * 2 * kRows + static_cast<size_t>(warps) * 2 * 128) * sizeof(float) +
         static_cast<size_t>(warps) * slots * kHalfBytes;
}
// The dynamic shared memory a block may take on this device beside red_s (227 KiB on Hopper, 163 on A100, 99 on
// sm_86 / sm_89 / sm_120).
size_t smem_max() { return device_smem_optin() - 32 * kMaxBatchRows * sizeof(float); }

// Halves in flight a warp: 4, or 2 where 4 do not fit beside x (several rows of 4,096 columns on 16 warps, or a
// GPU with less shared memory). Only the pipelining depends on it, not the arithmetic.
int slots_for(const GemvParams& p, int warps) {
  return smem_bytes(p.m.cols, p.n_rows, warps, 4) <= smem_max() ? 4 : 2;
}

// Warps of a block: a team (cols / (256 halves) warps) per 16-row group, about as many units as SMs x warps,
// 4..16 warps.
int warps_for(const QMatrix& m, int n_sms) {
  const int parts = m.cols / (kHalfCols * halves_for(m, n_sms)), n_rg = (m.rows + kUnitRows - 1) / kUnitRows;
  const int w = std::clamp((n_rg * parts + n_sms - 1) / n_sms, 4, kAsyncMaxWarps);
  return std::min(kAsyncMaxWarps, (w + parts - 1) / parts * parts);
}

}  // namespace mma

// Any cols (multiple of 512), 4 or 8 bits: a warp per row, lanes stride over the row's 16-byte vectors.
template <int BITS>
__global__ void __launch_bounds__(kThreads) gemv_generic_kernel(const __grid_constant__ GemvParams p) {
  const trace::BlockTrace trace_block(trace::kGemv);
  extern __shared__ __align__(16) float x_s[];
  __shared__ float red_s[32];
  pdl_launch_dependents();
  pdl_wait();
  build_x(p, x_s, red_s);
  constexpr int kElems = BITS == 4 ? kVecElems4 : kVecElems8;
  const int lane = threadIdx.x & 31, n_vecs = p.m.cols / kElems;
  for (int row = blockIdx.x * kWarps + (threadIdx.x >> 5); row < p.m.rows; row += gridDim.x * kWarps) {
    const uint4* w_row = reinterpret_cast<const uint4*>(p.m.w + row * p.m.words_per_row());
    const size_t g_row = static_cast<size_t>(row) * p.m.groups_per_row();
    float sum = 0.0f;
    for (int vec = lane; vec < n_vecs; vec += 32) {
      const uint4 w = ld_stream(w_row + vec);
      const int e0 = vec * kElems, g = e0 / 64;
      const unsigned short s = ld_bf16_bits(p.m.scales + g_row + g), b = ld_bf16_bits(p.m.biases + g_row + g);
      float x[32];
      float x_sum = 0.0f;
#pragma unroll
      for (int i = 0; i < kElems; ++i) x_sum += (x[i] = x_s[xpad(e0 + i)]);
      if constexpr (BITS == 4) {
        sum += q4_group_term(dot_q4_vec(w, x), x_sum, s, b);
      } else {
        sum += bf16_bits_to_float(s) * dot_q8_vec(w, x) + bf16_bits_to_float(b) * x_sum;
      }
    }
    sum = warp_sum(sum);
    if (lane == 0) p.y[row] = (p.residual ? p.residual[row] : 0.0f) + sum;
  }
}

// Persistent grid: as many blocks as fit on the device at once, but no more than the work needs.
int device_sms() {
  int device = 0, n_sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&n_sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    return 0;
  return n_sms;
}

// Warps of a block of the asynchronous one-row kernel: one block per SM, fewer warps when there are few chunks,
// so that they spread over all SMs; no more than the device's shared memory holds rings for beside x and 1 KiB
// for red_s and the driver's per-block reserve (16 on Hopper; 99 KB GPUs refused 16 at 2,048 columns).
int async_warps(const QMatrix& m, int n_sms) {
  const int rows_per_chunk = gemv_q4::kChunkWeights / m.cols;
  const int n_chunks = (m.rows + rows_per_chunk - 1) / rows_per_chunk;
  const size_t room = device_smem_optin() - 1024 - xpad_floats(m.cols) * sizeof(float);
  const int fit = static_cast<int>(std::min<size_t>(kAsyncMaxWarps, room / (kStages * kStageBytes)));
  return std::clamp((n_chunks + n_sms - 1) / n_sms, 4, std::max(4, fit));
}

template <class Kernel>
cudaError_t launch_persistent(Kernel kernel, int work_blocks, size_t smem, const GemvParams& p,
                              cudaStream_t stream) {
  int device = 0, n_sms = 0, per_sm = 0;
  CUDA_TRY(cudaGetDevice(&device));
  CUDA_TRY(cudaDeviceGetAttribute(&n_sms, cudaDevAttrMultiProcessorCount, device));
  CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem));
  const int blocks = std::max(1, std::min(work_blocks, n_sms * std::max(per_sm, 1)));
  return launch_pdl(kernel, dim3(blocks), dim3(kThreads), smem, stream, p);
}

template <int COLS>
cudaError_t launch_q4(const GemvParams& p, cudaStream_t stream) {
  using Lay = Q4Layout<COLS>;
  const int n_chunks = (p.m.rows + Lay::kRowsPerChunk - 1) / Lay::kRowsPerChunk;
  const bool aligned = reinterpret_cast<uintptr_t>(p.m.scales) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(p.m.biases) % 16 == 0;
  if (!aligned) return launch_persistent(gemv_q4_kernel<COLS>, (n_chunks + kWarps - 1) / kWarps, 0, p, stream);
  const int warps = async_warps(p.m, device_sms());
  const int blocks = std::max(1, std::min(device_sms(), (n_chunks + warps - 1) / warps));
  const size_t smem = xpad_floats(COLS) * sizeof(float) + static_cast<size_t>(warps) * kStages * kStageBytes;
  auto kernel = gemv_q4_async_kernel<COLS>;
  CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  return launch_pdl(kernel, dim3(blocks), dim3(32 * warps), smem, stream, p);
}

bool valid_params(const GemvParams& p) {
  const QMatrix& m = p.m;
  if (!m.w || !m.scales || !m.biases || !p.in || !p.y || m.rows <= 0 || m.cols <= 0 || m.cols % 512) return false;
  if (m.bits != 4 && m.bits != 8) return false;
  if (reinterpret_cast<uintptr_t>(m.w) % 16) return false;  // 16-byte vector loads
  if (xpad_floats(m.cols) * sizeof(float) > 96 * 1024) return false;
  switch (p.prologue) {
    case GemvPrologue::none: return true;
    case GemvPrologue::rms_norm: return p.norm_w != nullptr;
    case GemvPrologue::gated_rms_norm:
      return p.norm_w && p.gate_z && p.head_dim > 0 && m.cols % p.head_dim == 0;
  }
  return false;
}

// The several-row launch: R = n_rows rounded up to 2, 4 or 8 rows of x in shared memory beside the single-row
// block's warps' rings (the same block size, so the same prologue reduction order).
int rows_instance(int n) { return n <= 2 ? 2 : n <= 4 ? 4 : 8; }

template <int COLS, int R>
cudaError_t launch_q4_rows(const GemvParams& p, cudaStream_t stream) {
  using Lay = Q4Layout<COLS>;
  const int n_chunks = (p.m.rows + Lay::kRowsPerChunk - 1) / Lay::kRowsPerChunk;
  const int n_sms = device_sms(), warps = async_warps(p.m, n_sms);
  const int blocks = std::max(1, std::min(n_sms, (n_chunks + warps - 1) / warps));
  const size_t smem = static_cast<size_t>(R) * xpad_floats(COLS) * sizeof(float) +
                      static_cast<size_t>(warps) * kStages * kStageBytes;
  auto kernel = gemv_q4_rows_kernel<COLS, R>;
  CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  return launch_pdl(kernel, dim3(blocks), dim3(32 * warps), smem, stream, p);
}

template <int COLS>
cudaError_t launch_q4_rows(const GemvParams& p, cudaStream_t stream) {
  switch (rows_instance(p.n_rows)) {
    case 2: return launch_q4_rows<COLS, 2>(p, stream);
    case 4: return launch_q4_rows<COLS, 4>(p, stream);
    default: return launch_q4_rows<COLS, 8>(p, stream);
  }
}

// Whether the several-row kernel takes p (else gemv_rows runs gemv() per row).
bool rows_kernel_takes(const GemvParams& p, int n_sms) {
  const QMatrix& m = p.m;
  if (m.bits != 4 || (m.cols != 2048 && m.cols != 4096)) return false;
  if (reinterpret_cast<uintptr_t>(m.scales) % 16 || reinterpret_cast<uintptr_t>(m.biases) % 16) return false;
  if (!aligned16(p.in) || p.in_stride % 4) return false;
  if (p.prologue == GemvPrologue::rms_norm && !aligned16(p.norm_w)) return false;
  const int threads = 32 * async_warps(m, n_sms);
  if (p.prologue == GemvPrologue::rms_norm && m.cols / 4 > 2 * threads) return false;
  const size_t smem = static_cast<size_t>(rows_instance(p.n_rows)) * xpad_floats(m.cols) * sizeof(float) +
                      static_cast<size_t>(threads / 32) * kStages * kStageBytes;
  return smem <= device_smem_optin() - 32 * kRowsMax * sizeof(float) - 1024;
}

// Whether the tensor-core kernel takes p (4-bit; 4,096 columns, or 2,048 columns with at least kMmaMinRows2048 rows,
// i.e. lm_head; 16-byte aligned scales and biases, the prologue's conditions (x16_takes), the shared memory for
// n_rows on this GPU). Else gemv() takes the register kernel and gemv_rows the several-row register kernel or gemv()
// per row. A row alone passes wherever its batch does (its pointers are the batch's rows, and x grows with the rows),
// so it gets the same kernel, hence the same arithmetic. On the H200 (PERF_NOTES 2026-12-03, ninth session) lm_head
// on the tensor cores costs one decode row +0.3% and wins 8 rows 5.6%; attn_in / gdn_in (2,048 columns, < 13K rows)
// lose at one row (+1.2% for attn_in, more with gdn_in) and stay on the register kernels.
constexpr int kMmaMinRows2048 = 65536;  // lm_head's 248,320; the in projections have 9,216 and 12,352
bool mma_takes(const GemvParams& p, int n_sms) {
  const QMatrix& m = p.m;
  if (m.bits != 4 || n_sms < 1) return false;
  if (m.cols != 4096 && !(m.cols == 2048 && m.rows >= kMmaMinRows2048)) return false;
  if (reinterpret_cast<uintptr_t>(m.scales) % 16 || reinterpret_cast<uintptr_t>(m.biases) % 16) return false;
  if (!mma::x16_takes(p)) return false;
  return mma::smem_bytes(m.cols, p.n_rows, mma::warps_for(m, n_sms), 2) <= mma::smem_max();
}

template <int COLS, int HALVES, int SLOTS>
cudaError_t launch_mma(const GemvParams& p, int warps, int n_sms, cudaStream_t stream) {
  const int teams = warps / (COLS / (mma::kHalfCols * HALVES));
  const int n_rg = (p.m.rows + mma::kUnitRows - 1) / mma::kUnitRows;
  const int blocks = std::max(1, std::min(n_sms, (n_rg + teams - 1) / teams));
  const size_t smem = mma::smem_bytes(COLS, p.n_rows, warps, SLOTS);
  auto kernel = mma::gemv_mma_kernel<COLS, HALVES, SLOTS>;
  CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  return launch_pdl(kernel, dim3(blocks), dim3(32 * warps), smem, stream, p);
}

template <int COLS, int HALVES>
cudaError_t launch_mma(const GemvParams& p, int warps, int n_sms, cudaStream_t stream) {
  return mma::slots_for(p, warps) == 4 ? launch_mma<COLS, HALVES, 4>(p, warps, n_sms, stream)
                                       : launch_mma<COLS, HALVES, 2>(p, warps, n_sms, stream);
}

template <int COLS>
cudaError_t launch_mma(const GemvParams& p, int n_sms, cudaStream_t stream) {
  const int warps = mma::warps_for(p.m, n_sms);
  return mma::halves_for(p.m, n_sms) == 2 ? launch_mma<COLS, 2>(p, warps, n_sms, stream)
                                          : launch_mma<COLS, 1>(p, warps, n_sms, stream);
}

cudaError_t launch_mma_cols(const GemvParams& p, int n_sms, cudaStream_t stream) {
  return p.m.cols == 2048 ? launch_mma<2048>(p, n_sms, stream) : launch_mma<4096>(p, n_sms, stream);
}

}  // namespace

cudaError_t gemv(const GemvParams& p_in, cudaStream_t stream) {
  GemvParams p = p_in;
  p.n_rows = 1;
  if (!valid_params(p)) return cudaErrorInvalidValue;
  if (p.m.bits == 4) {
    const int n_sms = device_sms();
    if (mma_takes(p, n_sms)) return launch_mma_cols(p, n_sms, stream);
    switch (p.m.cols) {
      case 512: return launch_q4<512>(p, stream);
      case 1024: return launch_q4<1024>(p, stream);
      case 2048: return launch_q4<2048>(p, stream);
      case 4096: return launch_q4<4096>(p, stream);
      default: break;
    }
  }
  const size_t smem = xpad_floats(p.m.cols) * sizeof(float);
  const int work_blocks = (p.m.rows + kWarps - 1) / kWarps;
  auto kernel = p.m.bits == 4 ? gemv_generic_kernel<4> : gemv_generic_kernel<8>;
  if (smem > 48 * 1024) CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  return launch_persistent(kernel, work_blocks, smem, p, stream);
}

cudaError_t gemv_rows(const GemvParams& p, cudaStream_t stream) {
  if (p.n_rows < 1 || p.n_rows > kMaxBatchRows) return cudaErrorInvalidValue;
  GemvParams one = p;
  one.n_rows = 1;
  if (!valid_params(one)) return cudaErrorInvalidValue;
  if (p.n_rows == 1) return gemv(one, stream);
  const int n_sms = device_sms();
  if (mma_takes(p, n_sms)) return launch_mma_cols(p, n_sms, stream);
  // The register kernel for several rows only where a row alone takes the register kernel too (its rows are
  // bit-identical to gemv()'s); else one gemv() a row, which picks what the row alone would.
  if (!mma_takes(one, n_sms) && rows_kernel_takes(p, n_sms))
    return p.m.cols == 2048 ? launch_q4_rows<2048>(p, stream) : launch_q4_rows<4096>(p, stream);
  for (int r = 0; r < p.n_rows; ++r) CUDA_TRY(gemv(gemv_row(p, r), stream));
  return cudaSuccess;
}

}  // namespace lily::cuda
