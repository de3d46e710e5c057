// What moe_prefill's two Hopper grouped-GEMM kernels share (moe_prefill_rs.cu: the 4-bit weights expanded in
// registers; moe_prefill_w16.cu: the weights' resident fp16 copies from shared memory): the work item (a tile of
// the tile list, up to kRsRows rows of one expert, times a slice of 128 weight rows), the order of an item's 128
// weight rows (the SwiGLU's gate and up rows interleaved so that a thread's accumulators hold gate and up of the
// same output element) and the epilogue from the wgmma accumulators. Device code only; in its own namespace.
#pragma once
#include <cuda_fp16.h>

#include "cuda/kernels/qgemm_util.cuh"

namespace lily::cuda::qgemm_util::grouped_tiles {

inline constexpr int kChunks = kRsRows / 32;  // 32-row chunks of a tile (8 n8 blocks of the accumulators each)
inline constexpr int kARows = 128;            // weight rows of an item (2 consumer warpgroups x 64)
inline constexpr int kRowsPer = kRsRows / 16;  // activation rows a producer thread copies a stage (16 B each)

struct Item {
  int row0, rows, slice, expert;  // expert: the tile-list index (TileArgs::shared_expert for the shared one)
  QMatrix w[2];
};

// Item `item` of the list: its tile's rows, its feature slice and matrices (w[1] = w[0] for the down projection).
template <bool SWIGLU>
__device__ __forceinline__ Item item_of(const TileArgs& p, int item, int slices) {
  Item it;
  const int tile = item / slices;
  it.slice = item % slices;
  const int e = __ldcg(p.tile_expert + tile);
  it.expert = e;
  it.row0 = __ldcg(p.tile_row0 + tile);
  it.rows = __ldcg(p.tile_rows + tile);
#pragma unroll
  for (int m = 0; m < 2; ++m) {
    const QMatrix& src = e == p.shared_expert ? p.ws[SWIGLU ? m : 0] : p.w[SWIGLU ? m : 0];
    it.w[m] = e == p.shared_expert ? src : src.expert(e);
  }
  return it;
}

// Weight row ar (0..127) of an item: its matrix and output feature.
template <bool SWIGLU>
__host__ __device__ __forceinline__ void weight_row(int ar, int slice, int& mat, int& feature) {
  if constexpr (SWIGLU) {  // warpgroup ar / 64, warp (ar / 16) % 4, fragment half (ar / 8) % 2 = gate / up
    mat = (ar >> 3) & 1;
    feature = slice * 64 + 32 * (ar >> 6) + 8 * ((ar >> 4) & 3) + (ar & 7);
  } else {
    mat = 0;
    feature = slice * 128 + ar;
  }
}

// The item's outputs from consumer warpgroup cw's accumulators: acc[n][4 j + q] is weight row g (the gate /
// feature row) of warp `warp` and token 32 n + 8 j + 2 c + q of the tile, [4 j + 2 + q] row g + 8 (the up row /
// the feature 8 further). SwiGLU: fp16 silu(gate) * up; down: f32.
template <bool SWIGLU>
__device__ __forceinline__ void store_item(const TileArgs& p, const Item& it, const float (&acc)[kChunks][16], int cw,
                                           int warp, int g, int c) {
  const int nch = (it.rows + 31) / 32;
#pragma unroll
  for (int n = 0; n < kChunks; ++n) {
    if (n >= nch) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int t = 32 * n + 8 * j + 2 * c + q;
        if (t >= it.rows) continue;
        const size_t crow = static_cast<size_t>(it.row0 + t) * p.ldc;
        if constexpr (SWIGLU) {
          const int f = it.slice * 64 + 32 * cw + 8 * warp + g;
          static_cast<__half*>(p.c)[crow + f] = __float2half_rn(siluf_(acc[n][4 * j + q]) * acc[n][4 * j + 2 + q]);
        } else {
          const int f = it.slice * 128 + 64 * cw + 16 * warp + g;
          static_cast<float*>(p.c)[crow + f] = acc[n][4 * j + q];
          static_cast<float*>(p.c)[crow + f + 8] = acc[n][4 * j + 2 + q];
        }
      }
    }
  }
}

}  // namespace lily::cuda::qgemm_util::grouped_tiles
