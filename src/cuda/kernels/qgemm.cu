// Prefill matrix path (qgemm.cuh): GEMMs on tensor cores with the MLX weight dequantisation fused in,
// and the row-wise RMSNorm that feeds them (moe_prefill.cu runs the MoE block on these tiles).
//
// GEMM tile: one block computes a BM x BN tile of C = A W^T (A fp16 [M, K] row-major, W an MLX 4- or 8-bit
// QMatrix [N, K]), K in steps of 64 = one quantisation group:
//  - cp.async brings the A tile (BM x 64 fp16) and the packed W tile (BN x 64 x bits/8 bytes) into a
//    kStages-deep ring of shared-memory buffers, so the loads of the next steps overlap this one's math;
//  - the block expands the packed W tile ONCE into a fp16 tile in shared memory (value = scale * q + bias in
//    fp32, rounded to fp16: a relative error of at most 2^-11 per weight, like an fp16 activation), step k+1's
//    tile into one of two buffers while the warps multiply step k's; the group's scale and bias are fetched
//    a step ahead into registers. A 4-bit code becomes the float 0.5 + q/256 by one byte permute
//    (quant_dot.cuh), so value = (256 s) f + (b - 128 s); an 8-bit code becomes the float 2^23 + q;
//  - each warp multiplies its TM x TN sub-tile with mma.sync.m16n8k16 (fp16 in, fp32 accumulate), fragments
//    read with ldmatrix from XOR-swizzled rows (16-byte chunk c of row r stored at c ^ (r & 7)); 16-row
//    sub-tiles past the tile's rows skip their ldmatrix and mma (a partly filled expert tile costs the tensor
//    pipe only its rows; the dequantisation is shared by all warps either way).
// FLOPs 2 M N K; bytes N K bits/8 (+ N K / 16 of scales and biases) + M K 2 (L2 keeps A for the columns of
// blocks) + the output. The fp16 weight array never exists in device memory.
// Grouped mode (moe_prefill): blocks along x are the entries of a device-side tile list (expert, first row,
// rows); the grid is launched for the longest possible list and blocks past its device-side length exit. The
// A rows of a tile are gathered through an index array; the weights are matrix `expert` of a stacked QMatrix,
// or the separate matrices ws of the one list expert `shared_expert` (moe_prefill's shared expert).
// Split-K (dense mode, the router): blockIdx.z takes K range z K/S .. (z+1) K/S and writes its partial C to
// c + z M ldc; the consumer sums the S partials in a fixed order.
// qgemm_swiglu runs the gate and up matrices as the two MATS of one tile (two accumulators) and writes
// fp16(silu(g) * u).
//
#include <algorithm>
#include <type_traits>

#include <cuda_fp16.h>

#include "cuda/kernels/qgemm.cuh"
#include "cuda/kernels/qgemm_util.cuh"
#include "cuda/kernels/quant_dot.cuh"

