// Gated full attention prefill (eqs 7-12) for T new rows of one layer:
//  attn_prefill_prep: from the fused projection rows [q|gate interleaved per head (nq*2*D) | k (nkv*D) | v (nkv*D)]:
//                     q/k RMSNorm, partial RoPE at positions pos0 + t (rope_element, as the decode prep), K/V
//                     appended to the bf16 cache at rows pos0 .. pos0+T-1, q (bf16, normalised, rotated) to scratch.
//  flash attention:   causal, GQA (nq/nkv query heads share a KV head), row t attends cache rows 0 .. pos0+t (the
//                     KV of earlier chunks plus the new rows), online softmax in fp32 on tensor cores (mma.sync
//                     bf16); out = softmax(q K^T * scale) V * sigmoid(gate), fp16 [T, nq*D] (the out_proj's A).
// FLOPs: 4 * nq * D * sum_t (pos0 + t + 1); moves the cache rows once per query tile.
#pragma once
#include <cuda_fp16.h>

#include "cuda/kernels/common.cuh"

namespace lily::cuda {

struct AttnPrefillParams {
  const float* proj = nullptr;    // [T, nq*2*D + 2*nkv*D] row-major
  int T = 0;
  int pos0 = 0;                   // rows already in the cache (host value)
  const float* q_norm = nullptr;  // [D]
  const float* k_norm = nullptr;  // [D]
  int nq = 16, nkv = 2, head_dim = 256, rotary_dim = 64;
  float rope_theta = 1e7f;
  float eps = 1e-6f;
  float scale = 0.0625f;          // 1/sqrt(D)
  __nv_bfloat16* k_cache = nullptr;  // [capacity, nkv, D]
  __nv_bfloat16* v_cache = nullptr;
  __half* out = nullptr;          // [T, nq*D] (fp16: the A operand of the out_proj qgemm)
  void* scratch = nullptr;        // attn_prefill_scratch_bytes(...) bytes, 16-byte aligned; starts with q bf16 [T, nq, D]
  size_t scratch_bytes = 0;
  // Flash stage: 0 = mma.sync (attn_prefill.cu, every shape it validates); 1 = Hopper wgmma
  // (attn_prefill_wgmma.cu: head_dim 256, sm_90a build, else cudaErrorInvalidValue / InvalidDeviceFunction
  // before anything is launched). Same prep, KV split, combine, epilogue and outputs within rounding.
  int variant = 0;
  // Tests only: skip the prep (q already in the scratch, the new K/V rows already in the cache).
  bool flash_only = false;
};

size_t attn_prefill_scratch_bytes(int T, int nq, int head_dim);
cudaError_t attn_prefill(const AttnPrefillParams& p, cudaStream_t stream);

// The wgmma flash stage (attn_prefill_wgmma.cu), called by attn_prefill for variant 1: whether this build has its
// sm_90a code for the current device, and the launch (n_splits > 1: unnormalised partials to part_o / part_ml
// for attn_prefill's combine, as the mma.sync kernel).
bool attn_prefill_wgmma_built();
cudaError_t attn_prefill_flash_wgmma(const AttnPrefillParams& p, int n_splits, float* part_o, float* part_ml,
                                     cudaStream_t stream);

}  // namespace lily::cuda
