// qgemm on Hopper warpgroup MMA (qgemm.cuh: QGemmParams::use_wgmma; the prefill's dense projections). Needs the
// sm_90a target (CMAKE_CUDA_ARCHITECTURES 90a, the project default): in a pass for any other target the kernel
// compiles to nothing and the launcher returns cudaErrorInvalidDeviceFunction.
//
// C[M, N] = A[M, K] . W[N, K]^T, A fp16 row-major, W an MLX 4- or 8-bit QMatrix; one block computes a 128 x BN
// tile (BN = 256, or 128 for grids too small to fill the SMs: qgemm_util::wgmma_dense_wide), K in steps of 64
// (one quantisation group). Warpgroups (128 threads):
//  - the producer warpgroup: cp.async brings the A tile (128 x 64 fp16) and the packed W tile (BN x 64 x
//    bits/8 bytes) of step kt + kLead into slot (kt + kLead) % KS of a KS-deep ring; then it expands step kt's
//    packed W into one of KB fp16 tiles (value = scale * q + bias in fp32, rounded once to fp16: the same
//    arithmetic and rounding as qgemm.cu, so both paths see the same weights), fences the generic-proxy
//    writes (its cp.async data and its fp16 stores) against the tensor cores' async proxy and arrives on
//    full[slot]. (Two producer warpgroups with setmaxnreg do not compile here: at 512 threads a thread has 128
//    registers at launch, ptxas allocates the whole kernel within that, and an m64n256 wgmma needs 154. Letting
//    the consumers issue the loads, shallower rings and a third fp16 tile were measured and did not win: git
//    history, lab/2026-11-30.)
//  - two consumer warpgroups: each waits on full[slot], issues four wgmma.mma_async m64nBNk16 f32.f16.f16 (rows
//    64 c .. 64 c + 63 of the tile against all BN rows of W; both operands read from shared memory through
//    matrix descriptors), commits them as one group, waits until the previous step's group is done and arrives
//    on empty[previous slot]. So the dequantisation of step kt + 1 overlaps the wgmma of step kt. One empty
//    barrier frees both the A / packed slot and the fp16 tile of a step: with kLead = KS - KB the slot the
//    single producer loads at step kt and the fp16 tile it writes at step kt were both last used by step
//    kt - KB, so it waits once a step.
// Shared-memory layouts: the A tile and the fp16 W tile are K-major rows of 64 fp16 = 128 bytes with the
// 128-byte swizzle (16-byte chunk c of row r stored at chunk c ^ (r & 7); tiles 1024-byte aligned) -- the
// layout of qgemm.cu's swz() -- so one descriptor (start address, stride byte offset 1024 between 8-row
// groups, leading byte offset unused, swizzle mode 1 = 128B) covers 64 or BN rows, and the k-th 16-column
// slice of the step starts 32 k bytes further (the hardware applies the XOR to the address bits).
// Accumulators: 64 x BN per consumer warpgroup, BN / 2 fp32 registers a thread, in the mma.sync C-fragment
// order: for n8 block j, d[4j], d[4j + 1] at row 16 warp + lane / 4, columns 8 j + 2 (lane % 4) + {0, 1};
// d[4j + 2], d[4j + 3] eight rows below. Epilogue as qgemm.cu (f32, f16, add_f32; tails in M and N).
// With QGemmParams::w16 the packed W is first expanded to fp16 in device memory (expand_w16_kernel, the same values;
// the backend keeps every dense projection's copy resident), in tile order: 32 KB tiles of 256 W rows x 64 k, the
// rows padded with zeros to a multiple of 256, each tile already in the slots' 128-byte swizzle (qgemm.cuh
// qgemm_w16_halves). The GEMM on it only copies: the producer's 128 threads cp.async the A and W tiles into a ring
// of KS slots (qgemm_w16_kernel); its consumers' loop is the same (consume_steps), the sums bit-identical.
// At M 4,096 with 256-wide tiles ~406 against ~275 TFLOP/s for the dequantising kernel with row-major copies (H200);
// the tile order (a block's W tile of a step one contiguous 32 KB instead of 256 rows K * 2 bytes apart) took gdn
// in_proj in the 4K prefill 412 -> 481 TFLOP/s on an H100 (docs/PERF_NOTES.md 2026-12-07).
// (Until 2026-12-02 the kernel also ran moe_prefill's grouped expert GEMMs, with 64-row tiles and gate / up in
// one tile; the register-sourced tiles of moe_prefill_rs.cu replaced it there: git history.)
// FLOPs 2 M N K; bytes as qgemm.cu. Shared memory a step (BN = 256, 4-bit): wgmma reads 80 KB (each
// consumer reads A 8 KB and the whole fp16 W tile 32 KB), the producer writes 32 KB of fp16 W and reads 8 KB
// packed, cp.async writes 24 KB: ~144 KB = ~1150 cycles at 128 B/cycle against 1024 cycles of MMA at the dense
// fp16 rate (4.2 MFLOP a step at ~4096 FLOP/cycle/SM). Measured 2026-11-30: ~275 TFLOP/s at M 4096
// (docs/PERF_NOTES.md).
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/kernels/qgemm.cuh"
#include "cuda/kernels/qgemm_util.cuh"
#include "cuda/kernels/quant_dot.cuh"
#include "cuda/kernels/wgmma_util.cuh"