namespace lily::cuda {

using namespace qgemm_util;

namespace {

constexpr int kGroup = 64;  // K step = one quantisation group
constexpr int kStages = 4;  // cp.async ring depth

// ---- mma / ldmatrix
// ----------------------------------------------------------------------------------------

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// Element offset of 16-byte chunk `chunk` (8 fp16) of row `row` in a swizzled [rows, 64] fp16 tile.
__device__ __forceinline__ int swz(int row, int chunk) {
  return row * kGroup + ((chunk ^ (row & 7)) << 3);
}

// ---- the tile kernel
// -----------------------------------------------------------------------------------------



template <int BM, int BN, int WM, int WN, int BITS, int MATS>
struct Tile {
  static constexpr int kThreads = WM * WN * 32;
  static constexpr int TM = BM / WM, TN = BN / WN;
  static constexpr int MT = TM / 16, NT = TN / 8;
  static constexpr int kPackedRowBytes = kGroup * BITS / 8;    // 32 or 64
  static constexpr int kPackedChunks = kPackedRowBytes / 16;   // 2 or 4
  static constexpr int kAStage = BM * kGroup;                  // fp16 elements
  static constexpr int kWStage = MATS * BN * kPackedRowBytes;  // bytes
  static constexpr int kUnits = MATS * BN * 2;                 // dequant units of 32 elements
  static constexpr int kUnitsPerThread = kUnits / kThreads;
  static constexpr int kAChunks = BM * 8 / kThreads;
  static constexpr int kWChunks = MATS * BN * kPackedChunks;
  static constexpr size_t kSmem = size_t{kStages} * (kAStage * 2 + kWStage) +
                                  size_t{2} * MATS * BN * kGroup * 2;  // fp16 W tile: 2 buffers
  static_assert(TM % 16 == 0 && TN % 16 == 0, "warp tile");
  static_assert(kUnits % kThreads == 0 && (BM * 8) % kThreads == 0, "work split");
};

template <int BM, int BN, int WM, int WN, int BITS, int MATS>
__global__ void __launch_bounds__(WM* WN * 32, 2) qgemm_tile_kernel(const TileArgs p) {
  using C = Tile<BM, BN, WM, WN, BITS, MATS>;
  extern __shared__ __align__(128) unsigned char smem[];
  __half* a_s = reinterpret_cast<__half*>(smem);
  unsigned char* w_s = smem + size_t{kStages} * C::kAStage * 2;
  __half* b_s = reinterpret_cast<__half*>(w_s + size_t{kStages} * C::kWStage);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / WN, wn = warp % WN;
  const int n0 = blockIdx.y * BN;

  int row0, rows;
  QMatrix w[MATS];
  pdl_wait();
  if (!block_rows<BM, MATS>(p, row0, rows, w)) return;  // past the tile list (block-uniform)
  const int K = p.K, KT = K / kGroup / p.k_splits, kt0 = blockIdx.z * KT;
  // Rows of this warp's sub-tile that hold data: sub-tiles (16 rows) past them skip ldmatrix and mma, so a
  // partly filled tile costs the tensor pipe only its rows (the warp still dequantises its share).
  const int live = rows - wm * C::TM;

  // This thread's A chunks: source row pointers (nullptr past the tile's rows: zero-filled).
  const __half* a_src[C::kAChunks];
#pragma unroll
  for (int i = 0; i < C::kAChunks; ++i) {
    const int id = tid + i * C::kThreads, r = id >> 3;
    if (r < rows) {
      const int src = p.gather ? __ldcg(p.gather + row0 + r) : row0 + r;
      a_src[i] = p.a + static_cast<size_t>(src) * K + (id & 7) * 8;
    } else {
      a_src[i] = nullptr;
    }
  }
  const size_t wpr = static_cast<size_t>(K) * BITS / 32, gpr = K / kGroup;

  auto load_stage = [&](int kt, int stage) {
    __half* as = a_s + stage * C::kAStage;
#pragma unroll
    for (int i = 0; i < C::kAChunks; ++i) {
      const int id = tid + i * C::kThreads, r = id >> 3;
      cp_async_16(as + swz(r, id & 7), a_src[i] ? a_src[i] + (kt0 + kt) * kGroup : p.a, a_src[i] != nullptr);
    }
    unsigned char* ws = w_s + stage * C::kWStage;
    for (int id = tid; id < C::kWChunks; id += C::kThreads) {
      const int m = id / (BN * C::kPackedChunks), rem = id % (BN * C::kPackedChunks);
      const int r = rem / C::kPackedChunks, ch = rem % C::kPackedChunks;
      const bool valid = n0 + r < p.N;
      const uint32_t* base = m == 0 ? w[0].w : w[MATS - 1].w;
      const uint32_t* src =
          base + (valid ? (n0 + r) * wpr + (kt0 + kt) * (kGroup * BITS / 32) + ch * 4 : 0);
      cp_async_16(ws + (m * BN + r) * C::kPackedRowBytes + ch * 16, src, valid);
    }
  };

  // Dequant units: unit u = (mat, row, half) covers 32 elements of one row.
  float sc_r[C::kUnitsPerThread], bi_r[C::kUnitsPerThread];
  auto load_scales = [&](int kt) {
#pragma unroll
    for (int i = 0; i < C::kUnitsPerThread; ++i) {
      const int u = tid + i * C::kThreads, m = u / (2 * BN), r = (u >> 1) % BN;
      float s = 0.0f, b = 0.0f;
      if (n0 + r < p.N) {
        const size_t g = (n0 + r) * gpr + kt0 + kt;
        s = bf16_bits_to_float(ld_bf16_bits((m == 0 ? w[0].scales : w[MATS - 1].scales) + g));
        b = bf16_bits_to_float(ld_bf16_bits((m == 0 ? w[0].biases : w[MATS - 1].biases) + g));
      }
      sc_r[i] = BITS == 4 ? 256.0f * s : s;
      bi_r[i] = BITS == 4 ? b - 128.0f * s : b;
    }
  };
  auto dequant = [&](int stage, int buf) {
    const unsigned char* ws = w_s + stage * C::kWStage;
#pragma unroll
    for (int i = 0; i < C::kUnitsPerThread; ++i) {
      const int u = tid + i * C::kThreads, m = u / (2 * BN), r = (u >> 1) % BN, half = u & 1;
      const unsigned char* src = ws + (m * BN + r) * C::kPackedRowBytes + half * (C::kPackedRowBytes / 2);
      __half* dst = b_s + (buf * MATS + m) * BN * kGroup;
      const float sc = sc_r[i], bi = bi_r[i];
      if constexpr (BITS == 4) {
        const uint4 v = *reinterpret_cast<const uint4*>(src);
        const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {  // word j: elements 8j..8j+7 -> chunk 4 half + j
          const uint32_t lo = words[j] & 0x0F0F0F0Fu, hi = (words[j] >> 4) & 0x0F0F0F0Fu;
          uint4 o;
          o.x = pack_f16(fmaf(nibble_as_float<0>(lo), sc, bi), fmaf(nibble_as_float<0>(hi), sc, bi));
          o.y = pack_f16(fmaf(nibble_as_float<1>(lo), sc, bi), fmaf(nibble_as_float<1>(hi), sc, bi));
          o.z = pack_f16(fmaf(nibble_as_float<2>(lo), sc, bi), fmaf(nibble_as_float<2>(hi), sc, bi));
          o.w = pack_f16(fmaf(nibble_as_float<3>(lo), sc, bi), fmaf(nibble_as_float<3>(hi), sc, bi));
          *reinterpret_cast<uint4*>(dst + swz(r, half * 4 + j)) = o;
        }
      } else {
        const uint4 v0 = *reinterpret_cast<const uint4*>(src), v1 = *reinterpret_cast<const uint4*>(src + 16);
        const uint32_t words[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {  // words 2j, 2j+1: elements 8j..8j+7 -> chunk 4 half + j
          const uint32_t w0 = words[2 * j], w1 = words[2 * j + 1];
          uint4 o;
          o.x = pack_f16(fmaf(byte_as_float<0>(w0), sc, bi), fmaf(byte_as_float<1>(w0), sc, bi));
          o.y = pack_f16(fmaf(byte_as_float<2>(w0), sc, bi), fmaf(byte_as_float<3>(w0), sc, bi));
          o.z = pack_f16(fmaf(byte_as_float<0>(w1), sc, bi), fmaf(byte_as_float<1>(w1), sc, bi));
          o.w = pack_f16(fmaf(byte_as_float<2>(w1), sc, bi), fmaf(byte_as_float<3>(w1), sc, bi));
          *reinterpret_cast<uint4*>(dst + swz(r, half * 4 + j)) = o;
        }
      }
    }
  };

  float acc[MATS][C::MT][C::NT][4];
#pragma unroll
  for (int m = 0; m < MATS; ++m)
#pragma unroll
    for (int i = 0; i < C::MT; ++i)
#pragma unroll
      for (int j = 0; j < C::NT; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[m][i][j][q] = 0.0f;

  // Step kt multiplies with fp16 W buffer kt & 1 while the block expands step kt+1 into the other one: one
  // barrier a step, and the warps' dequantisation interleaves with their mma.
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < KT) load_stage(s, s);
    cp_async_commit();
  }
  load_scales(0);
  cp_async_wait<kStages - 2>();
  __syncthreads();
  dequant(0, 0);
  if (KT > 1) load_scales(1);

  for (int kt = 0; kt < KT; ++kt) {
    cp_async_wait<kStages - 3>();
    __syncthreads();  // step kt+1 landed and step kt's fp16 W tile is complete; step kt-1's buffers are free
    if (kt + kStages - 1 < KT) load_stage(kt + kStages - 1, (kt + kStages - 1) % kStages);
    cp_async_commit();
    if (kt + 1 < KT) {
      dequant((kt + 1) % kStages, (kt + 1) & 1);
      if (kt + 2 < KT) load_scales(kt + 2);
    }
    if (live <= 0) continue;  // warp-uniform
    const __half* as = a_s + (kt % kStages) * C::kAStage;
#pragma unroll
    for (int kk = 0; kk < kGroup / 16; ++kk) {
      uint32_t af[C::MT][4];
#pragma unroll
      for (int i = 0; i < C::MT; ++i) {
        const int r = wm * C::TM + i * 16 + (lane & 15);
        if (i * 16 < live) ldmatrix_x4(af[i], as + swz(r, kk * 2 + (lane >> 4)));
      }
#pragma unroll
      for (int m = 0; m < MATS; ++m) {
        const __half* bs = b_s + ((kt & 1) * MATS + m) * BN * kGroup;
#pragma unroll
        for (int jp = 0; jp < C::NT / 2; ++jp) {
          uint32_t bf[4];
          const int n = wn * C::TN + jp * 16 + ((lane >> 4) << 3) + (lane & 7);
          ldmatrix_x4(bf, bs + swz(n, kk * 2 + ((lane >> 3) & 1)));
#pragma unroll
          for (int i = 0; i < C::MT; ++i) {
            if (i * 16 >= live) continue;
            mma_f16(acc[m][i][2 * jp], af[i], bf[0], bf[1]);
            mma_f16(acc[m][i][2 * jp + 1], af[i], bf[2], bf[3]);
          }
        }
      }
    }
  }
  cp_async_wait<0>();
  pdl_launch_dependents();

  // Epilogue: c0, c1 at (row lane/4, cols 2 (lane%4) + {0, 1}); c2, c3 eight rows below. Column pairs are
  // stored together where the row stride and base allow it.
  const int ldc = p.ldc;
  const bool f32_out = MATS == 1 && p.out != GemmOut::f16;
  const size_t z_off = blockIdx.z * static_cast<size_t>(p.M) * ldc;  // split-K part z (f32 only)
  void* const cz = f32_out ? static_cast<void*>(static_cast<float*>(p.c) + z_off) : p.c;
  const bool pairs = ldc % 2 == 0 && (reinterpret_cast<uintptr_t>(cz) & (f32_out ? 7 : 3)) == 0;
#pragma unroll
  for (int i = 0; i < C::MT; ++i) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r = wm * C::TM + i * 16 + (lane >> 2) + hr * 8;
      if (r >= rows) continue;
      const size_t crow = static_cast<size_t>(row0 + r) * ldc;
#pragma unroll
      for (int j = 0; j < C::NT; ++j) {
        const int n = n0 + wn * C::TN + j * 8 + (lane & 3) * 2;
        if (n >= p.N) continue;
        float v[2] = {acc[0][i][j][hr * 2], acc[0][i][j][hr * 2 + 1]};
        if constexpr (MATS == 2) {
          v[0] = siluf_(v[0]) * acc[1][i][j][hr * 2];
          v[1] = siluf_(v[1]) * acc[1][i][j][hr * 2 + 1];
        }
        store_pair(cz, f32_out, p.out == GemmOut::add_f32, crow + n, n, p.N, pairs, v);
      }
    }
  }
}

