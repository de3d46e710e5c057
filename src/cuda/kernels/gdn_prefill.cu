// Gated DeltaNet prefill for T rows of one layer (gdn_prefill.cuh), eqs 14-19 of docs/MODEL.md with exactly the
// arithmetic of the decode step (gdn.cu) row after row, so a prefill chunk, further chunks and decode steps continue
// one another. Three steps in one stream:
//
// 1. gdn_prep, block (8 rows, key head kh): eq 14 conv + SiLU of q and k of key head kh and v of its value heads:
//    cc[ch] = silu(sum_k w[ch,k] * c_{p-K+1+k}[ch]) for p = pos0 + t, history rows from proj where t-K+1+k >= 0,
//    else from the ring (position p' in slot p' mod K; zero-initialised, so p' < 0 reads zeros); eq 16
//    q_hat = q / sqrt(|q|^2 + 1e-6) / sqrt(d_k), k_hat = k / sqrt(|k|^2 + 1e-6) and k_hat . q_hat as gdn.cu forms
//    them; eq 17 beta = sigmoid(b_h), decay = exp(-exp(A_log_h) * softplus(a_h + dt_bias_h)). Into scratch:
//    q_hat, k_hat [T, n_k, d_k], v [T, n_v*d_v], gates [T, n_v] x {beta, decay, k_hat.q_hat, 0}.
// 2. The gated delta rule (eq 18), by the scan GdnPrefillParams::scan names or the length picks (scan_for):
//    sequential (gdn_scan_rows.cu), chunked (gdn_chunk_prep.cu + gdn_chunk_scan.cu) or chunked_split
//    (gdn_chunk_prep.cu + gdn_chunk_state.cu). All give the same results to fp32 rounding.
// 3. gdn_norm, block per row: eq 19 x = norm_w * o / RMS(o_head) * silu(z) in fp16 (as gdn.cu's fused norm), and the
//    rows t >= T-K copy their pre-conv vector into ring slot (pos0+t) mod K (after kernel 1 has read the ring).
//    The split scans do both in their output pass where there is sm_90 code (gdn_chunk_state.cu).
//
// Traffic (full geometry, per row): proj 49 KB read, scratch ~2 * 49 KB written and read, 8 KB fp16 out; S (2 MiB)
// read and written once per call.

#include <cmath>

#include "cuda/kernels/gdn_prefill_util.cuh"

namespace lily::cuda {

using namespace gdn_prefill_impl;

namespace {

// The crossovers of the default (measured on the H200, per layer: 256 rows 0.099 ms chunked vs 0.105 split and
// faster than sequential; 512: 0.146 split vs 0.153; 4096: 0.928 vs 1.032; 2026-12-04, the state pass on wgmma:
// 256 rows 0.093 chunked vs 0.096, 512 0.128 vs 0.151 chunked, 4096 0.820 vs 0.922 for the mma.sync split; with
// eq 19 in the output pass: 128 rows 0.059 vs 0.060 sequential, 256 0.079 vs 0.092 chunked, 512 0.118, 4096 0.818).
// So on Hopper chunked_wgmma from 256 rows; elsewhere chunked from 256, chunked_split from 512.
constexpr int kChunkedMinT = 256;
constexpr int kSplitMinT = 512;

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

// ---- step 1: conv, l2norm, gates -----------------------------------------------------------------------------
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

// ---- step 3: gated RMSNorm (eq 19) and the conv ring ---------------------------------------------------------
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

template <int DK>
cudaError_t launch(const GdnPrefillParams& p, const Scratch& s, cudaStream_t stream) {
  gdn_prep_kernel<DK><<<dim3((p.T + kPrepRows - 1) / kPrepRows, p.n_k), kThreads, 0, stream>>>(p, s);
  CUDA_TRY(cudaGetLastError());
  const GdnScan scan = scan_for(p);
  switch (scan) {
    case GdnScan::chunked:
      CUDA_TRY(chunk_prep(p, s, stream));
      CUDA_TRY(scan_chunked(p, s, stream));
      break;
    case GdnScan::chunked_split:
    case GdnScan::chunked_wgmma: {
      CUDA_TRY(chunk_prep(p, s, stream));
      bool normed = false;
      CUDA_TRY(scan_chunked_split(p, s, scan == GdnScan::chunked_wgmma, &normed, stream));
      if (normed) return cudaSuccess;  // eq 19 and the ring done by the output pass
      break;
    }
    default: CUDA_TRY(scan_rows(p, s, stream)); break;
  }
  gdn_norm_kernel<<<p.T, kThreads, 0, stream>>>(p, s);
  return cudaGetLastError();
}

// The shapes and arguments gdn_prefill takes.
bool valid(const GdnPrefillParams& p) {
  if (!p.proj || !p.conv_ring || !p.conv_w || !p.A_log || !p.dt_bias || !p.S || !p.norm_w || !p.out || !p.scratch)
    return false;
  if (p.T < 1 || p.pos0 < 0 || p.kernel != kKernel) return false;
  if (p.scan != GdnScan::by_length && p.scan != GdnScan::sequential && p.scan != GdnScan::chunked &&
      p.scan != GdnScan::chunked_split && p.scan != GdnScan::chunked_wgmma)
    return false;
  if (p.scan == GdnScan::chunked_wgmma && !wgmma_built()) return false;
  if (p.scan != GdnScan::by_length && p.scan != GdnScan::sequential && p.d_v != p.d_k) return false;  // chunked: d_v = d_k
  if (p.d_k != 64 && p.d_k != 128) return false;
  if (p.d_v <= 0 || p.d_v % kCols != 0) return false;
  if (p.n_k <= 0 || p.n_v <= 0 || p.n_v % p.n_k != 0) return false;
  return p.scratch_bytes >= gdn_prefill_scratch_bytes(p.T, p.n_k, p.n_v, p.d_k, p.d_v);
}

}  // namespace

GdnScan scan_for(const GdnPrefillParams& p) {
  if (p.scan != GdnScan::by_length) return p.scan;
  if (p.d_v != p.d_k || p.T < kChunkedMinT) return GdnScan::sequential;
  if (wgmma_built()) return GdnScan::chunked_wgmma;
  return p.T >= kSplitMinT ? GdnScan::chunked_split : GdnScan::chunked;
}

const char* scan_name(GdnScan s) {
  switch (s) {
    case GdnScan::by_length: return "by_length";
    case GdnScan::sequential: return "sequential";
    case GdnScan::chunked: return "chunked";
    case GdnScan::chunked_split: return "chunked_split";
    case GdnScan::chunked_wgmma: return "chunked_wgmma";
  }
  return "?";
}

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

}  // namespace lily::cuda