namespace lily::cuda {
namespace {

using namespace qgemm_util;
using namespace wgmma_util;

constexpr int kWgGroup = 64;      // K step = one quantisation group = one 128-byte swizzled row of fp16
constexpr int kSmemMax = 232448;  // 227 KB: the largest dynamic shared memory of a block on sm_90

// The mma.sync tiles' arguments (qgemm_util.cuh); k_splits stays 1: the wgmma GEMM does not split K.
using WgArgs = TileArgs;

constexpr int kBM = 128;  // tile rows: two consumer warpgroups of 64

// Deepest A / packed ring that fits next to KB fp16 W tiles (8 at most).
constexpr int ring_fit(int BN, int BITS, int KB) {
  const int fit = (kSmemMax - 1024 - 256 - KB * BN * 128) / (kBM * 128 + BN * kWgGroup * BITS / 8);
  return fit < 8 ? fit : 8;
}

template <int BN, int BITS, int KB, int KS>
struct WgTile {
  static constexpr int kThreads = 384;
  static constexpr int NW = BN;                                // W rows of one consumer's wgmma
  static constexpr int kPackedRowBytes = kWgGroup * BITS / 8;  // 32 or 64
  static constexpr int kPackedChunks = kPackedRowBytes / 16;   // 2 or 4
  static constexpr int kABytes = kBM * 128;                    // A tile of a step (fp16, swizzled)
  static constexpr int kPBytes = BN * kPackedRowBytes;         // packed W of a step
  static constexpr int kBBytes = BN * 128;                     // fp16 W tile of a step (swizzled)
  static constexpr int kLead = KS - KB;                        // single producer: loads ahead of the dequant
  static constexpr int kUnits = BN * 2;                        // dequant units: half a row (32 elements)
  static constexpr int kUnitsPerThread = kUnits / 128;
  static constexpr int kAChunksPerThread = kBM * 8 / 128;  // 16-byte chunks of the A tile
  static constexpr int kPChunksPerThread = BN * kPackedChunks / 128;
  static constexpr size_t kSmem =
      1024 + size_t{KS} * (kABytes + kPBytes) + size_t{KB} * kBBytes + size_t{2} * KS * sizeof(uint64_t);
  static_assert(NW == 128 || NW == 256, "wgmma width");
  static_assert(KB >= 2 && KS <= 8 && kSmem <= kSmemMax, "shared memory");
  static_assert(kLead >= 2, "ring depth");
  static_assert(kUnits % 128 == 0 && (BN * kPackedChunks) % 128 == 0, "work split");
};

#if defined(LILY_SM90A_PASS)
template <int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t da, uint64_t db);

// D[64, 128] += A[64, 16] . B[128, 16]^T, both K-major in shared memory (descriptors da, db).
template <>
__device__ __forceinline__ void wgmma_ss<128>(float (&d)[64], uint64_t da, uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]),
        "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
        "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]),
        "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),
        "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]),
        "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]),
        "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(da), "l"(db), "r"(1));
}

// D[64, 256] += A[64, 16] . B[256, 16]^T, both K-major in shared memory (descriptors da, db).
template <>
__device__ __forceinline__ void wgmma_ss<256>(float (&d)[128], uint64_t da, uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
      "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]),
        "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
        "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]),
        "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),
        "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]),
        "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]),
        "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]),
        "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]),
        "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]),
        "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]),
        "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]),
        "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]),
        "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]),
        "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]),
        "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(da), "l"(db), "r"(1));
}

// A consumer warpgroup's K loop: step kt waits on full[kt % KS], issues the four wgmma m64nNWk16 of the step
// (A at a_base + (kt % KS) a_bytes, W at b_base + (kt % KB) b_bytes), commits them as one group, waits until
// step kt - 1's group is done and arrives on empty[(kt - 1) % KS]. Rows past the tile's (live false) skip the
// tensor cores but keep the barriers' counts.
template <int NW, int KS, int KB>
__device__ __forceinline__ void consume_steps(float (&acc)[NW / 2], int KT, uint32_t full0, uint32_t empty0,
                                              uint32_t a_base, int a_bytes, uint32_t b_base, int b_bytes,
                                              bool live) {
#pragma unroll 1
  for (int kt = 0; kt < KT; ++kt) {
    const int slot = kt % KS;
    mbar_wait(full0 + 8 * slot, (kt / KS) & 1);
    if (live) {
      const uint32_t a_addr = a_base + slot * a_bytes, b_addr = b_base + (kt % KB) * b_bytes;
      wgmma_fence();
      fence_regs(acc);
#pragma unroll
      for (int k = 0; k < kWgGroup / 16; ++k)
        wgmma_ss<NW>(acc, desc_sw128(a_addr + 32 * k), desc_sw128(b_addr + 32 * k));
      wgmma_commit();
      fence_regs(acc);
      wgmma_wait<1>();  // step kt - 1's group is done: its slot and fp16 tile may be refilled
      fence_regs(acc);
    }
    if (kt > 0) mbar_arrive(empty0 + 8 * ((kt - 1) % KS));
  }
}

