// Gated full attention for batch-1 decode (eqs 7-12), three kernels (and attn_fused, below: the whole layer with its
// projections in one persistent kernel):
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

// The whole attention decode layer (eqs 2 and 5: input_layernorm and residual, 7-8 in_proj, 9-12) as ONE
// persistent kernel instead of gemv attn_in + attn_prep + attn_decode + attn_combine + gemv attn_out (attn_fused.cu;
// opt-in, CudaBackendOptions::attn_fused). Three grid-wide barriers replace the four kernel boundaries:
//  phase A: every block normalises h (the chain GEMV's summation order: the same x bits); the warps of the grid
//           share the in_proj rows (gemv.cu's chunk code: the same proj bits);
//  barrier; phase B+C: block b takes split-KV units (kv head m, split s) as attn_decode's blocks: it prepares the
//           group's q itself (attn_prep's norm and RoPE), and the unit whose rows hold pos also k and v of head m,
//           which it appends to the caches before it reads that row; then attn_decode's code writes the partials;
//  barrier; attn_combine's code (gate included) writes the out_proj input;
//  barrier; phase D: the warps share the out_proj rows and add them to h (each element written once).
// Moves in_proj + out_proj (15.34 MB at full size) + the KV cache rows 0..pos. Shapes: head_dim 256, nq / nkv <= 8,
// H in {1024, 2048}, nq * head_dim in {2048, 4096}, both projections 4-bit with 16-byte aligned scales.
struct AttnFusedParams {
  QMatrix in_proj;                    // [nq*2*D + 2*nkv*D, H] 4-bit: q|gate interleaved per head, k, v
  QMatrix out_proj;                   // [H, nq*D] 4-bit
  float* h = nullptr;                 // [H] in/out residual stream, 16-byte aligned
  const float* input_norm = nullptr;  // [H] input_layernorm multiplier, 16-byte aligned
  const float* q_norm = nullptr;      // [D]
  const float* k_norm = nullptr;      // [D]
  int nq = 16, nkv = 2, head_dim = 256, rotary_dim = 64;
  float rope_theta = 1e7f;
  float eps = 1e-6f;                  // all three RMSNorms
  float scale = 0.0625f;              // 1/sqrt(D)
  const int* pos = nullptr;           // device: position of this token (= rows already cached)
  __nv_bfloat16* k_cache = nullptr;   // [max_ctx, nkv, D]
  __nv_bfloat16* v_cache = nullptr;
  int n_splits = 1;                   // as AttnDecodeParams (the decode graph is keyed by it)
  float* proj = nullptr;              // scratch [in_proj.rows]
  float* part_o = nullptr;            // scratch [n_splits, nq, D]
  float* part_ml = nullptr;           // scratch [n_splits, nq, 2]
  float* attn_out = nullptr;          // scratch [nq * D], 16-byte aligned: the out_proj's input
  unsigned* barrier = nullptr;        // one counter, zero before the first launch (see attn_fused.cu)
  bool prefetch_cache = false;        // as AttnDecodeParams: pos and cache rows < pos read before the wait
  int grid_blocks = 0;                // 0: every block that can be resident at once; else at most that many
};

// Whether attn_fused takes p's shapes, bits and pointers (everything its launcher checks except the grid size).
bool attn_fused_supported(const AttnFusedParams& p);
cudaError_t attn_fused(const AttnFusedParams& p, cudaStream_t stream);

}  // namespace lily::cuda
