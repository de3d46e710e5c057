// moe_prefill's grouped expert GEMMs on Hopper from resident fp16 copies of the experts (qgemm_util.cuh
// launch_grouped_w16; the copies: moe_prefill.cuh moe_expand_w16). The register-sourced tiles (moe_prefill_rs.cu)
// expand the 4-bit weights in every consumer thread, ~400 instructions a warp per 64-k step, and run at 3.6x the
// FLOP floor at 4,096 rows; here the weights were expanded once at load, in the order an item's stage needs them
// (128 weight rows x 64 k, 16 KB, already in the 128-byte swizzle), so a stage's weights are one bulk copy
// (cp.async.bulk, completing on the stage's mbarrier) and the consumers only issue wgmmas with both operands in
// shared memory: one m64nNk16 a 16-k slice, N = the tile's rows rounded up to 32 (up to kRsRows = 192).
// The weights and the activations stream through rings of their own, so that the DRAM stream runs as far ahead
// as its ring allows whatever the gathered rows do: lane 0 of the producer warpgroup's first warp issues the
// weight stages (kWStages deep), its other three warps copy the tile's gathered activation rows with cp.async
// (kBStages deep, each thread's stage landing as a cp.async arrive on the stage's barrier). The work items, their
// weight-row order (gate / up interleaved), the tile list and the epilogue are those of the register-sourced
// kernel (moe_prefill_tiles.cuh).
// The two numbers at 4,096 rows, a layer: 232 GFLOP (294 us at 790 TFLOP/s); the fp16 experts 257 x 6 MB =
// 1.62 GB (379 us at 4.27 TB/s): bound by the weight read. Shared memory read a 16-k slice per block: A 2 x 2 KB,
// B 2 x N 32 bytes (N = 128: 12 KB in 128 cycles of MMA, under the 128 bytes a cycle).
#include <cuda_fp16.h>

#include <algorithm>
#include <type_traits>

#include "cuda/kernels/moe_prefill.cuh"
#include "cuda/kernels/moe_prefill_tiles.cuh"
#include "cuda/kernels/qgemm.cuh"
#include "cuda/kernels/qgemm_util.cuh"
#include "cuda/kernels/quant_dot.cuh"
#include "cuda/kernels/wgmma_util.cuh"