// Launch of one tile configuration over `x_tiles` row tiles.
template <int BM, int BN, int WM, int WN, int MATS>
cudaError_t launch_tiles(const TileArgs& a, int bits, int x_tiles, cudaStream_t stream) {
  const dim3 grid(x_tiles, (a.N + BN - 1) / BN, a.k_splits), block(WM * WN * 32);
  if (grid.y > 65535u || x_tiles < 1 || a.k_splits < 1 || a.k_splits > 64 ||
      (a.K / kGroup) % a.k_splits != 0) {
    return cudaErrorInvalidValue;
  }
  if (bits == 4) {
    using C = Tile<BM, BN, WM, WN, 4, MATS>;
    auto* k = qgemm_tile_kernel<BM, BN, WM, WN, 4, MATS>;
    CUDA_TRY(
        cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(C::kSmem)));
    return launch_pdl(k, grid, block, C::kSmem, stream, a);
  }
  using C = Tile<BM, BN, WM, WN, 8, MATS>;
  auto* k = qgemm_tile_kernel<BM, BN, WM, WN, 8, MATS>;
  CUDA_TRY(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(C::kSmem)));
  return launch_pdl(k, grid, block, C::kSmem, stream, a);
}

// ---- rms_norm_rows
// -------------------------------------------------------------------------------------------

