// Prefill matrix path (qgemm.cuh): GEMMs on tensor cores with the MLX weight dequantisation fused in,
// row-wise RMSNorm, and the MoE block for many rows (eqs 20-25 of shared/MODEL.md).
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
// moe_prefill for T rows, one stream, no host synchronisation:
//  1 rms_norm_rows: x = fp16(RMSNorm(h) * norm_w)                                  (eq 5's ZN, eqs 1-2)
//  2 qgemm: router logits [T, E] fp32 (8-bit), K split in S parts so the small grid fills the SMs (eq 21)
//  3 moe_route_rows, one warp a row: logits = the S partials summed in order z = 0..S-1; fp32 softmax, top-k
//    (ties -> lower index), weights renormalised in
//    rank order (as lily::cpu::route_top_k), the shared-expert gate sg = sigmoid(w_seg . x), the histogram
//    of rows per expert                                                                  (eqs 21, 22, 24)
//  4 moe_tile_map: prefix scan of the histogram to offsets, the tile list: the shared expert's tiles (rows
//    T k .. T k + T - 1, list expert E) first, then every routed expert's rows
//  5 moe_scatter: (row, slot) pairs into expert order (the order within an expert is arbitrary: a GEMM
//    row's result does not depend on the other rows of its tile, so the output stays deterministic); the
//    shared expert's rows T k + t gather token t
//  6 grouped swiglu over the routed and shared rows -> act [T k + T, I] fp16; 7 grouped down -> y
//    [T k + T, H] fp32 (both on this file's mma.sync tiles, or with MoePrefillParams::use_wgmma on
//    qgemm_wgmma.cu's for 4-bit experts: same tile list, operands and epilogues): the routed experts (eq 23)
//    and the shared expert (eq 24) in the same two launches, so the shared expert's full tiles share the
//    grid with the routed ones' partial tiles
//  8 (only where the shared expert's shapes or bits differ from the routed experts') shared expert as dense
//    launches: swiglu -> [T, Is] fp16, down -> [T, H] fp32                                         (eq 24)
//  9 moe_combine: h[t] += sum_s w_s y[t, s] + sg[t] y_shared[t] in slot order (deterministic)     (eq 25)
#include <algorithm>

#include <cuda_fp16.h>

#include "cuda/kernels/qgemm.cuh"
#include "cuda/kernels/qgemm_util.cuh"
#include "cuda/kernels/quant_dot.cuh"

