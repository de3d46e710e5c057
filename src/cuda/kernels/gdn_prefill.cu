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
// 2'. Or eq 18 chunk by chunk (scan_variant 7-10; the default from kChunkedMinT rows): the WY / UT-transform form
//    of the gated delta rule over chunks of 64 rows, G_i = sum of g up to row i within the chunk, S the state at
//    the chunk's start. Unrolling the rows, e = U - W S with (I + A) e = beta v - beta exp(G) k S,
//    A[i][j] = beta_i (k_i . k_j) exp(G_i - G_j) (j < i), T = (I + A)^-1, W = T (beta exp(G) k), U = T (beta v);
//    o_i = exp(G_i) q_i S + sum_{j <= i} exp(G_i - G_j) (q_i . k_j) e_j (= S_i^T q_i, decay before the update, as
//    the sequential form); S <- exp(G_63) S + sum_j exp(G_63 - G_j) k_j e_j^T. gdn_chunk_prep_kernel forms A, T
//    (forward substitution, fp32), W, U and P = (q k^T) o mask o exp(G_i - G_j) per (chunk, value head), in
//    parallel; gdn_chunk_scan_kernel runs the chunks in order per (value head, 32 columns of S; 4 or 8 warps)
//    with S in registers. Products on the tensor cores (mma.sync m16n8k8, fp32 accumulation), S, T and the sums in
//    fp32; the operands in tf32 (variants 7, 8) or 3xTF32 (9, 10: hi*hi + hi*lo + lo*hi, fp32 accuracy for 3x
//    the tensor-core work; the default, as tf32 puts o ~1e-2 of its RMS off: the products' terms cancel). FLOPs
//    per chunk and value head ~2 * 64 * d * (64 + 64 + 64 + 3 d) (~13 MFLOP at d = 128: 27 GFLOP at T = 4096,
//    x3 in 3xTF32); the scan kernel reads W, q, k (3 x 32 KB) and P (16 KB) per chunk and column block.
//    Measured on the H200 (ncu, T = 4097, full geometry): gdn_chunk_prep 196 us (tf32) / 278 us (3xTF32),
//    gdn_chunk_scan 334 us (tf32, 4 warps) / 565 us (3xTF32, 8 warps), against 1.19-1.39 ms for the sequential
//    scan; the whole call at T = 256 and up is faster chunked (10: 0.093 ms vs 0.099 ms at 256, 1.03 vs 1.38 ms
//    at 4096), slower below. Both chunk kernels are latency bound (the 64-step substitution by 2 warps; one
//    block of 4-8 warps per SM through 3 dependent products per chunk), far from the tensor cores' rate.
// 2''. Or the chunked form split in two (scan_variant 11: 3xTF32, 8 warps; 12: tf32, 4 warps; as
//    flash-linear-attention's chunk_gated_delta_rule splits fwd_h from fwd_o): gdn_chunk_prep_kernel as in 2';
//    gdn_chunk_state_kernel walks the chunks per (value head, 32 columns of S) carrying only the state: per chunk it
//    stores S_c (the chunk's start state, fp32) to scratch hs [nc, n_v, d_k, d_v], forms V' = U - W S_c (to scratch
//    over U) and S <- exp(G_63) S + (exp(G_63 - G) k)^T V': two dependent products and two barriers per chunk
//    instead of three and four, its inputs (W, U, k, exp factors: 72 KB, not 120) double buffered a whole chunk
//    ahead, and the B operands S and V' stored split into tf32 hi / lo once by their owners instead of converted
//    by each of the 4-8 warps that read them. gdn_chunk_out_kernel then forms O = (exp(G) q) S_c + P V' for every (chunk, value head, 64 columns) at
//    once (4,096 blocks at T = 4096). Same operands and order of sums as 2', so the results match 9/10 (11) and 7/8
//    (12) to the bit. Costs the hs section: 2 MiB of scratch per 64 rows at full geometry (128 MiB at T = 4096),
//    written and read once (256 MB of traffic at T = 4096, ~60 us at the copy rate). Measured on the H200: 11
//    bit-identical to 10, 0.962 vs 1.032 ms a layer at T = 4096. scan_variant 13 (8 warps) / 14 (4 warps): 11 with
//    the state pass's 3xTF32 products summed in three accumulators (hi*hi, lo*hi, hi*lo; mma_sep), added once per
//    product, so a k-step's three mma are independent instead of a chain of three; prep and output pass as 11.
//    fp32-class, not bit-identical to 11 (bound at gdn_chunk_state_kernel). Measured on the H200 (2026-11-30):
//    0.928 vs 0.964 ms a layer at T = 4096 (predicted 0.91), the model's logits as close to the CPU as 11's
//    (teacher-forced full4, 512 positions: 3.03e-3 both); the default from kSplitMinT rows.
// 3. gdn_norm, block per row: eq 19 x = norm_w * o / RMS(o_head) * silu(z) in fp16 (as gdn.cu's fused norm), and the
//    rows t >= T-K copy their pre-conv vector into ring slot (pos0+t) mod K (after kernel 1 has read the ring).
// gdn_prefill_checkpoint (no kernel: three device copies) then takes the state after a multiple of 64 rows out of a
// split-path call: S_c from hs, the ring's K slots from the proj rows before it, as a call of only those rows would
// have left them (the engine's anchor checkpoint without a second scan: CudaBackendOptions::anchor_from_chunk_states).
//
// Traffic (full geometry, per row): proj 49 KB read, scratch ~2 * 49 KB written and read, 8 KB fp16 out; S (2 MiB)
// read and written once per call. The scan does 8 FLOPs per element of S per row, 4.2 MFLOP per row (17 GFLOP at
// T = 4096) as 4 dependent fp32 instructions per element (2 dot FMAs, a multiply and an FMA for the update): at
// 128 FP32 lanes x 132 SMs that is >= 124 cycles per row, ~0.27 ms at T = 4096 even with perfect issue; the row
// chain (dots, shuffle levels, e, update) is latency bound on top of that, hence the chunked form for long T.

