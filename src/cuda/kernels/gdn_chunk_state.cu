// GdnScan::chunked_split and chunked_wgmma (gdn_prefill.cuh; the default from 512 rows, chunked_wgmma where
// wgmma_built(), chunked_split on other GPUs): the chunked form split in two, as
// flash-linear-attention's chunk_gated_delta_rule splits fwd_h from fwd_o. After gdn_chunk_prep.cu,
// gdn_chunk_state_kernel walks the chunks per (value head, 32 columns of S) carrying only the state: per chunk it
// stores S_c (the chunk's start state, fp32) to scratch hs [nc, n_v, d_k, d_v], forms V' = U - W S_c (to scratch over
// U) and S <- exp(G_63) S + (exp(G_63 - G) k)^T V': two dependent products and two barriers per chunk instead of
// three and four, its inputs double buffered a whole chunk ahead, the B operands S and V' stored split into tf32
// hi / lo once by their owners, and the 3xTF32 correction products in accumulators of their own (mma_sep).
// gdn_chunk_out_kernel then forms O = (exp(G) q) S_c + P V' for every (chunk, value head, 64 columns) at once (4,096
// blocks at T = 4096). Costs the hs section: 2 MiB of scratch per 64 rows at full geometry (128 MiB at T = 4096).
// Measured on the H200 (2026-11-30): 0.928 ms a layer at T = 4096 against 1.032 for GdnScan::chunked; the model's
// logits as close to the CPU (teacher-forced full4, 512 positions: 3.03e-3). The state pass on wgmma
// (gdn_chunk_state_wgmma_kernel, 2026-12-04): 0.820 ms a layer at T = 4096, its outputs bit-identical to chunked's.
#include <cooperative_groups.h>

#include "cuda/kernels/gdn_chunk_util.cuh"
#include "cuda/kernels/wgmma_util.cuh"

namespace lily::cuda::gdn_prefill_impl {

namespace {

constexpr int kStateWarps = 8;

template <int D>
constexpr size_t chunk_state_smem() {
  constexpr int LDC = kChunkCols + 8;
  return sizeof(float) * (2 * (kChunk * (D + 4) + kChunk * LDC + kChunk * (D + 8) + 2 * kChunk) + 2 * D * LDC +
                          kChunk * LDC);
}

// Block (value head h, columns j0 .. j0 + 32 of S), NW warps (8), the chunks in order with S[:, j0..] in
// registers (fp32) and a copy in shared memory as an operand; per chunk c:
//   S (the chunk's start state) -> scratch hs; V' = U - W S -> scratch v (over U) and shared memory;
//   S <- exp(G_63) S + (exp(G_63 - G) k)^T V'.
// The same arithmetic as gdn_chunk_scan_kernel's V' and update (same operands, same order of the k sums), less the
// output product. Warp (mt = warp % 4, ch = warp / 4) owns rows 16 mt.. of V' and rows D/4 mt.. of S, columns
// CW ch.. of the block's (CW = 32 / (NW / 4)). The inputs (W, U, k, the exp factors) are double buffered: chunk
// c + 1's arrive by cp.async during chunk c, so a chunk has two barriers: (A) its inputs and S in shared memory
// visible; (B) V' complete, after which the S operand is free (only V' reads it) and the update's result goes
// straight there. The two B operands read by several warps, S (by the 4 row groups in V') and V' (by the 4 row
// groups and both halves of S's rows in the update), are stored already split into tf32 hi / lo by their owner
// (split_tf32, frag_pre: the same bits as converting at every read); V' hi overwrites U in place (each thread reads
// the U elements it then writes), V' lo has its own array.
// Each product's a_hi b_hi, a_lo b_hi and a_hi b_lo go into three
// accumulators (mma_sep; for the update, S itself and two zeroed ones), summed as main + (lo_hi + hi_lo) after the
// last k-step. The dependent chain of a product drops from 3 mma a k-step to 1 (V': 48 -> 16 mma latencies, update:
// 24 -> 8), for 2 x 4 NT (V') and 2 x 4 MS NT (update) more registers (D = 128: 121 at 8 warps; 80 with a single accumulator).
// The three exact partial products (tf32 x tf32 fits fp32) are the same as mma's chain; only the rounding of their sum
// differs: the chain rounds the running sum 3K/8 times, this K/8 times at the sum's scale plus twice (the corrections are
// ~2^-10 of it), so |this - chain| <= (K/2 + 2) 2^-23 sum_k |a_k b_k| per product (one ulp a rounding, as for a
// truncating accumulator): 7.9e-6 of sum |a b| at K = 128, 62x below tf32's operand rounding (2^-11), and no larger
// an error against the exact products than the chain's (GdnScan::chunked).
template <int D, int NW>
__global__ void __launch_bounds__(NW * 32) gdn_chunk_state_kernel(const __grid_constant__ GdnPrefillParams p, Scratch s) {
  constexpr int kNThreads = NW * 32, NC = kChunkCols, CW = NC / (NW / 4), NT = CW / 8;
  constexpr int LDA = D + 4, LDK = D + 8, LDC = NC + 8, MS = D / 64;
  constexpr int kBuf = kChunk * LDA + kChunk * LDC + kChunk * LDK + 2 * kChunk;  // floats per input buffer
  static_assert(kBuf % 4 == 0, "16-byte aligned buffers");
  using FA = Frag<4>;
  extern __shared__ __align__(16) float smem[];
  // Buffer b: [64][LDA] W | [64][LDC] U, then V' | [64][LDK] k_hat | [128] exp(G_i) | exp(G_63 - G_i).
  float* sh_s = smem + 2 * kBuf;  // [D][LDC] S at the chunk's start, tf32 part
  float* sl_s = sh_s + D * LDC;   // [D][LDC] ... the remainder's 
  float* vl_s = sl_s + D * LDC;   // [64][LDC] V', the remainder's tf32 part (V' hi is over U)
  const int col_blocks = D / NC, h = blockIdx.x / col_blocks, j0 = blockIdx.x % col_blocks * NC;
  const int kh = h / (p.n_v / p.n_k), nc = (p.T + kChunk - 1) / kChunk;
  const size_t value_dim = static_cast<size_t>(p.n_v) * D;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int r0 = (warp & 3) * 16, rs = (warp & 3) * 16 * MS, c0 = warp / 4 * CW;
  const float4 zero4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);