namespace lily::cuda {
namespace {

using namespace qgemm_util;

constexpr int kGroup = 64;  // K step = one quantisation group
constexpr int kStages = 4;  // cp.async ring depth
constexpr int kMaxExperts = 256;
constexpr int kMaxTopK = 16;
constexpr int kMinTileRows = 64;  // smallest grouped tile (sizes the tile list in the scratch)

// ---- mma / ldmatrix
// ----------------------------------------------------------------------------------------

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

__device__ __forceinline__ void mma_f16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Element offset of 16-byte chunk `chunk` (8 fp16) of row `row` in a swizzled [rows, 64] fp16 tile.
__device__ __forceinline__ int swz(int row, int chunk) {
  return row * kGroup + ((chunk ^ (row & 7)) << 3);
}

// ---- the tile kernel
// -----------------------------------------------------------------------------------------

struct TileArgs {
  QMatrix w[2];  // MATS matrices [N, K] (stacked in grouped mode)
  const __half* a = nullptr;
  int M = 0, N = 0, K = 0;  // M: rows of the dense GEMM (unused in grouped mode)
  GemmOut out = GemmOut::f32;
  void* c = nullptr;
  int ldc = 0;
  // grouped mode (tile_count != nullptr)
  const int* tile_count = nullptr;
  const int* tile_expert = nullptr;
  const int* tile_row0 = nullptr;
  const int* tile_rows = nullptr;
  const int* gather = nullptr;  // A row of output row r is gather[r] (nullptr: r)
  QMatrix ws[2];                // the matrices of tile-list expert `shared_expert` (the shared expert)
  int shared_expert = -1;
  // dense mode: K is split into k_splits equal parts (blockIdx.z); part z writes C to c + z M ldc (f32)
  int k_splits = 1;
};

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
        if (pairs && n + 1 < p.N) {
          if (!f32_out) {
            *reinterpret_cast<__half2*>(static_cast<__half*>(cz) + crow + n) =
                __floats2half2_rn(v[0], v[1]);
          } else {
            float2* dst = reinterpret_cast<float2*>(static_cast<float*>(cz) + crow + n);
            if (p.out == GemmOut::add_f32) {
              const float2 old = *dst;
              *dst = make_float2(old.x + v[0], old.y + v[1]);
            } else {
              *dst = make_float2(v[0], v[1]);
            }
          }
          continue;
        }
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          if (n + q >= p.N) continue;
          if (!f32_out) {
            static_cast<__half*>(cz)[crow + n + q] = __float2half_rn(v[q]);
          } else if (p.out == GemmOut::add_f32) {
            static_cast<float*>(cz)[crow + n + q] += v[q];
          } else {
            static_cast<float*>(cz)[crow + n + q] = v[q];
          }
        }
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

// ---- rms_norm_rows
// -------------------------------------------------------------------------------------------

struct NormArgs {
  const float* in;
  const float* w;
  int n;
  float eps;
  __half* out;
};

// One block per row: sum of squares in fp32 (per-thread partials, warp and block sums), then
// fp16(x / RMS * w).
__global__ void __launch_bounds__(256) rms_norm_rows_kernel(const NormArgs p) {
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
  __half* out = p.out + static_cast<size_t>(blockIdx.x) * p.n;
  for (int i = threadIdx.x; i < p.n; i += 256) out[i] = __float2half_rn(in[i] * inv * p.w[i]);
}

// ---- MoE routing, tile map, scatter, combine
// -----------------------------------------------------------------

struct RouteArgs {
  const float* logits;     // [splits, T, E]: partial sums over equal parts of H
  const __half* x;  // [T, H]
  QMatrix shared_gate;     // 8-bit [1, H]
  int T, E, k, H, splits;
  int* topk_idx;  // [T, k]
  float* topk_w;  // [T, k]
  float* sg;      // [T]
  int* counts;    // [E], zeroed before
};

// Eqs 21-22 and 24's gate for one row per warp: p = softmax(logits) in fp32, the k largest p (key = bits of p
// above ~index: unique and ordered like (p, -index)), weights p / (sum of the k p in rank order) like
// cpu::route_top_k; sg = sigmoid(w_seg . x); the histogram of rows per expert.
__global__ void __launch_bounds__(256) moe_route_rows_kernel(const RouteArgs p) {
  using u64 = unsigned long long;
  const int lane = threadIdx.x & 31, t = blockIdx.x * 8 + (threadIdx.x >> 5);
  pdl_wait();
  if (t >= p.T) return;
  constexpr int kPer = kMaxExperts / 32;
  const float* lg = p.logits + static_cast<size_t>(t) * p.E;
  float v[kPer];
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = lane * kPer + i;
    float l = -INFINITY;
    if (e < p.E) {
      l = lg[e];
      for (int z = 1; z < p.splits; ++z) l += lg[static_cast<size_t>(z) * p.T * p.E + e];  // fixed order
    }
    v[i] = l;
    mx = fmaxf(mx, v[i]);
  }
  mx = warp_max(mx);
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    v[i] = lane * kPer + i < p.E ? expf(v[i] - mx) : 0.0f;
    sum += v[i];
  }
  const float inv = 1.0f / warp_sum(sum);
  u64 key[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = lane * kPer + i;
    key[i] = e < p.E ? (u64{__float_as_uint(v[i] * inv)} << 32) | ~static_cast<uint32_t>(e) : 0ull;
  }
  int my_idx = 0;
  float my_p = 0.0f, psum = 0.0f;
  for (int r = 0; r < p.k; ++r) {
    u64 best = key[0];
#pragma unroll
    for (int i = 1; i < kPer; ++i) best = key[i] > best ? key[i] : best;
    const uint32_t hi = __reduce_max_sync(0xffffffffu, static_cast<uint32_t>(best >> 32));
    const uint32_t lo = __reduce_max_sync(
        0xffffffffu, static_cast<uint32_t>(best >> 32) == hi ? static_cast<uint32_t>(best) : 0u);
    const u64 win = (u64{hi} << 32) | lo;
#pragma unroll
    for (int i = 0; i < kPer; ++i) key[i] = key[i] == win ? 0ull : key[i];
    const float prob = __uint_as_float(hi);
    psum += prob;
    if (lane == r) my_idx = static_cast<int>(~lo), my_p = prob;
  }
  if (lane < p.k) {
    p.topk_idx[t * p.k + lane] = my_idx;
    p.topk_w[t * p.k + lane] = my_p / psum;
    atomicAdd(p.counts + my_idx, 1);
  }
  // Shared-expert gate logit: lane takes words lane, lane + 32, ... (4 elements each).
  const __half* x = p.x + static_cast<size_t>(t) * p.H;
  const int words = p.H / 4;
  float dot = 0.0f;
  for (int j = lane; j < words; j += 32) {
    const uint32_t wv = __ldg(p.shared_gate.w + j);
    const int g = j / 16;
    const float s = bf16_bits_to_float(ld_bf16_bits(p.shared_gate.scales + g));
    const float b = bf16_bits_to_float(ld_bf16_bits(p.shared_gate.biases + g));
    const uint2 xv = *reinterpret_cast<const uint2*>(x + 4 * j);
    const __half2 x01 = *reinterpret_cast<const __half2*>(&xv.x);
    const __half2 x23 = *reinterpret_cast<const __half2*>(&xv.y);
    const float xs[4] = {__low2float(x01), __high2float(x01), __low2float(x23), __high2float(x23)};
#pragma unroll
    for (int q = 0; q < 4; ++q)
      dot = fmaf(fmaf(s, static_cast<float>((wv >> (8 * q)) & 0xFFu), b), xs[q], dot);
  }
  dot = warp_sum(dot);
  if (lane == 0) p.sg[t] = sigmoidf_(dot);
}

