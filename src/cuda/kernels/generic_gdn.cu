// Generic Gated DeltaNet decode step (generic.cuh), the semantics of gdn.cuh (eqs 14-18) for any d_k, d_v, head
// counts (n_v a multiple of n_k) and conv kernel size. One block per value head h (key head kh = h / (n_v/n_k)):
//   eq 14  conv + SiLU of the 2*d_k + d_v channels the head needs (q and k of kh, v of h):
//          cc[ch] = silu(sum_k w[ch,k] * c_{pos-K+1+k}[ch]); history c_{pos-K+1..pos-1} from ring slots
//          (pos+1+k) % K, the current c from proj, which is then written to slot pos % K (read by no block in this
//          step; the q/k channels are written by every block of kh with identical values).
//   eq 16  q_hat = q / sqrt(|q|^2 + 1e-6) / sqrt(d_k);  k_hat = k / sqrt(|k|^2 + 1e-6)   (block reductions).
//   eq 17  beta = sigmoid(b_h);  decay = exp(-exp(A_log_h) * softplus(a_h + dt_bias_h)).
//   eq 18  per column j of S_h [d_k, d_v] (a thread per column, rows looped: coalesced over j):
//          pass 1: kv = sum_i decay*S[i,j] k_hat[i];  e = (v_j - kv) * beta;
//          pass 2: S[i,j] = decay*S[i,j] + k_hat[i] e;  o_j = sum_i S[i,j] q_hat[i].
// With S_out / ring_out (gdn.cuh) the new state goes there and S / the ring are only read.
// Layout: proj [q|k|v (conv_dim) | z (n_v*d_v) | b (n_v) | a (n_v)], conv ring [K, conv_dim], conv_w [conv_dim, K],
// S [n_v, d_k, d_v] fp32. Reads S twice and writes it once (the fast kernel: once each): for small geometries.
#include <cmath>

#include "cuda/kernels/generic.cuh"
#include "cuda/kernels/generic_util.cuh"

