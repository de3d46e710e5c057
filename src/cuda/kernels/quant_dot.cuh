// Device helpers shared by the decode GEMV and MoE kernels (gemv.cu, moe.cu): streaming 16-byte weight loads,
// MLX 4-bit / 8-bit dot products on one 16-byte vector of packed weights, and the block prologues that build
// the input x in shared memory (plain copy, RMSNorm, gated RMSNorm).
//
// 4-bit dequantisation without integer->float conversions: a nibble q moved into bits 16..19 of the word
// 0x3F000000 reads as the float 0.5 + q/256 (one byte permute, exact). So per 32-element vector
//   acc = sum (0.5 + q/256) x = 0.5 S + (sum q x) / 256, with S = sum x,
// and the group term s * sum q x + b * S = (256 s) acc + (b - 128 s) S. The 0.5 S part is of the size of the
// q x part (q/256 <= 0.06, |0.5| not much larger than its spread), so no precision is lost to cancellation.
//
// Shared-memory layout of x: element e at e + 4 * (e / 32) ("padded"): each 32-float vector starts 144 bytes
// after the previous one, so the 16-byte reads of 8 lanes fetching 8 different vectors hit distinct banks.
#pragma once
#include "cuda/kernels/common.cuh"

namespace lily::cuda {

constexpr int kVecElems4 = 32;  // elements of one 16-byte vector of 4-bit weights
constexpr int kVecElems8 = 16;  // ... of 8-bit weights

__device__ __forceinline__ int xpad(int e) { return e + 4 * (e >> 5); }
__host__ __device__ constexpr int xpad_floats(int cols) { return cols + cols / 8; }

// Weights are read once per token: bypass L1.
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// 16-byte asynchronous copy global -> shared (L2 only); zero-fills the destination when !valid.
__device__ __forceinline__ void cp_async_16(void* dst_s, const void* src, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(dst_s));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ unsigned short ld_bf16_bits(const __nv_bfloat16* p) {
  return __ldg(reinterpret_cast<const unsigned short*>(p));
}
__device__ __forceinline__ float bf16_bits_to_float(unsigned short b) {
  return __uint_as_float(static_cast<uint32_t>(b) << 16);
}

// Byte i of v (a nibble, 0..15) as the float 0.5 + q/256.
template <int i>
__device__ __forceinline__ float nibble_as_float(uint32_t v) {
  return __uint_as_float(__byte_perm(v, 0x3F000000u, 0x7044 | (i << 8)));
}

// sum_e (0.5 + q_e/256) x_e over the 32 elements of a 4-bit vector (see the header).
__device__ __forceinline__ float dot_q4_vec(uint4 w, const float (&x)[32]) {
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
  float acc_lo = 0.0f, acc_hi = 0.0f;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint32_t lo = words[k] & 0x0F0F0F0Fu;         // elements 8k + 0, 2, 4, 6
    const uint32_t hi = (words[k] >> 4) & 0x0F0F0F0Fu;  // elements 8k + 1, 3, 5, 7
    acc_lo = fmaf(nibble_as_float<0>(lo), x[8 * k + 0], acc_lo);
    acc_hi = fmaf(nibble_as_float<0>(hi), x[8 * k + 1], acc_hi);
    acc_lo = fmaf(nibble_as_float<1>(lo), x[8 * k + 2], acc_lo);
    acc_hi = fmaf(nibble_as_float<1>(hi), x[8 * k + 3], acc_hi);
    acc_lo = fmaf(nibble_as_float<2>(lo), x[8 * k + 4], acc_lo);
    acc_hi = fmaf(nibble_as_float<2>(hi), x[8 * k + 5], acc_hi);
    acc_lo = fmaf(nibble_as_float<3>(lo), x[8 * k + 6], acc_lo);
    acc_hi = fmaf(nibble_as_float<3>(hi), x[8 * k + 7], acc_hi);
  }
  return acc_lo + acc_hi;
}