#endif  // LILY_SM90A_PASS

// The epilogue of a consumer warpgroup: its 64 x NW accumulators (rows arow0 .. of the tile) to c, as
// qgemm.cu (f32, f16, add_f32; column pairs stored together where the row stride and base allow it; tails in
// M and N).
template <int NW>
__device__ __forceinline__ void store_tile(const WgArgs& p, const float (&acc)[NW / 2], int arow0, int rows,
                                           int row0, int n0, int tid) {
  const int lane = tid & 31, wq = (tid >> 5) & 3;
  const bool f32_out = p.out != GemmOut::f16;
  const int ldc = p.ldc, nc0 = n0;
  const bool pairs = ldc % 2 == 0 && (reinterpret_cast<uintptr_t>(p.c) & (f32_out ? 7 : 3)) == 0;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int r = arow0 + 16 * wq + (lane >> 2) + 8 * hr;
    if (r >= rows) continue;
    const size_t crow = static_cast<size_t>(row0 + r) * ldc;
#pragma unroll
    for (int j = 0; j < NW / 8; ++j) {
      const int n = nc0 + 8 * j + 2 * (lane & 3);
      if (n >= p.N) continue;
      const float v[2] = {acc[4 * j + 2 * hr], acc[4 * j + 2 * hr + 1]};
      store_pair(p.c, f32_out, p.out == GemmOut::add_f32, crow + n, n, p.N, pairs, v);
    }
  }
}

