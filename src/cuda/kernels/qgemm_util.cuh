// Code shared by the two qgemm kernels (qgemm.cu: mma.sync; qgemm_wgmma.cu: wgmma) and moe_prefill.cu: the exact
// byte -> float conversion and fp16 packing of the dequantisation (both paths must see the same fp16 weights), the
// block's rows and weight matrices (dense, or an entry of moe_prefill's device-side tile list), and the mma.sync
// tile kernel's arguments and launchers.
#pragma once
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/kernels/common.cuh"
#include "cuda/kernels/qgemm.cuh"  // GemmOut

namespace lily::cuda::qgemm_util {

// The mma.sync tile kernel's arguments (qgemm.cu).
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

// The mma.sync tile launches (qgemm.cu): dense (M rows, tile_rows 64 or 128), dense SwiGLU (gate w[0], up w[1]),
// grouped (the tile list of TileArgs, max_tiles blocks along x).
int dense_tile_rows(int M, int N, int bn);
cudaError_t launch_dense(const TileArgs& a, int bits, int tile_rows, cudaStream_t stream);
cudaError_t launch_dense_swiglu(const TileArgs& a, int bits, int tile_rows, cudaStream_t stream);
cudaError_t launch_grouped(const TileArgs& a, int bits, int tile_rows, int max_tiles, bool swiglu,
                           cudaStream_t stream);
// The grouped launch for tiles of at most kFewRows rows (moe_prefill_few.cu: few rows an expert, short prompts):
// weights straight from memory into mma fragments, the tile's rows on the mma's N side. 4-bit matrices only;
// N a multiple of 32 (16 with swiglu).
inline constexpr int kFewRows = 32;
cudaError_t launch_grouped_few(const TileArgs& a, int max_tiles, bool swiglu, cudaStream_t stream);
// qgemm_wgmma's dense grid for M rows of an [N, K] matrix: 128 x 256 tiles where they fill the SMs
// (wgmma_dense_wide), else 128 x 128; its blocks (one an SM).
bool wgmma_dense_wide(int M, int N);
long wgmma_dense_blocks(int M, int N);
// The grouped launch on Hopper with the weights in registers (moe_prefill_rs.cu: wgmma with A from registers, a
// tile's rows on N in 32-row chunks): tiles of up to kRsRows rows, so that an expert's rows at 4K tokens take one
// tile. 4-bit matrices; N a multiple of 64 (swiglu) or 128, K a multiple of 512 up to 4096; sm_90a only (else
// cudaErrorInvalidDeviceFunction).
inline constexpr int kRsRows = 192;
cudaError_t launch_grouped_rs(const TileArgs& a, int max_tiles, bool swiglu, cudaStream_t stream);
// The same tiles from the experts' resident fp16 copies (moe_prefill_w16.cu; w16: one projection's region of
// moe_expand_w16's layout, the shared expert at tile-list index a.shared_expert, which must be set): both wgmma
// operands in shared memory. sm_90a only.
cudaError_t launch_grouped_w16(const TileArgs& a, const __half* w16, int max_tiles, bool swiglu, cudaStream_t stream);
// A QMatrix the tile kernels take: 4- or 8-bit, K a multiple of 64, 16-byte aligned words.
bool valid_qmatrix(const QMatrix& w);

// c += a . b on the tensor cores: mma.sync m16n8k16, fp16 operands, fp32 accumulation (A row-major 16 x 16,
// B column-major 16 x 8; the fragment layouts of the PTX ISA).
__device__ __forceinline__ void mma_f16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Byte i of v (0..255) as a float, exactly: the low mantissa byte of 2^23, minus 2^23. (quant_dot.cuh's
// nibble_as_float puts the byte at bits 16..23, where a code >= 128 would reach the exponent.)
template <int i>
__device__ __forceinline__ float byte_as_float(uint32_t v) {
  return __uint_as_float(__byte_perm(v, 0x4B000000u, 0x7650 | i)) - 8388608.0f;
}

// An fp16 pair as its 32 bits and back (the mma fragments' register form).
__device__ __forceinline__ uint32_t h2_bits(__half2 v) { return *reinterpret_cast<const uint32_t*>(&v); }
__device__ __forceinline__ __half2 bits_h2(uint32_t v) { return *reinterpret_cast<const __half2*>(&v); }

// The fp16 pair 1024 + v: v's bits in the mantissa of 1024 (exact for v < 1024).
constexpr uint32_t kF16Magic1024 = 0x64006400u;

// (w & mask) | magic in one LOP3 (inline PTX: with both constants as immediates the compiler emits two).
__device__ __forceinline__ uint32_t and_or(uint32_t w, uint32_t mask, uint32_t magic) {
  uint32_t o;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(o) : "r"(w), "r"(mask), "r"(magic));
  return o;
}

// The four fp16 pairs (1024 + q_i, 1024 + q_{i+4}) of a word of 8 nibbles (exact: q sits in the mantissa of
// 1024), one LOP3 a pair: the pair order of the few-row kernel's nibble expansion (moe_prefill_few.cu).
__device__ __forceinline__ void biased_pairs(uint32_t w, uint32_t (&o)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) o[i] = and_or(w >> (4 * i), 0x000F000Fu, kF16Magic1024);
}