  auto load = [&](int c) {  // chunk c's inputs into buffer c & 1 (one commit group)
    if (c < nc) {
      float* w_s = smem + (c & 1) * kBuf;
      float* u_s = w_s + kChunk * LDA;
      float* k_s = u_s + kChunk * LDC;
      float* gk_s = k_s + kChunk * LDK;
      const int t0 = c * kChunk, n = min(kChunk, p.T - t0);
      const float* w = s.w + (static_cast<size_t>(c) * p.n_v + h) * kChunk * D;
      for (int i = threadIdx.x; i < kChunk * D / 4; i += kNThreads) {
        const int r = i / (D / 4), d = i % (D / 4) * 4;
        cp_async16(w_s + r * LDA + d, w + r * D + d);
        if (r < n) cp_async16(k_s + r * LDK + d, s.k + (static_cast<size_t>(t0 + r) * p.n_k + kh) * D + d);
        else *reinterpret_cast<float4*>(k_s + r * LDK + d) = zero4;
      }
      for (int i = threadIdx.x; i < kChunk * NC / 4; i += kNThreads) {
        const int r = i / (NC / 4), d = i % (NC / 4) * 4;
        if (r < n) cp_async16(u_s + r * LDC + d, s.v + static_cast<size_t>(t0 + r) * value_dim + h * D + j0 + d);
        else *reinterpret_cast<float4*>(u_s + r * LDC + d) = zero4;
      }
      const float* gk = s.gk + (static_cast<size_t>(c) * p.n_v + h) * 2 * kChunk;
      for (int i = threadIdx.x; i < 2 * kChunk / 4; i += kNThreads) cp_async16(gk_s + i * 4, gk + i * 4);
    }
    cp_async_commit();
  };

  load(0);
  float S[MS][NT][4];  // S[rs + 16 ms + g (+8)][j0 + c0 + 8 nt + 2t (+1)]
  float* S_g = p.S + static_cast<size_t>(h) * D * D + j0 + c0;
#pragma unroll
  for (int ms = 0; ms < MS; ++ms)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const float2 x = *reinterpret_cast<const float2*>(S_g + static_cast<size_t>(rs + 16 * ms + g + 8 * hf) * D + 8 * nt + 2 * t);
        S[ms][nt][2 * hf] = x.x, S[ms][nt][2 * hf + 1] = x.y;
      }
  // S -> shared memory (split) and, for chunk c, to scratch hs (the output pass's operand).
  auto store_state = [&](int c) {
    float* hs = s.hs + (static_cast<size_t>(c) * p.n_v + h) * D * D + j0 + c0;
#pragma unroll
    for (int ms = 0; ms < MS; ++ms)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int row = rs + 16 * ms + g + 8 * hf, col = 8 * nt + 2 * t;
          const float2 x = make_float2(S[ms][nt][2 * hf], S[ms][nt][2 * hf + 1]);
          const float2 a = split_tf32(x.x), b = split_tf32(x.y);
          *reinterpret_cast<float2*>(sh_s + row * LDC + c0 + col) = make_float2(a.x, b.x);
          *reinterpret_cast<float2*>(sl_s + row * LDC + c0 + col) = make_float2(a.y, b.y);
          if (c < nc) *reinterpret_cast<float2*>(hs + static_cast<size_t>(row) * D + col) = x;
        }
  };
  store_state(0);

  for (int c = 0; c < nc; ++c) {
    const int t0 = c * kChunk, n = min(kChunk, p.T - t0);
    float* w_s = smem + (c & 1) * kBuf;
    float* u_s = w_s + kChunk * LDA;  // U, then V' (tf32 part)
    const float* k_s = u_s + kChunk * LDC;
    const float* gk_s = k_s + kChunk * LDK;
    cp_async_wait<0>();  // chunk c's inputs (the only group in flight)
    __syncthreads();     // (A) ... visible to every warp, and S in sh_s / sl_s; buffer (c + 1) & 1 free (chunk c - 1's)
    load(c + 1);
    {  // V' = U - W S
      float acc[NT][4] = {}, ca[NT][4] = {}, cb[NT][4] = {};
#pragma unroll 4
      for (int k0 = 0; k0 < D; k0 += 8) {
        const FA af({w_s[(r0 + g) * LDA + k0 + t], w_s[(r0 + g + 8) * LDA + k0 + t], w_s[(r0 + g) * LDA + k0 + t + 4],
                     w_s[(r0 + g + 8) * LDA + k0 + t + 4]});
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const auto fb = frag_pre(sh_s, sl_s, (k0 + t) * LDC + c0 + 8 * nt + g, (k0 + t + 4) * LDC + c0 + 8 * nt + g);
          mma_sep(acc[nt], ca[nt], cb[nt], af, fb);
        }
      }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[nt][e] += ca[nt][e] + cb[nt][e];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = r0 + g + 8 * hf, off = i * LDC + c0 + 8 * nt + 2 * t;
          const float2 u = *reinterpret_cast<const float2*>(u_s + off);
          const float2 v2 = make_float2(u.x - acc[nt][2 * hf], u.y - acc[nt][2 * hf + 1]);
          const float2 a = split_tf32(v2.x), b = split_tf32(v2.y);
          *reinterpret_cast<float2*>(u_s + off) = make_float2(a.x, b.x);
          *reinterpret_cast<float2*>(vl_s + off) = make_float2(a.y, b.y);
          if (i < n)
            *reinterpret_cast<float2*>(s.v + static_cast<size_t>(t0 + i) * value_dim + h * D + j0 + c0 + 8 * nt + 2 * t) = v2;
        }
    }
    __syncthreads();  // (B) V' complete; sh_s / sl_s free
    {  // S <- exp(G_63) S + (exp(G_63 - G) k)^T V'
      const float decay = gk_s[kChunk - 1];
#pragma unroll
      for (int ms = 0; ms < MS; ++ms)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) S[ms][nt][e] *= decay;
      float ca[MS][NT][4] = {}, cb[MS][NT][4] = {};
