// Generic decode kernels: the same operations, Params structs and semantics as the fast launchers (gemv.cuh,
// moe.cuh, attention.cuh, gdn.cuh), for ANY geometry the model family can have (the tiny/small synthetic presets:
// hidden 128 or 1024, head_dim 64, d_k 64, expert width 64 or 256, cols not multiples of 512). Plain kernels, a
// warp or block per output row with grid-stride loops, fp32 math in the CPU reference's order where it is cheap;
// correctness over speed.
//
// Accepted shapes (launchers return cudaErrorInvalidValue otherwise, never crash):
//  gemv_generic:           bits 4 or 8, cols a multiple of 64 and <= 51200 (x lives in shared memory), any rows;
//                          gated_rms_norm: cols a multiple of head_dim.
//  moe_route_generic:      router 8-bit [E, H] (E <= 4096), shared gate 8-bit [1, H], H a multiple of 64, top_k in
//                          [1, min(16, E)]. Two kernels (logits, then softmax + top-k); `counter` is not used (it
//                          stays at whatever it was: zero), so it may be null.
//  moe_expert_in_generic:  gate/up [E, I, H] and shared [I, H] (Is == I, as the fast kernel), 4 or 8 bits.
//  moe_expert_out_generic: down [E, H, I] and shared [H, I], 4 or 8 bits.
//  attn_prep_generic:      any head_dim <= 4096, rotary_dim even <= head_dim.
//  attn_decode_generic:    nq a multiple of nkv, head_dim <= 4096, n_splits in [1, 4096]; rows are divided over
//                          the splits as chunks of ceil((*pos+1) / n_splits) (empty splits write max -inf, sum 0,
//                          o 0), so its partials merge with attn_combine or attn_combine_generic alike.
//  attn_combine_generic:   any head_dim, n_splits in [1, 4096].
//  gdn_step_generic:       n_v a multiple of n_k, d_k and d_v <= 4096, any conv kernel >= 1.
//
// The *_fast_supported predicates say whether the fast launcher accepts p (they mirror its argument checks), so
// a caller can pick: fast_supported(p) ? fast(p) : generic(p). Keep them in step with the fast launchers.
#pragma once
#include "cuda/kernels/attention.cuh"
#include "cuda/kernels/gdn.cuh"
#include "cuda/kernels/gemv.cuh"
#include "cuda/kernels/moe.cuh"

namespace lily::cuda {

bool gemv_fast_supported(const GemvParams& p);
bool moe_fast_supported(const MoeRouteParams& p);
bool moe_fast_supported(const MoeExpertInParams& p);
bool moe_fast_supported(const MoeExpertOutParams& p);
bool attn_fast_supported(const AttnPrepParams& p);
bool attn_fast_supported(const AttnDecodeParams& p);
bool attn_fast_supported(const AttnCombineParams& p);
bool gdn_fast_supported(const GdnStepParams& p);

cudaError_t gemv_generic(const GemvParams& p, cudaStream_t stream);
cudaError_t moe_route_generic(const MoeRouteParams& p, cudaStream_t stream);
cudaError_t moe_expert_in_generic(const MoeExpertInParams& p, cudaStream_t stream);
cudaError_t moe_expert_out_generic(const MoeExpertOutParams& p, cudaStream_t stream);
cudaError_t attn_prep_generic(const AttnPrepParams& p, cudaStream_t stream);
cudaError_t attn_decode_generic(const AttnDecodeParams& p, cudaStream_t stream);
cudaError_t attn_combine_generic(const AttnCombineParams& p, cudaStream_t stream);
cudaError_t gdn_step_generic(const GdnStepParams& p, cudaStream_t stream);

}  // namespace lily::cuda
