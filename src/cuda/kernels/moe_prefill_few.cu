// moe_prefill's grouped expert GEMMs for tiles of few rows (qgemm_util.cuh launch_grouped_few): a short prompt
// gives each expert ~T k / E rows (8 at 256 tokens), where qgemm.cu's 64-row tiles waste most of their work and
// expand every weight tile into shared memory for a handful of rows. Here the roles are swapped:
//  - the weights are mma.sync's A operand (16 output features x 16 k a fragment). Each warp owns 16 MT output
//    features of MATS matrices for all of the tile's rows and streams their groups (64 k) through its own ring of
//    kRing groups in shared memory, copied in stages of G groups (cp.async, kRing / G - 1 stages in flight; a
//    row's G * 32 bytes contiguous, so the copies reach the L2 as whole-line requests); the rows' scales and
//    biases are in shared memory from the start. A thread expands its 16 nibbles of a group row in registers: nibble pair ->
//    1024 + q as fp16 by one LOP3 on 0x6400, minus 1024 (exact), times the scale plus the bias by one HFMA2
//    (bf16 scale and bias are exact in fp16: the fp16 weight is scale * q + bias rounded once, the value
//    qgemm.cu's tiles hold);
//  - the tile's rows (tokens) are the B operand, 8 an mma (N = 8), read from memory (L2: a tile's rows are read
//    by every block of the tile) a group ahead of their use;
//  - the k order inside a fragment is permuted so both operands load contiguously: a thread's 16 nibbles of a
//    group row are k = 16c .. 16c + 15 (c = lane & 3); the pair (q_i, q_{i+4}) of a word is what the LOP3
//    yields, so B takes x_i and x_{i+4} of the same word of activations (one PRMT a register). The dot
//    product over a fragment's 16 k is the same sum in another order.
// No block barriers: warps are independent. FLOPs 2 rows N K; bytes N K / 2 (+ N K / 16 scales and biases) from
// memory, rows K 2 from L2 per block.
// Measured (H200, full geometry, docs/PERF_NOTES.md "2026-12-02 (second session)"): a layer's moe_prefill at
// T = 256 / 512 / 1024 / 2048 / 4096 takes 323 / 380 / 542 / 923 / 1721 us on these tiles, 550 / 618 / 724 / 1043 /
// 1783 on qgemm.cu's 64-row tiles (moe_prefill picks these up to 64 rows an expert).
#include <cuda_fp16.h>

#include "cuda/kernels/qgemm.cuh"
#include "cuda/kernels/qgemm_util.cuh"
#include "cuda/kernels/quant_dot.cuh"

namespace lily::cuda::qgemm_util {

namespace {

constexpr int kWarps = 4;
constexpr int kNT = kFewRows / 8;  // mma N tiles of 8 rows
constexpr int kGroupWords = 8;     // 4-bit words of a 64-element group row


// The four fp16 pairs (q_i, q_{i+4}) of a word of 8 nibbles, as scale * q + bias.
__device__ __forceinline__ void expand_word(uint32_t w, __half2 s, __half2 b, uint32_t (&o)[4]) {
  const __half2 k1024 = __float2half2_rn(1024.0f);
  biased_pairs(w, o);
#pragma unroll
  for (int i = 0; i < 4; ++i) o[i] = h2_bits(__hfma2(__hsub2(bits_h2(o[i]), k1024), s, b));
}


// The tile's results: acc[..][nt] regs 0, 1 = feature g, rows 2c, 2c + 1 of N tile nt; 2, 3 = feature g + 8.
template <int MATS, int MT>
__device__ __forceinline__ void store_tile(const TileArgs& p, const float (&acc)[MATS][MT][kNT][4], int row0, int rows,
                                           int f0, int g, int c) {
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int r = nt * 8 + 2 * c + q;
      if (r >= rows) continue;
      const size_t crow = static_cast<size_t>(row0 + r) * p.ldc;
#pragma unroll
      for (int i = 0; i < MT; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int f = f0 + i * 16 + g + 8 * h;
          const float v = acc[0][i][nt][2 * h + q];
          if constexpr (MATS == 2) {
            static_cast<__half*>(p.c)[crow + f] = __float2half_rn(siluf_(v) * acc[1][i][nt][2 * h + q]);
          } else if (p.out == GemmOut::f16) {
            static_cast<__half*>(p.c)[crow + f] = __float2half_rn(v);
          } else if (p.out == GemmOut::add_f32) {
            static_cast<float*>(p.c)[crow + f] += v;
          } else {
            static_cast<float*>(p.c)[crow + f] = v;
          }
        }
      }
    }
  }
}

constexpr int kRing = 8;  // groups of a warp's weights in shared memory

template <int MATS, int MT>
struct RingLayout {
  static constexpr int kRows = MATS * MT * 16;    // weight rows of the warp
  static constexpr int kStageBytes = kRows * 32;  // a group (32 bytes) of each row
  // The ring, then the rows' bf16 scales [row][group] and biases [row][group].
  __host__ __device__ static size_t warp_bytes(int groups) {
    return size_t{kRing} * kStageBytes + size_t{kRows} * groups * 4;
  }
};