template <class Out>
struct NormArgs {
  const float* in;
  const float* w;
  int n;
  float eps;
  Out* out;
  int out_stride;  // elements between output rows
};

// One block per row: sum of squares in fp32 (per-thread partials, warp and block sums), then
// fp16(x / RMS * w) (or fp32).
template <class Out>
__global__ void __launch_bounds__(256) rms_norm_rows_kernel(const NormArgs<Out> p) {
  __shared__ float part_s[8];
  pdl_wait();
  const float* in = p.in + static_cast<size_t>(blockIdx.x) * p.n;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < p.n; i += 256) ss = fmaf(in[i], in[i], ss);
  ss = warp_sum(ss);
  if ((threadIdx.x & 31) == 0) part_s[threadIdx.x >> 5] = ss;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) total += part_s[i];
  const float inv = rsqrtf(total / p.n + p.eps);
  pdl_launch_dependents();
  Out* out = p.out + static_cast<size_t>(blockIdx.x) * p.out_stride;
  for (int i = threadIdx.x; i < p.n; i += 256) {
    const float y = in[i] * inv * p.w[i];
    if constexpr (std::is_same_v<Out, __half>) out[i] = __float2half_rn(y);
    else out[i] = y;
  }
}

}  // namespace

namespace qgemm_util {

// Tile shapes: 128 x 128 (warps 2 x 4 of 64 x 32) for many rows, 64 x 128 (2 x 4 of 32 x 32) for few; the
// swiglu tiles hold 64 columns of each of gate and up (128 x 64: 4 x 2 warps of 32 x 32; 64 x 64: 2 x 4 warps
// of 32 x 16). Two blocks per SM (128 registers a thread), so that one block's dequantisation and barriers
// overlap the other's mma. A dense GEMM takes 128-row tiles only when they still fill the 132 SMs once: a K
// loop runs serially within a block, so a small grid is bound by one block's latency.
int dense_tile_rows(int M, int N, int bn) {
  return static_cast<long>((M + 127) / 128) * ((N + bn - 1) / bn) >= 132 ? 128 : 64;
}

cudaError_t launch_dense(const TileArgs& a, int bits, int tile_rows, cudaStream_t stream) {
  if (tile_rows == 128) return launch_tiles<128, 128, 2, 4, 1>(a, bits, (a.M + 127) / 128, stream);
  return launch_tiles<64, 128, 2, 4, 1>(a, bits, (a.M + 63) / 64, stream);
}
cudaError_t launch_dense_swiglu(const TileArgs& a, int bits, int tile_rows, cudaStream_t stream) {
  if (tile_rows == 128) return launch_tiles<128, 64, 4, 2, 2>(a, bits, (a.M + 127) / 128, stream);
  return launch_tiles<64, 64, 2, 4, 2>(a, bits, (a.M + 63) / 64, stream);
}
cudaError_t launch_grouped(const TileArgs& a, int bits, int tile_rows, int max_tiles, bool swiglu,
                           cudaStream_t stream) {
  if (swiglu) {
    return tile_rows == 128 ? launch_tiles<128, 64, 4, 2, 2>(a, bits, max_tiles, stream)
                            : launch_tiles<64, 64, 2, 4, 2>(a, bits, max_tiles, stream);
  }
  return tile_rows == 128 ? launch_tiles<128, 128, 2, 4, 1>(a, bits, max_tiles, stream)
                          : launch_tiles<64, 128, 2, 4, 1>(a, bits, max_tiles, stream);
}

bool valid_qmatrix(const QMatrix& w) {
  return w.w && w.scales && w.biases && w.rows >= 1 && w.cols >= kGroup && w.cols % kGroup == 0 &&
         (w.bits == 4 || w.bits == 8) && aligned16(w.w);
}

}  // namespace qgemm_util