namespace lily::cuda {

namespace {

// Eq 14 for this head's channels into q_s [d_k], k_s [d_k], v_s [d_v]; every load of the ring happens before
// this block's store to it (slot pos % K is never read, so the order across blocks does not matter).
__device__ void conv_channels(const GdnStepParams& p, int h, int kh, int pos, float* q_s, float* k_s, float* v_s) {
  const int dk = p.d_k, dv = p.d_v, K = p.kernel;
  const size_t key_dim = static_cast<size_t>(p.n_k) * dk, conv_dim = 2 * key_dim + static_cast<size_t>(p.n_v) * dv;
  for (int c = threadIdx.x; c < 2 * dk + dv; c += blockDim.x) {
    const size_t ch = c < dk ? static_cast<size_t>(kh) * dk + c
                      : c < 2 * dk ? key_dim + static_cast<size_t>(kh) * dk + (c - dk)
                                   : 2 * key_dim + static_cast<size_t>(h) * dv + (c - 2 * dk);
    const float* w = p.conv_w + ch * K;
    const float current = p.proj[ch];
    float acc = 0.0f;
    for (int k = 0; k < K - 1; ++k) {
      const float x = p.conv_ring[static_cast<size_t>((pos + 1 + k) % K) * conv_dim + ch];
      acc += w[k] * x;
      if (p.ring_out) p.ring_out[static_cast<size_t>((pos + 1 + k) % K) * conv_dim + ch] = x;  // the window moves
    }
    acc += w[K - 1] * current;
    (p.ring_out ? p.ring_out : p.conv_ring)[static_cast<size_t>(pos % K) * conv_dim + ch] = current;
    const float y = gen::silu_exact(acc);
    if (c < dk) q_s[c] = y;
    else if (c < 2 * dk) k_s[c - dk] = y;
    else v_s[c - 2 * dk] = y;
  }
  __syncthreads();
}

__global__ void __launch_bounds__(gen::kThreads) gdn_step_generic_kernel(const __grid_constant__ GdnStepParams p) {
  extern __shared__ float smem[];  // q_s [d_k], k_s [d_k], v_s [d_v]
  __shared__ float red_s[32];
  const int dk = p.d_k, dv = p.d_v, h = blockIdx.x, kh = h / (p.n_v / p.n_k), pos = *p.pos;
  float* q_s = smem;
  float* k_s = smem + dk;
  float* v_s = smem + 2 * dk;
  conv_channels(p, h, kh, pos, q_s, k_s, v_s);

  // Eq 16.
  float qq = 0.0f, kk = 0.0f;
  for (int i = threadIdx.x; i < dk; i += blockDim.x) qq += q_s[i] * q_s[i], kk += k_s[i] * k_s[i];
  qq = gen::block_sum(qq, red_s);
  kk = gen::block_sum(kk, red_s);
  const float q_inv = 1.0f / sqrtf(qq + 1e-6f) * (1.0f / sqrtf(static_cast<float>(dk)));
  const float k_inv = 1.0f / sqrtf(kk + 1e-6f);
  __syncthreads();  // every thread has read q_s / k_s for its sums before they are scaled
  for (int i = threadIdx.x; i < dk; i += blockDim.x) q_s[i] *= q_inv, k_s[i] *= k_inv;
  __syncthreads();

  // Eq 17.
  const float* gates = p.proj + 2 * static_cast<size_t>(p.n_k) * dk + 2 * static_cast<size_t>(p.n_v) * dv;
  const float beta = gen::sigmoid_exact(gates[h]);
  const float a = gates[p.n_v + h] + p.dt_bias[h];
  const float softplus = a > 20.0f ? a : log1pf(expf(a));
  const float decay = expf(-expf(p.A_log[h]) * softplus);

  // Eq 18, a thread per column.
  const float* S = p.S + static_cast<size_t>(h) * dk * dv;
  float* S_w = (p.S_out ? p.S_out : p.S) + static_cast<size_t>(h) * dk * dv;  // gdn.cuh: S_out
  for (int j = threadIdx.x; j < dv; j += blockDim.x) {
    float kv = 0.0f;
    for (int i = 0; i < dk; ++i) kv += (decay * S[static_cast<size_t>(i) * dv + j]) * k_s[i];
    const float e = (v_s[j] - kv) * beta;
    float o = 0.0f;
    for (int i = 0; i < dk; ++i) {
      const size_t at = static_cast<size_t>(i) * dv + j;
      const float s_new = decay * S[at] + k_s[i] * e;
      S_w[at] = s_new;
      o += s_new * q_s[i];
    }
    p.o[static_cast<size_t>(h) * dv + j] = o;
  }
}

}  // namespace

// The argument checks of gdn_step in gdn.cu.
bool gdn_fast_supported(const GdnStepParams& p) {
  if (!p.proj || !p.conv_ring || !p.conv_w || !p.A_log || !p.dt_bias || !p.S || !p.pos || !p.o) return false;
  if (p.d_k != 128 || p.d_v <= 0 || p.d_v % 32 != 0) return false;
  if (p.n_k <= 0 || p.n_v <= 0 || p.n_v % p.n_k != 0) return false;
  return p.kernel == 4;
}

cudaError_t gdn_step_generic(const GdnStepParams& p, cudaStream_t stream) {
  if (!p.proj || !p.conv_ring || !p.conv_w || !p.A_log || !p.dt_bias || !p.S || !p.pos || !p.o) {
    return cudaErrorInvalidValue;
  }
  if (p.d_k <= 0 || p.d_k > gen::kMaxDim || p.d_v <= 0 || p.d_v > gen::kMaxDim) return cudaErrorInvalidValue;
  if (p.n_k <= 0 || p.n_v <= 0 || p.n_v % p.n_k != 0 || p.kernel < 1) return cudaErrorInvalidValue;
  const size_t smem = (2 * static_cast<size_t>(p.d_k) + p.d_v) * sizeof(float);  // <= 48 KiB
  gdn_step_generic_kernel<<<p.n_v, gen::kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace lily::cuda