__device__ __forceinline__ uint32_t pack_f16(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Columns n and n + 1 (v[0], v[1]) of an output row whose column n is element `at` of c: fp16 (f32_out false) or
// fp32 stored or added (add); one paired store where `pairs` (an even row stride and base) and n + 1 < N, else one
// store a column below N. The epilogue of the dense and grouped tiles (qgemm.cu, qgemm_wgmma.cu).
__device__ __forceinline__ void store_pair(void* c, bool f32_out, bool add, size_t at, int n, int N, bool pairs,
                                           const float (&v)[2]) {
  if (pairs && n + 1 < N) {
    if (!f32_out) {
      *reinterpret_cast<__half2*>(static_cast<__half*>(c) + at) = __floats2half2_rn(v[0], v[1]);
      return;
    }
    float2* dst = reinterpret_cast<float2*>(static_cast<float*>(c) + at);
    if (add) {
      const float2 old = *dst;
      *dst = make_float2(old.x + v[0], old.y + v[1]);
    } else {
      *dst = make_float2(v[0], v[1]);
    }
    return;
  }
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    if (n + q >= N) continue;
    if (!f32_out) {
      static_cast<__half*>(c)[at + q] = __float2half_rn(v[q]);
    } else if (add) {
      static_cast<float*>(c)[at + q] += v[q];
    } else {
      static_cast<float*>(c)[at + q] = v[q];
    }
  }
}

// The block's output rows row0 .. row0 + rows - 1 and its MATS weight matrices. Grouped mode (p.tile_count set):
// tile-list entry blockIdx.x (expert, first row, rows); the expert's matrices of the stacked p.w, or p.ws for the
// tile-list expert p.shared_expert; false for a block past the list's length (block-uniform: the block exits).
// Dense: rows BM blockIdx.x .. of p.M, matrices p.w. Args: the kernel's arguments (TileArgs).
template <int BM, int MATS, class Args>
__device__ __forceinline__ bool block_rows(const Args& p, int& row0, int& rows, QMatrix (&w)[MATS]) {
  if (p.tile_count) {
    if (static_cast<int>(blockIdx.x) >= __ldcg(p.tile_count)) return false;
    const int e = __ldcg(p.tile_expert + blockIdx.x);
    row0 = __ldcg(p.tile_row0 + blockIdx.x);
    rows = __ldcg(p.tile_rows + blockIdx.x);
#pragma unroll
    for (int m = 0; m < MATS; ++m) w[m] = e == p.shared_expert ? p.ws[m] : p.w[m].expert(e);
  } else {
    row0 = blockIdx.x * BM;
    rows = min(BM, p.M - row0);
#pragma unroll
    for (int m = 0; m < MATS; ++m) w[m] = p.w[m];
  }
  return true;
}

}  // namespace lily::cuda::qgemm_util