#pragma unroll 2
      for (int k0 = 0; k0 < kChunk; k0 += 8) {
        const float f0 = gk_s[kChunk + k0 + t], f1 = gk_s[kChunk + k0 + t + 4];
#pragma unroll
        for (int ms = 0; ms < MS; ++ms) {
          const int d = rs + 16 * ms + g;
          const FA af({k_s[(k0 + t) * LDK + d] * f0, k_s[(k0 + t) * LDK + d + 8] * f0, k_s[(k0 + t + 4) * LDK + d] * f1,
                       k_s[(k0 + t + 4) * LDK + d + 8] * f1});
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            const auto fb = frag_pre(u_s, vl_s, (k0 + t) * LDC + c0 + 8 * nt + g, (k0 + t + 4) * LDC + c0 + 8 * nt + g);
            mma_sep(S[ms][nt], ca[ms][nt], cb[ms][nt], af, fb);
          }
        }
      }
#pragma unroll
        for (int ms = 0; ms < MS; ++ms)
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) S[ms][nt][e] += ca[ms][nt][e] + cb[ms][nt][e];
    }
    store_state(c + 1);  // chunk c + 1's start state (to scratch only if there is a chunk c + 1)
  }
  cp_async_wait<0>();
#pragma unroll
  for (int ms = 0; ms < MS; ++ms)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf)
        *reinterpret_cast<float2*>(S_g + static_cast<size_t>(rs + 16 * ms + g + 8 * hf) * D + 8 * nt + 2 * t) =
            make_float2(S[ms][nt][2 * hf], S[ms][nt][2 * hf + 1]);
}

// ---- GdnScan::chunked_wgmma: the same state pass on warpgroup MMAs (Hopper) ---------------------------------
// Block (value head h, columns j0 .. j0 + 32 of S), two warpgroups that pass the chunk back and forth:
//   warpgroup 0, V' = U - W S_c: wgmma m64n32k8, A = W (registers: warp w rows 16 w + g (+8), mma.sync's A
//     fragment), B = S_c^T, K = D;
//   warpgroup 1, S <- exp(G_63) S + (exp(G_63 - G) k)^T V': one m64n32k8 tile per 64 rows of S, A = the scaled k^T
//     (registers), B = V'^T, K = 64; S stays in its accumulators (fp32) across the chunks.
// Each product in 3xTF32 (lo hi, hi lo, hi hi into one accumulator a k-step: mma()'s order, bit-identical to
// GdnScan::chunked on the H200). The B operands live in shared memory split into tf32 hi / lo once by their owner
// (split_tf32), K-major (row n of the block's 32 columns, K contiguous) in the 128-byte swizzle, panels of 32 K
// elements 4 KB apart. Why two warpgroups: with one, the state pass ran at one warp a scheduler issuing every 3.3
// cycles (ncu, 2026-12-04) and took as long as the mma.sync kernel (0.388 vs 0.396 ms at T = 4097): the chunk's
// critical path was its ~2,200 instructions a warp. Here each warpgroup converts its next A operand (W of chunk c + 1,
// the scaled k of chunk c + 1: all of it, 128 registers) and waits for its own copies while the other warpgroup's
// product is on the critical path, which keeps only the wgmmas, their epilogues and two hand-overs a chunk:
//   S_ready (named barrier 1): warpgroup 1 arrives once S_c^T is stored (c = 0: the initial state), warpgroup 0
//     waits before its wgmmas; this also says warpgroup 1's wgmmas no longer read V'^T;
//   V_ready (named barrier 2): warpgroup 0 arrives once V'^T is stored (its wgmmas no longer read S^T), warpgroup 1
//     waits before its wgmmas.
// Each warpgroup copies its own inputs (0: W, U; 1: k, exp factors) a chunk ahead into the buffer of the chunk's
// parity and makes them visible inside the warpgroup by its own named barrier (3, 4).
template <int D>
struct WgStateLayout {  // bytes from the 1024-aligned base of dynamic shared memory
  static constexpr int LDA = D + 4, LDK = D + 8, LDC = kChunkCols + 8;
  static constexpr int kBufFloats = kChunk * LDA + kChunk * LDC + kChunk * LDK + 2 * kChunk;  // as chunk_state_smem
  static constexpr size_t kSt = size_t{kChunkCols} * D * 4, kVt = size_t{kChunkCols} * kChunk * 4;
  static constexpr size_t s_hi = 0, s_lo = kSt, v_hi = 2 * kSt, v_lo = 2 * kSt + kVt, buf = 2 * kSt + 2 * kVt;
  static constexpr size_t bytes = buf + 2 * sizeof(float) * kBufFloats + 1024;  // + the base's alignment
};