struct MapArgs {
  const int* counts;  // [E]
  int E, tile_rows;
  int shared_rows;    // T where the shared expert runs in the grouped launches (tile-list expert E), else 0
  int shared_row0;    // its first row (T k)
  int* cursor;       // out [E]: offsets (the scatter's running positions)
  int* tile_count;   // out [1]
  int* tile_expert;  // out [max_tiles]
  int* tile_row0;
  int* tile_rows_out;
};

// One block of 256 threads (thread e = expert e): exclusive scans of the counts and of the tiles per expert.
// The shared expert's tiles (if any) come first in the list: full tiles, started before the routed tails.
__global__ void __launch_bounds__(kMaxExperts) moe_tile_map_kernel(const MapArgs p) {
  __shared__ int warp_rows[8], warp_tiles[8];
  pdl_wait();
  const int e = threadIdx.x, lane = e & 31, warp = e >> 5;
  const int shared_tiles = (p.shared_rows + p.tile_rows - 1) / p.tile_rows;
  for (int i = e; i < shared_tiles; i += kMaxExperts) {
    p.tile_expert[i] = p.E;
    p.tile_row0[i] = p.shared_row0 + i * p.tile_rows;
    p.tile_rows_out[i] = min(p.tile_rows, p.shared_rows - i * p.tile_rows);
  }
  const int n = e < p.E ? p.counts[e] : 0, tiles = (n + p.tile_rows - 1) / p.tile_rows;
  int inc_rows = n, inc_tiles = tiles;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int r = __shfl_up_sync(0xffffffffu, inc_rows, o), t = __shfl_up_sync(0xffffffffu, inc_tiles, o);
    if (lane >= o) inc_rows += r, inc_tiles += t;
  }
  if (lane == 31) warp_rows[warp] = inc_rows, warp_tiles[warp] = inc_tiles;
  __syncthreads();
  int base_rows = 0, base_tiles = 0;
  for (int w = 0; w < warp; ++w) base_rows += warp_rows[w], base_tiles += warp_tiles[w];
  const int row_off = base_rows + inc_rows - n, tile_off = shared_tiles + base_tiles + inc_tiles - tiles;
  if (e < p.E) p.cursor[e] = row_off;
  for (int i = 0; i < tiles; ++i) {
    p.tile_expert[tile_off + i] = e;
    p.tile_row0[tile_off + i] = row_off + i * p.tile_rows;
    p.tile_rows_out[tile_off + i] = min(p.tile_rows, n - i * p.tile_rows);
  }
  if (e == kMaxExperts - 1) {
    int total = shared_tiles;
    for (int w = 0; w < 8; ++w) total += warp_tiles[w];
    *p.tile_count = total;
  }
  pdl_launch_dependents();
}

