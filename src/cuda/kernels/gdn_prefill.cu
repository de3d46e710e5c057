// Gated DeltaNet prefill for T rows of one layer (gdn_prefill.cuh), eqs 14-19 of shared/MODEL.md with exactly the
// arithmetic of the decode step (gdn.cu) row after row, so a prefill chunk, further chunks and decode steps continue
// one another. Three kernels in one stream:
//
// 1. gdn_prep, block (8 rows, key head kh): eq 14 conv + SiLU of q and k of key head kh and v of its value heads:
//    cc[ch] = silu(sum_k w[ch,k] * c_{p-K+1+k}[ch]) for p = pos0 + t, history rows from proj where t-K+1+k >= 0,
//    else from the ring (position p' in slot p' mod K; zero-initialised, so p' < 0 reads zeros); eq 16
//    q_hat = q / sqrt(|q|^2 + 1e-6) / sqrt(d_k), k_hat = k / sqrt(|k|^2 + 1e-6) and k_hat . q_hat as gdn.cu forms
//    them; eq 17 beta = sigmoid(b_h), decay = exp(-exp(A_log_h) * softplus(a_h + dt_bias_h)). Into scratch:
//    q_hat, k_hat [T, n_k, d_k], v [T, n_v*d_v], gates [T, n_v] x {beta, decay, k_hat.q_hat, 0}.
// 2. The gated delta rule (eq 18) as a sequential scan over the T rows with S in registers. Columns of S are
//    independent (e_j and S[:, j] depend only on column j), so block (h, c) owns the 32 columns c*32.. of value
//    head h (n_v * d_v / 32 blocks: 128 at full geometry). Per row and column: sk = sum_i S[i,j] k_i and
//    sq = sum_i S[i,j] q_i over d_k, split across lanes and reduced with shuffles; e = (v_j - decay*sk) * beta;
//    o_j = decay*sq + e (k_hat.q_hat) (= S_new^T q_hat, as gdn.cu); S[:, j] <- decay*S[:, j] + k e. Two layouts
//    (GdnPrefillParams::scan_variant; all give the same results to fp32 rounding):
//      gdn_scan_kernel: the 32 lanes of a warp span d_k (d_k/32 rows each), a warp owns CPW = 2, 4 or 8 columns;
//        the 2*CPW sums are reduce-scattered over the lanes, e broadcast back (log2(64/CPW)+1+CPW shuffles).
//      gdn_scan_cols_kernel (the default, L = 8): L lanes per column, d_k/L rows each; log2(L) butterfly levels for
//        the two sums and every lane has e (2 log2(L) shuffles, no broadcast).
//    The row inputs are staged 16 rows at a time into shared memory by cp.async, double buffered (one barrier per
//    16 rows), and the next row's k/q are read while the current row reduces. o goes to scratch [T, n_v*d_v] fp32.
// 3. gdn_norm, block per row: eq 19 x = norm_w * o / RMS(o_head) * silu(z) in bf16 (as gdn.cu's fused norm), and the
//    rows t >= T-K copy their pre-conv vector into ring slot (pos0+t) mod K (after kernel 1 has read the ring).
//
// Traffic (full geometry, per row): proj 49 KB read, scratch ~2 * 49 KB written and read, 8 KB bf16 out; S (2 MiB)
// read and written once per call. The scan does 8 FLOPs per element of S per row, 4.2 MFLOP per row (17 GFLOP at
// T = 4096) as 4 dependent fp32 instructions per element (2 dot FMAs, a multiply and an FMA for the update): at
// 128 FP32 lanes x 132 SMs that is >= 124 cycles per row, ~0.27 ms at T = 4096 even with perfect issue; the row
// chain (dots, shuffle levels, e, update) is latency bound on top of that. The chunked (WY / UT-transform)
// formulation on tensor cores is not implemented.

#include <cmath>

#include "cuda/kernels/gdn_prefill.cuh"

namespace lily::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kCols = 32;                     // columns of S per scan block
constexpr int kRowsPerStage = 16;             // rows staged into shared memory at a time
constexpr int kKernel = 4;
constexpr int kScanVariants = 6;  // GdnPrefillParams::scan_variant