namespace {

struct AddPartsArgs {
  const float* parts;  // [S, M, N]
  void* c;             // [M, ldc] in the GEMM's output type
  int M, N, ldc, S;
  GemmOut out;
};

// sum = parts[0, t, n] + ... + parts[S - 1, t, n], summed in that order, then c[t, n] = sum (f32, or fp16(sum))
// or c[t, n] += sum (add_f32).
__global__ void __launch_bounds__(256) add_parts_kernel(const AddPartsArgs p) {
  pdl_wait();
  const size_t part = static_cast<size_t>(p.M) * p.N;  // elements of a part
  for (size_t i = blockIdx.x * 256 + threadIdx.x; i < part; i += static_cast<size_t>(gridDim.x) * 256) {
    float sum = p.parts[i];
    for (int z = 1; z < p.S; ++z) sum += p.parts[z * part + i];
    const size_t at = i / p.N * p.ldc + i % p.N;
    if (p.out == GemmOut::f16) {
      static_cast<__half*>(p.c)[at] = __float2half_rn(sum);
    } else if (p.out == GemmOut::add_f32) {
      static_cast<float*>(p.c)[at] += sum;
    } else {
      static_cast<float*>(p.c)[at] = sum;
    }
  }
}

// Scratch of S fp32 parts of an M x N result.
size_t split_bytes(int S, int M, int N) { return size_t{4} * S * M * N; }

}  // namespace