#if defined(LILY_SM90A_PASS)
// Byte offset of element (row n, k) of a K-major operand tile of 32 rows in the 128-byte swizzle: panel k / 32
// (4 KB: 32 rows x 128 bytes), 16-byte chunk (k % 32) / 4 of row n stored at chunk ^ (n % 8).
__device__ __forceinline__ uint32_t sw_off(int n, int k) {
  return static_cast<uint32_t>((k >> 5) * 4096 + n * 128 + ((((k & 31) >> 2) ^ (n & 7)) << 4) + (k & 3) * 4);
}

// D[64, 32] += A[64, 8] B[8, 32] three times (3xTF32: a_lo b_hi, a_hi b_lo, a_hi b_hi): A from registers (hi, lo),
// B K-major in shared memory (descriptors bh, bl of its hi and lo parts).
__device__ __forceinline__ void wgmma3_tf32(float (&d)[16], const uint32_t (&ah)[4], const uint32_t (&al)[4],
                                            uint64_t bh, uint64_t bl) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k8.f32.tf32.tf32 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%20, %21, %22, %23}, %24, p, 1, 1;\n"
      "wgmma.mma_async.sync.aligned.m64n32k8.f32.tf32.tf32 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %25, p, 1, 1;\n"
      "wgmma.mma_async.sync.aligned.m64n32k8.f32.tf32.tf32 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %24, p, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(ah[0]), "r"(ah[1]), "r"(ah[2]), "r"(ah[3]), "r"(al[0]), "r"(al[1]), "r"(al[2]), "r"(al[3]), "l"(bh),
        "l"(bl));
}

// Keeps A fragments alive and unmoved until this point (the tensor cores read them until their group completes).
template <int N>
__device__ __forceinline__ void fence_frags(uint32_t (&a)[N][4]) {
#pragma unroll
  for (int j = 0; j < N; ++j)
#pragma unroll
    for (int q = 0; q < 4; ++q) asm volatile("" : "+r"(a[j][q])::"memory");
}

__device__ __forceinline__ void split_frag(const float (&x)[4], uint32_t (&hi)[4], uint32_t (&lo)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    hi[i] = tf32(x[i]);
    lo[i] = tf32(x[i] - __uint_as_float(hi[i]));
  }
}

// Named barriers of the 256 threads (1, 2: the hand-overs; one warpgroup arrives, the other waits) and of one
// warpgroup's 128 threads (3, 4). Barrier 0 is __syncthreads.
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
#endif