__device__ __forceinline__ float silu_exact(float x) { return x / (1.0f + expf(-x)); }

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Scratch sections (each 256-byte aligned).
struct Scratch {
  float* q;      // [T, n_k, d_k] q_hat (with 1/sqrt(d_k))
  float* k;      // [T, n_k, d_k] k_hat
  float* v;      // [T, n_v*d_v] conv output of v
  float4* gates; // [T, n_v] {beta, decay, k_hat.q_hat, 0}
  float* o;      // [T, n_v*d_v] S^T q_hat before the norm
};

size_t align256(size_t b) { return (b + 255) / 256 * 256; }

Scratch carve(void* base, int T, int n_k, int n_v, int d_k, int d_v, size_t* total) {
  const size_t qk = align256(sizeof(float) * T * n_k * d_k), vo = align256(sizeof(float) * T * n_v * d_v),
               g = align256(sizeof(float4) * T * n_v);
  char* p = static_cast<char*>(base);
  Scratch s;
  s.q = reinterpret_cast<float*>(p);
  s.k = reinterpret_cast<float*>(p + qk);
  s.v = reinterpret_cast<float*>(p + 2 * qk);
  s.gates = reinterpret_cast<float4*>(p + 2 * qk + vo);
  s.o = reinterpret_cast<float*>(p + 2 * qk + vo + g);
  if (total) *total = 2 * qk + 2 * vo + g;
  return s;
}

// ---- kernel 1: conv, l2norm, gates ---------------------------------------------------------------------------
// Block (row group of kPrepRows rows, key head kh): each thread slides the K-tap window of its channels down the
// rows (each proj value loaded once per block), warp r reduces row r's |q|^2, |k|^2 and q.k.
constexpr int kPrepRows = kWarps;

template <int DK>
__global__ void __launch_bounds__(kThreads) gdn_prep_kernel(const __grid_constant__ GdnPrefillParams p, Scratch s) {
  __shared__ float q_s[kPrepRows][DK], k_s[kPrepRows][DK];
  __shared__ float norm_s[kPrepRows][3];
  const int t0 = blockIdx.x * kPrepRows, kh = blockIdx.y, rows = min(kPrepRows, p.T - t0);
  const int hpk = p.n_v / p.n_k, key_dim = p.n_k * DK, value_dim = p.n_v * p.d_v;
  const int conv_dim = 2 * key_dim + value_dim;
  const size_t stride = static_cast<size_t>(conv_dim) + value_dim + 2 * p.n_v;
  const int channels = 2 * DK + hpk * p.d_v;
  for (int c = threadIdx.x; c < channels; c += kThreads) {
    const int ch = c < DK ? kh * DK + c : c < 2 * DK ? key_dim + kh * DK + (c - DK) : 2 * key_dim + kh * hpk * p.d_v + (c - 2 * DK);
    float w[kKernel];
#pragma unroll
    for (int k = 0; k < kKernel; ++k) w[k] = p.conv_w[static_cast<size_t>(ch) * kKernel + k];
    float x[kKernel];  // x[k]: the pre-conv value at row t - K + 1 + k; rows < 0 are earlier positions (ring)
#pragma unroll
    for (int k = 0; k < kKernel - 1; ++k) {
      const int r = t0 - (kKernel - 1) + k;
      const int slot = ((p.pos0 + r) % kKernel + kKernel) % kKernel;
      x[k] = r >= 0 ? p.proj[static_cast<size_t>(r) * stride + ch] : p.conv_ring[static_cast<size_t>(slot) * conv_dim + ch];
    }
    for (int rr = 0; rr < rows; ++rr) {
      x[kKernel - 1] = p.proj[static_cast<size_t>(t0 + rr) * stride + ch];
      float acc = 0.0f;
#pragma unroll
      for (int k = 0; k < kKernel; ++k) acc += w[k] * x[k];
      const float y = silu_exact(acc);
      if (c < DK) q_s[rr][c] = y;
      else if (c < 2 * DK) k_s[rr][c - DK] = y;
      else s.v[static_cast<size_t>(t0 + rr) * value_dim + (ch - 2 * key_dim)] = y;
#pragma unroll
      for (int k = 0; k < kKernel - 1; ++k) x[k] = x[k + 1];
    }
  }
  __syncthreads();
  // Eq 16 (the sums as gdn.cu forms them: lane-strided partials, then warp_sum).
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp < rows) {
    float qq = 0.0f, kk = 0.0f, qk = 0.0f;
    for (int i = lane; i < DK; i += 32) {
      qq += q_s[warp][i] * q_s[warp][i];
      kk += k_s[warp][i] * k_s[warp][i];
      qk += q_s[warp][i] * k_s[warp][i];
    }
    qq = warp_sum(qq), kk = warp_sum(kk), qk = warp_sum(qk);
    if (lane == 0) {
      norm_s[warp][0] = 1.0f / sqrtf(qq + 1e-6f) * (1.0f / sqrtf(static_cast<float>(DK)));
      norm_s[warp][1] = 1.0f / sqrtf(kk + 1e-6f);
      norm_s[warp][2] = qk * norm_s[warp][0] * norm_s[warp][1];  // k_hat . q_hat
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < rows * DK; i += kThreads) {
    const int rr = i / DK, d = i % DK;
    const size_t off = (static_cast<size_t>(t0 + rr) * p.n_k + kh) * DK + d;
    s.q[off] = q_s[rr][d] * norm_s[rr][0];
    s.k[off] = k_s[rr][d] * norm_s[rr][1];
  }
  // Eq 17 for the value heads of kh.
  for (int i = threadIdx.x; i < rows * hpk; i += kThreads) {
    const int rr = i / hpk, h = kh * hpk + i % hpk, t = t0 + rr;
    const float* gates = p.proj + static_cast<size_t>(t) * stride + conv_dim + value_dim;  // [b (n_v) | a (n_v)]
    const float beta = 1.0f / (1.0f + expf(-gates[h]));
    const float a_in = gates[p.n_v + h] + p.dt_bias[h];
    const float softplus = a_in > 20.0f ? a_in : log1pf(expf(a_in));
    const float decay = expf(-expf(p.A_log[h]) * softplus);
    s.gates[static_cast<size_t>(t) * p.n_v + h] = make_float4(beta, decay, norm_s[rr][2], 0.0f);
  }
}

