// The chunked Gated DeltaNet scans' first kernel (GdnScan::chunked and chunked_split, gdn_prefill.cuh): eq 18 in
// the WY / UT-transform form over chunks of 64 rows, G_i = sum of g up to row i within the chunk, S the state at the
// chunk's start. Unrolling the rows, e = U - W S with (I + A) e = beta v - beta exp(G) k S,
// A[i][j] = beta_i (k_i . k_j) exp(G_i - G_j) (j < i), T = (I + A)^-1, W = T (beta exp(G) k), U = T (beta v);
// o_i = exp(G_i) q_i S + sum_{j <= i} exp(G_i - G_j) (q_i . k_j) e_j; S <- exp(G_63) S + sum_j exp(G_63 - G_j) k_j e_j^T.
// This kernel forms what does not depend on S, for every (chunk, value head) in parallel; the scans then walk the
// chunks in order (gdn_chunk_scan.cu, gdn_chunk_state.cu). Products on the tensor cores in 3xTF32, T by forward
// substitution in fp32. Measured on the H200 (ncu, T = 4097, full geometry): 278 us; latency bound (the 64-step
// substitution by 2 warps).
#include "cuda/kernels/gdn_chunk_util.cuh"

namespace lily::cuda::gdn_prefill_impl {

namespace {

// Block (chunk c, value head h): the parts of chunk c that do not depend on the state (eq 18 over the chunk's 64
// rows, G = cumulative sum of g over the chunk, rows past T have k = q = v = 0, beta = 0, g = 0):
//   A[i][j] = beta_i (k_i . k_j) exp(G_i - G_j) (j < i), T = (I + A)^-1 by forward substitution in fp32;
//   W = T (beta exp(G) k) -> scratch w; U = T (beta v) -> over v (rows < T); P = (q k^T) exp(G_i - G_j) (j <= i)
//   -> scratch pqk; exp(G_i), exp(G_63 - G_i) -> scratch gk. The products on the tensor cores.
template <int D>
__global__ void __launch_bounds__(kThreads) gdn_chunk_prep_kernel(const __grid_constant__ GdnPrefillParams p, Scratch s) {
  constexpr int LD = D + 4;
  using FA = Frag<4>;
  using FB = Frag<2>;
  extern __shared__ __align__(16) float smem[];
  float* k_s = smem;                  // [64][LD] k_hat, then beta exp(G) k_hat
  float* q_s = k_s + kChunk * LD;     // [64][LD] q_hat, then beta v
  float* a_s = q_s + kChunk * LD;     // [64][kLdT] A
  float* t_s = a_s + kChunk * kLdT;   // [64][kLdT] T
  float* G = t_s + kChunk * kLdT;     // [64]
  float* beta = G + kChunk;           // [64]
  const int c = blockIdx.x, h = blockIdx.y, kh = h / (p.n_v / p.n_k);
  const int t0 = c * kChunk, n = min(kChunk, p.T - t0);
  const size_t value_dim = static_cast<size_t>(p.n_v) * D;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;

  for (int i = threadIdx.x; i < kChunk * D / 4; i += kThreads) {
    const int r = i / (D / 4), d = i % (D / 4) * 4;
    float4 q4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f), k4 = q4;
    if (r < n) {
      const size_t off = (static_cast<size_t>(t0 + r) * p.n_k + kh) * D + d;
      q4 = *reinterpret_cast<const float4*>(s.q + off);
      k4 = *reinterpret_cast<const float4*>(s.k + off);
    }
    *reinterpret_cast<float4*>(q_s + r * LD + d) = q4;
    *reinterpret_cast<float4*>(k_s + r * LD + d) = k4;
  }
  if (warp == 0) {  // G: lane l holds rows 2l, 2l+1; inclusive scan of the pair sums over the lanes
    float2 gg = make_float2(0.0f, 0.0f), bb = gg;
    if (2 * lane < n) {
      const float4 x = s.gates[static_cast<size_t>(t0 + 2 * lane) * p.n_v + h];
      gg.x = x.w, bb.x = x.x;
    }
    if (2 * lane + 1 < n) {
      const float4 x = s.gates[static_cast<size_t>(t0 + 2 * lane + 1) * p.n_v + h];
      gg.y = x.w, bb.y = x.x;
    }
    float incl = gg.x + gg.y;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float y = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += y;
    }
    float excl = __shfl_up_sync(0xffffffffu, incl, 1);
    if (lane == 0) excl = 0.0f;
    G[2 * lane] = excl + gg.x;
    G[2 * lane + 1] = (excl + gg.x) + gg.y;
    beta[2 * lane] = bb.x, beta[2 * lane + 1] = bb.y;
  }
  __syncthreads();