struct ScatterArgs {
  const int* topk_idx;  // [T k]
  int n;                // T k
  int k;
  int shared_rows;  // T where the shared expert's rows follow the routed ones (token_of[n + t] = t), else 0
  int* cursor;    // [E]
  int* token_of;  // out [T k (+ T)]: the token of each expert-ordered row
  int* pos_of;    // out [T k]: the expert-ordered row of (t, s)
};

__global__ void __launch_bounds__(256) moe_scatter_kernel(const ScatterArgs p) {
  pdl_wait();
  const int i = blockIdx.x * 256 + threadIdx.x;
  if (i >= p.n) {
    if (i < p.n + p.shared_rows) p.token_of[i] = i - p.n;
    return;
  }
  const int pos = atomicAdd(p.cursor + p.topk_idx[i], 1);
  p.token_of[pos] = i / p.k;
  p.pos_of[i] = pos;
}

struct CombineArgs {
  float* h;             // [T, H]
  const float* y;       // [T k, H] expert order
  const float* ys;      // [T, H]
  const float* topk_w;  // [T k]
  const int* pos_of;    // [T k]
  const float* sg;      // [T]
  int H, k;
};

// Eq 25 plus the residual: h[t] += sum_s w_s y[pos(t, s)] + sg[t] ys[t], slots in rank order, 4 columns
// a thread.
__global__ void __launch_bounds__(256) moe_combine_kernel(const CombineArgs p) {
  __shared__ int pos_s[kMaxTopK];
  __shared__ float w_s[kMaxTopK];
  pdl_wait();
  const int t = blockIdx.x;
  if (threadIdx.x < p.k) {
    pos_s[threadIdx.x] = p.pos_of[t * p.k + threadIdx.x];
    w_s[threadIdx.x] = p.topk_w[t * p.k + threadIdx.x];
  }
  __syncthreads();
  const float g = p.sg[t];
  for (int c = threadIdx.x * 4; c < p.H; c += 256 * 4) {
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int s = 0; s < p.k; ++s) {
      const float4 v = *reinterpret_cast<const float4*>(p.y + static_cast<size_t>(pos_s[s]) * p.H + c);
      acc.x = fmaf(w_s[s], v.x, acc.x), acc.y = fmaf(w_s[s], v.y, acc.y);
      acc.z = fmaf(w_s[s], v.z, acc.z), acc.w = fmaf(w_s[s], v.w, acc.w);
    }
    const float4 v = *reinterpret_cast<const float4*>(p.ys + static_cast<size_t>(t) * p.H + c);
    acc.x = fmaf(g, v.x, acc.x), acc.y = fmaf(g, v.y, acc.y), acc.z = fmaf(g, v.z, acc.z),
    acc.w = fmaf(g, v.w, acc.w);
    float4* hp = reinterpret_cast<float4*>(p.h + static_cast<size_t>(t) * p.H + c);
    float4 hv = *hp;
    hv.x += acc.x, hv.y += acc.y, hv.z += acc.z, hv.w += acc.w;
    *hp = hv;
  }
}

// Scratch layout of moe_prefill (each array 256-byte aligned).
struct MoeScratch {
  __half* x;
  float* logits;
  int* topk_idx;
  float* topk_w;
  float* sg;
  int* counts;
  int* cursor;
  int* tile_count;
  int* tile_expert;
  int* tile_row0;
  int* tile_rows;
  int* token_of;
  int* pos_of;
  __half* act;
  float* y;
  __half* act_s;
  float* ys;
  size_t bytes;
};