// ---- kernel 2: the sequential scan ----------------------------------------------------------------------------
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

template <int R>
__device__ __forceinline__ void load_rows(const float* src, float (&x)[R]) {
  if constexpr (R == 4) {
    const float4 f = *reinterpret_cast<const float4*>(src);
    x[0] = f.x, x[1] = f.y, x[2] = f.z, x[3] = f.w;
  } else {
    static_assert(R == 2);
    const float2 f = *reinterpret_cast<const float2*>(src);
    x[0] = f.x, x[1] = f.y;
  }
}

// Reduce-scatter of Count sums over the lanes, from lane bit M down: the lanes with the bit set keep the upper half
// of their sums and send the lower half (and vice versa), until one sum is left in acc[0].
template <int Count, int M>
__device__ __forceinline__ void reduce_scatter(float* acc, int lane) {
  if constexpr (Count > 1) {
    const bool up = lane & M;
#pragma unroll
    for (int i = 0; i < Count / 2; ++i) {
      const float send = up ? acc[i] : acc[i + Count / 2], keep = up ? acc[i + Count / 2] : acc[i];
      acc[i] = keep + __shfl_xor_sync(0xffffffffu, send, M);
    }
    reduce_scatter<Count / 2, M / 2>(acc, lane);
  }
}

// Block of 32 columns: 32 / CPW warps of CPW columns each.
template <int DK, int CPW>
__global__ void __launch_bounds__(32 * kCols / CPW) gdn_scan_kernel(const __grid_constant__ GdnPrefillParams p, Scratch s) {
  constexpr int R = DK / 32, kNThreads = 32 * kCols / CPW;
  constexpr int kSums = 2 * CPW;                   // sk and sq of each column, reduced over the 32 lanes
  constexpr int kShift = CPW == 2 ? 3 : CPW == 4 ? 2 : 1;  // log2(32 / kSums): lanes (bits above) own one sum
  __shared__ __align__(16) Stage<DK> st[2];
  __shared__ float o_s[kRowsPerStage][kCols];
  const int col_blocks = p.d_v / kCols;
  const int h = blockIdx.x / col_blocks, j0 = (blockIdx.x % col_blocks) * kCols;
  const int kh = h / (p.n_v / p.n_k);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, c0 = warp * CPW;
  const int value_dim = p.n_v * p.d_v;

  auto stage_rows = [&](int chunk, int buf) { stage_rows_async<DK, kNThreads>(p, s, st[buf], chunk, h, kh, j0); };

  const int n_chunks = (p.T + kRowsPerStage - 1) / kRowsPerStage;
  stage_rows(0, 0);

  float S[R][CPW];
  float* S_g = p.S + (static_cast<size_t>(h) * DK + lane * R) * p.d_v + j0 + c0;
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int c = 0; c < CPW; ++c) S[r][c] = S_g[static_cast<size_t>(r) * p.d_v + c];
  const int my_col = (lane >> kShift) & (CPW - 1);  // the column whose sums this lane ends up with
  const bool is_sq = lane & 16;                     // ... its sq (else sk)

  for (int chunk = 0; chunk < n_chunks; ++chunk) {
    const int buf = chunk & 1;
    if (chunk + 1 < n_chunks) {
      stage_rows(chunk + 1, buf ^ 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // stage `buf` visible to every warp
    const Stage<DK>& in = st[buf];
    const int n = min(kRowsPerStage, p.T - chunk * kRowsPerStage);
    float k[R], q[R];
    load_rows<R>(&in.k[0][lane * R], k);
    load_rows<R>(&in.q[0][lane * R], q);
    float4 g = in.g[0];
    for (int r = 0; r < n; ++r) {
      float acc[kSums];  // [sk_0 .. sk_{CPW-1} | sq_0 .. sq_{CPW-1}]
#pragma unroll
      for (int c = 0; c < CPW; ++c) {
        float sk = 0.0f, sq = 0.0f;
#pragma unroll
        for (int i = 0; i < R; ++i) sk = fmaf(S[i][c], k[i], sk), sq = fmaf(S[i][c], q[i], sq);
        acc[c] = sk, acc[CPW + c] = sq;
      }
      // The next row's inputs while this one reduces.
      const int rn = r + 1 < n ? r + 1 : r;
      float k_next[R], q_next[R];
      load_rows<R>(&in.k[rn][lane * R], k_next);
      load_rows<R>(&in.q[rn][lane * R], q_next);
      const float4 g_next = in.g[rn];
      const float v = in.v[r][c0 + my_col];
      // Reduce-scatter over the lanes, then one full butterfly per remaining lane bit below kShift.
      reduce_scatter<kSums, 16>(acc, lane);
      float sum = acc[0];
#pragma unroll
      for (int m = (1 << kShift) / 2; m > 0; m >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, m);
      const float other = __shfl_xor_sync(0xffffffffu, sum, 16);
      const float sk = is_sq ? other : sum, sq = is_sq ? sum : other;
      const float beta = g.x, decay = g.y, kq = g.z;
      const float e = (v - decay * sk) * beta;
      if ((lane & (16 | ((1 << kShift) - 1))) == 0) o_s[r][c0 + my_col] = decay * sq + e * kq;
      float ec[CPW];
#pragma unroll
      for (int c = 0; c < CPW; ++c) ec[c] = __shfl_sync(0xffffffffu, e, c << kShift);
#pragma unroll
      for (int i = 0; i < R; ++i)
#pragma unroll
        for (int c = 0; c < CPW; ++c) S[i][c] = fmaf(S[i][c], decay, k[i] * ec[c]);
#pragma unroll
      for (int i = 0; i < R; ++i) k[i] = k_next[i], q[i] = q_next[i];
      g = g_next;
    }
    __syncthreads();  // o_s complete; stage `buf` free for the next prefetch
    const int t0 = chunk * kRowsPerStage;
    for (int i = threadIdx.x; i < n * kCols; i += kNThreads)
      s.o[static_cast<size_t>(t0 + i / kCols) * value_dim + h * p.d_v + j0 + i % kCols] = o_s[i / kCols][i % kCols];
  }
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int c = 0; c < CPW; ++c) S_g[static_cast<size_t>(r) * p.d_v + c] = S[r][c];
}

