// Causal flash attention of the prefill (eqs 11-12 of docs/MODEL.md) on Hopper warpgroup MMA: the opt-in
// variant AttnPrefillParams::variant = 1 of attn_prefill's flash stage (attn_prefill.cu keeps the prep, the KV
// split and the combine). head_dim 256 only; needs the sm_90a target (CMAKE_CUDA_ARCHITECTURES 90a): in a pass for
// any other target the kernel compiles to nothing and attn_prefill refuses the variant with
// cudaErrorInvalidDeviceFunction before it launches anything.
//
// Block = (query tile, kv head m, KV split) exactly as the mma.sync kernel: 128 rows of the M dimension packed as
// (query head h of the GQA group, query row), 128 / g query rows x g heads (16 rows x 8 heads at the full
// geometry), so every K/V tile is loaded once for all the query heads that share it, and the block's rows share
// 128 / g query positions (at g = 8 only the last one or two of its tiles cross the diagonal). 384 threads, three
// warpgroups (setmaxnreg: the producer gives its registers up, 40 a thread, the consumers take 232):
//  - warpgroup 0, the producer: cp.async of the Q tile (once) and of the K and V tiles of the block's range into
//    a 2-stage ring; per tile it waits on empty[stage] (all 256 consumer threads done with the tile two back),
//    issues 32 16-byte copies a thread (one 512-byte cache row per warp instruction), waits for them, fences the
//    generic-proxy writes against the tensor cores' async proxy and arrives on full[stage] (and q_full once).
//    Rows >= pos0 + T are zero-filled (and masked).
//  - warpgroups 1 and 2, the consumers: consumer warpgroup w owns rows 64 w .. 64 w + 63 (its warp i: rows 16 i
//    .. 16 i + 15 of them, one head, 16 consecutive positions). Per cache tile of 64 rows: S[64, 64] = Q K^T as
//    16 wgmma m64n64k16 (Q and K from shared memory), online softmax in fp32 registers (log2 units; only tiles
//    that cross a row's diagonal are masked), P rounded to bf16 straight from the S accumulators into the
//    A-fragment registers, O[64, 256] += P V as 4 wgmma m64n256k16 with A from registers and V read MN-major
//    (transposed by the descriptor: imm-trans-b). O is 128 fp32 registers a thread. A warpgroup whose rows are
//    all above a tile's diagonal skips it (wgmma is warpgroup-collective).
// Shared memory (1024-byte aligned, 128-byte swizzle: 16-byte chunk c of a 128-byte row r at chunk c ^ (r & 7),
// the layout of qgemm_wgmma.cu): every operand is stored as 64-dim sub-tiles of 128-byte rows. Q: 4 sub-tiles of
// 128 rows (16 KB each); K and V of a stage: 4 sub-tiles of 64 cache rows (8 KB each). Q and K are K-major (the
// reduction runs over the dims): descriptor (start, SBO 1024 between 8-row groups), k-step kk at sub-tile kk / 4,
// + 32 (kk % 4) bytes. V is MN-major for P V (the reduction runs over the cache rows, N = dims): the canonical
// MN-major 128B layout ((8 x 8 elements, n), (8 rows, k)) : ((1, 8, LBO), (64, SBO)) with LBO = 8192 (next 64
// dims = next sub-tile), SBO = 1024 (next 8 cache rows); k-step kk (cache rows 16 kk ..) starts 2048 kk bytes in.
// Total 64 KB + 2 x 64 KB + barriers = 193 KB: one block per SM. ptxas (nvcc 13.0): no spills.
// FLOPs: 4 * nq * D * sum_t (pos0 + t + 1) (plus the masked halves of diagonal tiles); bytes: the cache rows
// 0 .. pos0 + t_last once per block (nkv * ceil(T / (128 / g)) blocks, from L2 after the first) and q once.
// Per tile and block: 40 wgmma, 8.4 MFLOP (1.4 us at the measured ~790 TFLOP/s dense peak, 6 TFLOP/s an SM);
// the tensor cores read 192 KB of shared memory for it (each warpgroup Q 32 KB + K 32 KB + V 32 KB), ~1,540
// cycles at 128 B/cycle (~0.85 us); the producer brings 64 KB (from L2: 4.6 TB/s over 132 SMs at 600 TFLOP/s).
// Within a warpgroup the two GEMMs and the softmax run in sequence; the two warpgroups overlap each other.
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/kernels/attn_prefill.cuh"
#include "cuda/kernels/attention_util.cuh"
#include "cuda/kernels/attn_prefill_util.cuh"
#include "cuda/kernels/wgmma_util.cuh"