int qgemm_split_k_parts(int M, const QMatrix& w) {
  if (M < 1 || w.rows < 1 || w.cols < kGroup) return 1;
  const long blocks = static_cast<long>((M + 63) / 64) * ((w.rows + 127) / 128);  // the 64-row tiles' grid
  int S = 1;
  while (S < 8 && (w.cols / kGroup) % (2 * S) == 0 && blocks * S * 2 <= 2 * 132) S *= 2;
  return S;
}

size_t qgemm_split_scratch_bytes(int M, const QMatrix& w) {
  const int S = qgemm_split_k_parts(M, w);
  return S > 1 ? split_bytes(S, M, w.rows) : 0;
}

namespace {

// Rounds of blocks the dense tile grid of M rows takes on the 132 SMs: qgemm_wgmma's tiles (one block an SM), or
// the mma.sync tiles (two).
long dense_rounds(int M, int N, bool wgmma) {
  if (wgmma) return (wgmma_dense_blocks(M, N) + 131) / 132;
  const int bm = dense_tile_rows(M, N, 128);
  return (static_cast<long>((M + bm - 1) / bm) * ((N + 127) / 128) + 263) / 264;
}

}  // namespace

int qgemm_row_tail(int M, const QMatrix& w, bool wgmma) {
  const int tail = M % 128, head = M - tail;
  return tail && head >= 128 && dense_rounds(head, w.rows, wgmma) < dense_rounds(M, w.rows, wgmma) ? tail : 0;
}

