// GdnScan::chunked (gdn_prefill.cuh; the default from 256 to 511 rows): after gdn_chunk_prep.cu, the chunks of 64
// rows in order per (value head, 32 columns of S; 8 warps) with S in registers: V' = U - W S; O = (exp(G) q) S +
// P V' -> scratch o; S <- exp(G_63) S + (exp(G_63 - G) k)^T V'. 3xTF32 on the tensor cores (fp32 accuracy).
// Measured on the H200 (ncu, T = 4097, full geometry): 565 us against 1.19-1.39 ms for the sequential scan; the
// whole call 0.093 ms vs 0.099 ms at 256 rows, slower below. Latency bound: one block of 8 warps per SM through
// 3 dependent products per chunk, far from the tensor cores' rate.
#include "cuda/kernels/gdn_chunk_util.cuh"

namespace lily::cuda::gdn_prefill_impl {

namespace {

constexpr int kScanWarps = 8;

template <int D>
constexpr size_t chunk_scan_smem() {
  constexpr int LDC = kChunkCols + 8;
  return sizeof(float) * (2 * kChunk * (D + 4) + kChunk * (D + 8) + kChunk * kLdT + 2 * kChunk * LDC + D * LDC +
                          2 * kChunk);
}

// Block (value head h, columns j0 .. j0 + 32 of S), NW warps (8): the chunks in order with the state
// S[:, j0..] in registers (fp32, the accumulator fragments of its update) and a copy in shared memory as an operand:
//   V' = U - W S; O = (exp(G) q) S + P V' -> scratch o; S <- exp(G_63) S + (exp(G_63 - G) k)^T V'.
// Warp (mt = warp % 4, ch = warp / 4) owns rows 16 mt.. of V' and O and rows D/4 mt.. of S, columns CW ch.. of the
// block's (CW = 32 / (NW / 4)). The inputs of chunk c + 1 arrive by cp.async in two groups while chunk c computes:
// W, U during O and the state update, q, P, k and the exp factors during V'.
template <int D, int NW>
__global__ void __launch_bounds__(NW * 32) gdn_chunk_scan_kernel(const __grid_constant__ GdnPrefillParams p, Scratch s) {
  constexpr int kNThreads = NW * 32, NC = kChunkCols, CW = NC / (NW / 4), NT = CW / 8;
  constexpr int LDA = D + 4, LDK = D + 8, LDC = NC + 8, MS = D / 64;
  using FA = Frag<4>;
  using FB = Frag<2>;
  extern __shared__ __align__(16) float smem[];
  float* w_s = smem;                  // [64][LDA] W
  float* q_s = w_s + kChunk * LDA;    // [64][LDA] q_hat
  float* k_s = q_s + kChunk * LDA;    // [64][LDK] k_hat
  float* p_s = k_s + kChunk * LDK;    // [64][kLdT] P
  float* u_s = p_s + kChunk * kLdT;   // [64][LDC] U
  float* v_s = u_s + kChunk * LDC;    // [64][LDC] V'
  float* s_s = v_s + kChunk * LDC;    // [D][LDC] S
  float* gk_s = s_s + D * LDC;        // [128] exp(G_i) | exp(G_63 - G_i)
  const int col_blocks = D / NC, h = blockIdx.x / col_blocks, j0 = blockIdx.x % col_blocks * NC;
  const int kh = h / (p.n_v / p.n_k), nc = (p.T + kChunk - 1) / kChunk;
  const size_t value_dim = static_cast<size_t>(p.n_v) * D;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int r0 = (warp & 3) * 16, rs = (warp & 3) * 16 * MS, c0 = warp / 4 * CW;
  const float4 zero4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);