// A stage of the ring: G consecutive groups of each row, a row's G * 32 bytes contiguous in shared memory as in
// global (so a copy's lanes that read one row's bytes write contiguous bytes: whole-line L2 requests), the
// 32-byte groups XOR-swizzled by row so the fragments' 8-byte reads of 8 rows stay at two wavefronts.
template <int G>
__device__ __forceinline__ int group_swizzle(int rr) {
  return G == 1 ? 0 : (rr / (4 / G)) & (G - 1);
}
template <int G>
__device__ __forceinline__ int group_offset(int rr, int j) {  // group j (0..G-1) of row rr in a stage
  return rr * G * 32 + ((j ^ group_swizzle<G>(rr)) * 32);
}

template <int MATS, int MT, int G>
__device__ __forceinline__ void issue_stage(char* slot, const QMatrix (&w)[MATS], int f0, int lane, int stage) {
  constexpr int kRows = MATS * MT * 16, kPieces = kRows * 2 * G;  // 16-byte pieces of a stage
#pragma unroll
  for (int it = 0; it < kPieces / 32; ++it) {
    const int piece = it * 32 + lane, rr = piece / (2 * G), pc = piece % (2 * G);
    const int t = rr / 16, m = t / MT, i = t % MT;
    const size_t row = static_cast<size_t>(f0 + i * 16 + rr % 16);
    cp_async_16(slot + group_offset<G>(rr, pc >> 1) + (pc & 1) * 16,
                w[m].w + row * w[m].words_per_row() + (stage * G) * kGroupWords + pc * 4, true);
  }
}

// The warp's rows' scales and biases (bf16) into s_s / b_s [row][group]: 16-byte copies in the first ring group
// where a row's groups are a multiple of 8 (K a multiple of 512), else plain loads.
template <int MATS, int MT>
__device__ __forceinline__ void load_scales(uint16_t* s_s, uint16_t* b_s, const QMatrix (&w)[MATS], int f0,
                                            int lane, int groups) {
#pragma unroll
  for (int m = 0; m < MATS; ++m) {
    const int per_mat = MT * 16 * groups;
    uint16_t* sm = s_s + m * per_mat;
    uint16_t* bm = b_s + m * per_mat;
    const size_t base = static_cast<size_t>(f0) * w[m].groups_per_row();  // rows f0.. are contiguous
    if (groups % 8 == 0) {
      for (int c = lane; c < per_mat / 8; c += 32) {
        cp_async_16(sm + 8 * c, w[m].scales + base + 8 * c, true);
        cp_async_16(bm + 8 * c, w[m].biases + base + 8 * c, true);
      }
    } else {
      for (int idx = lane; idx < per_mat; idx += 32) {
        sm[idx] = ld_bf16_bits(w[m].scales + base + idx);
        bm[idx] = ld_bf16_bits(w[m].biases + base + idx);
      }
    }
  }
}

