// Gated DeltaNet prefill for T rows of one layer (gdn_prefill.cuh), eqs 14-19 of shared/MODEL.md with exactly the
// arithmetic of the decode step (gdn.cu) row after row, so a prefill chunk, further chunks and decode steps continue
// one another. Three kernels in one stream:
//
// 1. gdn_prep, block (t, kh) per row and key head: eq 14 conv + SiLU of q and k of key head kh and v of its value
//    heads: cc[ch] = silu(sum_k w[ch,k] * c_{p-K+1+k}[ch]) for p = pos0 + t, history rows from proj where
//    t-K+1+k >= 0, else from the ring (position p' in slot p' mod K; zero-initialised, so p' < 0 reads zeros);
//    eq 16 q_hat = q / sqrt(|q|^2 + 1e-6) / sqrt(d_k), k_hat = k / sqrt(|k|^2 + 1e-6) and k_hat . q_hat as gdn.cu
//    forms it; eq 17 beta = sigmoid(b_h), decay = exp(-exp(A_log_h) * softplus(a_h + dt_bias_h)). Into scratch:
//    q_hat, k_hat [T, n_k, d_k], v [T, n_v*d_v], gates [T, n_v] x {beta, decay, k_hat.q_hat, 0}.
// 2. gdn_scan, the gated delta rule (eq 18) as a sequential scan over the T rows with S in registers. Columns of S
//    are independent (e_j and S[:, j] depend only on column j), so block (h, c) owns the 32 columns c*32.. of value
//    head h; warp w of its 8 owns 4 columns and lane l rows l*R .. l*R+R-1 of them (R = d_k / 32), S[R][4] in
//    registers. Per row: sk_c = sum_i S[i,c] k_i and sq_c = sum_i S[i,c] q_i (8 partial sums per lane), one
//    reduce-scatter over the 32 lanes (shuffles 4+2+1+1+1), e_c = (v_c - decay*sk_c) * beta,
//    o_c = decay*sq_c + e_c (k_hat.q_hat) (= S_new^T q_hat, as gdn.cu), e broadcast (4 shuffles), and
//    S <- decay*S + k e^T. The row inputs are staged for 16 rows at a time into shared memory by cp.async, double
//    buffered (one barrier per 16 rows), and the next row's k/q/gates are read while the current row reduces.
//    o goes to scratch [T, n_v*d_v] fp32.
// 3. gdn_norm, block per row: eq 19 x = norm_w * o / RMS(o_head) * silu(z) in bf16 (as gdn.cu's fused norm), and the
//    rows t >= T-K copy their pre-conv vector into ring slot (pos0+t) mod K (after kernel 1 has read the ring).
//
// Traffic (full geometry, per row): proj 49 KB read (q|k|v twice: conv and ring rows are re-read from cache), scratch
// written/read ~ 2*(16 + 16 + 0.5) KB, the bf16 output 8 KB; S (2 MiB) read and written once per call. FLOPs of the
// scan: 8 per element of S per row = 4.2 MFLOP per row (17 GFLOP at T = 4096): the scan is latency/issue bound, one
// row's dependent chain (two dot products, 5 shuffle levels, the update) per ~200 cycles.
#include <cmath>

#include "cuda/kernels/gdn_prefill.cuh"