// Layout B: L lanes per column, each holding RL = DK / L rows of it, so a row's two sums need only log2(L) butterfly
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

// ---- kernel 3: gated RMSNorm (eq 19) and the conv ring ---------------------------------------------------------
__global__ void __launch_bounds__(kThreads) gdn_norm_kernel(const __grid_constant__ GdnPrefillParams p, Scratch s) {
  const int t = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int key_dim = p.n_k * p.d_k, value_dim = p.n_v * p.d_v, conv_dim = 2 * key_dim + value_dim;
  const size_t stride = static_cast<size_t>(conv_dim) + value_dim + 2 * p.n_v;
  const float* z = p.proj + static_cast<size_t>(t) * stride + conv_dim;
  const float* o = s.o + static_cast<size_t>(t) * value_dim;
  __nv_bfloat16* out = p.out + static_cast<size_t>(t) * value_dim;
  for (int h = warp; h < p.n_v; h += kWarps) {
    float ss = 0.0f;
    for (int j = lane; j < p.d_v; j += 32) ss += o[h * p.d_v + j] * o[h * p.d_v + j];
    ss = warp_sum(ss);
    const float inv_rms = rsqrtf(ss / static_cast<float>(p.d_v) + p.eps);
    for (int j = lane; j < p.d_v; j += 32)
      out[h * p.d_v + j] = __float2bfloat16(p.norm_w[j] * (o[h * p.d_v + j] * inv_rms) * siluf_(z[h * p.d_v + j]));
  }
  if (t >= p.T - kKernel) {  // the last K pre-conv vectors into the ring
    float* slot = p.conv_ring + static_cast<size_t>((p.pos0 + t) % kKernel) * conv_dim;
    const float* src = p.proj + static_cast<size_t>(t) * stride;
    for (int c = threadIdx.x; c < conv_dim; c += kThreads) slot[c] = src[c];
  }
}