namespace lily::cuda {
namespace {

using attn_util::cp_async_16;
using attn_util::cp_async_commit;
using attn_util::cp_async_wait;
using attn_util::smem_u32;
using namespace attn_prefill_util;
using wgmma_util::desc_sw128;
using wgmma_util::fence_mbar_init;
using wgmma_util::fence_proxy_async;
using wgmma_util::fence_regs;
using wgmma_util::mbar_arrive;
using wgmma_util::mbar_init;
using wgmma_util::mbar_wait;
using wgmma_util::wgmma_commit;
using wgmma_util::wgmma_fence;
using wgmma_util::wgmma_wait;

constexpr int kD = 256;                      // head_dim
constexpr int kBM = 128;                     // (query head, query row) rows per block
constexpr int kBN = 64;                      // cache rows per tile
constexpr int kStages = 2;                   // K/V ring depth
constexpr int kConsumers = 256;              // two warpgroups
constexpr int kThreads = 128 + kConsumers;   // + the producer warpgroup
constexpr int kQSub = kBM * 128;             // one 64-dim sub-tile of Q (128-byte rows)
constexpr int kTileSub = kBN * 128;          // one 64-dim sub-tile of a K or V tile
constexpr int kQBytes = kQSub * (kD / 64);   // 64 KB
constexpr int kTileBytes = kTileSub * (kD / 64);  // 32 KB (K or V)
constexpr int kBarBytes = 128;               // full[2], empty[2], q_full
constexpr size_t kSmem = 1024 + kQBytes + size_t{kStages} * 2 * kTileBytes + kBarBytes;
static_assert(kSmem <= 232448, "shared memory");

struct WgFlashArgs {
  AttnPrefillParams p;
  int n_splits = 1;
  float* part_o = nullptr;   // [n_splits, T, nq, D] (n_splits > 1)
  float* part_ml = nullptr;  // [n_splits, T, nq, 2]
};

#if defined(LILY_SM90A_PASS)
constexpr int kProducerRegs = 40;  // setmaxnreg: 128 x 40 + 256 x 232 <= 64K registers
constexpr int kConsumerRegs = 232;
constexpr float kLog2e = 1.4426950408889634f;

// The register-operand (P) fence of wgmma_pv; wgmma_util.cuh's fence_regs covers the accumulators.
__device__ __forceinline__ void fence_regs(uint32_t (&a)[4][4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(a[i][j])::"memory");
}

// Descriptor of V as the MN-major B operand of P V (128-byte swizzle): leading byte offset 8192 = from one
// 64-dim sub-tile to the next along N, stride byte offset 1024 = from one group of 8 cache rows to the next
// along K.
__device__ __forceinline__ uint64_t desc_v_mn_major(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) | (uint64_t{kTileSub >> 4} << 16) |
         (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 62);
}

// S[64, 64] += Q[64, 16] . K[64, 16]^T: bf16, both K-major in shared memory (descriptors da, db).
__device__ __forceinline__ void wgmma_qk(float (&d)[32], uint64_t da, uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
      "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db), "r"(1));
}

// O[64, 256] += P[64, 16] . V[16, 256]: P bf16 from registers (per warp the m16n8k16 A-fragment order), V
// MN-major in shared memory (descriptor db, imm-trans-b = 1).
__device__ __forceinline__ void wgmma_pv(float (&d)[128], const uint32_t (&a)[4], uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
      "}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
#endif  // LILY_SM90A_PASS

__global__ void __launch_bounds__(kThreads, 1) attn_prefill_wgmma_kernel(const __grid_constant__ WgFlashArgs args) {
#if defined(LILY_SM90A_PASS)
  const AttnPrefillParams& p = args.p;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // The swizzle pattern repeats every 1024 bytes and the descriptors assume tiles aligned to it.
  const uint32_t q_s = smem_u32(smem_raw) + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  const uint32_t kv_s = q_s + kQBytes;  // stage st: K at kv_s + 2 st kTileBytes, V kTileBytes after it
  const uint32_t bars = kv_s + kStages * 2 * kTileBytes;
  auto full = [&](int st) { return bars + 8 * st; };
  auto empty = [&](int st) { return bars + 8 * (kStages + st); };
  const uint32_t q_full = bars + 8 * 2 * kStages;

  // Block = (query tile, kv head m, split) in the mma.sync kernel's order (latest query tile first).
  const int group = p.nq / p.nkv, rows_t = kBM / group;
  const int split = static_cast<int>(blockIdx.x) % args.n_splits, bm = static_cast<int>(blockIdx.x) / args.n_splits;
  const int m = bm % p.nkv, n_qtiles = gridDim.x / (p.nkv * args.n_splits);
  const int tq0 = (n_qtiles - 1 - bm / p.nkv) * rows_t;
  const int n_total = p.pos0 + p.T;  // valid cache rows
  const int kv_end = min(p.pos0 + tq0 + rows_t, n_total);
  const int n_tiles = (kv_end + kBN - 1) / kBN, chunk = (n_tiles + args.n_splits - 1) / args.n_splits;
  const int tile_begin = min(split * chunk, n_tiles), tile_end = min(tile_begin + chunk, n_tiles);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  if (threadIdx.x == 0) {
    for (int st = 0; st < kStages; ++st) {
      mbar_init(full(st), 128);         // the producer's threads, each after its copies landed and its fence
      mbar_init(empty(st), kConsumers);  // the consumers' threads, each after its wgmma of the tile completed
    }
    mbar_init(q_full, 128);
    fence_mbar_init();
  }
  __syncthreads();
  pdl_launch_dependents();
  pdl_wait();  // q and the new cache rows come from the prep

  if (warp < 4) {
    // ---------------- producer warpgroup: thread (warp pw, lane l) copies the 16-byte chunk l of rows pw, pw + 4,
    // ... (dims 8 l .. 8 l + 7 = chunk l % 8 of sub-tile l / 8, swizzled by the row): one 512-byte row per warp
    // instruction.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kProducerRegs));
    if (tile_begin == tile_end) return;  // an empty split: the consumers read nothing either
    const int sub = lane >> 3, ch = lane & 7, pw = warp;
    const __nv_bfloat16* q_src = static_cast<const __nv_bfloat16*>(p.scratch);
    for (int r = pw; r < kBM; r += 4) {
      const int h = r / rows_t, t = tq0 + r % rows_t;
      const bool valid = t < p.T;  // rows past the chunk: zeros, never written out
      const __nv_bfloat16* src = q_src + (static_cast<size_t>(valid ? t : 0) * p.nq + m * group + h) * kD + lane * 8;
      cp_async_16(q_s + sub * kQSub + r * 128 + ((ch ^ (r & 7)) << 4), src, valid);
    }
    cp_async_commit();
    const size_t kv_row_stride = static_cast<size_t>(p.nkv) * kD;
    for (int i = tile_begin; i < tile_end; ++i) {
      const int j = i - tile_begin, st = j % kStages;
      if (j >= kStages) mbar_wait(empty(st), (j / kStages - 1) & 1);  // tile j - kStages consumed
      const uint32_t k_dst = kv_s + st * 2 * kTileBytes + sub * kTileSub;
      for (int r = pw; r < kBN; r += 4) {
        const int row = i * kBN + r;
        const bool valid = row < n_total;
        const size_t off =
            static_cast<size_t>(valid ? row : 0) * kv_row_stride + static_cast<size_t>(m) * kD + lane * 8;
        const uint32_t dst = k_dst + r * 128 + ((ch ^ (r & 7)) << 4);
        cp_async_16(dst, p.k_cache + off, valid);
        cp_async_16(dst + kTileBytes, p.v_cache + off, valid);
      }
      cp_async_commit();
      cp_async_wait<0>();
      fence_proxy_async();
      if (j == 0) mbar_arrive(q_full);
      mbar_arrive(full(st));
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kConsumerRegs));

  // ---------------- consumers. Warp w = 4 (wg + 1) + wq: rows R0 = 64 wg + 16 wq .. + 15 of the block = head
  // h_w of the group, positions tw0 .. tw0 + 15; lane (g = lane / 4, t4 = lane % 4) holds rows g and g + 8 (the
  // accumulator layout of wgmma: per warp the mma.sync C fragment). Row r may attend cache rows 0 .. lim[r] (its
  // position; rows past the chunk clamp to the last valid row).
  const int wg = warp / 4 - 1, wq = warp % 4, g = lane / 4, t4 = lane % 4;
  const int R0 = 64 * wg + 16 * wq, h_w = R0 / rows_t, tw0 = tq0 + R0 % rows_t;
  const bool warp_active = tw0 < p.T;
  const int lim_first = min(p.pos0 + tw0, n_total - 1);
  const int lim[2] = {min(p.pos0 + tw0 + g, n_total - 1), min(p.pos0 + tw0 + g + 8, n_total - 1)};
  // The warpgroup's positions: 64 consecutive ones (rows_t >= 64) or the block's rows_t (each head a slice).
  const int wg_t_lo = rows_t >= 64 ? tq0 + (64 * wg) % rows_t : tq0;
  const int wg_t_hi = wg_t_lo + min(rows_t, 64) - 1;
  const bool wg_active = wg_t_lo < p.T;
  const int wg_lim_last = min(p.pos0 + wg_t_hi, n_total - 1);
  const uint32_t q_wg = q_s + wg * 64 * 128;
  const float s_mul = p.scale * kLog2e;

  float o[128];  // O [64 rows, 256]: o[4 nt + 0..1] row g, dims 8 nt + 2 t4 + {0, 1}; o[4 nt + 2..3] row g + 8
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};  // l_run: this lane's part of the row sum
  auto o_at = [&o](int nt, int e) -> float& { return o[4 * nt + e]; };

  if (tile_begin < tile_end) mbar_wait(q_full, 0);
  for (int i = tile_begin; i < tile_end; ++i) {
    const int j = i - tile_begin, st = j % kStages;
    mbar_wait(full(st), (j / kStages) & 1);
    const int k0 = i * kBN;
    if (wg_active && k0 <= wg_lim_last) {  // else every row of the warpgroup is masked
      const uint32_t k_tile = kv_s + st * 2 * kTileBytes, v_tile = k_tile + kTileBytes;

      // S = Q K^T: 64 rows x 64 cache rows, D in 16 k-steps (4 per 64-dim sub-tile, 32 bytes apart).
      float s[32];
#pragma unroll
      for (int e = 0; e < 32; ++e) s[e] = 0.0f;
      fence_regs(s);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk)
        wgmma_qk(s, desc_sw128(q_wg + (kk / 4) * kQSub + 32 * (kk % 4)),
                 desc_sw128(k_tile + (kk / 4) * kTileSub + 32 * (kk % 4)));
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(s);

      // Online softmax (log2 units) as the mma.sync kernel; only tiles crossing the diagonal are masked.
      float mx[2] = {-INFINITY, -INFINITY};
      scale_mask_max<kBN>([&s](int nt, int e) -> float& { return s[4 * nt + e]; }, k0, t4,
                          k0 + kBN - 1 > lim_first, lim, s_mul, mx);
      float alpha[2], m_use[2];
      online_softmax_update(mx, m_run, l_run, alpha, m_use);
      // P = exp2(s - m), rounded to bf16 into the A fragments of the 4 k-steps of P V: k-step kk takes the S
      // accumulators of n8 blocks 2 kk (cache rows 16 kk + 2 t4 ..) and 2 kk + 1 (8 rows further).
      uint32_t a[4][4];
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        float pe[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          pe[e] = exp2f(s[8 * kk + e] - m_use[(e / 2) % 2]);
          l_run[(e / 2) % 2] += pe[e];
        }
        a[kk][0] = pack_bf16x2(pe[0], pe[1]);  // row g, cache rows 16 kk + 2 t4 + {0, 1}
        a[kk][1] = pack_bf16x2(pe[2], pe[3]);  // row g + 8
        a[kk][2] = pack_bf16x2(pe[4], pe[5]);  // row g, cache rows 16 kk + 8 + 2 t4 + {0, 1}
        a[kk][3] = pack_bf16x2(pe[6], pe[7]);  // row g + 8
      }
      rescale_o<kD>(o_at, alpha);

      // O += P V: cache rows 16 kk .. 16 kk + 15 of V start 16 kk 128-byte rows into every sub-tile.
      fence_regs(o);
      fence_regs(a);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBN / 16; ++kk) wgmma_pv(o, a[kk], desc_v_mn_major(v_tile + kk * 16 * 128));
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(o);
      fence_regs(a);
    }
    mbar_arrive(empty(st));  // this thread is done with the stage (its wgmma completed)
  }

  // Epilogue (eq 12's gate) as the mma.sync kernel: out = O / l * sigmoid(gate) or, split, the partials.
  if (!warp_active) return;
  flash_epilogue<kD>(args, split, m * group + h_w, tw0, g, t4, o_at, m_run, l_run);