namespace lily::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kCols = 32;                     // columns of S per scan block
constexpr int kRowsPerStage = 16;             // rows staged into shared memory at a time
constexpr int kKernel = 4;

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
template <int DK>
__global__ void __launch_bounds__(kThreads) gdn_prep_kernel(const __grid_constant__ GdnPrefillParams p, Scratch s) {
  __shared__ float q_s[DK], k_s[DK];
  __shared__ float norm_s[3];
  const int t = blockIdx.x, kh = blockIdx.y;
  const int hpk = p.n_v / p.n_k, key_dim = p.n_k * DK, value_dim = p.n_v * p.d_v;
  const int conv_dim = 2 * key_dim + value_dim;
  const size_t stride = static_cast<size_t>(conv_dim) + value_dim + 2 * p.n_v;
  const int channels = 2 * DK + hpk * p.d_v;
  for (int c = threadIdx.x; c < channels; c += kThreads) {
    const int ch = c < DK ? kh * DK + c : c < 2 * DK ? key_dim + kh * DK + (c - DK) : 2 * key_dim + kh * hpk * p.d_v + (c - 2 * DK);
    float acc = 0.0f;
#pragma unroll
    for (int k = 0; k < kKernel; ++k) {
      const int r = t - (kKernel - 1) + k;  // row of the tap; < 0: an earlier position, from the ring
      float x;
      if (r >= 0) {
        x = p.proj[static_cast<size_t>(r) * stride + ch];
      } else {
        const int slot = ((p.pos0 + r) % kKernel + kKernel) % kKernel;
        x = p.conv_ring[static_cast<size_t>(slot) * conv_dim + ch];
      }
      acc += p.conv_w[static_cast<size_t>(ch) * kKernel + k] * x;
    }
    const float y = silu_exact(acc);
    if (c < DK) q_s[c] = y;
    else if (c < 2 * DK) k_s[c - DK] = y;
    else s.v[static_cast<size_t>(t) * value_dim + (ch - 2 * key_dim)] = y;
  }
  __syncthreads();
  // Eq 16: warps 0 and 1 take |q|^2 and |k|^2, warp 2 the raw q.k (scaled afterwards), as gdn.cu.
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp < 3) {
    float acc = 0.0f;
    for (int i = lane; i < DK; i += 32) acc += warp == 0 ? q_s[i] * q_s[i] : warp == 1 ? k_s[i] * k_s[i] : q_s[i] * k_s[i];
    acc = warp_sum(acc);
    if (lane == 0) norm_s[warp] = warp == 2 ? acc : 1.0f / sqrtf(acc + 1e-6f);
  }
  __syncthreads();
  const float q_inv = norm_s[0] * (1.0f / sqrtf(static_cast<float>(DK))), k_inv = norm_s[1];
  const float kq = norm_s[2] * q_inv * k_inv;
  const size_t qk_off = (static_cast<size_t>(t) * p.n_k + kh) * DK;
  for (int i = threadIdx.x; i < DK; i += kThreads) {
    s.q[qk_off + i] = q_s[i] * q_inv;
    s.k[qk_off + i] = k_s[i] * k_inv;
  }
  // Eq 17 for the value heads of kh.
  if (threadIdx.x < hpk) {
    const int h = kh * hpk + threadIdx.x;
    const float* gates = p.proj + static_cast<size_t>(t) * stride + conv_dim + value_dim;  // [b (n_v) | a (n_v)]
    const float beta = 1.0f / (1.0f + expf(-gates[h]));
    const float a_in = gates[p.n_v + h] + p.dt_bias[h];
    const float softplus = a_in > 20.0f ? a_in : log1pf(expf(a_in));
    const float decay = expf(-expf(p.A_log[h]) * softplus);
    s.gates[static_cast<size_t>(t) * p.n_v + h] = make_float4(beta, decay, kq, 0.0f);
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

  auto stage_rows = [&](int chunk, int buf) {
    const int t0 = chunk * kRowsPerStage, n = min(kRowsPerStage, p.T - t0);
    constexpr int kVec = DK / 4, kPerRow = 2 * kVec + kCols / 4 + 1;
    for (int i = threadIdx.x; i < n * kPerRow; i += kNThreads) {
      const int r = i / kPerRow, u = i % kPerRow, t = t0 + r;
      const size_t qk = (static_cast<size_t>(t) * p.n_k + kh) * DK;
      if (u < kVec) cp_async16(&st[buf].q[r][u * 4], s.q + qk + u * 4);
      else if (u < 2 * kVec) cp_async16(&st[buf].k[r][(u - kVec) * 4], s.k + qk + (u - kVec) * 4);
      else if (u < 2 * kVec + kCols / 4)
        cp_async16(&st[buf].v[r][(u - 2 * kVec) * 4], s.v + static_cast<size_t>(t) * value_dim + h * p.d_v + j0 + (u - 2 * kVec) * 4);
      else cp_async16(&st[buf].g[r], s.gates + static_cast<size_t>(t) * p.n_v + h);
    }
    cp_async_commit();
  };

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
  gdn_prep_kernel<DK><<<dim3(p.T, p.n_k), kThreads, 0, stream>>>(p, s);
  CUDA_TRY(cudaGetLastError());
  const dim3 grid(p.n_v * (p.d_v / kCols));
  switch (p.scan_cols_per_warp) {
    case 2: gdn_scan_kernel<DK, 2><<<grid, 32 * kCols / 2, 0, stream>>>(p, s); break;
    case 8: gdn_scan_kernel<DK, 8><<<grid, 32 * kCols / 8, 0, stream>>>(p, s); break;
    default: gdn_scan_kernel<DK, 4><<<grid, 32 * kCols / 4, 0, stream>>>(p, s); break;
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
  if (p.scan_cols_per_warp != 0 && p.scan_cols_per_warp != 2 && p.scan_cols_per_warp != 4 && p.scan_cols_per_warp != 8)
    return cudaErrorInvalidValue;
  if (p.d_k != 64 && p.d_k != 128) return cudaErrorInvalidValue;
  if (p.d_v <= 0 || p.d_v % kCols != 0) return cudaErrorInvalidValue;
  if (p.n_k <= 0 || p.n_v <= 0 || p.n_v % p.n_k != 0) return cudaErrorInvalidValue;
  if (p.scratch_bytes < gdn_prefill_scratch_bytes(p.T, p.n_k, p.n_v, p.d_k, p.d_v)) return cudaErrorInvalidValue;
  const Scratch s = carve(p.scratch, p.T, p.n_k, p.n_v, p.d_k, p.d_v, nullptr);
  return p.d_k == 128 ? launch<128>(p, s, stream) : launch<64>(p, s, stream);
}

}  // namespace lily::cuda
