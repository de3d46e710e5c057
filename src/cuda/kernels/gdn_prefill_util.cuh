// Internals shared by the Gated DeltaNet prefill's translation units: gdn_prefill.cu (conv, gates, norm and the
// choice of scan), gdn_scan_rows.cu (GdnScan::sequential), gdn_chunk_prep.cu (the chunked scans' state-independent
// part), gdn_chunk_scan.cu (GdnScan::chunked) and gdn_chunk_state.cu (GdnScan::chunked_split). Block sizes, the
// scratch sections, the cp.async helpers and the scans' launchers.
#pragma once
#include "cuda/kernels/gdn_prefill.cuh"

namespace lily::cuda::gdn_prefill_impl {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kCols = 32;                     // columns of S per scan block
constexpr int kRowsPerStage = 16;             // rows staged into shared memory at a time
constexpr int kKernel = 4;
constexpr int kChunk = 64;                   // rows per chunk of the chunked scans

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
  float* hs;     // [nc, n_v, d_k, d_v] S at each chunk's start (GdnScan::chunked_split)
};

// Eq 18 over the T rows, from the prepared scratch (q, k, v, gates) into scratch o and p.S.
cudaError_t scan_rows(const GdnPrefillParams& p, const Scratch& s, cudaStream_t stream);       // sequential
cudaError_t chunk_prep(const GdnPrefillParams& p, const Scratch& s, cudaStream_t stream);      // W, U, P, exp(G)
cudaError_t scan_chunked(const GdnPrefillParams& p, const Scratch& s, cudaStream_t stream);    // after chunk_prep
// After chunk_prep; wgmma: the state pass on warpgroup MMAs (GdnScan::chunked_wgmma, only where wgmma_built()).
// *normed: the output pass also applied eq 19 and wrote the conv ring into p (sm_90 code), so gdn_norm_kernel
// must not run; else O is in scratch o as for the other scans.
cudaError_t scan_chunked_split(const GdnPrefillParams& p, const Scratch& s, bool wgmma, bool* normed,
                               cudaStream_t stream);

#if defined(__CUDACC__)
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
#endif  // __CUDACC__

}  // namespace lily::cuda::gdn_prefill_impl
