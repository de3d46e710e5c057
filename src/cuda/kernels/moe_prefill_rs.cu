// moe_prefill's grouped expert GEMMs on Hopper with the weights in registers (qgemm_util.cuh launch_grouped_rs):
// wgmma.mma_async with the A operand from registers (the "RS" form). Each tile of the tile list covers up to
// kRsRows rows of one expert, so at 4,096 tokens (~128 rows an expert) an expert's weights are read and expanded
// once a chunk instead of once per 64- or 128-row tile, and no fp16 weight tile ever goes through shared memory.
//
// Work item: (tile, feature slice); a slice is 64 output features of the SwiGLU (gate and up: 128 weight rows) or
// 128 of the down projection. The grid is persistent (one block an SM, items blockIdx.x, + gridDim.x, ...; items
// of a tile are adjacent, so the tile's activation rows are read from the L2 by consecutive blocks). Block: two
// consumer warpgroups and one producer warpgroup.
//  - The producer warpgroup streams each item's K steps (64 k = one quantisation group) through a ring of kStages stages:
//    the tile's activation rows (gathered: row r of the tile is A row gather[row0 + r]) as a K-major tile in the
//    128-byte swizzle the wgmma descriptor reads, and the 128 weight rows' packed nibbles (32 bytes a row); at an
//    item's first step also the rows' bf16 scales and biases of every group (double-buffered by item parity).
//    cp.async. Each step it first releases the stage issued kLag steps before (cp.async.wait_group, the generic
//    -> async proxy fence, an arrive on full[stage]) and only then waits for the slot it fills next, so the
//    consumers never wait for the producer's issue of a later stage.
//  - A consumer warpgroup owns 64 weight rows: warp w rows 16 w .. 16 w + 15 of the warpgroup's (the wgmma A
//    fragment's rows g and g + 8, g = lane / 4). In the SwiGLU row g is the gate row of feature 8 w + g and row
//    g + 8 the up row of the same feature, so a thread's accumulators hold gate and up of the same output element
//    and the epilogue writes fp16(silu(g) * u) without an exchange. A step: the thread's two rows' 32 bytes from
//    shared memory, byte c (= lane % 4: elements 2c, 2c + 1 of each 8-element word, the A fragment's k columns)
//    of each word to fp16 pairs (PRMT, LOP3 on 0x6400: 1024 + q_lo and 1024 + 16 q_hi, one HFMA2 to q exactly,
//    one HFMA2 to scale * q + bias: the fp16 weights of the other prefill tiles), then for each 16-k slice and
//    each 32-row chunk of the tile's rows one wgmma m64n32k16 (B: the chunk's rows through a descriptor). A
//    registers alternate between two sets by step parity: a step's set is still read by its wgmmas until the
//    next step's wgmma.wait_group 1, after which the consumers arrive on empty[previous stage].
// FLOPs 2 rows N K; bytes N K / 2 (+ N K / 16 scales and biases) from memory, rows K 2 from the L2 per block.
// Measured (H200, full geometry, docs/PERF_NOTES.md "2026-12-02 (third session)"): a layer's moe_prefill at
// T = 1024 / 1280 / 1536 / 2048 / 4096 takes 587 / 624 / 656 / 731 / 1047 us on these tiles (few-row tiles: 544 /
// 642 / 738 / 923 / 1732; 128-row tiles at 4096: 1602); moe_prefill picks them from 40 rows an expert.
#include <cuda_fp16.h>

#include <algorithm>

#include "cuda/kernels/qgemm.cuh"
#include "cuda/kernels/moe_prefill_tiles.cuh"
#include "cuda/kernels/qgemm_util.cuh"
#include "cuda/kernels/quant_dot.cuh"
#include "cuda/kernels/wgmma_util.cuh"