template <int BN, int BITS, int KB, int KS>
__global__ void __launch_bounds__(384, 1) qgemm_wgmma_kernel(const WgArgs p) {
#if defined(LILY_SM90A_PASS)
  using C = WgTile<BN, BITS, KB, KS>;
  constexpr int NW = C::NW;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // The swizzle pattern repeats every 1024 bytes and the descriptors assume tiles aligned to it.
  unsigned char* const smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  unsigned char* const a_s = smem;                    // KS x [128 rows x 128 B]
  unsigned char* const b_s = a_s + KS * C::kABytes;   // KB x [BN rows x 128 B]
  unsigned char* const w_s = b_s + KB * C::kBBytes;   // KS x [BN rows x packed bytes]
  uint64_t* const bars = reinterpret_cast<uint64_t*>(w_s + KS * C::kPBytes);
  // barrier s at + 8 s
  const uint32_t full0 = smem_u32(bars), empty0 = smem_u32(bars + KS);

  const int tid = threadIdx.x, wg = tid >> 7;
  const int n0 = blockIdx.y * BN;
  int row0, rows;
  QMatrix w[1];
  pdl_wait();
  block_rows<kBM, 1>(p, row0, rows, w);  // dense: rows 128 blockIdx.x .. of p.M
  const int K = p.K, KT = K / kWgGroup;
  if (tid == 0) {
    for (int s = 0; s < KS; ++s) {
      mbar_init(full0 + 8 * s, 128);    // the dequantising threads, each after its fence
      mbar_init(empty0 + 8 * s, 256);   // the consumers' threads, each after its wgmma of the step completed
    }
    fence_mbar_init();
  }
  __syncthreads();

  const size_t wpr = static_cast<size_t>(K) * BITS / 32, gpr = K / kWgGroup;
  // This thread's loads (t: its index in the loading warpgroup), fixed for the block (each step adds its K
  // offset): A chunk i is row a_r0 + 16 i, 16-byte chunk a_ch of the tile (its swizzled place depends on
  // row & 7 = a_r0 & 7 only); packed W chunk i is 16-byte chunk t + 128 i of the stage (row-major [BN][bits * 8]
  // bytes). Rows past the tile's rows or past N read from the matrix's start (a valid address) with a zero
  // source size: zero-filled.
  struct Loads {
    int a_dst;
    const __half* a_ptr[C::kAChunksPerThread];
    bool a_ok[C::kAChunksPerThread];
    const uint32_t* w_ptr[C::kPChunksPerThread];
    bool w_ok[C::kPChunksPerThread];
  };
  auto make_loads = [&](int t, Loads& l) {
    const int a_r0 = t >> 3, a_ch = t & 7;
    l.a_dst = a_r0 * 128 + ((a_ch ^ (a_r0 & 7)) << 4);
#pragma unroll
    for (int i = 0; i < C::kAChunksPerThread; ++i) {
      const int r = a_r0 + 16 * i;
      l.a_ok[i] = r < rows;
      l.a_ptr[i] = p.a;
      if (l.a_ok[i]) {
        const int src = p.gather ? __ldcg(p.gather + row0 + r) : row0 + r;
        l.a_ptr[i] += static_cast<size_t>(src) * K + a_ch * 8;
      }
    }
#pragma unroll
    for (int i = 0; i < C::kPChunksPerThread; ++i) {
      const int id = t + i * 128, ch = id % C::kPackedChunks, col = n0 + id / C::kPackedChunks;
      l.w_ok[i] = col < p.N;
      l.w_ptr[i] = l.w_ok[i] ? w[0].w + col * wpr + ch * 4 : w[0].w;
    }
  };
  auto issue_loads = [&](int t, const Loads& l, int kt) {
    unsigned char* const as = a_s + (kt % KS) * C::kABytes + l.a_dst;
#pragma unroll
    for (int i = 0; i < C::kAChunksPerThread; ++i)
      cp_async_16(as + i * 16 * 128, l.a_ptr[i] + kt * kWgGroup, l.a_ok[i]);
    unsigned char* const ws = w_s + (kt % KS) * C::kPBytes + t * 16;
#pragma unroll
    for (int i = 0; i < C::kPChunksPerThread; ++i)
      cp_async_16(ws + i * 128 * 16, l.w_ptr[i] + kt * (kWgGroup * BITS / 32), l.w_ok[i]);
  };
  // Dequant unit u = t + 128 i: row u >> 1 of the W tile, half u & 1 (32 elements = 4 swizzled chunks); its
  // scale and bias rows (nullptr past N: zero weights).
  struct Groups {
    const __nv_bfloat16* s[C::kUnitsPerThread];
    const __nv_bfloat16* b[C::kUnitsPerThread];
  };
  auto make_groups = [&](int t, Groups& g) {
#pragma unroll
    for (int i = 0; i < C::kUnitsPerThread; ++i) {
      const int col = n0 + ((t + i * 128) >> 1);
      const bool ok = col < p.N;
      g.s[i] = ok ? w[0].scales + col * gpr : nullptr;
      g.b[i] = ok ? w[0].biases + col * gpr : nullptr;
    }
  };
  auto load_scales = [&](const Groups& g, int kt, float(&sc)[C::kUnitsPerThread],
                         float(&bi)[C::kUnitsPerThread]) {
#pragma unroll
    for (int i = 0; i < C::kUnitsPerThread; ++i) {
      float s = 0.0f, b = 0.0f;
      if (g.s[i]) {
        s = bf16_bits_to_float(ld_bf16_bits(g.s[i] + kt));
        b = bf16_bits_to_float(ld_bf16_bits(g.b[i] + kt));
      }
      sc[i] = BITS == 4 ? 256.0f * s : s;  // 4-bit codes come out as 0.5 + q / 256 (quant_dot.cuh)
      bi[i] = BITS == 4 ? b - 128.0f * s : b;
    }
  };
  auto dequant = [&](int t, int kt, const float(&sc)[C::kUnitsPerThread],
                     const float(&bi)[C::kUnitsPerThread]) {
    const unsigned char* const ws = w_s + (kt % KS) * C::kPBytes;
    unsigned char* const bs = b_s + (kt % KB) * C::kBBytes;
#pragma unroll
    for (int i = 0; i < C::kUnitsPerThread; ++i) {
      const int u = t + i * 128, r = u >> 1, half = u & 1;
      const unsigned char* src = ws + r * C::kPackedRowBytes + half * (C::kPackedRowBytes / 2);
      unsigned char* const dst_row = bs + r * 128;
      const float s = sc[i], b = bi[i];
      if constexpr (BITS == 4) {
        const uint4 v = *reinterpret_cast<const uint4*>(src);
        const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {  // word j: elements 8 j .. 8 j + 7 of the half -> chunk 4 half + j
          const uint32_t lo = words[j] & 0x0F0F0F0Fu, hi = (words[j] >> 4) & 0x0F0F0F0Fu;
          uint4 o;
          o.x = pack_f16(fmaf(nibble_as_float<0>(lo), s, b), fmaf(nibble_as_float<0>(hi), s, b));
          o.y = pack_f16(fmaf(nibble_as_float<1>(lo), s, b), fmaf(nibble_as_float<1>(hi), s, b));
          o.z = pack_f16(fmaf(nibble_as_float<2>(lo), s, b), fmaf(nibble_as_float<2>(hi), s, b));
          o.w = pack_f16(fmaf(nibble_as_float<3>(lo), s, b), fmaf(nibble_as_float<3>(hi), s, b));
          *reinterpret_cast<uint4*>(dst_row + (((half * 4 + j) ^ (r & 7)) << 4)) = o;
        }
      } else {
        const uint4 v0 = *reinterpret_cast<const uint4*>(src),
                    v1 = *reinterpret_cast<const uint4*>(src + 16);
        const uint32_t words[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {  // words 2 j, 2 j + 1: elements 8 j .. 8 j + 7 -> chunk 4 half + j
          const uint32_t w0 = words[2 * j], w1 = words[2 * j + 1];
          uint4 o;
          o.x = pack_f16(fmaf(byte_as_float<0>(w0), s, b), fmaf(byte_as_float<1>(w0), s, b));
          o.y = pack_f16(fmaf(byte_as_float<2>(w0), s, b), fmaf(byte_as_float<3>(w0), s, b));
          o.z = pack_f16(fmaf(byte_as_float<0>(w1), s, b), fmaf(byte_as_float<1>(w1), s, b));
          o.w = pack_f16(fmaf(byte_as_float<2>(w1), s, b), fmaf(byte_as_float<3>(w1), s, b));
          *reinterpret_cast<uint4*>(dst_row + (((half * 4 + j) ^ (r & 7)) << 4)) = o;
        }
      }
    }
  };

  if (wg == 0) {
    // ---------------- the loads and the dequantisation
    const int t = tid & 127;
    Loads l;
    make_loads(t, l);
    Groups g;
    make_groups(t, g);
    // Step kt: (1) wait until step kt - KB is consumed: it frees the fp16 tile step kt writes and the ring slot
    // step kt + kLead loads into; (2) loads of step kt + kLead; (3) scales of step kt + 1 into the other register
    // set; (4) step kt's packed W and A landed: this thread's cp.async group, then every producer thread's (named
    // barrier); (5) dequantise; (6) fence (generic -> async proxy), arrive on full.
    auto step = [&](int kt, const float(&sc)[C::kUnitsPerThread], const float(&bi)[C::kUnitsPerThread],
                    float(&sc_next)[C::kUnitsPerThread], float(&bi_next)[C::kUnitsPerThread]) {
      if (kt >= KB) {
        const int j = kt - KB;
        mbar_wait(empty0 + 8 * (j % KS), (j / KS) & 1);
      }
      if (kt + C::kLead < KT) issue_loads(t, l, kt + C::kLead);
      cp_async_commit();
      if (kt + 1 < KT) load_scales(g, kt + 1, sc_next, bi_next);
      cp_async_wait<C::kLead>();
      producer_bar_sync();
      dequant(t, kt, sc, bi);
      fence_proxy_async();
      mbar_arrive(full0 + 8 * (kt % KS));
    };

#pragma unroll 1
    for (int s = 0; s < C::kLead; ++s) {
      if (s < KT) issue_loads(t, l, s);
      cp_async_commit();
    }
    float sc0[C::kUnitsPerThread], bi0[C::kUnitsPerThread], sc1[C::kUnitsPerThread], bi1[C::kUnitsPerThread];
    load_scales(g, 0, sc0, bi0);
#pragma unroll 1
    for (int kt = 0; kt < KT; kt += 2) {  // two steps an iteration: the scale registers alternate
      step(kt, sc0, bi0, sc1, bi1);
      if (kt + 1 < KT) step(kt + 1, sc1, bi1, sc0, bi0);
    }
    cp_async_wait<0>();
  } else {
    // ---------------- consumers: wgmma and the epilogue
    const int cw = wg - 1;
    const int arow0 = 64 * cw;  // tile rows 64 cw .. + 63 against all W rows
    const bool live = rows > arow0;  // warpgroup-uniform: rows past the tile's skip the tensor cores
    float acc[NW / 2];
#pragma unroll
    for (int i = 0; i < NW / 2; ++i) acc[i] = 0.0f;
    consume_steps<NW, KS, KB>(acc, KT, full0, empty0, smem_u32(a_s) + arow0 * 128, C::kABytes, smem_u32(b_s),
                              C::kBBytes, live);
    wgmma_wait<0>();
    fence_regs(acc);
    pdl_launch_dependents();

    store_tile<NW>(p, acc, arow0, rows, row0, n0, tid);
  }
#else
  using C = WgTile<BN, BITS, KB, KS>;  // its constants are used only in the sm_90a pass
  static_assert(C::kUnitsPerThread > 0 && C::kAChunksPerThread > 0 && C::kPChunksPerThread > 0);
  (void)p;  // not an sm_90a pass: no wgmma (the launchers refuse to launch, see wgmma_built)
#endif
}

// ---- W expanded to fp16 in device memory first (QGemmParams::w16)
// expand_w16_kernel writes the copy in the tile order of qgemm_w16_halves (qgemm.cuh): W's rows padded with zero
// rows to a multiple of 256, 32 KB tiles of 256 rows x 64 k, tile (b, kt) at (b KT + kt) 32 KB, each tile already in
// the 128-byte swizzle of the shared-memory slots. Thread i writes 16-byte chunk i of the copy: tile i / 2048, row
// r = (i / 8) % 256 of it, stored chunk i % 8 = column chunk (i % 8) ^ (r & 7). The values are those qgemm's tiles
// compute for W[n, k] (fp32 scale * q + bias, rounded once to fp16), so the fp16-W GEMMs see the same operands as
// the dequantising one and sum the same k16 products in the same order: bit-identical results. A thread expands 8
// elements (one 32-bit word of 4-bit codes, two of 8-bit). It waits for the previous kernel first: the buffer may
// still be read by an earlier GEMM.
struct ExpandArgs {
  QMatrix w;
  __half* out;
  long chunks;  // qgemm_w16_halves(w) / 8
};

// Elements 8 k8 .. 8 k8 + 7 of row n of w, as fp16 (the dequantising producer's arithmetic).
template <int BITS>
__device__ __forceinline__ uint4 expand8(const QMatrix& w, long n, int k8) {
  const size_t g = static_cast<size_t>(n) * (w.cols / kWgGroup) + k8 * 8 / kWgGroup;
  const float s0 = bf16_bits_to_float(ld_bf16_bits(w.scales + g)),
              b0 = bf16_bits_to_float(ld_bf16_bits(w.biases + g));
  const float s = BITS == 4 ? 256.0f * s0 : s0, b = BITS == 4 ? b0 - 128.0f * s0 : b0;
  uint4 o;
  if constexpr (BITS == 4) {
    const uint32_t word = __ldg(w.w + n * (w.cols / 8) + k8);
    const uint32_t lo = word & 0x0F0F0F0Fu, hi = (word >> 4) & 0x0F0F0F0Fu;
    o.x = pack_f16(fmaf(nibble_as_float<0>(lo), s, b), fmaf(nibble_as_float<0>(hi), s, b));
    o.y = pack_f16(fmaf(nibble_as_float<1>(lo), s, b), fmaf(nibble_as_float<1>(hi), s, b));
    o.z = pack_f16(fmaf(nibble_as_float<2>(lo), s, b), fmaf(nibble_as_float<2>(hi), s, b));
    o.w = pack_f16(fmaf(nibble_as_float<3>(lo), s, b), fmaf(nibble_as_float<3>(hi), s, b));
  } else {
    const uint32_t w0 = __ldg(w.w + n * (w.cols / 4) + 2 * k8), w1 = __ldg(w.w + n * (w.cols / 4) + 2 * k8 + 1);
    o.x = pack_f16(fmaf(byte_as_float<0>(w0), s, b), fmaf(byte_as_float<1>(w0), s, b));
    o.y = pack_f16(fmaf(byte_as_float<2>(w0), s, b), fmaf(byte_as_float<3>(w0), s, b));
    o.z = pack_f16(fmaf(byte_as_float<0>(w1), s, b), fmaf(byte_as_float<1>(w1), s, b));
    o.w = pack_f16(fmaf(byte_as_float<2>(w1), s, b), fmaf(byte_as_float<3>(w1), s, b));
  }
  return o;
}

template <int BITS>
__global__ void expand_w16_kernel(const ExpandArgs args) {
  pdl_wait();
  const QMatrix& w = args.w;
  const long i = static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= args.chunks) return;
  const int KT = w.cols / kWgGroup;
  const long tile = i >> 11;  // 2048 chunks a tile: 256 rows x 8
  const int r = static_cast<int>(i >> 3) & 255, pos = static_cast<int>(i) & 7;
  const long n = tile / KT * 256 + r;
  const int k8 = static_cast<int>(tile % KT) * 8 + (pos ^ (r & 7));
  reinterpret_cast<uint4*>(args.out)[i] = n < w.rows ? expand8<BITS>(w, n, k8) : make_uint4(0u, 0u, 0u, 0u);
}