  auto load_wu = [&](int c) {
    if (c < nc) {
      const int t0 = c * kChunk, n = min(kChunk, p.T - t0);
      const float* w = s.w + (static_cast<size_t>(c) * p.n_v + h) * kChunk * D;
      for (int i = threadIdx.x; i < kChunk * D / 4; i += kNThreads) {
        const int r = i / (D / 4), d = i % (D / 4) * 4;
        cp_async16(w_s + r * LDA + d, w + r * D + d);
      }
      for (int i = threadIdx.x; i < kChunk * NC / 4; i += kNThreads) {
        const int r = i / (NC / 4), d = i % (NC / 4) * 4;
        if (r < n) cp_async16(u_s + r * LDC + d, s.v + static_cast<size_t>(t0 + r) * value_dim + h * D + j0 + d);
        else *reinterpret_cast<float4*>(u_s + r * LDC + d) = zero4;
      }
    }
    cp_async_commit();
  };
  auto load_qpk = [&](int c) {
    if (c < nc) {
      const int t0 = c * kChunk, n = min(kChunk, p.T - t0);
      for (int i = threadIdx.x; i < kChunk * D / 4; i += kNThreads) {
        const int r = i / (D / 4), d = i % (D / 4) * 4;
        if (r < n) {
          const size_t off = (static_cast<size_t>(t0 + r) * p.n_k + kh) * D + d;
          cp_async16(q_s + r * LDA + d, s.q + off);
          cp_async16(k_s + r * LDK + d, s.k + off);
        } else {
          *reinterpret_cast<float4*>(q_s + r * LDA + d) = zero4;
          *reinterpret_cast<float4*>(k_s + r * LDK + d) = zero4;
        }
      }
      const float* pqk = s.pqk + (static_cast<size_t>(c) * p.n_v + h) * kChunk * kChunk;
      for (int i = threadIdx.x; i < kChunk * kChunk / 4; i += kNThreads) {
        const int r = i / (kChunk / 4), d = i % (kChunk / 4) * 4;
        cp_async16(p_s + r * kLdT + d, pqk + r * kChunk + d);
      }
      const float* gk = s.gk + (static_cast<size_t>(c) * p.n_v + h) * 2 * kChunk;
      for (int i = threadIdx.x; i < 2 * kChunk / 4; i += kNThreads) cp_async16(gk_s + i * 4, gk + i * 4);
    }
    cp_async_commit();
  };