namespace lily::cuda::qgemm_util {

namespace {

using namespace wgmma_util;

using namespace grouped_tiles;

constexpr int kStages = 6;             // ring depth
[[maybe_unused]] constexpr int kLag = kStages - 2;   // steps in flight behind the producer's newest
static_assert(kARows == 128, "the producer warpgroup: one weight row a thread for the scales");
constexpr int kThreads = 256 + 128;  // two consumer warpgroups, one producer warpgroup
constexpr int kBBytes = kRsRows * 128;  // a stage's activation tile (fp16, 128-byte swizzle)
constexpr int kWBytes = kARows * 32;    // a stage's packed weights (4-bit, 64 k a row)

// Shared-memory layout (all sizes multiples of 1024 up to the scales).
struct RsLayout {
  int groups, pitch;  // K / 64; halves a scale row (groups rounded so that 8 consecutive rows hit 8 banks)
  __host__ __device__ explicit RsLayout(int K) : groups(K / 64) {
    int words = groups / 2;
    if ((words / 4) % 2 == 0) words += 4;
    pitch = 2 * words;
  }
  __host__ __device__ size_t b_off(int s) const { return static_cast<size_t>(s) * kBBytes; }
  __host__ __device__ size_t w_off(int s) const { return b_off(kStages) + static_cast<size_t>(s) * kWBytes; }
  __host__ __device__ size_t scale_bytes() const { return size_t{kARows} * pitch * 2; }  // one array, one item
  // buffer b (item parity), array i (0 scales, 1 biases)
  __host__ __device__ size_t s_off(int b, int i) const {
    return w_off(kStages) + (2 * b + i) * scale_bytes();
  }
  __host__ __device__ size_t g_off() const { return s_off(2, 0); }
  __host__ __device__ size_t bar_off() const { return g_off() + kRsRows * 4; }
  __host__ __device__ size_t bytes() const { return bar_off() + 2 * kStages * 8 + 1024; }  // + alignment slack
};

#if defined(LILY_SM90A_PASS)
// D[64, 32] (+)= A[64, 16] . B[32, 16]^T: A from registers (the mma.sync A fragment layout per warp), B K-major
// in shared memory (descriptor db); scale_d 0 overwrites D.
__device__ __forceinline__ void wgmma_rs32(float (&d)[16], const uint32_t (&a)[4], uint64_t db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
      "{%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
}

// Keeps A registers alive (unmoved, unreused) until this point: the tensor cores read them until the wgmma
// group that uses them has completed.
__device__ __forceinline__ void fence_a(uint32_t (&a)[4][4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int q = 0; q < 4; ++q) asm volatile("" : "+r"(a[j][q])::"memory");
}

// A step's wgmmas: each 16-k slice j against the first NCH 32-row chunks of the stage's activation tile.
// The stage's descriptor is built once: a chunk n and slice j start n 4096 + 32 j bytes further, i.e. (n 4096 +
// 32 j) >> 4 more in the descriptor's address field (addresses stay below 256 KB: no carry out of the field).
template <int NCH>
__device__ __forceinline__ void issue(float (&acc)[kChunks][16], const uint32_t (&a)[4][4], uint32_t bslot, int kt) {
  const uint64_t d0 = desc_sw128(bslot);
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int n = 0; n < NCH; ++n) wgmma_rs32(acc[n], a[j], d0 + static_cast<uint64_t>((n * 4096 + 32 * j) >> 4), kt > 0 || j > 0);
}

// Elements 2c, 2c + 1 of a word of 8 nibbles (its byte c: sel picks it into bytes 0 and 2) as fp16
// scale * q + bias.
__device__ __forceinline__ uint32_t expand_pair(uint32_t w, uint32_t sel, __half2 s, __half2 b) {
  const uint32_t v = (__byte_perm(w, 0u, sel) & 0x00F0000Fu) | 0x64006400u;  // 1024 + q_lo | 1024 + 16 q_hi
  const __half2 q = __hfma2(bits_h2(v), __halves2half2(__float2half(1.0f), __float2half(0.0625f)),
                            __halves2half2(__float2half(-1024.0f), __float2half(-64.0f)));
  return h2_bits(__hfma2(q, s, b));
}
#endif

template <bool SWIGLU>
__global__ void __launch_bounds__(kThreads, 1) grouped_rs_kernel(const TileArgs p) {
#if defined(LILY_SM90A_PASS)
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* const smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  const RsLayout L(p.K);
  const uint32_t full0 = smem_u32(smem + L.bar_off()), empty0 = full0 + 8 * kStages;
  const int tid = threadIdx.x, KT = L.groups;
  const int slices = p.N / (SWIGLU ? 64 : 128);
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full0 + 8 * s, 128);   // the producer's threads, each after its copies and fence
      mbar_init(empty0 + 8 * s, 256);  // the consumers' threads, each after the stage's wgmmas completed
    }
    fence_mbar_init();
  }
  __syncthreads();
  pdl_wait();
  const int items = __ldcg(p.tile_count) * slices;
  const size_t wpr = static_cast<size_t>(p.K) / 8;  // 4-bit words a row
  const int gpr = L.groups;

  if (tid >= 256) {
    // ---------------- producer warpgroup
    const int t = tid - 256, ch = t & 7, r0 = t >> 3, b_dst = r0 * 128 + ((ch ^ (r0 & 7)) << 4);
    int* const gidx = reinterpret_cast<int*>(smem + L.g_off());
    const uint32_t* wptr[2];
    int gs = 0, slot = 0;  // steps issued; the slot of step gs
    uint32_t phase = 0;    // (gs / kStages) & 1
    int ii = 0;
    // Stage s's copies landed (this thread's, then all of them through the barrier's count): fence them against
    // the tensor cores' async proxy and release the stage to the consumers.
    int pslot = 0;  // the stage publish releases next, mod kStages
    auto publish = [&]() {
      fence_proxy_async();
      mbar_arrive(full0 + 8 * pslot);
      pslot = pslot + 1 == kStages ? 0 : pslot + 1;
    };
    for (int item = blockIdx.x; item < items; item += gridDim.x, ++ii) {
      const Item it = item_of<SWIGLU>(p, item, slices);
      producer_bar_sync();  // every producer thread is done with the previous item's gather indices
      for (int r = t; r < it.rows; r += 128) gidx[r] = p.gather ? __ldcg(p.gather + it.row0 + r) : it.row0 + r;
      producer_bar_sync();
      // This thread's activation copies: chunk ch of rows r0 + 16 i (i < kRowsPer) of the tile, their sources
      // (nullptr past the tile's rows) and their swizzled place (r & 7 = r0 & 7 for all of them).
      const __half* src[kRowsPer];
#pragma unroll
      for (int i = 0; i < kRowsPer; ++i) {
        const int r = r0 + 16 * i;
        src[i] = r < it.rows ? p.a + static_cast<size_t>(gidx[r]) * p.K + ch * 8 : nullptr;
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {  // 16-byte chunk t + 128 i of a stage's weights: row t / 2 + 64 i
        int mat, feature;
        weight_row<SWIGLU>(t / 2 + 64 * i, it.slice, mat, feature);
        wptr[i] = (mat ? it.w[1].w : it.w[0].w) + feature * wpr + (t & 1) * 4;
      }
      for (int kt = 0; kt < KT; ++kt, ++gs, slot = slot + 1 == kStages ? (phase ^= 1, 0) : slot + 1) {
        // First release stage gs - kLag (its copies are kLag groups old), then wait for the slot of stage gs:
        // the consumers never wait on this thread's issue of a later stage.
        if (gs >= kLag) {
          cp_async_wait<kLag - 1>();
          publish();  // step gs - kLag
        }
        if (gs >= kStages) mbar_wait(empty0 + 8 * slot, phase ^ 1);
        if (kt == 0) {  // the item's scales and biases, [row][group] with a padded row pitch: thread t row t
          int mat, feature;
          weight_row<SWIGLU>(t, it.slice, mat, feature);
          const __nv_bfloat16* const sc = (mat ? it.w[1].scales : it.w[0].scales) + feature * gpr;
          const __nv_bfloat16* const bi = (mat ? it.w[1].biases : it.w[0].biases) + feature * gpr;
          unsigned char* const ds = smem + L.s_off(ii & 1, 0) + t * L.pitch * 2;
          unsigned char* const db = smem + L.s_off(ii & 1, 1) + t * L.pitch * 2;
          for (int c16 = 0; c16 < gpr / 8; ++c16) {  // 16-byte chunks of the row's groups
            cp_async_16(ds + c16 * 16, sc + c16 * 8, true);
            cp_async_16(db + c16 * 16, bi + c16 * 8, true);
          }
        }
        unsigned char* const bs = smem + L.b_off(slot) + b_dst;
#pragma unroll
        for (int i = 0; i < kRowsPer; ++i)
          if (src[i]) cp_async_16(bs + i * 16 * 128, src[i] + kt * 64, true);
        unsigned char* const ws = smem + L.w_off(slot) + t * 16;
#pragma unroll
        for (int i = 0; i < 2; ++i) cp_async_16(ws + i * 2048, wptr[i] + kt * 8, true);
        cp_async_commit();
      }
    }
    cp_async_wait<0>();
    for (int s = gs - kLag < 0 ? 0 : gs - kLag; s < gs; ++s) publish();
    return;
  }

  // ---------------- consumers
  const int cw = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, c = lane & 3;
  const int ar0 = 64 * cw + 16 * warp + g, ar1 = ar0 + 8;
  const uint32_t sel = static_cast<uint32_t>(c) | (4u << 4) | (static_cast<uint32_t>(c) << 8) | (4u << 12);
  const uint32_t b_base = smem_u32(smem);
  float acc[kChunks][16];
  uint32_t a[2][4][4];
  int gs = 0, slot = 0, prev_slot = 0;  // steps consumed, the slot of step gs and of step gs - 1
  uint32_t phase = 0;                   // (gs / kStages) & 1
  int ii = 0;
  // One step: wait for stage gs, expand this thread's A fragments into set `set`, issue the wgmmas, then free the
  // previous stage once its wgmmas (and so its A set, the other one) are done.
  auto step = [&](int kt, int nch, uint32_t (&ac)[4][4], uint32_t (&prev)[4][4]) {
    mbar_wait(full0 + 8 * slot, phase);
    const unsigned char* ws = smem + L.w_off(slot);
    const uint4 r0a = *reinterpret_cast<const uint4*>(ws + ar0 * 32), r0b = *reinterpret_cast<const uint4*>(ws + ar0 * 32 + 16);
    const uint4 r1a = *reinterpret_cast<const uint4*>(ws + ar1 * 32), r1b = *reinterpret_cast<const uint4*>(ws + ar1 * 32 + 16);
    const uint16_t* ss = reinterpret_cast<const uint16_t*>(smem + L.s_off(ii & 1, 0));
    const uint16_t* bb = reinterpret_cast<const uint16_t*>(smem + L.s_off(ii & 1, 1));
    const __half2 s0 = __float2half2_rn(bf16_bits_to_float(ss[ar0 * L.pitch + kt]));
    const __half2 b0 = __float2half2_rn(bf16_bits_to_float(bb[ar0 * L.pitch + kt]));
    const __half2 s1 = __float2half2_rn(bf16_bits_to_float(ss[ar1 * L.pitch + kt]));
    const __half2 b1 = __float2half2_rn(bf16_bits_to_float(bb[ar1 * L.pitch + kt]));
    const uint32_t w0[8] = {r0a.x, r0a.y, r0a.z, r0a.w, r0b.x, r0b.y, r0b.z, r0b.w};
    const uint32_t w1[8] = {r1a.x, r1a.y, r1a.z, r1a.w, r1b.x, r1b.y, r1b.z, r1b.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // k slice j: words 2j (k 16j .. 16j + 7) and 2j + 1
      ac[j][0] = expand_pair(w0[2 * j], sel, s0, b0);
      ac[j][1] = expand_pair(w1[2 * j], sel, s1, b1);
      ac[j][2] = expand_pair(w0[2 * j + 1], sel, s0, b0);
      ac[j][3] = expand_pair(w1[2 * j + 1], sel, s1, b1);
    }
    wgmma_fence();
#pragma unroll
    for (int n = 0; n < kChunks; ++n) fence_regs(acc[n]);
    const uint32_t bslot = b_base + static_cast<uint32_t>(L.b_off(slot));
    switch (nch) {  // the tile's 32-row chunks (warpgroup-uniform): no branch between a step's wgmmas
      case 1: issue<1>(acc, ac, bslot, kt); break;
      case 2: issue<2>(acc, ac, bslot, kt); break;
      case 3: issue<3>(acc, ac, bslot, kt); break;
      case 4: issue<4>(acc, ac, bslot, kt); break;
      case 5: issue<5>(acc, ac, bslot, kt); break;
      default: issue<6>(acc, ac, bslot, kt); break;
    }
    wgmma_commit();
#pragma unroll
    for (int n = 0; n < kChunks; ++n) fence_regs(acc[n]);
    wgmma_wait<1>();
    fence_a(prev);
#pragma unroll
    for (int n = 0; n < kChunks; ++n) fence_regs(acc[n]);
    if (gs > 0) mbar_arrive(empty0 + 8 * prev_slot);
    ++gs;
    prev_slot = slot;
    if (++slot == kStages) slot = 0, phase ^= 1;
  };
  for (int item = blockIdx.x; item < items; item += gridDim.x, ++ii) {
    const Item it = item_of<SWIGLU>(p, item, slices);
    const int nch = (it.rows + 31) / 32;
#pragma unroll 1
    for (int kt = 0; kt < KT; kt += 2) {  // KT is even (launch_grouped_rs): the A sets alternate
      step(kt, nch, a[0], a[1]);
      step(kt + 1, nch, a[1], a[0]);
    }
    wgmma_wait<0>();
    fence_a(a[1]);
#pragma unroll
    for (int n = 0; n < kChunks; ++n) fence_regs(acc[n]);
    if (item + static_cast<int>(gridDim.x) >= items) pdl_launch_dependents();
    store_item<SWIGLU>(p, it, acc, cw, warp, g, c);
  }
#else
  (void)p;  // not an sm_90a pass: no wgmma (launch_grouped_rs refuses to launch, see wgmma_built)
#endif
}

}  // namespace

