// GdnScan::sequential (gdn_prefill.cuh): the gated delta rule (eq 18 of docs/MODEL.md) row after row over the T
// rows, with S in registers. Columns of S are independent (e_j and S[:, j] depend only on column j), so block (h, c)
// owns the 32 columns c*32.. of value head h (n_v * d_v / 32 blocks: 128 at full geometry). Per row and column:
// sk = sum_i S[i,j] k_i and sq = sum_i S[i,j] q_i over d_k, split over 8 lanes a column and reduced with
// log2(8) butterfly levels (every lane has e, no broadcast); e = (v_j - decay*sk) * beta; o_j = decay*sq +
// e (k_hat.q_hat) (= S_new^T q_hat, as gdn.cu); S[:, j] <- decay*S[:, j] + k e. The row inputs are staged 16 rows at
// a time into shared memory by cp.async, double buffered (one barrier per 16 rows). o goes to scratch [T, n_v*d_v].
// The default below 256 rows (and for d_k != d_v): latency bound, 4 dependent fp32 instructions per element of S
// per row (>= 124 cycles a row at full geometry), which is why longer chunks take the chunked scans.
#include "cuda/kernels/gdn_prefill_util.cuh"

namespace lily::cuda::gdn_prefill_impl {

namespace {

constexpr int kLanesPerCol = 8;

template <int DK>
struct Stage {
  float q[kRowsPerStage][DK];
  float k[kRowsPerStage][DK];
  float v[kRowsPerStage][kCols];
  float4 g[kRowsPerStage];
};

// Rows chunk*kRowsPerStage.. of the scan inputs of block (h, j0) into `st` (cp.async, one commit group).
template <int DK, int kNThreads>
__device__ __forceinline__ void stage_rows_async(const GdnPrefillParams& p, const Scratch& s, Stage<DK>& st, int chunk,
                                                 int h, int kh, int j0) {
  const int t0 = chunk * kRowsPerStage, n = min(kRowsPerStage, p.T - t0);
  const size_t value_dim = static_cast<size_t>(p.n_v) * p.d_v;
  constexpr int kVec = DK / 4, kPerRow = 2 * kVec + kCols / 4 + 1;
  for (int i = threadIdx.x; i < n * kPerRow; i += kNThreads) {
    const int r = i / kPerRow, u = i % kPerRow, t = t0 + r;
    const size_t qk = (static_cast<size_t>(t) * p.n_k + kh) * DK;
    if (u < kVec) cp_async16(&st.q[r][u * 4], s.q + qk + u * 4);
    else if (u < 2 * kVec) cp_async16(&st.k[r][(u - kVec) * 4], s.k + qk + (u - kVec) * 4);
    else if (u < 2 * kVec + kCols / 4)
      cp_async16(&st.v[r][(u - 2 * kVec) * 4], s.v + t * value_dim + h * p.d_v + j0 + (u - 2 * kVec) * 4);
    else cp_async16(&st.g[r], s.gates + static_cast<size_t>(t) * p.n_v + h);
  }
  cp_async_commit();
}

// L lanes per column (L = 8: measured fastest of 2-16 lanes and of the warp-per-columns layouts on the H200), each holding RL = DK / L rows of it, so a row's two sums need only log2(L) butterfly
// levels and every lane of the column gets e itself (no broadcast). The block's 32 columns are L warps of 32 / L
// columns; lane = c * L + g holds rows m*4L + g*4 + u (m < RL/4, u < 4) of column c: the L lanes' float4 reads
// of k and q are contiguous (no bank conflicts).
template <int DK, int L>
__global__ void __launch_bounds__(32 * L) gdn_scan_cols_kernel(const __grid_constant__ GdnPrefillParams p, Scratch s) {
  constexpr int RL = DK / L, M = RL / 4, CPW = 32 / L, kNThreads = 32 * L;
  static_assert(M >= 1 && RL % 4 == 0);
  __shared__ __align__(16) Stage<DK> st[2];
  __shared__ float o_s[kRowsPerStage][kCols];
  const int col_blocks = p.d_v / kCols;
  const int h = blockIdx.x / col_blocks, j0 = (blockIdx.x % col_blocks) * kCols;
  const int kh = h / (p.n_v / p.n_k);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane % L, col = warp * CPW + lane / L;
  const int value_dim = p.n_v * p.d_v;

  const int n_chunks = (p.T + kRowsPerStage - 1) / kRowsPerStage;
  stage_rows_async<DK, kNThreads>(p, s, st[0], 0, h, kh, j0);

  float S[M][4];
  float* S_g = p.S + static_cast<size_t>(h) * DK * p.d_v + j0 + col;
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int u = 0; u < 4; ++u) S[m][u] = S_g[static_cast<size_t>(m * 4 * L + g * 4 + u) * p.d_v];