  load_wu(0);
  load_qpk(0);
  float S[MS][NT][4];  // S[rs + 16 ms + g (+8)][j0 + c0 + 8 nt + 2t (+1)]
  float* S_g = p.S + static_cast<size_t>(h) * D * D + j0 + c0;
  auto store_state = [&]() {
#pragma unroll
    for (int ms = 0; ms < MS; ++ms)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf)
          *reinterpret_cast<float2*>(s_s + (rs + 16 * ms + g + 8 * hf) * LDC + c0 + 8 * nt + 2 * t) =
              make_float2(S[ms][nt][2 * hf], S[ms][nt][2 * hf + 1]);
  };
#pragma unroll
  for (int ms = 0; ms < MS; ++ms)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const float2 x = *reinterpret_cast<const float2*>(S_g + static_cast<size_t>(rs + 16 * ms + g + 8 * hf) * D + 8 * nt + 2 * t);
        S[ms][nt][2 * hf] = x.x, S[ms][nt][2 * hf + 1] = x.y;
      }
  store_state();

  for (int c = 0; c < nc; ++c) {
    const int t0 = c * kChunk, n = min(kChunk, p.T - t0);
    cp_async_wait<1>();  // W, U of chunk c
    __syncthreads();     // ... and S in s_s visible to every warp
    {  // V' = U - W S
      float acc[NT][4] = {};
#pragma unroll 4
      for (int k0 = 0; k0 < D; k0 += 8) {
        const FA af({w_s[(r0 + g) * LDA + k0 + t], w_s[(r0 + g + 8) * LDA + k0 + t], w_s[(r0 + g) * LDA + k0 + t + 4],
                     w_s[(r0 + g + 8) * LDA + k0 + t + 4]});
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          mma(acc[nt], af, FB({s_s[(k0 + t) * LDC + c0 + 8 * nt + g], s_s[(k0 + t + 4) * LDC + c0 + 8 * nt + g]}));
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int off = (r0 + g + 8 * hf) * LDC + c0 + 8 * nt + 2 * t;
          const float2 u = *reinterpret_cast<const float2*>(u_s + off);
          *reinterpret_cast<float2*>(v_s + off) = make_float2(u.x - acc[nt][2 * hf], u.y - acc[nt][2 * hf + 1]);
        }
    }
    __syncthreads();  // V' complete; w_s, u_s free
    load_wu(c + 1);
    cp_async_wait<1>();  // q, k, P, exp factors of chunk c
    __syncthreads();
    {  // O = (exp(G) q) S + P V' (P lower triangular: columns j < r0 + 16)
      float acc[NT][4] = {};
      const float gm0 = gk_s[r0 + g], gm1 = gk_s[r0 + g + 8];
#pragma unroll 4
      for (int k0 = 0; k0 < D; k0 += 8) {
        const FA af({q_s[(r0 + g) * LDA + k0 + t] * gm0, q_s[(r0 + g + 8) * LDA + k0 + t] * gm1,
                     q_s[(r0 + g) * LDA + k0 + t + 4] * gm0, q_s[(r0 + g + 8) * LDA + k0 + t + 4] * gm1});
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          mma(acc[nt], af, FB({s_s[(k0 + t) * LDC + c0 + 8 * nt + g], s_s[(k0 + t + 4) * LDC + c0 + 8 * nt + g]}));
      }
#pragma unroll 2
      for (int k0 = 0; k0 < r0 + 16; k0 += 8) {
        const FA af({p_s[(r0 + g) * kLdT + k0 + t], p_s[(r0 + g + 8) * kLdT + k0 + t], p_s[(r0 + g) * kLdT + k0 + t + 4],
                     p_s[(r0 + g + 8) * kLdT + k0 + t + 4]});
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          mma(acc[nt], af, FB({v_s[(k0 + t) * LDC + c0 + 8 * nt + g], v_s[(k0 + t + 4) * LDC + c0 + 8 * nt + g]}));
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = r0 + g + 8 * hf;
          if (i < n)
            *reinterpret_cast<float2*>(s.o + static_cast<size_t>(t0 + i) * value_dim + h * D + j0 + c0 + 8 * nt + 2 * t) =
                make_float2(acc[nt][2 * hf], acc[nt][2 * hf + 1]);
        }
    }
    {  // S <- exp(G_63) S + (exp(G_63 - G) k)^T V'
      const float decay = gk_s[kChunk - 1];
#pragma unroll
      for (int ms = 0; ms < MS; ++ms)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) S[ms][nt][e] *= decay;
#pragma unroll 2
      for (int k0 = 0; k0 < kChunk; k0 += 8) {
        const float f0 = gk_s[kChunk + k0 + t], f1 = gk_s[kChunk + k0 + t + 4];
#pragma unroll
        for (int ms = 0; ms < MS; ++ms) {
          const int d = rs + 16 * ms + g;
          const FA af({k_s[(k0 + t) * LDK + d] * f0, k_s[(k0 + t) * LDK + d + 8] * f0, k_s[(k0 + t + 4) * LDK + d] * f1,
                       k_s[(k0 + t + 4) * LDK + d + 8] * f1});
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
            mma(S[ms][nt], af, FB({v_s[(k0 + t) * LDC + c0 + 8 * nt + g], v_s[(k0 + t + 4) * LDC + c0 + 8 * nt + g]}));
        }
      }
    }
    __syncthreads();  // every warp done with s_s, q_s, k_s, p_s, v_s
    store_state();
    load_qpk(c + 1);
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

}  // namespace

cudaError_t scan_chunked(const GdnPrefillParams& p, const Scratch& s, cudaStream_t stream) {
  auto run = [&](auto kernel, int d, size_t smem) {
    CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    kernel<<<p.n_v * (d / kChunkCols), kScanWarps * 32, smem, stream>>>(p, s);
    return cudaGetLastError();
  };
  return p.d_k == 128 ? run(gdn_chunk_scan_kernel<128, kScanWarps>, 128, chunk_scan_smem<128>())
                      : run(gdn_chunk_scan_kernel<64, kScanWarps>, 64, chunk_scan_smem<64>());
}

}  // namespace lily::cuda::gdn_prefill_impl