template <int D>
__global__ void __launch_bounds__(256, 1) gdn_chunk_state_wgmma_kernel(const __grid_constant__ GdnPrefillParams p,
                                                                       Scratch s) {
#if defined(LILY_SM90A_PASS)
  using namespace wgmma_util;
  using L = WgStateLayout<D>;
  constexpr int NC = kChunkCols, MT = D / 64, KV = D / 8, KU = MT * (kChunk / 8);
  constexpr int LDA = L::LDA, LDK = L::LDK, LDC = L::LDC, kBuf = L::kBufFloats;
  constexpr int kSReady = 1, kVReady = 2;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* const base = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  float* const bufs = reinterpret_cast<float*>(base + L::buf);
  const int col_blocks = D / NC, h = blockIdx.x / col_blocks, j0 = blockIdx.x % col_blocks * NC;
  const int kh = h / (p.n_v / p.n_k), nc = (p.T + kChunk - 1) / kChunk;
  const size_t value_dim = static_cast<size_t>(p.n_v) * D;
  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4, r = 16 * warp + g;
  const float4 zero4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  // Buffer b: [64][LDA] W | [64][LDC] U | [64][LDK] k_hat | [128] exp(G_i) | exp(G_63 - G_i).
  auto w_of = [&](int c) { return bufs + (c & 1) * kBuf; };
  auto u_of = [&](int c) { return w_of(c) + kChunk * LDA; };
  auto k_of = [&](int c) { return u_of(c) + kChunk * LDC; };
  auto gk_of = [&](int c) { return k_of(c) + kChunk * LDK; };
  uint32_t ah[KV][4], al[KV][4];  // this warpgroup's A operand of its next product (hi, lo), every k-step

  if (wg == 0) {  // ---- V' = U - W S_c
    auto load = [&](int c) {  // W and U of chunk c (one commit group)
      if (c < nc) {
        float* w_s = w_of(c);
        float* u_s = u_of(c);
        const int t0 = c * kChunk, n = min(kChunk, p.T - t0);
        const float* w = s.w + (static_cast<size_t>(c) * p.n_v + h) * kChunk * D;
        for (int i = tid; i < kChunk * D / 4; i += 128) {
          const int row = i / (D / 4), d = i % (D / 4) * 4;
          cp_async16(w_s + row * LDA + d, w + row * D + d);
        }
        for (int i = tid; i < kChunk * NC / 4; i += 128) {
          const int row = i / (NC / 4), d = i % (NC / 4) * 4;
          if (row < n) cp_async16(u_s + row * LDC + d, s.v + static_cast<size_t>(t0 + row) * value_dim + h * D + j0 + d);
          else *reinterpret_cast<float4*>(u_s + row * LDC + d) = zero4;
        }
      }
      cp_async_commit();
    };
    auto convert = [&](int c) {  // W of chunk c -> ah / al (after its copies are visible)
      const float* w_s = w_of(c);
#pragma unroll
      for (int kk = 0; kk < KV; ++kk) {
        const int k0 = 8 * kk;
        const float x[4] = {w_s[r * LDA + k0 + t], w_s[(r + 8) * LDA + k0 + t], w_s[r * LDA + k0 + t + 4],
                            w_s[(r + 8) * LDA + k0 + t + 4]};
        split_frag(x, ah[kk], al[kk]);
      }
    };
    load(0);
    cp_async_wait<0>();
    named_sync(3, 128);
    convert(0);
    const uint32_t s_hi = smem_u32(base + L::s_hi), s_lo = smem_u32(base + L::s_lo);
    for (int c = 0; c < nc; ++c) {
      const int t0 = c * kChunk, n = min(kChunk, p.T - t0);
      load(c + 1);  // into the buffer of chunk c - 1, whose W and U this warpgroup is done with
      float vacc[16];  // vacc[4 j + 2 hf + e] = (W S)[r + 8 hf][8 j + 2 t + e]
#pragma unroll
      for (int i = 0; i < 16; ++i) vacc[i] = 0.0f;
      named_sync(kSReady, 256);  // S_c^T stored by warpgroup 1
      wgmma_fence();
      fence_regs(vacc);
#pragma unroll
      for (int kk = 0; kk < KV; ++kk) {
        const uint32_t off = static_cast<uint32_t>((kk >> 2) * 4096 + (kk & 3) * 32);
        wgmma3_tf32(vacc, ah[kk], al[kk], desc_sw128(s_hi + off), desc_sw128(s_lo + off));
      }
      wgmma_commit();
      fence_regs(vacc);
      wgmma_wait<0>();
      fence_regs(vacc);
      fence_frags(ah);
      fence_frags(al);
      const float* u_s = u_of(c);
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = r + 8 * hf, n0 = 8 * j + 2 * t;
          const float2 u = *reinterpret_cast<const float2*>(u_s + i * LDC + n0);
          const float2 v2 = make_float2(u.x - vacc[4 * j + 2 * hf], u.y - vacc[4 * j + 2 * hf + 1]);
          const float2 a = split_tf32(v2.x), b = split_tf32(v2.y);
          *reinterpret_cast<float*>(base + L::v_hi + sw_off(n0, i)) = a.x;
          *reinterpret_cast<float*>(base + L::v_lo + sw_off(n0, i)) = a.y;
          *reinterpret_cast<float*>(base + L::v_hi + sw_off(n0 + 1, i)) = b.x;
          *reinterpret_cast<float*>(base + L::v_lo + sw_off(n0 + 1, i)) = b.y;
          if (i < n) *reinterpret_cast<float2*>(s.v + static_cast<size_t>(t0 + i) * value_dim + h * D + j0 + n0) = v2;
        }
      fence_proxy_async();  // V'^T's stores, for warpgroup 1's wgmmas
      named_arrive(kVReady, 256);
      if (c + 1 < nc) {
        cp_async_wait<0>();
        named_sync(3, 128);
        convert(c + 1);
      }
    }
    cp_async_wait<0>();
  } else {  // ---- S <- exp(G_63) S + (exp(G_63 - G) k)^T V'
    auto load = [&](int c) {  // k and the exp factors of chunk c (one commit group)
      if (c < nc) {
        float* k_s = k_of(c);
        float* gk_s = gk_of(c);
        const int t0 = c * kChunk, n = min(kChunk, p.T - t0);
        for (int i = tid; i < kChunk * D / 4; i += 128) {
          const int row = i / (D / 4), d = i % (D / 4) * 4;
          if (row < n) cp_async16(k_s + row * LDK + d, s.k + (static_cast<size_t>(t0 + row) * p.n_k + kh) * D + d);
          else *reinterpret_cast<float4*>(k_s + row * LDK + d) = zero4;
        }
        const float* gk = s.gk + (static_cast<size_t>(c) * p.n_v + h) * 2 * kChunk;
        for (int i = tid; i < 2 * kChunk / 4; i += 128) cp_async16(gk_s + i * 4, gk + i * 4);
      }
      cp_async_commit();
    };
    auto convert = [&](int c) {  // the scaled k^T of chunk c -> ah / al: unit u = (tile u / 8, k-step u % 8)
      const float* k_s = k_of(c);
      const float* gk_s = gk_of(c);
#pragma unroll
      for (int u = 0; u < KU; ++u) {
        const int k0 = 8 * (u % 8), d = 64 * (u / 8) + r;
        const float f0 = gk_s[kChunk + k0 + t], f1 = gk_s[kChunk + k0 + t + 4];
        const float x[4] = {k_s[(k0 + t) * LDK + d] * f0, k_s[(k0 + t) * LDK + d + 8] * f0,
                            k_s[(k0 + t + 4) * LDK + d] * f1, k_s[(k0 + t + 4) * LDK + d + 8] * f1};
        split_frag(x, ah[u], al[u]);
      }
    };
    load(0);
    // S in the accumulators: sacc[mt][4 j + 2 hf + e] = S[64 mt + r + 8 hf][j0 + 8 j + 2 t + e].
    float sacc[MT][16];
    float* S_g = p.S + static_cast<size_t>(h) * D * D + j0;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const float2 x = *reinterpret_cast<const float2*>(S_g + static_cast<size_t>(64 * mt + r + 8 * hf) * D + 8 * j + 2 * t);
          sacc[mt][4 * j + 2 * hf] = x.x, sacc[mt][4 * j + 2 * hf + 1] = x.y;
        }
    // S -> warpgroup 0's B operand (S^T, split) and, for chunk c, scratch hs (the output pass's operand).
    auto store_state = [&](int c) {
      float* hs = s.hs + (static_cast<size_t>(c) * p.n_v + h) * D * D + j0;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            const int d = 64 * mt + r + 8 * hf, n0 = 8 * j + 2 * t;
            const float2 x = make_float2(sacc[mt][4 * j + 2 * hf], sacc[mt][4 * j + 2 * hf + 1]);
            const float2 a = split_tf32(x.x), b = split_tf32(x.y);
            *reinterpret_cast<float*>(base + L::s_hi + sw_off(n0, d)) = a.x;
            *reinterpret_cast<float*>(base + L::s_lo + sw_off(n0, d)) = a.y;
            *reinterpret_cast<float*>(base + L::s_hi + sw_off(n0 + 1, d)) = b.x;
            *reinterpret_cast<float*>(base + L::s_lo + sw_off(n0 + 1, d)) = b.y;
            *reinterpret_cast<float2*>(hs + static_cast<size_t>(d) * D + n0) = x;
          }
      fence_proxy_async();  // S^T's stores, for warpgroup 0's wgmmas
      named_arrive(kSReady, 256);
    };
    store_state(0);
    cp_async_wait<0>();
    named_sync(4, 128);
    convert(0);
    const uint32_t v_hi = smem_u32(base + L::v_hi), v_lo = smem_u32(base + L::v_lo);
    for (int c = 0; c < nc; ++c) {
      load(c + 1);  // into the buffer of chunk c - 1, whose k and factors this warpgroup is done with
      const float decay = gk_of(c)[kChunk - 1];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int e = 0; e < 16; ++e) sacc[mt][e] *= decay;
      named_sync(kVReady, 256);  // V'^T stored by warpgroup 0
      wgmma_fence();
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) fence_regs(sacc[mt]);
#pragma unroll
      for (int u = 0; u < KU; ++u) {
        const int kk = u % 8;
        const uint32_t off = static_cast<uint32_t>((kk >> 2) * 4096 + (kk & 3) * 32);
        wgmma3_tf32(sacc[u / 8], ah[u], al[u], desc_sw128(v_hi + off), desc_sw128(v_lo + off));
      }
      wgmma_commit();
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) fence_regs(sacc[mt]);
      wgmma_wait<0>();
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) fence_regs(sacc[mt]);
      fence_frags(ah);
      fence_frags(al);
      if (c + 1 < nc) {
        store_state(c + 1);  // chunk c + 1's start state
        cp_async_wait<0>();
        named_sync(4, 128);
        convert(c + 1);
      }
    }
    cp_async_wait<0>();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf)
          *reinterpret_cast<float2*>(S_g + static_cast<size_t>(64 * mt + r + 8 * hf) * D + 8 * j + 2 * t) =
              make_float2(sacc[mt][4 * j + 2 * hf], sacc[mt][4 * j + 2 * hf + 1]);
  }