namespace lily::cuda::qgemm_util {

namespace {

using namespace wgmma_util;
using namespace grouped_tiles;

constexpr int kWStages = 7;               // weight ring depth (the DRAM stream)
constexpr int kBStages = 4;               // activation ring depth (gathered rows, from the L2)
constexpr int kBThreads = 96;             // producer warps 1-3 copy the activation rows; warp 0 lane 0 the weights
constexpr int kThreads = 256 + 128;       // two consumer warpgroups, one producer warpgroup
constexpr int kBBytes = kRsRows * 128;    // a stage's activation tile (fp16, 128-byte swizzle)
constexpr int kWHalves = kARows * 64;     // a stage's weights: 128 rows x 64 k (one tile of the copies)
constexpr int kWBytes = kWHalves * 2;
[[maybe_unused]] constexpr int kBRowsPer = kRsRows * 8 / kBThreads;     // activation rows a copying thread takes a stage (16 B each)
constexpr size_t kWOff = size_t{kBStages} * kBBytes;
constexpr size_t kGOff = kWOff + size_t{kWStages} * kWBytes;  // the item's gather indices
constexpr size_t kBarOff = kGOff + kRsRows * 4;
constexpr size_t kSmem = kBarOff + 2 * (kWStages + kBStages) * 8 + 1024;  // + alignment slack
static_assert(kSmem <= 232448, "shared memory");
static_assert(kRsRows * 8 % kBThreads == 0 && kBThreads % 8 == 0, "activation copy split");

#if defined(LILY_SM90A_PASS)
// D[64, 32 NCH] (+)= A[64, 16] . B[32 NCH, 16]^T, both K-major in shared memory (descriptors da, db); scale_d 0
// overwrites D. d[n] holds n8 blocks 4 n .. 4 n + 3 (the mma.sync C-fragment order).
template <int NCH>
__device__ __forceinline__ void wgmma_ss(float (&d)[kChunks][16], uint64_t da, uint64_t db, int scale_d);
template <>
__device__ __forceinline__ void wgmma_ss<1>(float (&d)[kChunks][16], uint64_t da, uint64_t db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[0][4]), "+f"(d[0][5]), "+f"(d[0][6]), "+f"(d[0][7]),
        "+f"(d[0][8]), "+f"(d[0][9]), "+f"(d[0][10]), "+f"(d[0][11]), "+f"(d[0][12]), "+f"(d[0][13]), "+f"(d[0][14]), "+f"(d[0][15])
      : "l"(da), "l"(db), "r"(scale_d));
}
template <>
__device__ __forceinline__ void wgmma_ss<2>(float (&d)[kChunks][16], uint64_t da, uint64_t db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[0][4]), "+f"(d[0][5]), "+f"(d[0][6]), "+f"(d[0][7]),
        "+f"(d[0][8]), "+f"(d[0][9]), "+f"(d[0][10]), "+f"(d[0][11]), "+f"(d[0][12]), "+f"(d[0][13]), "+f"(d[0][14]), "+f"(d[0][15]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[1][4]), "+f"(d[1][5]), "+f"(d[1][6]), "+f"(d[1][7]),
        "+f"(d[1][8]), "+f"(d[1][9]), "+f"(d[1][10]), "+f"(d[1][11]), "+f"(d[1][12]), "+f"(d[1][13]), "+f"(d[1][14]), "+f"(d[1][15])
      : "l"(da), "l"(db), "r"(scale_d));
}
template <>
__device__ __forceinline__ void wgmma_ss<3>(float (&d)[kChunks][16], uint64_t da, uint64_t db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %50, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n96k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, %48, %49, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[0][4]), "+f"(d[0][5]), "+f"(d[0][6]), "+f"(d[0][7]),
        "+f"(d[0][8]), "+f"(d[0][9]), "+f"(d[0][10]), "+f"(d[0][11]), "+f"(d[0][12]), "+f"(d[0][13]), "+f"(d[0][14]), "+f"(d[0][15]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[1][4]), "+f"(d[1][5]), "+f"(d[1][6]), "+f"(d[1][7]),
        "+f"(d[1][8]), "+f"(d[1][9]), "+f"(d[1][10]), "+f"(d[1][11]), "+f"(d[1][12]), "+f"(d[1][13]), "+f"(d[1][14]), "+f"(d[1][15]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[2][4]), "+f"(d[2][5]), "+f"(d[2][6]), "+f"(d[2][7]),
        "+f"(d[2][8]), "+f"(d[2][9]), "+f"(d[2][10]), "+f"(d[2][11]), "+f"(d[2][12]), "+f"(d[2][13]), "+f"(d[2][14]), "+f"(d[2][15])
      : "l"(da), "l"(db), "r"(scale_d));
}
template <>
__device__ __forceinline__ void wgmma_ss<4>(float (&d)[kChunks][16], uint64_t da, uint64_t db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[0][4]), "+f"(d[0][5]), "+f"(d[0][6]), "+f"(d[0][7]),
        "+f"(d[0][8]), "+f"(d[0][9]), "+f"(d[0][10]), "+f"(d[0][11]), "+f"(d[0][12]), "+f"(d[0][13]), "+f"(d[0][14]), "+f"(d[0][15]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[1][4]), "+f"(d[1][5]), "+f"(d[1][6]), "+f"(d[1][7]),
        "+f"(d[1][8]), "+f"(d[1][9]), "+f"(d[1][10]), "+f"(d[1][11]), "+f"(d[1][12]), "+f"(d[1][13]), "+f"(d[1][14]), "+f"(d[1][15]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[2][4]), "+f"(d[2][5]), "+f"(d[2][6]), "+f"(d[2][7]),
        "+f"(d[2][8]), "+f"(d[2][9]), "+f"(d[2][10]), "+f"(d[2][11]), "+f"(d[2][12]), "+f"(d[2][13]), "+f"(d[2][14]), "+f"(d[2][15]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[3][4]), "+f"(d[3][5]), "+f"(d[3][6]), "+f"(d[3][7]),
        "+f"(d[3][8]), "+f"(d[3][9]), "+f"(d[3][10]), "+f"(d[3][11]), "+f"(d[3][12]), "+f"(d[3][13]), "+f"(d[3][14]), "+f"(d[3][15])
      : "l"(da), "l"(db), "r"(scale_d));
}
template <>
__device__ __forceinline__ void wgmma_ss<5>(float (&d)[kChunks][16], uint64_t da, uint64_t db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %82, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n160k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79}, %80, %81, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[0][4]), "+f"(d[0][5]), "+f"(d[0][6]), "+f"(d[0][7]),
        "+f"(d[0][8]), "+f"(d[0][9]), "+f"(d[0][10]), "+f"(d[0][11]), "+f"(d[0][12]), "+f"(d[0][13]), "+f"(d[0][14]), "+f"(d[0][15]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[1][4]), "+f"(d[1][5]), "+f"(d[1][6]), "+f"(d[1][7]),
        "+f"(d[1][8]), "+f"(d[1][9]), "+f"(d[1][10]), "+f"(d[1][11]), "+f"(d[1][12]), "+f"(d[1][13]), "+f"(d[1][14]), "+f"(d[1][15]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[2][4]), "+f"(d[2][5]), "+f"(d[2][6]), "+f"(d[2][7]),
        "+f"(d[2][8]), "+f"(d[2][9]), "+f"(d[2][10]), "+f"(d[2][11]), "+f"(d[2][12]), "+f"(d[2][13]), "+f"(d[2][14]), "+f"(d[2][15]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[3][4]), "+f"(d[3][5]), "+f"(d[3][6]), "+f"(d[3][7]),
        "+f"(d[3][8]), "+f"(d[3][9]), "+f"(d[3][10]), "+f"(d[3][11]), "+f"(d[3][12]), "+f"(d[3][13]), "+f"(d[3][14]), "+f"(d[3][15]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[4][4]), "+f"(d[4][5]), "+f"(d[4][6]), "+f"(d[4][7]),
        "+f"(d[4][8]), "+f"(d[4][9]), "+f"(d[4][10]), "+f"(d[4][11]), "+f"(d[4][12]), "+f"(d[4][13]), "+f"(d[4][14]), "+f"(d[4][15])
      : "l"(da), "l"(db), "r"(scale_d));
}
template <>
__device__ __forceinline__ void wgmma_ss<6>(float (&d)[kChunks][16], uint64_t da, uint64_t db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n192k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, %96, %97, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[0][4]), "+f"(d[0][5]), "+f"(d[0][6]), "+f"(d[0][7]),
        "+f"(d[0][8]), "+f"(d[0][9]), "+f"(d[0][10]), "+f"(d[0][11]), "+f"(d[0][12]), "+f"(d[0][13]), "+f"(d[0][14]), "+f"(d[0][15]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[1][4]), "+f"(d[1][5]), "+f"(d[1][6]), "+f"(d[1][7]),
        "+f"(d[1][8]), "+f"(d[1][9]), "+f"(d[1][10]), "+f"(d[1][11]), "+f"(d[1][12]), "+f"(d[1][13]), "+f"(d[1][14]), "+f"(d[1][15]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[2][4]), "+f"(d[2][5]), "+f"(d[2][6]), "+f"(d[2][7]),
        "+f"(d[2][8]), "+f"(d[2][9]), "+f"(d[2][10]), "+f"(d[2][11]), "+f"(d[2][12]), "+f"(d[2][13]), "+f"(d[2][14]), "+f"(d[2][15]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[3][4]), "+f"(d[3][5]), "+f"(d[3][6]), "+f"(d[3][7]),
        "+f"(d[3][8]), "+f"(d[3][9]), "+f"(d[3][10]), "+f"(d[3][11]), "+f"(d[3][12]), "+f"(d[3][13]), "+f"(d[3][14]), "+f"(d[3][15]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[4][4]), "+f"(d[4][5]), "+f"(d[4][6]), "+f"(d[4][7]),
        "+f"(d[4][8]), "+f"(d[4][9]), "+f"(d[4][10]), "+f"(d[4][11]), "+f"(d[4][12]), "+f"(d[4][13]), "+f"(d[4][14]), "+f"(d[4][15]),
        "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[5][4]), "+f"(d[5][5]), "+f"(d[5][6]), "+f"(d[5][7]),
        "+f"(d[5][8]), "+f"(d[5][9]), "+f"(d[5][10]), "+f"(d[5][11]), "+f"(d[5][12]), "+f"(d[5][13]), "+f"(d[5][14]), "+f"(d[5][15])
      : "l"(da), "l"(db), "r"(scale_d));
}