template <int DK>
cudaError_t launch(const GdnPrefillParams& p, const Scratch& s, cudaStream_t stream) {
  gdn_prep_kernel<DK><<<dim3((p.T + kPrepRows - 1) / kPrepRows, p.n_k), kThreads, 0, stream>>>(p, s);
  CUDA_TRY(cudaGetLastError());
  const dim3 grid(p.n_v * (p.d_v / kCols));
  switch (p.scan_variant) {
    case 1: gdn_scan_kernel<DK, 2><<<grid, 32 * kCols / 2, 0, stream>>>(p, s); break;
    case 2: gdn_scan_kernel<DK, 4><<<grid, 32 * kCols / 4, 0, stream>>>(p, s); break;
    case 3: gdn_scan_kernel<DK, 8><<<grid, 32 * kCols / 8, 0, stream>>>(p, s); break;
    case 4: gdn_scan_cols_kernel<DK, 4><<<grid, 32 * 4, 0, stream>>>(p, s); break;
    case 6: gdn_scan_cols_kernel<DK, 16><<<grid, 32 * 16, 0, stream>>>(p, s); break;
    default: gdn_scan_cols_kernel<DK, 8><<<grid, 32 * 8, 0, stream>>>(p, s); break;
  }
  CUDA_TRY(cudaGetLastError());
  gdn_norm_kernel<<<p.T, kThreads, 0, stream>>>(p, s);
  return cudaGetLastError();
}

}  // namespace

size_t gdn_prefill_scratch_bytes(int T, int n_k, int n_v, int d_k, int d_v) {
  if (T <= 0 || n_k <= 0 || n_v <= 0 || d_k <= 0 || d_v <= 0) return 0;
  size_t total = 0;
  carve(nullptr, T, n_k, n_v, d_k, d_v, &total);
  return total;
}

cudaError_t gdn_prefill(const GdnPrefillParams& p, cudaStream_t stream) {
  if (!p.proj || !p.conv_ring || !p.conv_w || !p.A_log || !p.dt_bias || !p.S || !p.norm_w || !p.out || !p.scratch)
    return cudaErrorInvalidValue;
  if (p.T < 1 || p.pos0 < 0 || p.kernel != kKernel) return cudaErrorInvalidValue;
  if (p.scan_variant < 0 || p.scan_variant > kScanVariants) return cudaErrorInvalidValue;
  if (p.d_k != 64 && p.d_k != 128) return cudaErrorInvalidValue;
  if (p.d_v <= 0 || p.d_v % kCols != 0) return cudaErrorInvalidValue;
  if (p.n_k <= 0 || p.n_v <= 0 || p.n_v % p.n_k != 0) return cudaErrorInvalidValue;
  if (p.scratch_bytes < gdn_prefill_scratch_bytes(p.T, p.n_k, p.n_v, p.d_k, p.d_v)) return cudaErrorInvalidValue;
  const Scratch s = carve(p.scratch, p.T, p.n_k, p.n_v, p.d_k, p.d_v, nullptr);
  return p.d_k == 128 ? launch<128>(p, s, stream) : launch<64>(p, s, stream);
}

}  // namespace lily::cuda