#include <cmath>

#include "cuda/kernels/gdn_prefill.cuh"

namespace lily::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kCols = 32;                     // columns of S per scan block
constexpr int kRowsPerStage = 16;             // rows staged into shared memory at a time
constexpr int kKernel = 4;
constexpr int kScanVariants = 14;  // GdnPrefillParams::scan_variant
constexpr int kChunk = kGdnPrefillChunkRows;  // rows per chunk of the chunked formulation
constexpr int kChunkedMinT = 256; // the default (scan_variant 0) takes the chunked path (10) from this many rows
constexpr int kSplitMinT = 512;   // and the split chunked path (13) from this many (H200: 0.105 vs 0.099 ms at 256
                                  // rows, 0.146 vs 0.153 at 512, 0.962 vs 1.032 at 4096)

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
  float4* gates; // [T, n_v] {beta, decay, k_hat.q_hat, g = log decay}
  float* o;      // [T, n_v*d_v] S^T q_hat before the norm
  // The chunked path (nc = ceil(T / 64) chunks; row r of a chunk is row 64c + r, rows >= T zero):
  float* w;      // [nc, n_v, 64, d_k] W = T (beta exp(G) k_hat)
  float* pqk;    // [nc, n_v, 64, 64] (q_hat k_hat^T) o causal mask o exp(G_i - G_j)
  float* gk;     // [nc, n_v, 128] exp(G_i) | exp(G_63 - G_i)
  float* hs;     // [nc, n_v, d_k, d_v] S at each chunk's start (the split chunked path, variants 11-14)
};

size_t align256(size_t b) { return (b + 255) / 256 * 256; }