[[maybe_unused]] constexpr int kW16TileBytes = 256 * 128;  // a tile of the copy: 256 rows x 64 fp16

// Deepest ring of A and fp16 W tiles that fits (8 at most).
constexpr int w16_ring(int BN) {
  const int fit = (kSmemMax - 1024 - 256) / (kBM * 128 + BN * 128);
  return fit < 8 ? fit : 8;
}

// The GEMM on fp16 W: the producer warpgroup only copies (cp.async, 16 bytes a copy) the A tile and the
// W tile of step kt + KS - 1 into slot (kt + KS - 1) % KS, both K-major with the 128-byte swizzle; the consumers as
// in qgemm_wgmma_kernel. Step kt: the producer waits for its copies of step kt, fences them to the async proxy and
// arrives on full[kt % KS] (128 arrivals), then waits until step kt - 1 is consumed and loads step kt + KS - 1 into
// its slot. The block's BN W rows are rows n0 % 256 .. of the copy's 256-row tile n0 / 256 (a half of it at BN =
// 128), already swizzled: each 16-byte chunk sits at the same offset from the first of those rows as in the slot.
struct W16Args {
  WgArgs g;
  const __half* w16;
};
template <int BN, int KS>
__global__ void __launch_bounds__(384, 1) qgemm_w16_kernel(const W16Args args) {
#if defined(LILY_SM90A_PASS)
  const WgArgs& p = args.g;
  const __half* const w16 = args.w16;
  constexpr int kABytes = kBM * 128, kBBytes = BN * 128;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* const smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  unsigned char* const a_s = smem;                // KS x [128 rows x 128 B]
  unsigned char* const b_s = a_s + KS * kABytes;  // KS x [BN rows x 128 B]
  uint64_t* const bars = reinterpret_cast<uint64_t*>(b_s + KS * kBBytes);
  const uint32_t full0 = smem_u32(bars), empty0 = smem_u32(bars + KS);
  const int tid = threadIdx.x, wg = tid >> 7;
  const int n0 = blockIdx.y * BN;
  int row0, rows;
  QMatrix w[1];
  pdl_wait();
  block_rows<kBM, 1>(p, row0, rows, w);
  const int K = p.K, KT = K / kWgGroup;
  if (tid == 0) {
    for (int s = 0; s < KS; ++s) {
      mbar_init(full0 + 8 * s, 128);
      mbar_init(empty0 + 8 * s, 256);
    }
    fence_mbar_init();
  }
  __syncthreads();

  if (wg == 0) {
    const int t = tid & 127, r0 = t >> 3, ch = t & 7;
    const int dst = r0 * 128 + ((ch ^ (r0 & 7)) << 4);  // rows r0 + 16 i share r0's swizzle
    constexpr int kAChunks = kBM / 16, kBChunks = BN / 16;
    const __half* a_ptr[kAChunks];
    bool a_ok[kAChunks];
#pragma unroll
    for (int i = 0; i < kAChunks; ++i) {
      const int r = r0 + 16 * i;
      a_ok[i] = r < rows;
      a_ptr[i] = p.a;
      if (a_ok[i])
        a_ptr[i] += static_cast<size_t>(p.gather ? __ldcg(p.gather + row0 + r) : row0 + r) * K + ch * 8;
    }
    const unsigned char* const b_ptr = reinterpret_cast<const unsigned char*>(w16) +
                                       static_cast<size_t>(n0 / 256) * KT * kW16TileBytes + (n0 % 256) * 128 + dst;
    auto issue = [&](int kt) {
      unsigned char* const as = a_s + (kt % KS) * kABytes + dst;
#pragma unroll
      for (int i = 0; i < kAChunks; ++i) cp_async_16(as + i * 16 * 128, a_ptr[i] + kt * kWgGroup, a_ok[i]);
      unsigned char* const bs = b_s + (kt % KS) * kBBytes + dst;
#pragma unroll
      for (int i = 0; i < kBChunks; ++i) {
        const bool ok = n0 + r0 + 16 * i < p.N;  // the copy's padding rows are zeros; not read
        cp_async_16(bs + i * 16 * 128,
                    ok ? static_cast<const void*>(b_ptr + static_cast<size_t>(kt) * kW16TileBytes + i * 16 * 128)
                       : static_cast<const void*>(w16),
                    ok);
      }
    };
#pragma unroll 1
    for (int s = 0; s < KS - 1; ++s) {
      if (s < KT) issue(s);
      cp_async_commit();
    }
#pragma unroll 1
    for (int kt = 0; kt < KT; ++kt) {
      cp_async_wait<KS - 2>();  // this thread's copies of step kt landed
      fence_proxy_async();
      mbar_arrive(full0 + 8 * (kt % KS));
      const int next = kt + KS - 1;
      if (next < KT) {
        if (kt >= 1) mbar_wait(empty0 + 8 * ((kt - 1) % KS), ((kt - 1) / KS) & 1);
        issue(next);
      }
      cp_async_commit();
    }
    cp_async_wait<0>();
  } else {
    const int arow0 = 64 * (wg - 1);
    const bool live = rows > arow0;
    float acc[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;
    consume_steps<BN, KS, KS>(acc, KT, full0, empty0, smem_u32(a_s) + arow0 * 128, kABytes, smem_u32(b_s),
                              kBBytes, live);
    wgmma_wait<0>();
    fence_regs(acc);
    pdl_launch_dependents();
    store_tile<BN>(p, acc, arow0, rows, row0, n0, tid);
  }
#else
  (void)args;
#endif
}

cudaError_t expand_w16(const QMatrix& w, __half* w16, cudaStream_t stream) {
  const long chunks = static_cast<long>(qgemm_w16_halves(w) / 8);
  const unsigned blocks = static_cast<unsigned>((chunks + 255) / 256);
  const ExpandArgs e{w, w16, chunks};
  return w.bits == 8 ? launch_pdl(expand_w16_kernel<8>, dim3(blocks), dim3(256), 0, stream, e)
                     : launch_pdl(expand_w16_kernel<4>, dim3(blocks), dim3(256), 0, stream, e);
}

template <int BN>
cudaError_t launch_w16(const WgArgs& a, const QMatrix& w, __half* w16, bool expanded, cudaStream_t stream) {
  if (!expanded) CUDA_TRY(expand_w16(w, w16, stream));
  constexpr int KS = w16_ring(BN);
  constexpr size_t smem = 1024 + size_t{KS} * (kBM * 128 + BN * 128) + size_t{2} * KS * sizeof(uint64_t);
  static_assert(KS >= 3 && smem <= kSmemMax, "shared memory");
  const dim3 grid((a.M + kBM - 1) / kBM, (a.N + BN - 1) / BN);
  if (grid.y > 65535u) return cudaErrorInvalidValue;
  auto* k = qgemm_w16_kernel<BN, KS>;
  CUDA_TRY(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  return launch_pdl(k, grid, dim3(384), smem, stream, W16Args{a, w16});
}

// Static shared memory only in a device pass for sm_90a: cudaFuncGetAttributes on it says whether the code
// the runtime loaded for the current device is that pass (and so whether qgemm_wgmma_kernel has a body),
// without a launch or a copy (safe inside a stream capture).
__global__ void wgmma_probe_kernel(int* out) {
#if defined(LILY_SM90A_PASS)
  __shared__ volatile int marker[64];
  marker[threadIdx.x & 63] = 1;
  *out = marker[0];
#else
  *out = 0;
#endif
}

// Dense launch with the deepest ring that fits next to KB fp16 tiles.
template <int BN, int BITS, int KB>
cudaError_t launch_dense_wgmma(const WgArgs& a, cudaStream_t stream) {
  constexpr int KS = ring_fit(BN, BITS, KB);
  using C = WgTile<BN, BITS, KB, KS>;
  const dim3 grid((a.M + kBM - 1) / kBM, (a.N + BN - 1) / BN), block(C::kThreads);
  if (grid.y > 65535u) return cudaErrorInvalidValue;
  auto* k = qgemm_wgmma_kernel<BN, BITS, KB, KS>;
  CUDA_TRY(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(C::kSmem)));
  return launch_pdl(k, grid, block, C::kSmem, stream, a);
}

}  // namespace