// A step's four 16-k slices: slice j of a K-major 128-byte row starts 32 j bytes further.
template <int NCH>
__device__ __forceinline__ void issue(float (&acc)[kChunks][16], uint64_t da, uint64_t db, int kt) {
#pragma unroll
  for (int j = 0; j < 4; ++j) wgmma_ss<NCH>(acc, da + ((32 * j) >> 4), db + ((32 * j) >> 4), kt > 0 || j > 0);
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(bar),
               "r"(bytes)
               : "memory");
}
// An arrive on bar once this thread's earlier cp.async copies have landed (counted in the barrier's init count).
__device__ __forceinline__ void cp_async_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void b_threads_sync() { asm volatile("bar.sync 1, %0;" ::"n"(kBThreads) : "memory"); }
// L2 cache policies as the 64-bit operands of .L2::cache_hint (the encodings createpolicy yields for a whole-
// fraction evict-first / evict-last policy on sm_90, as constants: ptxas has miscompiled createpolicy.fractional
// with cp.async, docs/PERF_NOTES.md 2026-12-03). The weights, each read once a chunk, are evicted first; the
// gathered activation rows (read by every slice of their experts' tiles) last. Measured: -1.4 to -2.3% a layer.
constexpr uint64_t kEvictFirst = 0x12F0000000000000ull, kEvictLast = 0x14F0000000000000ull;
// cp_async_16 (quant_dot.cuh) under an L2 policy.
__device__ __forceinline__ void cp_async_16_hint(void* dst_s, const void* src, uint64_t pol) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(dst_s));
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "l"(pol) : "memory");
}
// bytes from global src to shared dst by the copy engine, counted on mbarrier bar's transaction count.
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar, uint64_t pol) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(
          dst),
      "l"(src), "r"(bytes), "r"(bar), "l"(pol)
      : "memory");
}
#endif