// dot_q4_vec of one weight vector against two x vectors, each exactly as dot_q4_vec computes it (the same fmaf
// chains in the same order), with each weight's float decoded once for both.
__device__ __forceinline__ void dot_q4_vec2(uint4 w, const float (&x0)[32], const float (&x1)[32], float& d0,
                                            float& d1) {
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
  float lo0 = 0.0f, hi0 = 0.0f, lo1 = 0.0f, hi1 = 0.0f;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint32_t lo = words[k] & 0x0F0F0F0Fu;
    const uint32_t hi = (words[k] >> 4) & 0x0F0F0F0Fu;
    const float q0 = nibble_as_float<0>(lo), q1 = nibble_as_float<0>(hi), q2 = nibble_as_float<1>(lo);
    const float q3 = nibble_as_float<1>(hi), q4 = nibble_as_float<2>(lo), q5 = nibble_as_float<2>(hi);
    const float q6 = nibble_as_float<3>(lo), q7 = nibble_as_float<3>(hi);
    lo0 = fmaf(q0, x0[8 * k + 0], lo0), lo1 = fmaf(q0, x1[8 * k + 0], lo1);
    hi0 = fmaf(q1, x0[8 * k + 1], hi0), hi1 = fmaf(q1, x1[8 * k + 1], hi1);
    lo0 = fmaf(q2, x0[8 * k + 2], lo0), lo1 = fmaf(q2, x1[8 * k + 2], lo1);
    hi0 = fmaf(q3, x0[8 * k + 3], hi0), hi1 = fmaf(q3, x1[8 * k + 3], hi1);
    lo0 = fmaf(q4, x0[8 * k + 4], lo0), lo1 = fmaf(q4, x1[8 * k + 4], lo1);
    hi0 = fmaf(q5, x0[8 * k + 5], hi0), hi1 = fmaf(q5, x1[8 * k + 5], hi1);
    lo0 = fmaf(q6, x0[8 * k + 6], lo0), lo1 = fmaf(q6, x1[8 * k + 6], lo1);
    hi0 = fmaf(q7, x0[8 * k + 7], hi0), hi1 = fmaf(q7, x1[8 * k + 7], hi1);
  }
  d0 = lo0 + hi0, d1 = lo1 + hi1;
}

// The group term s * sum(q x) + b * sum(x) from acc = dot_q4_vec(...) and x_sum = sum(x).
__device__ __forceinline__ float q4_group_term(float acc, float x_sum, unsigned short s_bits, unsigned short b_bits) {
  const float s = bf16_bits_to_float(s_bits), b = bf16_bits_to_float(b_bits);
  return fmaf(256.0f * s, acc, fmaf(-128.0f, s, b) * x_sum);
}

// sum q_e x_e over the 16 elements of an 8-bit vector (q exact: 2^23 + q as a float, minus 2^23).
__device__ __forceinline__ float dot_q8_vec(uint4 w, const float* x) {
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
  float acc = 0.0f;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float q = __uint_as_float(__byte_perm(words[k], 0x4B000000u, 0x7440 | i)) - 8388608.0f;
      acc = fmaf(q, x[4 * k + i], acc);
    }
  }
  return acc;
}

// Loads the 32 floats of vector `vec` of a padded x in shared memory into registers; returns their sum.
__device__ __forceinline__ float load_x_vec(const float* x_s, int vec, float (&x)[32]) {
  const float4* src = reinterpret_cast<const float4*>(x_s + vec * 36);
  float sum = 0.0f;
#pragma unroll
  for (int t = 0; t < 8; ++t) {
    const float4 v = src[t];
    x[4 * t] = v.x, x[4 * t + 1] = v.y, x[4 * t + 2] = v.z, x[4 * t + 3] = v.w;
    sum += (v.x + v.y) + (v.z + v.w);
  }
  return sum;
}