Scratch carve(void* base, int T, int n_k, int n_v, int d_k, int d_v, size_t* total) {
  const size_t rows = static_cast<size_t>(T), padded = static_cast<size_t>((T + kChunk - 1) / kChunk) * kChunk;
  const size_t qk = align256(sizeof(float) * rows * n_k * d_k), vo = align256(sizeof(float) * rows * n_v * d_v),
               g = align256(sizeof(float4) * rows * n_v), w = align256(sizeof(float) * padded * n_v * d_k),
               pqk = align256(sizeof(float) * padded * n_v * kChunk), gk = align256(sizeof(float) * padded * n_v * 2),
               hs = align256(sizeof(float) * (padded / kChunk) * n_v * d_k * d_v);
  char* p = static_cast<char*>(base);
  Scratch s;
  s.q = reinterpret_cast<float*>(p);
  s.k = reinterpret_cast<float*>(p + qk);
  s.v = reinterpret_cast<float*>(p + 2 * qk);
  s.gates = reinterpret_cast<float4*>(p + 2 * qk + vo);
  s.o = reinterpret_cast<float*>(p + 2 * qk + vo + g);
  s.w = reinterpret_cast<float*>(p + 2 * qk + 2 * vo + g);
  s.pqk = reinterpret_cast<float*>(p + 2 * qk + 2 * vo + g + w);
  s.gk = reinterpret_cast<float*>(p + 2 * qk + 2 * vo + g + w + pqk);
  s.hs = reinterpret_cast<float*>(p + 2 * qk + 2 * vo + g + w + pqk + gk);
  if (total) *total = 2 * qk + 2 * vo + g + w + pqk + gk + hs;
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
    const float g = -expf(p.A_log[h]) * softplus;
    s.gates[static_cast<size_t>(t) * p.n_v + h] = make_float4(beta, expf(g), norm_s[rr][2], g);
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

// ---- kernels 2a/2b: the chunked formulation on the tensor cores -----------------------------------------------
// x rounded to tf32 (10 mantissa bits), to nearest with ties away from zero: cvt.rna.tf32.f32's result for finite x,
// in two integer instructions instead of a conversion.
__device__ __forceinline__ uint32_t tf32(float x) { return (__float_as_uint(x) + 0x1000u) & 0xffffe000u; }

// An mma.sync m16n8k8 operand fragment (A: N = 4, B: N = 2) in tf32, and with kSplit its rounding remainder too
// (3xTF32: a b ~ a_hi b_hi + a_hi b_lo + a_lo b_hi, ~fp32 accuracy for 3 tensor-core products).
template <bool kSplit, int N>
struct Frag {
  uint32_t hi[N], lo[N];
  Frag() = default;
  __device__ __forceinline__ explicit Frag(const float (&x)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      hi[i] = tf32(x[i]);
      lo[i] = kSplit ? tf32(x[i] - __uint_as_float(hi[i])) : 0u;
    }
  }
};

__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// d += a b for one 16x8x8 tile, fp32 accumulation. Fragments (g = lane / 4, t = lane % 4): a = A[g][t], A[g+8][t],
// A[g][t+4], A[g+8][t+4]; b = B[t][g], B[t+4][g]; d = D[g][2t], D[g][2t+1], D[g+8][2t], D[g+8][2t+1].
template <bool kSplit>
__device__ __forceinline__ void mma(float (&d)[4], const Frag<kSplit, 4>& a, const Frag<kSplit, 2>& b) {
  if constexpr (kSplit) {
    mma_tf32(d, a.lo, b.hi);
    mma_tf32(d, a.hi, b.lo);
  }
  mma_tf32(d, a.hi, b.hi);
}

// d += a b in 3xTF32 with the two correction products in accumulators of their own (ca += a_lo b_hi, cb += a_hi b_lo):
// three independent mma per k-step instead of mma's chain of three into d. The caller adds d + (ca + cb) once, after
// the last k-step (scan_variant 13, 14). Not the rounding order of mma: fp32-class, not bit-identical (see
// gdn_chunk_state_kernel for the bound).
__device__ __forceinline__ void mma_sep(float (&d)[4], float (&ca)[4], float (&cb)[4], const Frag<true, 4>& a,
                                        const Frag<true, 2>& b) {
  mma_tf32(ca, a.lo, b.hi);
  mma_tf32(cb, a.hi, b.lo);
  mma_tf32(d, a.hi, b.hi);
}

// Shared-memory row strides (floats): a tile read as a row-major A operand or a transposed B operand has a
// stride = 4 mod 32, one read as a row-major B operand or a transposed A operand 8 mod 32 (conflict-free fragments).
constexpr int kLdT = kChunk + 4;  // [64][64] tiles: A (I + A)^-1, P

template <int D>
constexpr size_t chunk_prep_smem() {
  return sizeof(float) * (2 * kChunk * (D + 4) + 2 * kChunk * kLdT + 2 * kChunk);
}