template <int MATS, int MT, int G>
__global__ void __launch_bounds__(kWarps * 32) few_rows_kernel(const TileArgs p) {
  constexpr int S = kRing / G;  // stages in the ring
  using L = RingLayout<MATS, MT>;
  extern __shared__ __align__(16) char smem[];
  pdl_wait();
  int row0 = 0, rows = 0;
  QMatrix w[MATS];
  if (!block_rows<kFewRows, MATS>(p, row0, rows, w)) return;
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3, warp = threadIdx.x >> 5;
  const int f0 = (blockIdx.y * kWarps + warp) * 16 * MT;
  if (f0 >= p.N || rows < 1) return;
  const int groups = p.K / 64;
  char* ring = smem + warp * L::warp_bytes(groups);
  uint16_t* s_s = reinterpret_cast<uint16_t*>(ring + kRing * L::kStageBytes);  // [row][group] bf16
  uint16_t* b_s = s_s + L::kRows * groups;
  load_scales<MATS, MT>(s_s, b_s, w, f0, lane, groups);  // joins the first ring group's copies
#pragma unroll
  for (int k = 0; k < S - 1; ++k) {
    if (k * G < groups) issue_stage<MATS, MT, G>(ring + k * G * L::kStageBytes, w, f0, lane, k);
    cp_async_commit();
  }
  const int ntiles = (rows + 7) / 8;
  const __half* brow[kNT];
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt) {
    const int r = row0 + min(nt * 8 + g, rows - 1);
    brow[nt] = p.a + static_cast<size_t>(p.gather ? __ldg(p.gather + r) : r) * p.K + 16 * c;
  }
  // This lane's 16 activations of the group of each N tile, loaded a group ahead.
  uint4 xb[kNT][2];
  auto load_x = [&](int grp) {
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
      if (nt < ntiles) {
        const uint4* xp = reinterpret_cast<const uint4*>(brow[nt] + grp * 64);
        xb[nt][0] = __ldg(xp), xb[nt][1] = __ldg(xp + 1);
      }
    }
  };
  load_x(0);
  float acc[MATS][MT][kNT][4] = {};
  for (int grp = 0; grp < groups; ++grp) {
    const int stage = grp / G, j = grp % G;
    if (j == 0) {
      if ((stage + S - 1) * G < groups)
        issue_stage<MATS, MT, G>(ring + ((stage + S - 1) % S) * G * L::kStageBytes, w, f0, lane, stage + S - 1);
      cp_async_commit();
      cp_async_wait<S - 1>();
      __syncwarp();
    }
    const char* slot = ring + (stage % S) * G * L::kStageBytes;
    uint32_t a[MATS][MT][4][4];
#pragma unroll
    for (int m = 0; m < MATS; ++m) {
#pragma unroll
      for (int i = 0; i < MT; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int rr = (m * MT + i) * 16 + g + 8 * h;
          const uint2 q = *reinterpret_cast<const uint2*>(slot + group_offset<G>(rr, j) + 8 * c);
          const __half2 sc = __float2half2_rn(bf16_bits_to_float(s_s[rr * groups + grp]));
          const __half2 bi = __float2half2_rn(bf16_bits_to_float(b_s[rr * groups + grp]));
          uint32_t e0[4], e1[4];
          expand_word(q.x, sc, bi, e0);
          expand_word(q.y, sc, bi, e1);
          a[m][i][0][h] = e0[0], a[m][i][0][2 + h] = e0[1];
          a[m][i][1][h] = e0[2], a[m][i][1][2 + h] = e0[3];
          a[m][i][2][h] = e1[0], a[m][i][2][2 + h] = e1[1];
          a[m][i][3][h] = e1[2], a[m][i][3][2 + h] = e1[3];
        }
      }
    }
    if (j == G - 1) __syncwarp();  // the stage's slot is free for the next issue
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
      if (nt >= ntiles) break;
      const uint4 u0 = xb[nt][0], u1 = xb[nt][1];
      const uint32_t b[4][2] = {{__byte_perm(u0.x, u0.z, 0x5410), __byte_perm(u0.x, u0.z, 0x7632)},
                                {__byte_perm(u0.y, u0.w, 0x5410), __byte_perm(u0.y, u0.w, 0x7632)},
                                {__byte_perm(u1.x, u1.z, 0x5410), __byte_perm(u1.x, u1.z, 0x7632)},
                                {__byte_perm(u1.y, u1.w, 0x5410), __byte_perm(u1.y, u1.w, 0x7632)}};
#pragma unroll
      for (int m = 0; m < MATS; ++m)
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) mma_f16(acc[m][i][nt], a[m][i][j], b[j][0], b[j][1]);
    }
    if (grp + 1 < groups) load_x(grp + 1);  // used after the next group's wait and expansion
  }
  cp_async_wait<0>();
  pdl_launch_dependents();
  store_tile<MATS, MT>(p, acc, row0, rows, f0, g, c);
}

}  // namespace

cudaError_t launch_grouped_few(const TileArgs& a, int max_tiles, bool swiglu, cudaStream_t stream) {
  const int mats = swiglu ? 2 : 1, mt = swiglu ? 1 : 2, per_block = kWarps * 16 * mt;
  bool ok = a.tile_count && max_tiles >= 1 && a.N % (16 * mt) == 0 && a.K % 64 == 0 && a.c && a.a &&
            aligned16(a.a) && a.ldc >= a.N && (swiglu || a.out == GemmOut::f32);
  for (int m = 0; m < mats; ++m) {
    ok = ok && a.w[m].bits == 4 && a.w[m].cols == a.K && a.w[m].rows == a.N && aligned16(a.w[m].w);
    if (a.shared_expert >= 0) ok = ok && a.ws[m].bits == 4 && a.ws[m].cols == a.K && a.ws[m].rows == a.N;
  }
  if (!ok) return cudaErrorInvalidValue;
  const dim3 grid(max_tiles, (a.N + per_block - 1) / per_block), block(kWarps * 32);
  auto run = [&](auto kernel, size_t warp_bytes) {
    const size_t smem = kWarps * warp_bytes;
    CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    return launch_pdl(kernel, grid, block, smem, stream, a);
  };
  // Ring stages of 4 groups (measured 2026-12-03 on the H200, T 256 / 512 / 1,024: 318 / 370 / 529 us a layer with
  // 1 group a stage, 290 / 342 / 490 with 2, 276 / 336 / 484 with 4); 1 where a matrix's groups are not a multiple.
  const size_t wb = swiglu ? RingLayout<2, 1>::warp_bytes(a.K / 64) : RingLayout<1, 2>::warp_bytes(a.K / 64);
  const bool by4 = (a.K / 64) % 4 == 0;
  if (swiglu) return by4 ? run(few_rows_kernel<2, 1, 4>, wb) : run(few_rows_kernel<2, 1, 1>, wb);
  return by4 ? run(few_rows_kernel<1, 2, 4>, wb) : run(few_rows_kernel<1, 2, 1>, wb);
}

}  // namespace lily::cuda::qgemm_util