namespace qgemm_util {

// 128 x 256 tiles (half the shared-memory reads of W per FLOP of 128 x 128) unless they would leave SMs idle: a K
// loop runs serially in a block, so a grid of fewer tiles than SMs is bound by one block.
bool wgmma_dense_wide(int M, int N) { return static_cast<long>((M + 127) / 128) * ((N + 255) / 256) >= 132; }

long wgmma_dense_blocks(int M, int N) {
  const int bn = wgmma_dense_wide(M, N) ? 256 : 128;
  return static_cast<long>((M + 127) / 128) * ((N + bn - 1) / bn);
}

}  // namespace qgemm_util

bool wgmma_built() {
  static int cache[64] = {};
  return probe_marked(reinterpret_cast<const void*>(wgmma_probe_kernel), cache);
}

cudaError_t qgemm_wgmma(const QGemmParams& p, cudaStream_t stream) {
  const QMatrix& w = p.w;
  const int ldc = p.ldc ? p.ldc : w.rows;
  if (!w.w || !w.scales || !w.biases || w.rows < 1 || w.cols < kWgGroup || w.cols % kWgGroup != 0 ||
      (w.bits != 4 && w.bits != 8) || !aligned16(w.w) || !p.a || !p.c || p.M < 1 || ldc < w.rows ||
      !aligned16(p.a) || (p.out != GemmOut::f32 && p.out != GemmOut::f16 && p.out != GemmOut::add_f32) ||
      (p.wgmma_tile_n != 0 && p.wgmma_tile_n != 128 && p.wgmma_tile_n != 256)) {
    return cudaErrorInvalidValue;
  }
  if (!wgmma_built()) return cudaErrorInvalidDeviceFunction;
  WgArgs a;
  a.w[0] = a.w[1] = w;
  a.a = p.a, a.M = p.M, a.N = w.rows, a.K = w.cols, a.out = p.out, a.c = p.c, a.ldc = ldc;
  const bool wide = p.wgmma_tile_n ? p.wgmma_tile_n == 256 : wgmma_dense_wide(a.M, a.N);
  if (p.w16 && p.w16_bytes >= qgemm_w16_halves(w) * sizeof(__half) && aligned16(p.w16)) {
    return wide ? launch_w16<256>(a, w, p.w16, p.w16_expanded, stream)
                : launch_w16<128>(a, w, p.w16, p.w16_expanded, stream);
  }
  // Two fp16 W tiles at 256 columns, three at 128 (the ring takes the rest of shared memory).
  if (w.bits == 8) return wide ? launch_dense_wgmma<256, 8, 2>(a, stream) : launch_dense_wgmma<128, 8, 3>(a, stream);
  return wide ? launch_dense_wgmma<256, 4, 2>(a, stream) : launch_dense_wgmma<128, 4, 3>(a, stream);
}

cudaError_t qgemm_expand_w16(const QMatrix& w, __half* w16, cudaStream_t stream) {
  if (!w.w || !w.scales || !w.biases || w.rows < 1 || w.cols < kWgGroup || w.cols % kWgGroup != 0 ||
      (w.bits != 4 && w.bits != 8) || !w16 || !aligned16(w16)) {
    return cudaErrorInvalidValue;
  }
  if (!wgmma_built()) return cudaErrorInvalidDeviceFunction;
  return expand_w16(w, w16, stream);
}

}  // namespace lily::cuda