// Block (chunk c, value head h): the parts of chunk c that do not depend on the state (eq 18 over the chunk's 64
// rows, G = cumulative sum of g over the chunk, rows past T have k = q = v = 0, beta = 0, g = 0):
//   A[i][j] = beta_i (k_i . k_j) exp(G_i - G_j) (j < i), T = (I + A)^-1 by forward substitution in fp32;
//   W = T (beta exp(G) k) -> scratch w; U = T (beta v) -> over v (rows < T); P = (q k^T) exp(G_i - G_j) (j <= i)
//   -> scratch pqk; exp(G_i), exp(G_63 - G_i) -> scratch gk. The products on the tensor cores.
template <int D, bool kSplit>
__global__ void __launch_bounds__(kThreads) gdn_chunk_prep_kernel(const __grid_constant__ GdnPrefillParams p, Scratch s) {
  constexpr int LD = D + 4;
  using FA = Frag<kSplit, 4>;
  using FB = Frag<kSplit, 2>;
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

constexpr int kChunkCols = 32;  // columns of S per block of the chunked scan

template <int D>
constexpr size_t chunk_scan_smem() {
  constexpr int LDC = kChunkCols + 8;
  return sizeof(float) * (2 * kChunk * (D + 4) + kChunk * (D + 8) + kChunk * kLdT + 2 * kChunk * LDC + D * LDC +
                          2 * kChunk);
}

// Block (value head h, columns j0 .. j0 + 32 of S), NW = 4 or 8 warps: the chunks in order with the state
// S[:, j0..] in registers (fp32, the accumulator fragments of its update) and a copy in shared memory as an operand:
//   V' = U - W S; O = (exp(G) q) S + P V' -> scratch o; S <- exp(G_63) S + (exp(G_63 - G) k)^T V'.
// Warp (mt = warp % 4, ch = warp / 4) owns rows 16 mt.. of V' and O and rows D/4 mt.. of S, columns CW ch.. of the
// block's (CW = 32 / (NW / 4)). The inputs of chunk c + 1 arrive by cp.async in two groups while chunk c computes:
// W, U during O and the state update, q, P, k and the exp factors during V'.
template <int D, int NW, bool kSplit>
__global__ void __launch_bounds__(NW * 32) gdn_chunk_scan_kernel(const __grid_constant__ GdnPrefillParams p, Scratch s) {
  constexpr int kNThreads = NW * 32, NC = kChunkCols, CW = NC / (NW / 4), NT = CW / 8;
  constexpr int LDA = D + 4, LDK = D + 8, LDC = NC + 8, MS = D / 64;
  using FA = Frag<kSplit, 4>;
  using FB = Frag<kSplit, 2>;
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

template <int D, int NW, bool kSplit>
cudaError_t launch_chunked(const GdnPrefillParams& p, const Scratch& s, cudaStream_t stream) {
  constexpr size_t kPrepSmem = chunk_prep_smem<D>(), kScanSmem = chunk_scan_smem<D>();
  CUDA_TRY(cudaFuncSetAttribute(gdn_chunk_prep_kernel<D, kSplit>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                static_cast<int>(kPrepSmem)));
  CUDA_TRY(cudaFuncSetAttribute(gdn_chunk_scan_kernel<D, NW, kSplit>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                static_cast<int>(kScanSmem)));
  gdn_chunk_prep_kernel<D, kSplit><<<dim3((p.T + kChunk - 1) / kChunk, p.n_v), kThreads, kPrepSmem, stream>>>(p, s);
  CUDA_TRY(cudaGetLastError());
  gdn_chunk_scan_kernel<D, NW, kSplit><<<p.n_v * (D / kChunkCols), NW * 32, kScanSmem, stream>>>(p, s);
  return cudaGetLastError();
}

// ---- kernels 2c/2d: the chunked formulation split into a state pass and a parallel output pass ----------------
// (scan_variant 11, 12; flash-linear-attention's fwd_h / fwd_o split.) gdn_chunk_prep_kernel as above, then
// gdn_chunk_state_kernel carries only the state through the chunks and gdn_chunk_out_kernel forms every chunk's
// output at once from the stored chunk-start states.

template <int D>
constexpr size_t chunk_state_smem() {
  constexpr int LDC = kChunkCols + 8;
  return sizeof(float) * (2 * (kChunk * (D + 4) + kChunk * LDC + kChunk * (D + 8) + 2 * kChunk) + 2 * D * LDC +
                          kChunk * LDC);
}

// x as Frag splits it (its tf32 rounding, and with kSplit the tf32 rounding of the remainder; else 0), as floats,
// for an operand stored split once and read back as fragments by several warps (frag_pre).
template <bool kSplit>
__device__ __forceinline__ float2 split_tf32(float x) {
  const uint32_t hi = tf32(x);
  return make_float2(__uint_as_float(hi), kSplit ? __uint_as_float(tf32(x - __uint_as_float(hi))) : 0.0f);
}

// The B fragment {B[t][g], B[t+4][g]} (elements i0, i1) of an operand stored split by split_tf32: the same bits as
// Frag<kSplit, 2> of the unsplit values, without the conversions.
template <bool kSplit>
__device__ __forceinline__ Frag<kSplit, 2> frag_pre(const float* hi, const float* lo, int i0, int i1) {
  Frag<kSplit, 2> f;
  f.hi[0] = __float_as_uint(hi[i0]), f.hi[1] = __float_as_uint(hi[i1]);
  f.lo[0] = kSplit ? __float_as_uint(lo[i0]) : 0u;
  f.lo[1] = kSplit ? __float_as_uint(lo[i1]) : 0u;
  return f;
}

// Block (value head h, columns j0 .. j0 + 32 of S), NW = 4 or 8 warps, the chunks in order with S[:, j0..] in
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
// kSepAcc (scan_variant 13, 14; 3xTF32 only): each product's a_hi b_hi, a_lo b_hi and a_hi b_lo go into three
// accumulators (mma_sep; for the update, S itself and two zeroed ones), summed as main + (lo_hi + hi_lo) after the
// last k-step. The dependent chain of a product drops from 3 mma a k-step to 1 (V': 48 -> 16 mma latencies, update:
// 24 -> 8), for 2 x 4 NT (V') and 2 x 4 MS NT (update) more registers (D = 128: 121 at 8 warps, 163 at 4; 11: 80).
// The three exact partial products (tf32 x tf32 fits fp32) are the same as 11's; only the rounding of their sum
// differs: 11 rounds the running sum 3K/8 times, this K/8 times at the sum's scale plus twice (the corrections are
// ~2^-10 of it), so |this - 11| <= (K/2 + 2) 2^-23 sum_k |a_k b_k| per product (one ulp a rounding, as for a
// truncating accumulator): 7.9e-6 of sum |a b| at K = 128, 62x below tf32's operand rounding (2^-11), and no larger
// an error against the exact products than 11's. The test's 13-vs-11 tolerance follows from that ratio.
template <int D, int NW, bool kSplit, bool kSepAcc>
__global__ void __launch_bounds__(NW * 32) gdn_chunk_state_kernel(const __grid_constant__ GdnPrefillParams p, Scratch s) {
  constexpr int kNThreads = NW * 32, NC = kChunkCols, CW = NC / (NW / 4), NT = CW / 8;
  constexpr int LDA = D + 4, LDK = D + 8, LDC = NC + 8, MS = D / 64;
  constexpr int kBuf = kChunk * LDA + kChunk * LDC + kChunk * LDK + 2 * kChunk;  // floats per input buffer
  constexpr int SA = kSepAcc ? 1 : 0;  // the correction accumulators exist (extent 1 when not: unused)
  static_assert(kBuf % 4 == 0, "16-byte aligned buffers");
  static_assert(!kSepAcc || kSplit, "separate correction accumulators are a 3xTF32 form");
  using FA = Frag<kSplit, 4>;
  extern __shared__ __align__(16) float smem[];
  // Buffer b: [64][LDA] W | [64][LDC] U, then V' | [64][LDK] k_hat | [128] exp(G_i) | exp(G_63 - G_i).
  float* sh_s = smem + 2 * kBuf;  // [D][LDC] S at the chunk's start, tf32 part
  float* sl_s = sh_s + D * LDC;   // [D][LDC] ... the remainder's (kSplit)
  float* vl_s = sl_s + D * LDC;   // [64][LDC] V', the remainder's tf32 part (kSplit; V' hi is over U)
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
          const float2 a = split_tf32<kSplit>(x.x), b = split_tf32<kSplit>(x.y);
          *reinterpret_cast<float2*>(sh_s + row * LDC + c0 + col) = make_float2(a.x, b.x);
          if (kSplit) *reinterpret_cast<float2*>(sl_s + row * LDC + c0 + col) = make_float2(a.y, b.y);
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
      float acc[NT][4] = {}, ca[SA * NT + 1 - SA][4] = {}, cb[SA * NT + 1 - SA][4] = {};
#pragma unroll 4
      for (int k0 = 0; k0 < D; k0 += 8) {
        const FA af({w_s[(r0 + g) * LDA + k0 + t], w_s[(r0 + g + 8) * LDA + k0 + t], w_s[(r0 + g) * LDA + k0 + t + 4],
                     w_s[(r0 + g + 8) * LDA + k0 + t + 4]});
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const auto fb = frag_pre<kSplit>(sh_s, sl_s, (k0 + t) * LDC + c0 + 8 * nt + g, (k0 + t + 4) * LDC + c0 + 8 * nt + g);
          if constexpr (kSepAcc) mma_sep(acc[nt], ca[nt], cb[nt], af, fb);
          else mma(acc[nt], af, fb);
        }
      }
      if constexpr (kSepAcc)
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
          const float2 a = split_tf32<kSplit>(v2.x), b = split_tf32<kSplit>(v2.y);
          *reinterpret_cast<float2*>(u_s + off) = make_float2(a.x, b.x);
          if (kSplit) *reinterpret_cast<float2*>(vl_s + off) = make_float2(a.y, b.y);
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
      float ca[SA * MS + 1 - SA][SA * NT + 1 - SA][4] = {}, cb[SA * MS + 1 - SA][SA * NT + 1 - SA][4] = {};
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
            const auto fb = frag_pre<kSplit>(u_s, vl_s, (k0 + t) * LDC + c0 + 8 * nt + g, (k0 + t + 4) * LDC + c0 + 8 * nt + g);
            if constexpr (kSepAcc) mma_sep(S[ms][nt], ca[ms][nt], cb[ms][nt], af, fb);
            else mma(S[ms][nt], af, fb);
          }
        }
      }
      if constexpr (kSepAcc)
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
template <int D, bool kSplit>
__global__ void __launch_bounds__(kThreads) gdn_chunk_out_kernel(const __grid_constant__ GdnPrefillParams p, Scratch s) {
  constexpr int NC = kOutCols, CW = 32, NT = CW / 8, LDA = D + 4, LDC = NC + 8;
  using FA = Frag<kSplit, 4>;
  using FB = Frag<kSplit, 2>;
  extern __shared__ __align__(16) float smem[];
  float* q_s = smem;                  // [64][LDA] q_hat
  float* p_s = q_s + kChunk * LDA;    // [64][kLdT] P
  float* s_s = p_s + kChunk * kLdT;   // [D][LDC] S_c
  float* v_s = s_s + D * LDC;         // [64][LDC] V'
  float* gq_s = v_s + kChunk * LDC;   // [64] exp(G_i)
  const int c = blockIdx.x, h = blockIdx.y, j0 = blockIdx.z * NC, kh = h / (p.n_v / p.n_k);
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

template <int D, int NW, bool kSplit, bool kSepAcc = false>
cudaError_t launch_chunked_split(const GdnPrefillParams& p, const Scratch& s, cudaStream_t stream) {
  constexpr size_t kPrepSmem = chunk_prep_smem<D>(), kStateSmem = chunk_state_smem<D>(), kOutSmem = chunk_out_smem<D>();
  CUDA_TRY(cudaFuncSetAttribute(gdn_chunk_prep_kernel<D, kSplit>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                static_cast<int>(kPrepSmem)));
  CUDA_TRY(cudaFuncSetAttribute(gdn_chunk_state_kernel<D, NW, kSplit, kSepAcc>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                static_cast<int>(kStateSmem)));
  CUDA_TRY(cudaFuncSetAttribute(gdn_chunk_out_kernel<D, kSplit>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                static_cast<int>(kOutSmem)));
  const int nc = (p.T + kChunk - 1) / kChunk;
  gdn_chunk_prep_kernel<D, kSplit><<<dim3(nc, p.n_v), kThreads, kPrepSmem, stream>>>(p, s);
  CUDA_TRY(cudaGetLastError());
  gdn_chunk_state_kernel<D, NW, kSplit, kSepAcc><<<p.n_v * (D / kChunkCols), NW * 32, kStateSmem, stream>>>(p, s);
  CUDA_TRY(cudaGetLastError());
  gdn_chunk_out_kernel<D, kSplit><<<dim3(nc, p.n_v, D / kOutCols), kThreads, kOutSmem, stream>>>(p, s);
  return cudaGetLastError();
}

// ---- kernel 3: gated RMSNorm (eq 19) and the conv ring ---------------------------------------------------------
__global__ void __launch_bounds__(kThreads) gdn_norm_kernel(const __grid_constant__ GdnPrefillParams p, Scratch s) {
  const int t = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int key_dim = p.n_k * p.d_k, value_dim = p.n_v * p.d_v, conv_dim = 2 * key_dim + value_dim;
  const size_t stride = static_cast<size_t>(conv_dim) + value_dim + 2 * p.n_v;
  const float* z = p.proj + static_cast<size_t>(t) * stride + conv_dim;
  const float* o = s.o + static_cast<size_t>(t) * value_dim;
  __half* out = p.out + static_cast<size_t>(t) * value_dim;
  for (int h = warp; h < p.n_v; h += kWarps) {
    float ss = 0.0f;
    for (int j = lane; j < p.d_v; j += 32) ss += o[h * p.d_v + j] * o[h * p.d_v + j];
    ss = warp_sum(ss);
    const float inv_rms = rsqrtf(ss / static_cast<float>(p.d_v) + p.eps);
    for (int j = lane; j < p.d_v; j += 32)
      out[h * p.d_v + j] = __float2half_rn(p.norm_w[j] * (o[h * p.d_v + j] * inv_rms) * siluf_(z[h * p.d_v + j]));
  }
  if (t >= p.T - kKernel) {  // the last K pre-conv vectors into the ring
    float* slot = p.conv_ring + static_cast<size_t>((p.pos0 + t) % kKernel) * conv_dim;
    const float* src = p.proj + static_cast<size_t>(t) * stride;
    for (int c = threadIdx.x; c < conv_dim; c += kThreads) slot[c] = src[c];
  }
}

// The scan variant gdn_prefill(p) runs: p.scan_variant, or for 0 the default by length.
int resolved_variant(const GdnPrefillParams& p) {
  if (p.scan_variant != 0) return p.scan_variant;
  return p.d_v != p.d_k ? 5 : p.T >= kSplitMinT ? 13 : p.T >= kChunkedMinT ? 10 : 5;
}

template <int DK>
cudaError_t launch(const GdnPrefillParams& p, const Scratch& s, cudaStream_t stream) {
  gdn_prep_kernel<DK><<<dim3((p.T + kPrepRows - 1) / kPrepRows, p.n_k), kThreads, 0, stream>>>(p, s);
  CUDA_TRY(cudaGetLastError());
  const int variant = resolved_variant(p);
  const dim3 grid(p.n_v * (p.d_v / kCols));
  switch (variant) {
    case 1: gdn_scan_kernel<DK, 2><<<grid, 32 * kCols / 2, 0, stream>>>(p, s); break;
    case 2: gdn_scan_kernel<DK, 4><<<grid, 32 * kCols / 4, 0, stream>>>(p, s); break;
    case 3: gdn_scan_kernel<DK, 8><<<grid, 32 * kCols / 8, 0, stream>>>(p, s); break;
    case 4: gdn_scan_cols_kernel<DK, 4><<<grid, 32 * 4, 0, stream>>>(p, s); break;
    case 6: gdn_scan_cols_kernel<DK, 16><<<grid, 32 * 16, 0, stream>>>(p, s); break;
    case 7: CUDA_TRY((launch_chunked<DK, 4, false>(p, s, stream))); break;
    case 8: CUDA_TRY((launch_chunked<DK, 8, false>(p, s, stream))); break;
    case 9: CUDA_TRY((launch_chunked<DK, 4, true>(p, s, stream))); break;
    case 10: CUDA_TRY((launch_chunked<DK, 8, true>(p, s, stream))); break;
    case 11: CUDA_TRY((launch_chunked_split<DK, 8, true>(p, s, stream))); break;
    case 12: CUDA_TRY((launch_chunked_split<DK, 4, false>(p, s, stream))); break;
    case 13: CUDA_TRY((launch_chunked_split<DK, 8, true, true>(p, s, stream))); break;
    case 14: CUDA_TRY((launch_chunked_split<DK, 4, true, true>(p, s, stream))); break;
    default: gdn_scan_cols_kernel<DK, 8><<<grid, 32 * 8, 0, stream>>>(p, s); break;
  }
  CUDA_TRY(cudaGetLastError());
  gdn_norm_kernel<<<p.T, kThreads, 0, stream>>>(p, s);
  return cudaGetLastError();
}

// The shapes and arguments gdn_prefill takes.
bool valid(const GdnPrefillParams& p) {
  if (!p.proj || !p.conv_ring || !p.conv_w || !p.A_log || !p.dt_bias || !p.S || !p.norm_w || !p.out || !p.scratch)
    return false;
  if (p.T < 1 || p.pos0 < 0 || p.kernel != kKernel) return false;
  if (p.scan_variant < 0 || p.scan_variant > kScanVariants) return false;
  if (p.scan_variant >= 7 && p.d_v != p.d_k) return false;  // the chunked path: d_v = d_k
  if (p.d_k != 64 && p.d_k != 128) return false;
  if (p.d_v <= 0 || p.d_v % kCols != 0) return false;
  if (p.n_k <= 0 || p.n_v <= 0 || p.n_v % p.n_k != 0) return false;
  return p.scratch_bytes >= gdn_prefill_scratch_bytes(p.T, p.n_k, p.n_v, p.d_k, p.d_v);
}

}  // namespace

