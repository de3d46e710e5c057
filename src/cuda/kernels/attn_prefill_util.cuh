// Device code shared by the two flash kernels of the prefill attention (eqs 11-12 of docs/MODEL.md):
// attn_prefill.cu (mma.sync) and attn_prefill_wgmma.cu (wgmma). Both take the same blocks (query tile, kv head,
// KV split), hold per warp 16 rows of one head in the m16n8 accumulator layout (lane g = lane / 4, t4 = lane % 4:
// rows g and g + 8, columns 8 nt + 2 t4 + {0, 1} of n8 block nt), run the same online softmax in log2 units and
// write the same outputs (gated fp16 rows, or a split's partials for attn_prefill_combine). The kernels keep their
// own accumulator arrays; the functions here reach them through accessors at(nt, e) -> float& (element e = 0..3
// of n8 block nt: e / 2 selects the row g + 8 (e / 2), e % 2 the column).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/kernels/attn_prefill.cuh"

namespace lily::cuda::attn_prefill_util {

inline int ceil_div(int a, int b) { return (a + b - 1) / b; }

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// S of one cache tile (BN columns from k0) to log2 units (times s_mul = scale log2(e)), masked past each row's
// last visible cache row lim[r] when the tile crosses the diagonal (`masked`); mx: the lane's row maxima.
template <int BN, class S>
__device__ __forceinline__ void scale_mask_max(S s, int k0, int t4, bool masked, const int (&lim)[2], float s_mul,
                                               float (&mx)[2]) {
#pragma unroll
  for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = e / 2, col = k0 + nt * 8 + 2 * t4 + (e & 1);
      float v = s(nt, e) * s_mul;
      if (masked && col > lim[r]) v = -INFINITY;
      s(nt, e) = v;
      mx[r] = fmaxf(mx[r], v);
    }
}

// The online-softmax update of the lane's two rows from the tile's maxima mx: the row max over the 4 lanes of the
// row, the new running max, the factor alpha of the old O and l, and m_use, the max to subtract from the tile's
// scores (0 for a row with nothing visible yet, which keeps o = 0, l = 0).
__device__ __forceinline__ void online_softmax_update(float (&mx)[2], float (&m_run)[2], float (&l_run)[2],
                                                      float (&alpha)[2], float (&m_use)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    const float m_new = fmaxf(m_run[r], mx[r]);
    m_use[r] = m_new == -INFINITY ? 0.0f : m_new;
    alpha[r] = exp2f(m_run[r] - m_use[r]);
    m_run[r] = m_new;
    l_run[r] *= alpha[r];
  }
}

// O (D columns) times alpha, only when a running max of the warp grew (rare once the rows have seen many keys).
template <int D, class O>
__device__ __forceinline__ void rescale_o(O o, const float (&alpha)[2]) {
  if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
      o(nt, 0) *= alpha[0];
      o(nt, 1) *= alpha[0];
      o(nt, 2) *= alpha[1];
      o(nt, 3) *= alpha[1];
    }
  }
}

// Epilogue of a warp (eq 12's gate): rows g, g + 8 of query positions tw0 .., head jh. One split: out = O / l *
// sigmoid(gate), fp16; else O, max and sum to the split's partials (a row that sees no cache row of this split
// writes max -inf, sum 0, O 0).
// Args: the kernel's arguments (p, n_splits, part_o, part_ml).
template <int D, class Args, class O>
__device__ __forceinline__ void flash_epilogue(const Args& args, int split, int jh, int tw0, int g, int t4, O o,
                                               const float (&m_run)[2], const float (&l_run)[2]) {
  const AttnPrefillParams& p = args.p;
  const size_t proj_stride = static_cast<size_t>(p.nq) * 2 * D + size_t{2} * p.nkv * D;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = l_run[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int t = tw0 + g + 8 * r;
    if (t >= p.T) continue;
    if (args.n_splits > 1) {
      const size_t row = (static_cast<size_t>(split) * p.T + t) * p.nq + jh;
      float* dst = args.part_o + row * D;
#pragma unroll
      for (int nt = 0; nt < D / 8; ++nt)
        *reinterpret_cast<float2*>(dst + nt * 8 + 2 * t4) = make_float2(o(nt, 2 * r), o(nt, 2 * r + 1));
      if (t4 == 0) *reinterpret_cast<float2*>(args.part_ml + row * 2) = make_float2(m_run[r], l);
      continue;
    }
    const float inv_l = 1.0f / l;
    const float* gate = p.proj + static_cast<size_t>(t) * proj_stride + static_cast<size_t>(jh) * 2 * D + D;
    __half* dst = p.out + (static_cast<size_t>(t) * p.nq + jh) * D;
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
      const int d = nt * 8 + 2 * t4;
      const float2 gv = *reinterpret_cast<const float2*>(gate + d);
      const float y0 = o(nt, 2 * r) * inv_l * (1.0f / (1.0f + expf(-gv.x)));
      const float y1 = o(nt, 2 * r + 1) * inv_l * (1.0f / (1.0f + expf(-gv.y)));
      *reinterpret_cast<__half2*>(dst + d) = __floats2half2_rn(y0, y1);
    }
  }
}

}  // namespace lily::cuda::attn_prefill_util