constexpr int kMaxRouterSplits = 8;

// Longest tile list: routed rows in the smallest tiles, a partial tile per expert, the shared expert's rows.
int max_tiles(int T, int E, int k) {
  return (T * k + kMinTileRows - 1) / kMinTileRows + E + (T + kMinTileRows - 1) / kMinTileRows;
}

MoeScratch carve(void* base, int T, int H, int I, int Is, int E, int k) {
  MoeScratch s{};
  size_t off = 0;
  char* b = static_cast<char*>(base);
  auto take = [&](size_t bytes) {
    void* ptr = b ? b + off : nullptr;
    off += (bytes + 255) / 256 * 256;
    return ptr;
  };
  const size_t Tz = T, rows = size_t{1} * T * k, tiles = max_tiles(T, E, k);
  s.x = static_cast<__half*>(take(Tz * H * 2));
  s.logits = static_cast<float*>(take(size_t{kMaxRouterSplits} * Tz * E * 4));
  s.topk_idx = static_cast<int*>(take(rows * 4));
  s.topk_w = static_cast<float*>(take(rows * 4));
  s.sg = static_cast<float*>(take(Tz * 4));
  s.counts = static_cast<int*>(take(size_t{1} * E * 4));
  s.cursor = static_cast<int*>(take(size_t{1} * E * 4));
  s.tile_count = static_cast<int*>(take(4));
  s.tile_expert = static_cast<int*>(take(tiles * 4));
  s.tile_row0 = static_cast<int*>(take(tiles * 4));
  s.tile_rows = static_cast<int*>(take(tiles * 4));
  s.token_of = static_cast<int*>(take((rows + Tz) * 4));
  s.pos_of = static_cast<int*>(take(rows * 4));
  if (I == Is) {  // the shared expert's act / y rows follow the routed ones (rows T k .. T k + T - 1)
    s.act = static_cast<__half*>(take((rows + Tz) * I * 2));
    s.y = static_cast<float*>(take((rows + Tz) * H * 4));
    s.act_s = s.act ? s.act + rows * I : nullptr;
    s.ys = s.y ? s.y + rows * H : nullptr;
  } else {
    s.act = static_cast<__half*>(take(rows * I * 2));
    s.y = static_cast<float*>(take(rows * H * 4));
    s.act_s = static_cast<__half*>(take(Tz * Is * 2));
    s.ys = static_cast<float*>(take(Tz * H * 4));
  }
  s.bytes = off;
  return s;
}

}  // namespace

cudaError_t qgemm(const QGemmParams& p, cudaStream_t stream) {
  if (p.use_wgmma) return qgemm_wgmma(p, stream);
  const int ldc = p.ldc ? p.ldc : p.w.rows;
  if (!valid_qmatrix(p.w) || !p.a || !p.c || p.M < 1 || ldc < p.w.rows || !aligned16(p.a) ||
      (p.out != GemmOut::f32 && p.out != GemmOut::f16 && p.out != GemmOut::add_f32)) {
    return cudaErrorInvalidValue;
  }
  TileArgs a;
  a.w[0] = a.w[1] = p.w;
  a.a = p.a, a.M = p.M, a.N = p.w.rows, a.K = p.w.cols, a.out = p.out, a.c = p.c, a.ldc = ldc;
  return launch_dense(a, p.w.bits, dense_tile_rows(p.M, a.N, 128), stream);
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
                          cudaStream_t stream) {
  if (!in || !w || !out || T < 1 || n < 1) return cudaErrorInvalidValue;
  return launch_pdl(rms_norm_rows_kernel, dim3(T), dim3(256), 0, stream, NormArgs{in, w, n, eps, out});
}

size_t moe_prefill_scratch_bytes(int T, int H, int I, int Is, int n_experts, int top_k) {
  if (T < 1 || H < 1 || I < 1 || Is < 1 || n_experts < 1 || top_k < 1) return 0;
  return carve(nullptr, T, H, I, Is, n_experts, top_k).bytes;
}