#else
  using L = WgStateLayout<D>;  // not an sm_90a pass: no wgmma (scan_chunked_split refuses, see wgmma_built)
  (void)p, (void)s, (void)L::s_hi, (void)L::s_lo, (void)L::v_hi, (void)L::v_lo, (void)L::buf;
#endif
}

constexpr int kOutCols = 64;  // columns of O per block of the output pass

template <int D>
constexpr size_t chunk_out_smem() {
  constexpr int LDC = kOutCols + 8;
  return sizeof(float) * (kChunk * (D + 4) + kChunk * kLdT + D * LDC + kChunk * LDC + kChunk);
}

// Block (chunk c, value head h, columns j0 .. j0 + 64), 8 warps, independent of every other block:
//   O = (exp(G) q) S_c + P V' -> scratch o (rows < T), S_c the chunk's start state from scratch hs, V' from scratch v.
// Warp (mt = warp % 4, ch = warp / 4) owns rows 16 mt.. and columns 32 ch.. of the block's; the k sums in the order
// of gdn_chunk_scan_kernel's output product (q S over d, then P V' over j < 16 (mt + 1)).
// NORM (sm_90 code: thread block clusters): eq 19 and the conv ring here instead of gdn_norm_kernel, so O never goes
// through scratch: the D / 64 blocks of a head's row are one cluster (blockIdx.x = c (D / 64) + column block); each
// sums o^2 of its rows over its 64 columns (a fixed order: the thread's 8, then the quad, then the two warps of a
// row), the cluster exchanges the sums through distributed shared memory and adds them in rank order, and each block
// writes x = norm_w * o / RMS(o_head) * silu(z) for its columns in fp16 (gdn_norm_kernel's expression; its sum of
// squares in another order: the same to fp32 rounding); the blocks of the chunk copy the pre-conv vectors of its rows
// t >= T - K into the ring, as gdn_norm_kernel does (gdn_prep_kernel, which reads the ring, ran before).
template <int D, bool NORM>
__global__ void __launch_bounds__(kThreads) gdn_chunk_out_kernel(const __grid_constant__ GdnPrefillParams p, Scratch s) {
  constexpr int NC = kOutCols, CW = 32, NT = CW / 8, LDA = D + 4, LDC = NC + 8, CB = D / NC;
  using FA = Frag<4>;
  using FB = Frag<2>;
  extern __shared__ __align__(16) float smem[];
  float* q_s = smem;                  // [64][LDA] q_hat
  float* p_s = q_s + kChunk * LDA;    // [64][kLdT] P
  float* s_s = p_s + kChunk * kLdT;   // [D][LDC] S_c
  float* v_s = s_s + D * LDC;         // [64][LDC] V'
  float* gq_s = v_s + kChunk * LDC;   // [64] exp(G_i)
  const int c = NORM ? blockIdx.x / CB : blockIdx.x, h = blockIdx.y;
  const int j0 = (NORM ? blockIdx.x % CB : blockIdx.z) * NC, kh = h / (p.n_v / p.n_k);
  const int t0 = c * kChunk, n = min(kChunk, p.T - t0);
  const size_t value_dim = static_cast<size_t>(p.n_v) * D;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int r0 = (warp & 3) * 16, c0 = warp / 4 * CW;
  const float4 zero4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);

  // Two commit groups: q, S_c and exp(G) (the first product), then P and V'.
  const float* hs = s.hs + (static_cast<size_t>(c) * p.n_v + h) * D * D + j0;
  for (int i = threadIdx.x; i < kChunk * D / 4; i += kThreads) {
    const int r = i / (D / 4), d = i % (D / 4) * 4;
    if (r < n) cp_async16(q_s + r * LDA + d, s.q + (static_cast<size_t>(t0 + r) * p.n_k + kh) * D + d);
    else *reinterpret_cast<float4*>(q_s + r * LDA + d) = zero4;
  }
  for (int i = threadIdx.x; i < D * NC / 4; i += kThreads) {
    const int r = i / (NC / 4), d = i % (NC / 4) * 4;
    cp_async16(s_s + r * LDC + d, hs + static_cast<size_t>(r) * D + d);
  }
  const float* gk = s.gk + (static_cast<size_t>(c) * p.n_v + h) * 2 * kChunk;
  for (int i = threadIdx.x; i < kChunk / 4; i += kThreads) cp_async16(gq_s + i * 4, gk + i * 4);
  cp_async_commit();
  const float* pqk = s.pqk + (static_cast<size_t>(c) * p.n_v + h) * kChunk * kChunk;
  for (int i = threadIdx.x; i < kChunk * kChunk / 4; i += kThreads) {
    const int r = i / (kChunk / 4), d = i % (kChunk / 4) * 4;
    cp_async16(p_s + r * kLdT + d, pqk + r * kChunk + d);
  }
  for (int i = threadIdx.x; i < kChunk * NC / 4; i += kThreads) {
    const int r = i / (NC / 4), d = i % (NC / 4) * 4;
    if (r < n) cp_async16(v_s + r * LDC + d, s.v + static_cast<size_t>(t0 + r) * value_dim + h * D + j0 + d);
    else *reinterpret_cast<float4*>(v_s + r * LDC + d) = zero4;
  }
  cp_async_commit();

  float acc[NT][4] = {};
  cp_async_wait<1>();
  __syncthreads();
  {  // (exp(G) q) S_c
    const float gm0 = gq_s[r0 + g], gm1 = gq_s[r0 + g + 8];
#pragma unroll 4
    for (int k0 = 0; k0 < D; k0 += 8) {
      const FA af({q_s[(r0 + g) * LDA + k0 + t] * gm0, q_s[(r0 + g + 8) * LDA + k0 + t] * gm1,
                   q_s[(r0 + g) * LDA + k0 + t + 4] * gm0, q_s[(r0 + g + 8) * LDA + k0 + t + 4] * gm1});
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        mma(acc[nt], af, FB({s_s[(k0 + t) * LDC + c0 + 8 * nt + g], s_s[(k0 + t + 4) * LDC + c0 + 8 * nt + g]}));
    }
  }
  cp_async_wait<0>();
  __syncthreads();
  // + P V' (P lower triangular: columns j < r0 + 16)