size_t gdn_prefill_scratch_bytes(int T, int n_k, int n_v, int d_k, int d_v) {
  if (T <= 0 || n_k <= 0 || n_v <= 0 || d_k <= 0 || d_v <= 0) return 0;
  size_t total = 0;
  carve(nullptr, T, n_k, n_v, d_k, d_v, &total);
  return total;
}

cudaError_t gdn_prefill(const GdnPrefillParams& p, cudaStream_t stream) {
  if (!valid(p)) return cudaErrorInvalidValue;
  const Scratch s = carve(p.scratch, p.T, p.n_k, p.n_v, p.d_k, p.d_v, nullptr);
  return p.d_k == 128 ? launch<128>(p, s, stream) : launch<64>(p, s, stream);
}

bool gdn_prefill_stores_chunk_states(const GdnPrefillParams& p) {
  const int variant = resolved_variant(p);
  return p.d_k == p.d_v && variant >= 11 && variant <= 14;
}

// Three copies on the stream: S from hs[row / 64], then the ring's slots as at most two runs of consecutive slots
// (rows row-K .. row-1 go to slots (pos0 + row - K + i) % K, i = 0 .. K-1: from slot s0 = (pos0 + row) % K to K-1,
// then 0 to s0-1), each run a pitched copy of proj rows (pitch: the proj row) into ring rows (pitch conv_dim).
cudaError_t gdn_prefill_checkpoint(const GdnPrefillParams& p, int row, float* S_out, float* ring_out,
                                   cudaStream_t stream) {
  if (!valid(p) || !S_out || !ring_out || !gdn_prefill_stores_chunk_states(p)) return cudaErrorInvalidValue;
  if (row <= 0 || row >= p.T || row % kChunk != 0) return cudaErrorInvalidValue;
  const Scratch s = carve(p.scratch, p.T, p.n_k, p.n_v, p.d_k, p.d_v, nullptr);
  const size_t state = static_cast<size_t>(p.n_v) * p.d_k * p.d_v;
  CUDA_TRY(cudaMemcpyAsync(S_out, s.hs + static_cast<size_t>(row / kChunk) * state, state * sizeof(float),
                           cudaMemcpyDeviceToDevice, stream));
  const size_t conv_dim = static_cast<size_t>(2 * p.n_k * p.d_k + p.n_v * p.d_v);
  const size_t stride = conv_dim + static_cast<size_t>(p.n_v) * p.d_v + 2 * p.n_v;  // floats per proj row
  const int s0 = (p.pos0 + row) % kKernel, first = row - kKernel;  // proj row first goes to slot s0
  const int runs[2][3] = {{s0, kKernel - s0, first}, {0, s0, first + kKernel - s0}};  // {slot, slots, proj row}
  for (const auto& r : runs) {
    if (r[1] == 0) continue;
    CUDA_TRY(cudaMemcpy2DAsync(ring_out + static_cast<size_t>(r[0]) * conv_dim, conv_dim * sizeof(float),
                               p.proj + static_cast<size_t>(r[2]) * stride, stride * sizeof(float),
                               conv_dim * sizeof(float), static_cast<size_t>(r[1]), cudaMemcpyDeviceToDevice, stream));
  }
  return cudaSuccess;
}

}  // namespace lily::cuda