#else
  (void)args;  // not an sm_90a pass: no wgmma (attn_prefill refuses the variant, see attn_prefill_wgmma_built)
#endif
}

}  // namespace

// The probe of qgemm_wgmma.cu: both kernels are in the same library, built for the same targets.
bool attn_prefill_wgmma_built() { return wgmma_built(); }

cudaError_t attn_prefill_flash_wgmma(const AttnPrefillParams& p, int n_splits, float* part_o, float* part_ml,
                                     cudaStream_t stream) {
  if (p.head_dim != kD || p.nkv <= 0 || p.nq % p.nkv != 0 || kBM % (p.nq / p.nkv) != 0 ||
      kBM / (p.nq / p.nkv) % 16 != 0 || n_splits < 1 || (n_splits > 1 && (!part_o || !part_ml)))
    return cudaErrorInvalidValue;
  if (!attn_prefill_wgmma_built()) return cudaErrorInvalidDeviceFunction;
  CUDA_TRY(cudaFuncSetAttribute(attn_prefill_wgmma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                static_cast<int>(kSmem)));
  WgFlashArgs args;
  args.p = p;
  args.n_splits = n_splits;
  args.part_o = part_o;
  args.part_ml = part_ml;
  const dim3 grid(ceil_div(p.T, kBM / (p.nq / p.nkv)) * p.nkv * n_splits);
  return launch_pdl(attn_prefill_wgmma_kernel, grid, dim3(kThreads), kSmem, stream, args);
}

}  // namespace lily::cuda