// Args: the tile list's, plus the copies (w16: expert e's tiles at w16 + e expert_halves, tile (slice, kt) at
// (slice KT + kt) kWHalves further).
struct W16TileArgs {
  TileArgs t;
  const __half* w16;
  size_t expert_halves;
};

template <bool SWIGLU>
__global__ void __launch_bounds__(kThreads, 1) grouped_w16_kernel(const __grid_constant__ W16TileArgs args) {
#if defined(LILY_SM90A_PASS)
  const TileArgs& p = args.t;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* const smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  // Barriers: full / empty of each weight stage, then of each activation stage.
  const uint32_t fw0 = smem_u32(smem + kBarOff), ew0 = fw0 + 8 * kWStages, fb0 = ew0 + 8 * kWStages,
                 eb0 = fb0 + 8 * kBStages;
  const int tid = threadIdx.x, KT = p.K / 64;
  const int slices = p.N / (SWIGLU ? 64 : 128);
  if (tid == 0) {
    for (int s = 0; s < kWStages; ++s) {
      mbar_init(fw0 + 8 * s, 1);    // the weight issuer's arrive with the bulk copy's bytes
      mbar_init(ew0 + 8 * s, 256);  // the consumers' threads, each after the stage's wgmmas completed
    }
    for (int s = 0; s < kBStages; ++s) {
      mbar_init(fb0 + 8 * s, kBThreads);  // each copying thread's cp.async arrive
      mbar_init(eb0 + 8 * s, 256);
    }
    fence_mbar_init();
  }
  __syncthreads();
  pdl_wait();
  const int items = __ldcg(p.tile_count) * slices;

  if (tid >= 256) {
    const int t = tid - 256;
    if (t < 32) {
      // ---------------- weight issuer (warp 0 of the producer warpgroup, one lane): up to kWStages stages ahead of
      // the consumers, independent of the activation copies.
      if (t != 0) return;
      int gs = 0, slot = 0;
      uint32_t phase = 0;
      for (int item = blockIdx.x; item < items; item += gridDim.x) {
        const int tile = item / slices, slice = item % slices;
        const __half* const wsrc = args.w16 + static_cast<size_t>(__ldcg(p.tile_expert + tile)) * args.expert_halves +
                                   static_cast<size_t>(slice) * KT * kWHalves;
        for (int kt = 0; kt < KT; ++kt, ++gs, slot = slot + 1 == kWStages ? (phase ^= 1, 0) : slot + 1) {
          if (gs >= kWStages) mbar_wait(ew0 + 8 * slot, phase ^ 1);
          mbar_arrive_expect_tx(fw0 + 8 * slot, kWBytes);
          bulk_copy(smem_u32(smem + kWOff + static_cast<size_t>(slot) * kWBytes), wsrc + static_cast<size_t>(kt) * kWHalves,
                    kWBytes, fw0 + 8 * slot, kEvictFirst);
        }
      }
      return;
    }
    // ---------------- activation copies (warps 1-3): the tile's gathered rows, chunk ch of rows r0 + 12 i
    const int u = t - 32, ch = u & 7, r0 = u >> 3;
    int* const gidx = reinterpret_cast<int*>(smem + kGOff);
    int gs = 0, slot = 0;
    uint32_t phase = 0;
    for (int item = blockIdx.x; item < items; item += gridDim.x) {
      const Item it = item_of<SWIGLU>(p, item, slices);
      b_threads_sync();  // every copying thread is done with the previous item's gather indices
      for (int r = u; r < it.rows; r += kBThreads) gidx[r] = p.gather ? __ldcg(p.gather + it.row0 + r) : it.row0 + r;
      b_threads_sync();
      const __half* src[kBRowsPer];
      int dst[kBRowsPer];
#pragma unroll
      for (int i = 0; i < kBRowsPer; ++i) {
        const int r = r0 + (kBThreads / 8) * i;
        src[i] = r < it.rows ? p.a + static_cast<size_t>(gidx[r]) * p.K + ch * 8 : nullptr;
        dst[i] = r * 128 + ((ch ^ (r & 7)) << 4);
      }
      for (int kt = 0; kt < KT; ++kt, ++gs, slot = slot + 1 == kBStages ? (phase ^= 1, 0) : slot + 1) {
        if (gs >= kBStages) mbar_wait(eb0 + 8 * slot, phase ^ 1);
        unsigned char* const bs = smem + static_cast<size_t>(slot) * kBBytes;
#pragma unroll
        for (int i = 0; i < kBRowsPer; ++i)
          if (src[i]) cp_async_16_hint(bs + dst[i], src[i] + kt * 64, kEvictLast);
        cp_async_arrive(fb0 + 8 * slot);
      }
    }
    cp_async_wait<0>();
    return;
  }

  // ---------------- consumers: warpgroup cw owns weight rows 64 cw .. 64 cw + 63 of each stage
  const int cw = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, c = lane & 3;
  const uint32_t base = smem_u32(smem);
  float acc[kChunks][16];
  int gs = 0, ws = 0, bs = 0, prev_ws = 0, prev_bs = 0;  // steps consumed; this step's and the last one's slots
  uint32_t wphase = 0, bphase = 0;
  // An item's K loop with N = 32 NCH (one instantiation a width: no register moves between a step's wgmmas).
  auto run_item = [&](auto nch_tag) {
    constexpr int NCH = decltype(nch_tag)::value;
#pragma unroll 1
    for (int kt = 0; kt < KT; ++kt) {
      mbar_wait(fb0 + 8 * bs, bphase);
      fence_proxy_async();  // the activation rows came through the generic proxy (cp.async)
      mbar_wait(fw0 + 8 * ws, wphase);
      wgmma_fence();
#pragma unroll
      for (int n = 0; n < kChunks; ++n) fence_regs(acc[n]);
      const uint64_t da = desc_sw128(base + static_cast<uint32_t>(kWOff + static_cast<size_t>(ws) * kWBytes) + cw * (64 * 128));
      const uint64_t db = desc_sw128(base + static_cast<uint32_t>(bs) * kBBytes);
      issue<NCH>(acc, da, db, kt);
      wgmma_commit();
#pragma unroll
      for (int n = 0; n < kChunks; ++n) fence_regs(acc[n]);
      wgmma_wait<1>();
#pragma unroll
      for (int n = 0; n < kChunks; ++n) fence_regs(acc[n]);
      if (gs > 0) {
        mbar_arrive(ew0 + 8 * prev_ws);
        mbar_arrive(eb0 + 8 * prev_bs);
      }
      ++gs;
      prev_ws = ws, prev_bs = bs;
      if (++ws == kWStages) ws = 0, wphase ^= 1;
      if (++bs == kBStages) bs = 0, bphase ^= 1;
    }
  };
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const Item it = item_of<SWIGLU>(p, item, slices);
    switch ((it.rows + 31) / 32) {  // the tile's 32-row chunks (warpgroup-uniform)
      case 1: run_item(std::integral_constant<int, 1>{}); break;
      case 2: run_item(std::integral_constant<int, 2>{}); break;
      case 3: run_item(std::integral_constant<int, 3>{}); break;
      case 4: run_item(std::integral_constant<int, 4>{}); break;
      case 5: run_item(std::integral_constant<int, 5>{}); break;
      default: run_item(std::integral_constant<int, 6>{}); break;
    }
    wgmma_wait<0>();
#pragma unroll
    for (int n = 0; n < kChunks; ++n) fence_regs(acc[n]);
    if (item + static_cast<int>(gridDim.x) >= items) pdl_launch_dependents();
    store_item<SWIGLU>(p, it, acc, cw, warp, g, c);
  }