#pragma unroll 2
  for (int k0 = 0; k0 < r0 + 16; k0 += 8) {
    const FA af({p_s[(r0 + g) * kLdT + k0 + t], p_s[(r0 + g + 8) * kLdT + k0 + t], p_s[(r0 + g) * kLdT + k0 + t + 4],
                 p_s[(r0 + g + 8) * kLdT + k0 + t + 4]});
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      mma(acc[nt], af, FB({v_s[(k0 + t) * LDC + c0 + 8 * nt + g], v_s[(k0 + t + 4) * LDC + c0 + 8 * nt + g]}));
  }
  if constexpr (!NORM) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = r0 + g + 8 * hf;
        if (i < n)
          *reinterpret_cast<float2*>(s.o + static_cast<size_t>(t0 + i) * value_dim + h * D + j0 + c0 + 8 * nt + 2 * t) =
              make_float2(acc[nt][2 * hf], acc[nt][2 * hf + 1]);
      }
  } else {
#if defined(LILY_SM90_PASS)
    namespace cg = cooperative_groups;
    __shared__ float ss_s[2][kChunk];  // [ch][row]: a warp's sum of o^2 over its 32 columns
    __shared__ float part_s[kChunk];   // [row]: this block's over its 64 columns (read by the cluster)
    const int key_dim = p.n_k * D, conv_dim = 2 * key_dim + static_cast<int>(value_dim);
    const size_t stride = static_cast<size_t>(conv_dim) + value_dim + 2 * p.n_v;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float q = 0.0f;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) q += acc[nt][2 * hf] * acc[nt][2 * hf] + acc[nt][2 * hf + 1] * acc[nt][2 * hf + 1];
      q += __shfl_xor_sync(0xffffffffu, q, 1);
      q += __shfl_xor_sync(0xffffffffu, q, 2);
      if (t == 0) ss_s[warp / 4][r0 + g + 8 * hf] = q;
    }
    __syncthreads();
    if (threadIdx.x < kChunk) part_s[threadIdx.x] = ss_s[0][threadIdx.x] + ss_s[1][threadIdx.x];
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();  // every block's part_s written
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int i = r0 + g + 8 * hf;
      float total = 0.0f;
