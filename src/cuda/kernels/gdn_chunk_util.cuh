// Device code of the chunked Gated DeltaNet scans (gdn_chunk_prep.cu, gdn_chunk_scan.cu, gdn_chunk_state.cu): the
// 3xTF32 operand fragments of mma.sync m16n8k8 (tf32 operands alone put o ~1e-2 of its RMS off: the products'
// terms cancel) and the shared-memory strides.
#pragma once
#include "cuda/kernels/gdn_prefill_util.cuh"

#if defined(__CUDACC__)
namespace lily::cuda::gdn_prefill_impl {

// x rounded to tf32 (10 mantissa bits), to nearest with ties away from zero: cvt.rna.tf32.f32's result for finite x,
// in two integer instructions instead of a conversion.
__device__ __forceinline__ uint32_t tf32(float x) { return (__float_as_uint(x) + 0x1000u) & 0xffffe000u; }

// An mma.sync m16n8k8 operand fragment (A: N = 4, B: N = 2) in tf32 with its rounding remainder
// (3xTF32: a b ~ a_hi b_hi + a_hi b_lo + a_lo b_hi, ~fp32 accuracy for 3 tensor-core products).
template <int N>
struct Frag {
  uint32_t hi[N], lo[N];
  Frag() = default;
  __device__ __forceinline__ explicit Frag(const float (&x)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      hi[i] = tf32(x[i]);
      lo[i] = tf32(x[i] - __uint_as_float(hi[i]));
    }
  }
};

__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// d += a b for one 16x8x8 tile, fp32 accumulation. Fragments (g = lane / 4, t = lane % 4): a = A[g][t], A[g+8][t],
// A[g][t+4], A[g+8][t+4]; b = B[t][g], B[t+4][g]; d = D[g][2t], D[g][2t+1], D[g+8][2t], D[g+8][2t+1].
__device__ __forceinline__ void mma(float (&d)[4], const Frag<4>& a, const Frag<2>& b) {
  mma_tf32(d, a.lo, b.hi);
  mma_tf32(d, a.hi, b.lo);
  mma_tf32(d, a.hi, b.hi);
}

// d += a b in 3xTF32 with the two correction products in accumulators of their own (ca += a_lo b_hi, cb += a_hi b_lo):
// three independent mma per k-step instead of mma's chain of three into d. The caller adds d + (ca + cb) once, after
// the last k-step (GdnScan::chunked_split). Not the rounding order of mma: fp32-class, not bit-identical (see
// gdn_chunk_state_kernel for the bound).
__device__ __forceinline__ void mma_sep(float (&d)[4], float (&ca)[4], float (&cb)[4], const Frag<4>& a,
                                        const Frag<2>& b) {
  mma_tf32(ca, a.lo, b.hi);
  mma_tf32(cb, a.hi, b.lo);
  mma_tf32(d, a.hi, b.hi);
}

// Shared-memory row strides (floats): a tile read as a row-major A operand or a transposed B operand has a
// stride = 4 mod 32, one read as a row-major B operand or a transposed A operand 8 mod 32 (conflict-free fragments).
constexpr int kLdT = kChunk + 4;  // [64][64] tiles: A (I + A)^-1, P

template <int D>
constexpr size_t chunk_prep_smem() {
  return sizeof(float) * (2 * kChunk * (D + 4) + 2 * kChunk * kLdT + 2 * kChunk);
}

// x as Frag splits it (its tf32 rounding and the tf32 rounding of the remainder), as floats,
// for an operand stored split once and read back as fragments by several warps (frag_pre).
__device__ __forceinline__ float2 split_tf32(float x) {
  const uint32_t hi = tf32(x);
  return make_float2(__uint_as_float(hi), __uint_as_float(tf32(x - __uint_as_float(hi))));
}

// The B fragment {B[t][g], B[t+4][g]} (elements i0, i1) of an operand stored split by split_tf32: the same bits as
// Frag<2> of the unsplit values, without the conversions.
__device__ __forceinline__ Frag<2> frag_pre(const float* hi, const float* lo, int i0, int i1) {
  Frag<2> f;
  f.hi[0] = __float_as_uint(hi[i0]), f.hi[1] = __float_as_uint(hi[i1]);
  f.lo[0] = __float_as_uint(lo[i0]);
  f.lo[1] = __float_as_uint(lo[i1]);
  return f;
}

constexpr int kChunkCols = 32;  // columns of S per block of the chunked scans

}  // namespace lily::cuda::gdn_prefill_impl
#endif  // __CUDACC__