cudaError_t qgemm(const QGemmParams& p, cudaStream_t stream) {
  const int ldc = p.ldc ? p.ldc : p.w.rows;
  if (!valid_qmatrix(p.w) || !p.a || !p.c || p.M < 1 || ldc < p.w.rows || !aligned16(p.a) ||
      (p.out != GemmOut::f32 && p.out != GemmOut::f16 && p.out != GemmOut::add_f32)) {
    return cudaErrorInvalidValue;
  }
  // Row tail: where the rows past the last multiple of 128 would add a round of blocks (1,025 rows of gdn_out: 144
  // tiles of 128 x 128 on 132 SMs, twice the time of 1,024 rows), the full 128-row tiles run as one GEMM and the
  // tail rows as another (split-K when there is scratch: the tail rows' sums in another order, within the same
  // fp32 tolerance).
  const int tail = qgemm_row_tail(p.M, p.w, p.use_wgmma && wgmma_built()), head = p.M - tail;
  if (tail) {
    QGemmParams h = p, t = p;
    h.M = head, t.M = tail, t.ldc = ldc, t.use_wgmma = false;
    t.a = p.a + static_cast<size_t>(head) * p.w.cols;
    const size_t c_off = static_cast<size_t>(head) * ldc * (p.out == GemmOut::f16 ? 2 : 4);
    t.c = static_cast<char*>(p.c) + c_off;
    CUDA_TRY(qgemm(h, stream));
    return qgemm(t, stream);
  }
  int S = p.split_scratch ? qgemm_split_k_parts(p.M, p.w) : 1;
  if (S > 1 && p.split_scratch_bytes < split_bytes(S, p.M, p.w.rows)) S = 1;  // too little scratch: no split
  if (p.use_wgmma && S == 1) return qgemm_wgmma(p, stream);
  TileArgs a;
  a.w[0] = a.w[1] = p.w;
  a.a = p.a, a.M = p.M, a.N = p.w.rows, a.K = p.w.cols, a.out = p.out, a.c = p.c, a.ldc = ldc;
  if (S == 1) return launch_dense(a, p.w.bits, dense_tile_rows(p.M, a.N, 128), stream);
  a.out = GemmOut::f32, a.c = p.split_scratch, a.ldc = a.N, a.k_splits = S;
  CUDA_TRY(launch_dense(a, p.w.bits, 64, stream));
  const AddPartsArgs ap{static_cast<const float*>(p.split_scratch), p.c, p.M, a.N, ldc, S, p.out};
  const long n_all = static_cast<long>(p.M) * a.N;
  return launch_pdl(add_parts_kernel, dim3(static_cast<unsigned>(std::min<long>((n_all + 255) / 256, 4 * 132))),
                    dim3(256), 0, stream, ap);
}

cudaError_t qgemm_swiglu(const QGemmSwigluParams& p, cudaStream_t stream) {
  if (!valid_qmatrix(p.gate) || !valid_qmatrix(p.up) || p.gate.rows != p.up.rows ||
      p.gate.cols != p.up.cols || p.gate.bits != p.up.bits || !aligned16(p.up.w) || !p.a || !p.act ||
      p.M < 1 || !aligned16(p.a)) {
    return cudaErrorInvalidValue;
  }
  TileArgs a;
  a.w[0] = p.gate, a.w[1] = p.up;
  a.a = p.a, a.M = p.M, a.N = p.gate.rows, a.K = p.gate.cols, a.out = GemmOut::f16, a.c = p.act;
  a.ldc = p.gate.rows;
  return launch_dense_swiglu(a, p.gate.bits, dense_tile_rows(p.M, a.N, 64), stream);
}

cudaError_t rms_norm_rows(const float* in, const float* w, int T, int n, float eps, __half* out,
                          cudaStream_t stream, int out_stride) {
  if (!in || !w || !out || T < 1 || n < 1 || (out_stride != 0 && out_stride < n)) return cudaErrorInvalidValue;
  return launch_pdl(rms_norm_rows_kernel<__half>, dim3(T), dim3(256), 0, stream,
                    NormArgs<__half>{in, w, n, eps, out, out_stride ? out_stride : n});
}

cudaError_t rms_norm_rows_f32(const float* in, const float* w, int T, int n, float eps, float* out,
                              cudaStream_t stream, int out_stride) {
  if (!in || !w || !out || T < 1 || n < 1) return cudaErrorInvalidValue;
  return launch_pdl(rms_norm_rows_kernel<float>, dim3(T), dim3(256), 0, stream,
                    NormArgs<float>{in, w, n, eps, out, out_stride ? out_stride : n});
}

}  // namespace lily::cuda