// The 4-bit row layout of the decode kernels for rows of COLS elements: a group of L lanes covers a row with V
// 16-byte vectors per lane (lane j of the group reads vectors v * L + j); a warp holds 32 / L rows side by side
// and P passes of them make a chunk, so each lane has P * V (= 8) loads in flight.
template <int COLS>
struct Q4Layout {
  static constexpr int kVecsPerRow = COLS / kVecElems4;
  static constexpr int kVecsPerLane = COLS >= 2048 ? COLS / 1024 : 1;       // V
  static constexpr int kLanesPerRow = kVecsPerRow / kVecsPerLane;           // L: 16 or 32
  static constexpr int kRowsPerPass = 32 / kLanesPerRow;                    // rows side by side in a warp
  static constexpr int kPasses = kVecsPerLane >= 8 ? 1 : 8 / kVecsPerLane;  // P
  static constexpr int kRowsPerChunk = kRowsPerPass * kPasses;
  static constexpr int kLanesPerValue = kLanesPerRow / kPasses;  // after group_reduce_scatter<P, L>
  static_assert(kLanesPerRow == 16 || kLanesPerRow == 32, "cols 512..4096");
};

// One lane's weights of a chunk: P passes x V vectors, with their bf16 scale and bias bits.
template <int COLS>
struct Q4Chunk {
  using Lay = Q4Layout<COLS>;
  uint4 w[Lay::kPasses][Lay::kVecsPerLane];
  unsigned short s[Lay::kPasses][Lay::kVecsPerLane], b[Lay::kPasses][Lay::kVecsPerLane];

  // Issues the loads of pass `pass` (a compile-time constant after unrolling): row `row` of m, lane j of its
  // group; an invalid row loads nothing and contributes 0.
  __device__ __forceinline__ void load(int pass, const QMatrix& m, int row, bool valid, int j) {
    const uint4* w_row = reinterpret_cast<const uint4*>(m.w) + static_cast<size_t>(row) * Lay::kVecsPerRow;
    const size_t g_row = static_cast<size_t>(row) * (COLS / 64);
#pragma unroll
    for (int v = 0; v < Lay::kVecsPerLane; ++v) {
      const int vec = v * Lay::kLanesPerRow + j;
      w[pass][v] = valid ? ld_stream(w_row + vec) : make_uint4(0, 0, 0, 0);
      s[pass][v] = valid ? ld_bf16_bits(m.scales + g_row + vec / 2) : 0;
      b[pass][v] = valid ? ld_bf16_bits(m.biases + g_row + vec / 2) : 0;
    }
  }

  // part[pass] = this lane's share of row(pass) . x, x padded in shared memory.
  __device__ __forceinline__ void dot(const float* x_s, int j, float (&part)[Lay::kPasses]) const {
#pragma unroll
    for (int pass = 0; pass < Lay::kPasses; ++pass) part[pass] = 0.0f;
#pragma unroll
    for (int v = 0; v < Lay::kVecsPerLane; ++v) {
      float x[32];
      const float x_sum = load_x_vec(x_s, v * Lay::kLanesPerRow + j, x);
#pragma unroll
      for (int pass = 0; pass < Lay::kPasses; ++pass) {
        part[pass] += q4_group_term(dot_q4_vec(w[pass][v], x), x_sum, s[pass][v], b[pass][v]);
      }
    }
  }
};

// Block-wide sum; `red_s` holds >= 32 floats. All threads get the result.
__device__ __forceinline__ float block_sum(float v, float* red_s) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n_warps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // red_s may still be read by a previous call
  if (lane == 0) red_s[warp] = v;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < n_warps; ++w) total += red_s[w];
  return total;
}

__host__ __device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

// A thread's sum of squares of one float4 and its normalised value: the terms of block_load_x (and of the several-row
// gemv prologue, which must match it bit for bit).
__device__ __forceinline__ float x4_sum_squares(const float4& v) {
  return (v.x * v.x + v.y * v.y) + (v.z * v.z + v.w * v.w);
}
__device__ __forceinline__ float4 x4_normalised(const float4& v, float inv_rms, const float4& w) {
  return make_float4(v.x * inv_rms * w.x, v.y * inv_rms * w.y, v.z * inv_rms * w.z, v.w * inv_rms * w.w);
}