cudaError_t moe_prefill(const MoePrefillParams& p, cudaStream_t stream) {
  const int T = p.T, k = p.top_k, E = p.router.rows, H = p.router.cols, I = p.gate.rows,
            Is = p.shared_up.rows;
  const bool shapes_ok =
      valid_qmatrix(p.router) && p.router.bits == 8 && E <= kMaxExperts && valid_qmatrix(p.shared_gate) &&
      p.shared_gate.bits == 8 && p.shared_gate.cols == H && valid_qmatrix(p.gate) && valid_qmatrix(p.up) &&
      valid_qmatrix(p.down) && p.gate.cols == H && p.up.cols == H && p.up.rows == I &&
      p.up.bits == p.gate.bits && p.down.rows == H && p.down.cols == I && valid_qmatrix(p.shared_gate_proj) &&
      valid_qmatrix(p.shared_up) && valid_qmatrix(p.shared_down) && p.shared_gate_proj.rows == Is &&
      p.shared_gate_proj.cols == H && p.shared_up.cols == H && p.shared_gate_proj.bits == p.shared_up.bits &&
      p.shared_down.rows == H && p.shared_down.cols == Is && H % 4 == 0;
  if (!shapes_ok || T < 1 || k < 1 || k > kMaxTopK || k > E || !p.h || !p.norm_w || !p.scratch ||
      p.scratch_bytes < moe_prefill_scratch_bytes(T, H, I, Is, E, k) || !aligned16(p.h) ||
      !aligned16(p.scratch) || (p.tile_rows != 0 && p.tile_rows != 64 && p.tile_rows != 128)) {
    return cudaErrorInvalidValue;
  }
  const MoeScratch s = carve(p.scratch, T, H, I, Is, E, k);
  // Tile rows from the rows an expert gets on average (T k / E). Measured (H200, full geometry, cold
  // weights, 64-row / 128-row tiles): T = 512 (16 rows an expert) 611 / 769 us; T = 1024 (32) 727 / 882 us;
  // T = 2048 (64) 1048 / 1090 us; T = 4096 (128) 1793 / 1637 us. 128-row tiles from 96 rows an expert.
  const int tile_rows = p.tile_rows ? p.tile_rows : (static_cast<long>(T) * k >= 96L * E ? 128 : 64);

  // The shared expert runs as tile-list expert E of the grouped launches (its tiles fill the grouped grid's
  // tail) where its matrices have the routed experts' shapes and bits; else as dense launches after them.
  const bool fold = p.shared_in_grouped && Is == I && p.shared_gate_proj.bits == p.gate.bits &&
                    p.shared_down.bits == p.down.bits;
  const int shared_rows = fold ? T : 0;

  CUDA_TRY(rms_norm_rows(p.h, p.norm_w, T, H, p.eps, s.x, stream));
  // Router: a few row tiles of a 2048-deep K loop would leave most SMs idle, so K is split into equal parts
  // (partial logits summed in a fixed order by moe_route_rows) until the grid covers the SMs twice.
  TileArgs r;
  r.w[0] = r.w[1] = p.router, r.a = s.x, r.M = T, r.N = E, r.K = H, r.out = GemmOut::f32, r.c = s.logits;
  r.ldc = E;
  const int r_rows = dense_tile_rows(T, E, 128);
  const long r_blocks = static_cast<long>((T + r_rows - 1) / r_rows) * ((E + 127) / 128);
  while (r.k_splits < kMaxRouterSplits && (H / kGroup) % (2 * r.k_splits) == 0 &&
         r_blocks * r.k_splits * 2 <= 2 * 132) {
    r.k_splits *= 2;
  }
  CUDA_TRY(launch_dense(r, 8, r_rows, stream));
  CUDA_TRY(cudaMemsetAsync(s.counts, 0, sizeof(int) * E, stream));
  RouteArgs ra{s.logits, s.x, p.shared_gate, T, E, k, H, r.k_splits, s.topk_idx, s.topk_w, s.sg, s.counts};
  CUDA_TRY(launch_pdl(moe_route_rows_kernel, dim3((T + 7) / 8), dim3(256), 0, stream, ra));
  MapArgs ma{s.counts,  E,           tile_rows,   shared_rows, T * k,
             s.cursor, s.tile_count, s.tile_expert, s.tile_row0, s.tile_rows};
  CUDA_TRY(launch_pdl(moe_tile_map_kernel, dim3(1), dim3(kMaxExperts), 0, stream, ma));
  ScatterArgs sa{s.topk_idx, T * k, k, shared_rows, s.cursor, s.token_of, s.pos_of};
  CUDA_TRY(launch_pdl(moe_scatter_kernel, dim3((T * k + shared_rows + 255) / 256), dim3(256), 0, stream, sa));

  const int tiles = (T * k + tile_rows - 1) / tile_rows + E + (shared_rows + tile_rows - 1) / tile_rows;
  TileArgs g;
  g.w[0] = p.gate, g.w[1] = p.up, g.a = s.x, g.N = I, g.K = H, g.c = s.act, g.ldc = I;
  g.tile_count = s.tile_count, g.tile_expert = s.tile_expert, g.tile_row0 = s.tile_row0,
  g.tile_rows = s.tile_rows;
  g.gather = s.token_of;
  g.ws[0] = p.shared_gate_proj, g.ws[1] = p.shared_up, g.shared_expert = fold ? E : -1;
  // use_wgmma: the same tile list, operands and epilogues on the Hopper wgmma kernel (4-bit experts only).
  auto grouped = [&](const TileArgs& t, int bits, bool swiglu) {
    if (!p.use_wgmma || bits != 4 || (!swiglu && !p.wgmma_down)) {
      return launch_grouped(t, bits, tile_rows, tiles, swiglu, stream);
    }
    WgmmaGroupedParams wp;
    wp.w[0] = t.w[0], wp.w[1] = t.w[1], wp.ws[0] = t.ws[0], wp.ws[1] = t.ws[1];
    wp.shared_expert = t.shared_expert, wp.a = t.a, wp.gather = t.gather;
    wp.tile_count = t.tile_count, wp.tile_expert = t.tile_expert, wp.tile_row0 = t.tile_row0;
    wp.tile_rows = t.tile_rows, wp.max_tiles = tiles, wp.tile_rows_max = tile_rows, wp.swiglu = swiglu;
    wp.c = t.c, wp.ldc = t.ldc, wp.split = p.wgmma_split;
    return qgemm_wgmma_grouped(wp, stream);
  };
  CUDA_TRY(grouped(g, p.gate.bits, true));
  TileArgs d = g;
  d.w[0] = d.w[1] = p.down, d.a = s.act, d.N = H, d.K = I, d.out = GemmOut::f32, d.c = s.y, d.ldc = H;
  d.gather = nullptr;
  d.ws[0] = d.ws[1] = p.shared_down;
  CUDA_TRY(grouped(d, p.down.bits, false));

  if (!fold) {
    TileArgs sh;
    sh.w[0] = p.shared_gate_proj, sh.w[1] = p.shared_up, sh.a = s.x, sh.M = T, sh.N = Is, sh.K = H;
    sh.out = GemmOut::f16, sh.c = s.act_s, sh.ldc = Is;
    CUDA_TRY(launch_dense_swiglu(sh, p.shared_up.bits, dense_tile_rows(T, Is, 64), stream));
    TileArgs sd;
    sd.w[0] = sd.w[1] = p.shared_down, sd.a = s.act_s, sd.M = T, sd.N = H, sd.K = Is, sd.out = GemmOut::f32;
    sd.c = s.ys, sd.ldc = H;
    CUDA_TRY(launch_dense(sd, p.shared_down.bits, dense_tile_rows(T, H, 128), stream));
  }

  CombineArgs ca{p.h, s.y, s.ys, s.topk_w, s.pos_of, s.sg, H, k};
  return launch_pdl(moe_combine_kernel, dim3(T), dim3(256), 0, stream, ca);
}

}  // namespace lily::cuda
