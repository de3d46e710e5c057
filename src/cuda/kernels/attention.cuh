// Gated full attention for batch-1 decode (eqs 7-12), three kernels:
//  attn_prep:    from the fused projection [q|gate interleaved per head (nq*2*D) | k (nkv*D) | v (nkv*D)]:
//                q/k RMSNorm (multiplier form, shared over heads), partial RoPE (NeoX half split on the first
//                rotary_dim dims, theta_i = rope_theta^(-2i/rotary_dim), position *pos), KV append (bf16) at row *pos.
//  attn_decode:  split-KV (flash-decoding) GQA attention over rows 0..*pos of the cache: block (kv head m, split s)
//                reads each K/V row of its range once for all nq/nkv query heads of m (GQA packing), 16-byte
//                coalesced loads; writes unnormalised partial outputs and (max, sum) per split. Moves
//                (*pos+1) * nkv * D * 2 * 2 bytes.
//  attn_combine: merges the splits, divides by the softmax sum, multiplies by sigmoid(gate): out [nq*D].
// Cache layout: K and V each [max_ctx, nkv, D] bf16. All three use programmatic dependent launch: each waits for
// its predecessor before reading what that kernel (or an earlier one) wrote.
#pragma once
#include "cuda/kernels/common.cuh"

namespace lily::cuda {

struct AttnPrepParams {
  const float* proj = nullptr;    // [nq*2*D + 2*nkv*D]
  const float* q_norm = nullptr;  // [D]
  const float* k_norm = nullptr;  // [D]
  int nq = 16, nkv = 2, head_dim = 256, rotary_dim = 64;
  float rope_theta = 1e7f;
  float eps = 1e-6f;
  const int* pos = nullptr;       // device: position of this token (= rows already cached)
  float* q = nullptr;             // out [nq, D]: normalised, rotated
  __nv_bfloat16* k_cache = nullptr;  // [max_ctx, nkv, D]
  __nv_bfloat16* v_cache = nullptr;
};

struct AttnDecodeParams {
  const float* q = nullptr;  // [nq, D]
  const __nv_bfloat16* k_cache = nullptr;
  const __nv_bfloat16* v_cache = nullptr;
  int nq = 16, nkv = 2, head_dim = 256;
  const int* pos = nullptr;  // device: attend over rows 0..*pos inclusive
  int n_splits = 1;          // grid = nkv * n_splits; rows are divided evenly over splits at run time
  float scale = 0.0625f;     // 1/sqrt(D)
  float* part_o = nullptr;   // out [n_splits, nq, D] unnormalised
  float* part_ml = nullptr;  // out [n_splits, nq, 2]: running max and sum of exp
  // The kernel starts before attn_prep has finished (programmatic dependent launch) and waits for it before reading
  // q. With prefetch_cache it also reads *pos and starts copying cache rows < *pos before that wait: only valid when
  // no kernel still in flight writes them (the decode graph: rows < pos were appended in earlier steps, pos is
  // written by advance_position at the end of the previous step); row *pos, appended by attn_prep, comes after.
  bool prefetch_cache = false;
};

struct AttnCombineParams {
  const float* part_o = nullptr;
  const float* part_ml = nullptr;
  int n_splits = 1, nq = 16, head_dim = 256;
  const float* proj = nullptr;  // the fused projection: gate of head j at proj[j*2*D + D + d]
  float* out = nullptr;         // [nq * D] = softmax(qK^T) V * sigmoid(gate)
};

cudaError_t attn_prep(const AttnPrepParams& p, cudaStream_t stream);
cudaError_t attn_decode(const AttnDecodeParams& p, cudaStream_t stream);
cudaError_t attn_combine(const AttnCombineParams& p, cudaStream_t stream);
// n <= kMaxBatchRows rows (sequences) of one layer in one launch each (grid z = row), each row exactly as the
// single-row launch.
cudaError_t attn_prep_rows(const AttnPrepParams* rows, int n, cudaStream_t stream);
cudaError_t attn_decode_rows(const AttnDecodeParams* rows, int n, cudaStream_t stream);
cudaError_t attn_combine_rows(const AttnCombineParams* rows, int n, cudaStream_t stream);

}  // namespace lily::cuda