  // A (warps 0-3, k k^T) and P (warps 4-7, q k^T): warp rows 16 mt.., the 8 column tiles up to the diagonal.
  {
    const int r0 = (warp & 3) * 16;
    const float* a_src = warp < 4 ? k_s : q_s;
    float acc[kChunk / 8][4] = {};
    for (int k0 = 0; k0 < D; k0 += 8) {
      const FA af({a_src[(r0 + g) * LD + k0 + t], a_src[(r0 + g + 8) * LD + k0 + t], a_src[(r0 + g) * LD + k0 + t + 4],
                   a_src[(r0 + g + 8) * LD + k0 + t + 4]});
#pragma unroll
      for (int nt = 0; nt < kChunk / 8; ++nt)
        if (nt * 8 < r0 + 16) mma(acc[nt], af, FB({k_s[(nt * 8 + g) * LD + k0 + t], k_s[(nt * 8 + g) * LD + k0 + t + 4]}));
    }
    float* pqk = s.pqk + (static_cast<size_t>(c) * p.n_v + h) * kChunk * kChunk;
#pragma unroll
    for (int nt = 0; nt < kChunk / 8; ++nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = r0 + g + hf * 8, j = nt * 8 + 2 * t;
        const float x0 = acc[nt][2 * hf], x1 = acc[nt][2 * hf + 1];
        if (warp < 4) {
          a_s[i * kLdT + j] = j < i ? beta[i] * expf(G[i] - G[j]) * x0 : 0.0f;
          a_s[i * kLdT + j + 1] = j + 1 < i ? beta[i] * expf(G[i] - G[j + 1]) * x1 : 0.0f;
        } else {
          const float2 v2 = make_float2(j <= i ? expf(G[i] - G[j]) * x0 : 0.0f,
                                        j + 1 <= i ? expf(G[i] - G[j + 1]) * x1 : 0.0f);
          *reinterpret_cast<float2*>(pqk + i * kChunk + j) = v2;
        }
      }
  }
  __syncthreads();

  if (warp < 2) {
    // T = (I + A)^-1, column `col` per thread: T[i][col] = [i == col] - sum_{j < i} A[i][j] T[j][col] (T[j][col] = 0
    // for j < col, so the sum may run over every j < i).
    const int col = threadIdx.x;
    float x[kChunk];
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma unroll
      for (int j = 0; j + 4 <= i; j += 4) {
        const float4 a = *reinterpret_cast<const float4*>(a_s + i * kLdT + j);
        s0 = fmaf(a.x, x[j], s0), s1 = fmaf(a.y, x[j + 1], s1), s2 = fmaf(a.z, x[j + 2], s2), s3 = fmaf(a.w, x[j + 3], s3);
      }
#pragma unroll
      for (int j = i / 4 * 4; j < i; ++j) s0 = fmaf(a_s[i * kLdT + j], x[j], s0);
      x[i] = i == col ? 1.0f : i < col ? 0.0f : -((s0 + s1) + (s2 + s3));
    }
#pragma unroll
    for (int i = 0; i < kChunk; ++i) t_s[i * kLdT + col] = x[i];
  } else {
    // Meanwhile: beta v over q_s, beta exp(G) k over k_s, and the decay factors for the scan.
    for (int i = threadIdx.x - 64; i < kChunk * D / 4; i += kThreads - 64) {
      const int r = i / (D / 4), d = i % (D / 4) * 4;
      float4 v4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (r < n) v4 = *reinterpret_cast<const float4*>(s.v + static_cast<size_t>(t0 + r) * value_dim + h * D + d);
      const float b = beta[r], bg = b * expf(G[r]);
      *reinterpret_cast<float4*>(q_s + r * LD + d) = make_float4(b * v4.x, b * v4.y, b * v4.z, b * v4.w);
      float4* k4 = reinterpret_cast<float4*>(k_s + r * LD + d);
      const float4 kk = *k4;
      *k4 = make_float4(bg * kk.x, bg * kk.y, bg * kk.z, bg * kk.w);
    }
    float* gk = s.gk + (static_cast<size_t>(c) * p.n_v + h) * 2 * kChunk;
    for (int i = threadIdx.x - 64; i < kChunk; i += kThreads - 64) {
      gk[i] = expf(G[i]);
      gk[kChunk + i] = expf(G[kChunk - 1] - G[i]);
    }
  }
  __syncthreads();

  // W = T (beta exp(G) k) (warps 0-3) and U = T (beta v) (warps 4-7); T is lower triangular, so rows 16 mt.. need
  // columns j < 16 (mt + 1) only.
  {
    const int r0 = (warp & 3) * 16;
    const float* b_src = warp < 4 ? k_s : q_s;
    float acc[D / 8][4] = {};
    for (int k0 = 0; k0 < r0 + 16; k0 += 8) {
      const FA af({t_s[(r0 + g) * kLdT + k0 + t], t_s[(r0 + g + 8) * kLdT + k0 + t], t_s[(r0 + g) * kLdT + k0 + t + 4],
                   t_s[(r0 + g + 8) * kLdT + k0 + t + 4]});
#pragma unroll
      for (int nt = 0; nt < D / 8; ++nt)
        mma(acc[nt], af, FB({b_src[(k0 + t) * LD + nt * 8 + g], b_src[(k0 + t + 4) * LD + nt * 8 + g]}));
    }
    float* w = s.w + (static_cast<size_t>(c) * p.n_v + h) * kChunk * D;
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = r0 + g + hf * 8, j = nt * 8 + 2 * t;
        const float2 v2 = make_float2(acc[nt][2 * hf], acc[nt][2 * hf + 1]);
        if (warp < 4) *reinterpret_cast<float2*>(w + i * D + j) = v2;
        else if (i < n) *reinterpret_cast<float2*>(s.v + static_cast<size_t>(t0 + i) * value_dim + h * D + j) = v2;
      }
  }
}

}  // namespace

cudaError_t chunk_prep(const GdnPrefillParams& p, const Scratch& s, cudaStream_t stream) {
  auto run = [&](auto kernel, size_t smem) {
    CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    kernel<<<dim3((p.T + kChunk - 1) / kChunk, p.n_v), kThreads, smem, stream>>>(p, s);
    return cudaGetLastError();
  };
  return p.d_k == 128 ? run(gdn_chunk_prep_kernel<128>, chunk_prep_smem<128>())
                      : run(gdn_chunk_prep_kernel<64>, chunk_prep_smem<64>());
}

}  // namespace lily::cuda::gdn_prefill_impl