#pragma unroll
      for (int b = 0; b < CB; ++b) total += cluster.map_shared_rank(part_s, b)[i];
      const float inv_rms = rsqrtf(total / static_cast<float>(D) + p.eps);
      if (i >= n) continue;
      const float* z = p.proj + static_cast<size_t>(t0 + i) * stride + conv_dim + h * D;
      __half* out = p.out + static_cast<size_t>(t0 + i) * value_dim + h * D;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int j = j0 + c0 + 8 * nt + 2 * t;
        const float2 z2 = *reinterpret_cast<const float2*>(z + j);
        *reinterpret_cast<__half2*>(out + j) =
            __halves2half2(__float2half_rn(p.norm_w[j] * (acc[nt][2 * hf] * inv_rms) * siluf_(z2.x)),
                           __float2half_rn(p.norm_w[j + 1] * (acc[nt][2 * hf + 1] * inv_rms) * siluf_(z2.y)));
      }
    }
    // The conv ring: the pre-conv vectors of this chunk's rows t >= T - K, split over the chunk's blocks.
    const int nb = p.n_v * CB, b = h * CB + static_cast<int>(blockIdx.x % CB);
    for (int row = max(p.T - kKernel, t0); row < t0 + n; ++row) {
      float* slot = p.conv_ring + static_cast<size_t>((p.pos0 + row) % kKernel) * conv_dim;
      const float* src = p.proj + static_cast<size_t>(row) * stride;
      for (int ch = b * kThreads + static_cast<int>(threadIdx.x); ch < conv_dim; ch += nb * kThreads) slot[ch] = src[ch];
    }
    cluster.sync();  // no block leaves while another may still read its part_s
#else
    (void)acc;  // no clusters before sm_90: scan_chunked_split runs the plain variant and gdn_norm_kernel there
#endif
  }
}

}  // namespace

cudaError_t scan_chunked_split(const GdnPrefillParams& p, const Scratch& s, bool wgmma, bool* normed,
                               cudaStream_t stream) {
  const int nc = (p.T + kChunk - 1) / kChunk;
  const bool norm = sm90_code_built();  // the output pass applies eq 19 itself (clusters)
  *normed = norm;
  auto run = [&](auto state_kernel, int d, int threads, size_t state_smem, auto out_plain, auto out_norm,
                 size_t out_smem) {
    CUDA_TRY(cudaFuncSetAttribute(state_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(state_smem)));
    state_kernel<<<p.n_v * (d / kChunkCols), threads, state_smem, stream>>>(p, s);
    CUDA_TRY(cudaGetLastError());
    const int cb = d / kOutCols;
    if (!norm) {
      CUDA_TRY(cudaFuncSetAttribute(out_plain, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(out_smem)));
      out_plain<<<dim3(nc, p.n_v, cb), kThreads, out_smem, stream>>>(p, s);
      return cudaGetLastError();
    }
    CUDA_TRY(cudaFuncSetAttribute(out_norm, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(out_smem)));
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = static_cast<unsigned>(cb);
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(nc * cb, p.n_v, 1);
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = out_smem;
    cfg.stream = stream;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    CUDA_TRY(cudaLaunchKernelEx(&cfg, out_norm, p, s));
    return cudaGetLastError();
  };
  if (wgmma && !wgmma_built()) return cudaErrorInvalidDeviceFunction;
  if (p.d_k == 128) {
    return wgmma ? run(gdn_chunk_state_wgmma_kernel<128>, 128, 256, WgStateLayout<128>::bytes,
                       gdn_chunk_out_kernel<128, false>, gdn_chunk_out_kernel<128, true>, chunk_out_smem<128>())
                 : run(gdn_chunk_state_kernel<128, kStateWarps>, 128, kStateWarps * 32, chunk_state_smem<128>(),
                       gdn_chunk_out_kernel<128, false>, gdn_chunk_out_kernel<128, true>, chunk_out_smem<128>());
  }
  return wgmma ? run(gdn_chunk_state_wgmma_kernel<64>, 64, 256, WgStateLayout<64>::bytes,
                     gdn_chunk_out_kernel<64, false>, gdn_chunk_out_kernel<64, true>, chunk_out_smem<64>())
               : run(gdn_chunk_state_kernel<64, kStateWarps>, 64, kStateWarps * 32, chunk_state_smem<64>(),
                     gdn_chunk_out_kernel<64, false>, gdn_chunk_out_kernel<64, true>, chunk_out_smem<64>());
}

}  // namespace lily::cuda::gdn_prefill_impl
