// Kernel dispatch for the decode step: the fast kernel when its launcher accepts the shape (the real model's
// geometry), else the generic kernel of the same semantics (synthetic test geometries). See generic.cuh.
#pragma once
#include "cuda/kernels/attention.cuh"
#include "cuda/kernels/gdn.cuh"
#include "cuda/kernels/gemv.cuh"
#include "cuda/kernels/generic.cuh"
#include "cuda/kernels/moe.cuh"

namespace lily::cuda::dispatch {

inline cudaError_t gemv(const GemvParams& p, cudaStream_t s) {
  return gemv_fast_supported(p) ? cuda::gemv(p, s) : gemv_generic(p, s);
}
inline cudaError_t moe_route(const MoeRouteParams& p, cudaStream_t s) {
  return moe_fast_supported(p) ? cuda::moe_route(p, s) : moe_route_generic(p, s);
}
inline cudaError_t moe_expert_in(const MoeExpertInParams& p, cudaStream_t s) {
  return moe_fast_supported(p) ? cuda::moe_expert_in(p, s) : moe_expert_in_generic(p, s);
}
inline cudaError_t moe_expert_out(const MoeExpertOutParams& p, cudaStream_t s) {
  return moe_fast_supported(p) ? cuda::moe_expert_out(p, s) : moe_expert_out_generic(p, s);
}
inline cudaError_t attn_prep(const AttnPrepParams& p, cudaStream_t s) {
  return attn_fast_supported(p) ? cuda::attn_prep(p, s) : attn_prep_generic(p, s);
}
inline cudaError_t attn_decode(const AttnDecodeParams& p, cudaStream_t s) {
  return attn_fast_supported(p) ? cuda::attn_decode(p, s) : attn_decode_generic(p, s);
}
inline cudaError_t attn_combine(const AttnCombineParams& p, cudaStream_t s) {
  return attn_fast_supported(p) ? cuda::attn_combine(p, s) : attn_combine_generic(p, s);
}
inline cudaError_t gdn_step(const GdnStepParams& p, cudaStream_t s) {
  return gdn_fast_supported(p) ? cuda::gdn_step(p, s) : gdn_step_generic(p, s);
}

}  // namespace lily::cuda::dispatch