// x_s (padded) = in, or in / RMS(in) * norm_w (eqs 1-2, multiplier form) when norm_w is given. Fast path (16-byte
// aligned inputs, cols % 4 == 0, cols <= 16 * blockDim): each thread loads up to 4 float4 of in and of norm_w at
// once (one memory round trip, ~60 instructions; the scalar version was ~700 per thread); else a strided loop.
__device__ __forceinline__ void block_load_x(const float* in, const float* norm_w, float eps, int cols, float* x_s,
                                             float* red_s) {
  constexpr int kVecsPerThread = 4;
  const int n_vecs = cols / 4;
  if (cols % 4 == 0 && n_vecs <= kVecsPerThread * static_cast<int>(blockDim.x) && aligned16(in) &&
      (!norm_w || aligned16(norm_w))) {
    const float4* in4 = reinterpret_cast<const float4*>(in);
    const float4* w4 = reinterpret_cast<const float4*>(norm_w);
    float4 v[kVecsPerThread], w[kVecsPerThread];
    float ss = 0.0f;
#pragma unroll
    for (int t = 0; t < kVecsPerThread; ++t) {
      const int i = threadIdx.x + t * blockDim.x;
      v[t] = i < n_vecs ? in4[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      w[t] = i < n_vecs && norm_w ? w4[i] : make_float4(1.0f, 1.0f, 1.0f, 1.0f);
      ss += x4_sum_squares(v[t]);
    }
    const float inv_rms = norm_w ? rsqrtf(block_sum(ss, red_s) / static_cast<float>(cols) + eps) : 1.0f;
#pragma unroll
    for (int t = 0; t < kVecsPerThread; ++t) {
      const int i = threadIdx.x + t * blockDim.x;
      if (i < n_vecs) {  // 4 consecutive elements stay contiguous in the padded layout
        *reinterpret_cast<float4*>(x_s + xpad(4 * i)) = x4_normalised(v[t], inv_rms, w[t]);
      }
    }
  } else {
    float inv_rms = 1.0f;
    if (norm_w) {
      float ss = 0.0f;
      for (int e = threadIdx.x; e < cols; e += blockDim.x) ss += in[e] * in[e];
      inv_rms = rsqrtf(block_sum(ss, red_s) / static_cast<float>(cols) + eps);
    }
    for (int e = threadIdx.x; e < cols; e += blockDim.x) x_s[xpad(e)] = norm_w ? in[e] * inv_rms * norm_w[e] : in[e];
  }
  __syncthreads();
}

// silu with the approximate division (MUFU.RCP + FMUL, 2 ulp): the IEEE one branches to a slow path per element,
// which serialised the 16 exp/rcp chains of a thread in the gated prologue. x / inf = 0 for very negative x.
__device__ __forceinline__ float silu_fast(float x) { return __fdividef(x, 1.0f + __expf(-x)); }

// Eq 19's value of 4 consecutive elements: norm_w * o / RMS(o_head) * silu(z) (the gated GEMV prologues').
__device__ __forceinline__ float4 x4_gated(const float4& o, float inv_rms, const float4& w, const float4& z) {
  return make_float4(w.x * (o.x * inv_rms) * silu_fast(z.x), w.y * (o.y * inv_rms) * silu_fast(z.y),
                     w.z * (o.z * inv_rms) * silu_fast(z.z), w.w * (o.w * inv_rms) * silu_fast(z.w));
}

// Eq 19 per head of head_dim: x_s (padded) = norm_w[d] * o / RMS(o_head) * silu(z).
// Fast path (head_dim = 16 L with L a power of two <= 32, 16-byte aligned inputs): each lane takes 16 consecutive
// elements (4 float4 of o, z and norm_w, loaded at once), so a head is L adjacent lanes and its sum of squares is
// log2(L) shuffles: no shared memory, no block barrier, ~150 instructions a thread. (The previous version, 16
// strided values a thread with per-element integer division and modulo by head_dim, compiled to ~4,150
// instructions a thread: the 13 us of the gated GEMV.) Else a warp per head.
__device__ __forceinline__ void block_load_x_gated(const float* o, const float* z, const float* norm_w, int head_dim,
                                                   float eps, int cols, float* x_s) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n_warps = blockDim.x >> 5;
  const int lanes_per_head = head_dim / 16;
  if (head_dim % 16 == 0 && lanes_per_head <= 32 && (lanes_per_head & (lanes_per_head - 1)) == 0 &&
      aligned16(o) && aligned16(z) && aligned16(norm_w)) {
    const float4* o4 = reinterpret_cast<const float4*>(o);
    const float4* z4 = reinterpret_cast<const float4*>(z);
    const float4* w4 = reinterpret_cast<const float4*>(norm_w);
    for (int base = 512 * warp; base < cols; base += 512 * n_warps) {  // warp-uniform: full-warp shuffles
      const int e0 = base + 16 * lane;
      const bool valid = e0 < cols;  // cols is a multiple of head_dim, so a head is all valid or all not
      const int d0 = e0 & (head_dim - 1);
      float4 ov[4], zv[4], wv[4];
      float ss = 0.0f;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        ov[q] = valid ? o4[e0 / 4 + q] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        zv[q] = valid ? z4[e0 / 4 + q] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        wv[q] = valid ? w4[d0 / 4 + q] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
#pragma unroll
      for (int q = 0; q < 4; ++q)
        ss += (ov[q].x * ov[q].x + ov[q].y * ov[q].y) + (ov[q].z * ov[q].z + ov[q].w * ov[q].w);
      for (int offset = 1; offset < lanes_per_head; offset <<= 1)
        ss += __shfl_xor_sync(0xffffffffu, ss, offset);
      const float inv_rms = rsqrtf(ss / static_cast<float>(head_dim) + eps);
      if (valid) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          *reinterpret_cast<float4*>(x_s + xpad(e0 + 4 * q)) = x4_gated(ov[q], inv_rms, wv[q], zv[q]);
        }
      }
    }
  } else {
    for (int head = warp; head * head_dim < cols; head += n_warps) {
      const float* o_h = o + head * head_dim;
      float ss = 0.0f;
      for (int d = lane; d < head_dim; d += 32) ss += o_h[d] * o_h[d];
      const float inv_rms = rsqrtf(warp_sum(ss) / static_cast<float>(head_dim) + eps);
      for (int d = lane; d < head_dim; d += 32) {
        const int e = head * head_dim + d;
        x_s[xpad(e)] = norm_w[d] * (o_h[d] * inv_rms) * siluf_(z[e]);
      }
    }
  }
  __syncthreads();
}

// Sum over the lanes of each group of L consecutive lanes for P values at once (a reduce-scatter butterfly:
// log2(P) levels exchange half of the remaining values, then a plain butterfly). Afterwards lane j of a group
// holds the full sum of value number j / (L / P) in v[0]. P <= L, both powers of two.
template <int P, int L>
__device__ __forceinline__ void group_reduce_scatter(float (&v)[P], int lane) {
  static_assert(P <= L && (P & (P - 1)) == 0 && (L & (L - 1)) == 0, "powers of two, P <= L");
  int count = P;
#pragma unroll
  for (int offset = L / 2; offset >= 1; offset >>= 1) {
    const bool upper = lane & offset;
    if (count > 1) {
      const int half = count / 2;
#pragma unroll
      for (int i = 0; i < P / 2; ++i) {
        if (i < half) {
          const float send = upper ? v[i] : v[i + half];
          const float keep = upper ? v[i + half] : v[i];
          v[i] = keep + __shfl_xor_sync(0xffffffffu, send, offset);
        }
      }
      count = half;
    } else {
      v[0] += __shfl_xor_sync(0xffffffffu, v[0], offset);
    }
  }
}

}  // namespace lily::cuda