cudaError_t launch_grouped_rs(const TileArgs& a, int max_tiles, bool swiglu, cudaStream_t stream) {
  const int mats = swiglu ? 2 : 1, per_slice = swiglu ? 64 : 128;
  bool ok = a.tile_count && max_tiles >= 1 && a.N % per_slice == 0 && a.K % 512 == 0 && a.K <= 4096 && a.c &&
            a.a && aligned16(a.a) && a.ldc >= a.N && (swiglu || a.out == GemmOut::f32);
  for (int m = 0; m < mats; ++m) {
    ok = ok && a.w[m].bits == 4 && a.w[m].cols == a.K && a.w[m].rows == a.N && aligned16(a.w[m].w);
    if (a.shared_expert >= 0) ok = ok && a.ws[m].bits == 4 && a.ws[m].cols == a.K && a.ws[m].rows == a.N;
  }
  if (!ok) return cudaErrorInvalidValue;
  if (!wgmma_built()) return cudaErrorInvalidDeviceFunction;
  const RsLayout L(a.K);
  const size_t smem = L.bytes();
  if (smem > 232448) return cudaErrorInvalidValue;
  int sms = 0, dev = 0;
  CUDA_TRY(cudaGetDevice(&dev));
  CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const long items = static_cast<long>(max_tiles) * (a.N / per_slice);
  const dim3 grid(static_cast<unsigned>(std::min<long>(items, sms))), block(kThreads);
  auto run = [&](auto kernel) {
    CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    return launch_pdl(kernel, grid, block, smem, stream, a);
  };
  return swiglu ? run(grouped_rs_kernel<true>) : run(grouped_rs_kernel<false>);
}

}  // namespace lily::cuda::qgemm_util