  for (int chunk = 0; chunk < n_chunks; ++chunk) {
    const int buf = chunk & 1;
    if (chunk + 1 < n_chunks) {
      stage_rows_async<DK, kNThreads>(p, s, st[buf ^ 1], chunk + 1, h, kh, j0);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // stage `buf` visible to every warp
    const Stage<DK>& in = st[buf];
    const int n = min(kRowsPerStage, p.T - chunk * kRowsPerStage);
    float4 k[M], q[M];
#pragma unroll
    for (int m = 0; m < M; ++m) {
      k[m] = *reinterpret_cast<const float4*>(&in.k[0][m * 4 * L + g * 4]);
      q[m] = *reinterpret_cast<const float4*>(&in.q[0][m * 4 * L + g * 4]);
    }
    for (int r = 0; r < n; ++r) {
      const float4 gt = in.g[r];
      const float v = in.v[r][col];
      float sk0 = 0.0f, sk1 = 0.0f, sq0 = 0.0f, sq1 = 0.0f;
#pragma unroll
      for (int m = 0; m < M; ++m) {
        sk0 = fmaf(S[m][0], k[m].x, sk0), sk1 = fmaf(S[m][1], k[m].y, sk1);
        sq0 = fmaf(S[m][0], q[m].x, sq0), sq1 = fmaf(S[m][1], q[m].y, sq1);
        sk0 = fmaf(S[m][2], k[m].z, sk0), sk1 = fmaf(S[m][3], k[m].w, sk1);
        sq0 = fmaf(S[m][2], q[m].z, sq0), sq1 = fmaf(S[m][3], q[m].w, sq1);
      }
      float sk = sk0 + sk1, sq = sq0 + sq1;
      // The next row's k and q while this one reduces.
      const int rn = r + 1 < n ? r + 1 : r;
      float4 k_next[M], q_next[M];
#pragma unroll
      for (int m = 0; m < M; ++m) {
        k_next[m] = *reinterpret_cast<const float4*>(&in.k[rn][m * 4 * L + g * 4]);
        q_next[m] = *reinterpret_cast<const float4*>(&in.q[rn][m * 4 * L + g * 4]);
      }
#pragma unroll
      for (int off = L / 2; off > 0; off >>= 1) {
        sk += __shfl_xor_sync(0xffffffffu, sk, off);
        sq += __shfl_xor_sync(0xffffffffu, sq, off);
      }
      const float beta = gt.x, decay = gt.y, kq = gt.z;
      const float e = (v - decay * sk) * beta;
      if (g == 0) o_s[r][col] = decay * sq + e * kq;
#pragma unroll
      for (int m = 0; m < M; ++m) {
        S[m][0] = fmaf(S[m][0], decay, k[m].x * e), S[m][1] = fmaf(S[m][1], decay, k[m].y * e);
        S[m][2] = fmaf(S[m][2], decay, k[m].z * e), S[m][3] = fmaf(S[m][3], decay, k[m].w * e);
        k[m] = k_next[m], q[m] = q_next[m];
      }
    }
    __syncthreads();  // o_s complete; stage `buf` free for the next prefetch
    const int t0 = chunk * kRowsPerStage;
    for (int i = threadIdx.x; i < n * kCols; i += kNThreads)
      s.o[static_cast<size_t>(t0 + i / kCols) * value_dim + h * p.d_v + j0 + i % kCols] = o_s[i / kCols][i % kCols];
  }
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int u = 0; u < 4; ++u) S_g[static_cast<size_t>(m * 4 * L + g * 4 + u) * p.d_v] = S[m][u];
}

}  // namespace

cudaError_t scan_rows(const GdnPrefillParams& p, const Scratch& s, cudaStream_t stream) {
  const dim3 grid(p.n_v * (p.d_v / kCols));
  if (p.d_k == 128) gdn_scan_cols_kernel<128, kLanesPerCol><<<grid, 32 * kLanesPerCol, 0, stream>>>(p, s);
  else gdn_scan_cols_kernel<64, kLanesPerCol><<<grid, 32 * kLanesPerCol, 0, stream>>>(p, s);
  return cudaGetLastError();
}

}  // namespace lily::cuda::gdn_prefill_impl
