// Row-parallel quantized GEMV for batch-1 decode: y = W x (+ residual), W an MLX QMatrix [rows, cols] used in
// its checkpoint layout (no repacking), x built from `in` by an optional prologue (gemv.cuh).
//
// Memory-bound: moves rows * (cols * bits / 8 + cols / 16) bytes (weights + bf16 scales and biases per group
// of 64); target >= 85% of 4.27 TB/s on large matrices (lm_head [248320, 2048]: 286 MB, 67 us at the floor).
//
// 4-bit, cols in {512, 1024, 2048, 4096}: a chunk is 8192 weights = 8192 / cols consecutive rows (4 KiB of
// packed weights + 256 B of scales + 256 B of biases, all contiguous). A group of L = min(32, cols / 32 / V)
// lanes covers a row with V 16-byte vectors per lane (V = 2 from cols 2048 up): cols 512 puts two rows in a warp
// (half-warps), cols 4096 gives 4 vectors per lane. A lane always handles the same vector positions of a row,
// so its 32-float slices of x are read from shared memory once per chunk for all the chunk's rows; the partial
// sums of the chunk's P row-passes are reduced by one reduce-scatter butterfly. Dequantisation: quant_dot.cuh.
//  gemv_q4_async_kernel (scales/biases 16-byte aligned): each warp streams its chunks through a 2-stage ring in
//    shared memory with cp.async (no registers held by loads in flight: ~147 KB in flight per SM), issued
//    before the prologue and, with programmatic dependent launch, before the previous kernel has finished.
//  gemv_q4_kernel (any alignment): the same chunks loaded straight into registers, 8 x 16 B per lane.
// The grid is persistent (one block per SM or fewer; warps grid-stride over chunks), so the prologue (the norm
// of `in`) runs once per block, overlapped with the first chunks' weight loads. The residual of a lane's next
// output row is loaded a chunk ahead (the first with the prologue's inputs), never after the dot product.
// Other widths and 8-bit (gemv_generic_kernel): a warp per row, x from shared memory; for small matrices.
#include "cuda/kernels/gemv.cuh"
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
  // One block per SM; fewer warps per block when there are few chunks, so that they spread over all SMs.
  int device = 0, n_sms = 0;
  CUDA_TRY(cudaGetDevice(&device));
  CUDA_TRY(cudaDeviceGetAttribute(&n_sms, cudaDevAttrMultiProcessorCount, device));
  const int warps = gemv_q4_async_threads(p.m, n_sms) / 32;
  const int blocks = std::max(1, std::min(n_sms, (n_chunks + warps - 1) / warps));
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
  int device = 0, n_sms = 0;
  CUDA_TRY(cudaGetDevice(&device));
  CUDA_TRY(cudaDeviceGetAttribute(&n_sms, cudaDevAttrMultiProcessorCount, device));
  const int warps = gemv_q4_async_threads(p.m, n_sms) / 32;
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
  const int threads = gemv_q4_async_threads(m, n_sms);
  if (p.prologue == GemvPrologue::rms_norm && m.cols / 4 > 2 * threads) return false;
  const size_t smem = static_cast<size_t>(rows_instance(p.n_rows)) * xpad_floats(m.cols) * sizeof(float) +
                      static_cast<size_t>(threads / 32) * kStages * kStageBytes;
  return smem <= device_smem_optin() - 32 * kRowsMax * sizeof(float) - 1024;
}

}  // namespace

int gemv_q4_async_threads(const QMatrix& m, int n_sms) {
  const int rows_per_chunk = gemv_q4::kChunkWeights / m.cols;
  const int n_chunks = (m.rows + rows_per_chunk - 1) / rows_per_chunk;
  // No more warps than the device's shared memory holds rings for (16 on Hopper; 9 at 2,048 columns on the
  // 99 KB of sm_86 / sm_89 / sm_120, whose launch with 16 failed), beside x and 1 KiB for red_s and the driver's
  // per-block reserve (as rows_kernel_takes counts it).
  const size_t room = device_smem_optin() - 1024 - xpad_floats(m.cols) * sizeof(float);
  const int fit = static_cast<int>(std::min<size_t>(kAsyncMaxWarps, room / (kStages * kStageBytes)));
  return 32 * std::clamp((n_chunks + n_sms - 1) / n_sms, 4, std::max(4, fit));
}

cudaError_t gemv(const GemvParams& p, cudaStream_t stream) {
  if (!valid_params(p)) return cudaErrorInvalidValue;
  if (p.m.bits == 4) {
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
  int device = 0, n_sms = 0;
  CUDA_TRY(cudaGetDevice(&device));
  CUDA_TRY(cudaDeviceGetAttribute(&n_sms, cudaDevAttrMultiProcessorCount, device));
  if (rows_kernel_takes(p, n_sms)) return p.m.cols == 2048 ? launch_q4_rows<2048>(p, stream) : launch_q4_rows<4096>(p, stream);
  for (int r = 0; r < p.n_rows; ++r) CUDA_TRY(gemv(gemv_row(p, r), stream));
  return cudaSuccess;
}

}  // namespace lily::cuda