#else
  (void)args;  // not an sm_90a pass: no wgmma (launch_grouped_w16 refuses to launch, see wgmma_built)
#endif
}

// ---- the copies: one thread writes 8 fp16 weights (one 16-byte chunk of a tile row) from one 32-bit word of
// codes, each as the register-sourced kernel computes it (moe_prefill_rs.cu expand_pair: fp16 scale and bias, one
// fp16 fma): the two kernels see the same fp16 operands.
struct ExpandArgs {
  QMatrix w[2], ws[2];  // stacked routed matrices and the shared expert's (expert index E = the tile list's)
  int E, N, K;          // per matrix: [N, K]
  __half* out;
};
template <bool SWIGLU>
__global__ void expand_kernel(const __grid_constant__ ExpandArgs a) {
  const int mats = SWIGLU ? 2 : 1, KT = a.K / 64;
  const size_t expert_chunks = static_cast<size_t>(mats) * a.N * a.K / 8;
  const size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= expert_chunks * (a.E + 1)) return;
  const int e = static_cast<int>(i / expert_chunks);
  const size_t rem = i % expert_chunks;
  const int tile = static_cast<int>(rem / (kWHalves / 8)), ar = static_cast<int>(rem % (kWHalves / 8)) / 8,
            pos = static_cast<int>(rem % 8), ck = pos ^ (ar & 7);
  const int slice = tile / KT, kt = tile % KT;
  int mat, feature;
  weight_row<SWIGLU>(ar, slice, mat, feature);
  const QMatrix m = e == a.E ? a.ws[mat] : a.w[mat].expert(e);
  const uint32_t word = m.w[static_cast<size_t>(feature) * m.words_per_row() + kt * 8 + ck];
  const size_t gi = static_cast<size_t>(feature) * m.groups_per_row() + kt;
  const __half2 s = __float2half2_rn(__bfloat162float(m.scales[gi])), b = __float2half2_rn(__bfloat162float(m.biases[gi]));
  uint32_t o[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {  // elements 2 q, 2 q + 1 (nibbles 2 q, 2 q + 1 of the word)
    const __half2 v = __halves2half2(__ushort2half_rn((word >> (8 * q)) & 15u), __ushort2half_rn((word >> (8 * q + 4)) & 15u));
    o[q] = h2_bits(__hfma2(v, s, b));
  }
  *reinterpret_cast<uint4*>(a.out + i * 8) = make_uint4(o[0], o[1], o[2], o[3]);
}

}  // namespace

