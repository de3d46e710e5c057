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

// ---- several decode rows (one per sequence) in one call -----------------------------------------------------------
// The fast kernels' batched launches where every row takes the fast kernel, else one generic launch per row.

inline cudaError_t gemv_rows(const GemvParams& p, cudaStream_t s) {
  GemvParams one = p;
  one.n_rows = 1;
  if (p.n_rows == 1) return dispatch::gemv(one, s);
  if (gemv_fast_supported(one)) return cuda::gemv_rows(p, s);
  for (int r = 0; r < p.n_rows; ++r) CUDA_TRY(gemv_generic(gemv_row(p, r), s));
  return cudaSuccess;
}

template <class P, class Supported, class Fast, class Generic>
cudaError_t rows_or_loop(const P* rows, int n, Supported supported, Fast fast, Generic generic, cudaStream_t s) {
  bool all_fast = true;
  for (int r = 0; r < n; ++r) all_fast = all_fast && supported(rows[r]);
  if (all_fast) return fast(rows, n, s);
  for (int r = 0; r < n; ++r) CUDA_TRY(generic(rows[r], s));
  return cudaSuccess;
}

#define LILY_DISPATCH_ROWS(name, Params, supported)                                                            \
  inline cudaError_t name##_rows(const Params* rows, int n, cudaStream_t s) {                                  \
    return rows_or_loop(                                                                                       \
        rows, n, [](const Params& p) { return supported(p); }, cuda::name##_rows,                               \
        [](const Params& p, cudaStream_t st) { return name##_generic(p, st); }, s);                            \
  }
LILY_DISPATCH_ROWS(moe_route, MoeRouteParams, moe_fast_supported)
LILY_DISPATCH_ROWS(moe_expert_in, MoeExpertInParams, moe_fast_supported)
LILY_DISPATCH_ROWS(moe_expert_out, MoeExpertOutParams, moe_fast_supported)
LILY_DISPATCH_ROWS(attn_prep, AttnPrepParams, attn_fast_supported)
LILY_DISPATCH_ROWS(attn_decode, AttnDecodeParams, attn_fast_supported)
LILY_DISPATCH_ROWS(attn_combine, AttnCombineParams, attn_fast_supported)
LILY_DISPATCH_ROWS(gdn_step, GdnStepParams, gdn_fast_supported)
#undef LILY_DISPATCH_ROWS

}  // namespace lily::cuda::dispatch