cudaError_t launch_grouped_w16(const TileArgs& a, const __half* w16, int max_tiles, bool swiglu, cudaStream_t stream) {
  const int per_slice = swiglu ? 64 : 128;
  const bool ok = a.tile_count && max_tiles >= 1 && a.N % per_slice == 0 && a.K % 64 == 0 && a.c && a.a &&
                  aligned16(a.a) && a.ldc >= a.N && (swiglu || a.out == GemmOut::f32) && w16 && aligned16(w16) &&
                  a.shared_expert >= 0;
  if (!ok) return cudaErrorInvalidValue;
  if (!wgmma_built()) return cudaErrorInvalidDeviceFunction;
  int sms = 0, dev = 0;
  CUDA_TRY(cudaGetDevice(&dev));
  CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const long items = static_cast<long>(max_tiles) * (a.N / per_slice);
  const dim3 grid(static_cast<unsigned>(std::min<long>(items, sms))), block(kThreads);
  const W16TileArgs args{a, w16, static_cast<size_t>(swiglu ? 2 : 1) * a.N * a.K};
  auto run = [&](auto kernel) {
    CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmem)));
    return launch_pdl(kernel, grid, block, kSmem, stream, args);
  };
  return swiglu ? run(grouped_w16_kernel<true>) : run(grouped_w16_kernel<false>);
}

}  // namespace lily::cuda::qgemm_util

namespace lily::cuda {

size_t moe_w16_halves(int n_experts, int H, int I) { return size_t{3} * (n_experts + 1) * H * I; }
size_t moe_w16_down_offset(int n_experts, int H, int I) { return size_t{2} * (n_experts + 1) * H * I; }

cudaError_t moe_expand_w16(const MoePrefillParams& p, __half* out, cudaStream_t stream) {
  using namespace qgemm_util;
  const int E = p.gate.rows > 0 ? p.router.rows : 0, H = p.router.cols, I = p.gate.rows;
  const auto fits = [](const QMatrix& m, int rows, int cols) {
    return valid_qmatrix(m) && m.bits == 4 && m.rows == rows && m.cols == cols;
  };
  const bool ok = E > 0 && out && aligned16(out) && H % 128 == 0 && I % 64 == 0 && fits(p.gate, I, H) &&
                  fits(p.up, I, H) && fits(p.down, H, I) && fits(p.shared_gate_proj, I, H) && fits(p.shared_up, I, H) &&
                  fits(p.shared_down, H, I);
  if (!ok) return cudaErrorInvalidValue;
  ExpandArgs gu{{p.gate, p.up}, {p.shared_gate_proj, p.shared_up}, E, I, H, out};
  ExpandArgs dn{{p.down, p.down}, {p.shared_down, p.shared_down}, E, H, I, out + moe_w16_down_offset(E, H, I)};
  const size_t gu_threads = moe_w16_down_offset(E, H, I) / 8, dn_threads = gu_threads / 2;
  expand_kernel<true><<<static_cast<unsigned>((gu_threads + 255) / 256), 256, 0, stream>>>(gu);
  CUDA_TRY(cudaGetLastError());
  expand_kernel<false><<<static_cast<unsigned>((dn_threads + 255) / 256), 256, 0, stream>>>(dn);
  return cudaGetLastError();
}

}  // namespace lily::cuda
