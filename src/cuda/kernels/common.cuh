// Shared helpers of the CUDA kernels: error checks, the MLX quantized matrix view, warp reductions.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace lily::cuda {

#define CUDA_TRY(expr)                            \
  do {                                            \
    cudaError_t _e = (expr);                      \
    if (_e != cudaSuccess) return _e;             \
  } while (0)

// An MLX affine-quantized matrix [rows, cols] in device memory, exactly the checkpoint layout (shared/MODEL.md
// 2.4): w packed uint32 [rows, cols*bits/32] (element j of a row in word j*bits/32, LSB first), scales and biases
// bf16 [rows, cols/64]; value = scale * q + bias. A stacked expert tensor [E, rows, cols] is `n_mats` of these
// back to back (matrix e starts at row e*rows).
struct QMatrix {
  const uint32_t* w = nullptr;
  const __nv_bfloat16* scales = nullptr;
  const __nv_bfloat16* biases = nullptr;
  int rows = 0;
  int cols = 0;
  int bits = 4;
  __host__ __device__ size_t words_per_row() const { return static_cast<size_t>(cols) * bits / 32; }
  __host__ __device__ size_t groups_per_row() const { return static_cast<size_t>(cols) / 64; }
  // Matrix e of a stacked tensor.
  __host__ __device__ QMatrix expert(int e) const {
    QMatrix m = *this;
    m.w = w + static_cast<size_t>(e) * rows * words_per_row();
    m.scales = scales + static_cast<size_t>(e) * rows * groups_per_row();
    m.biases = biases + static_cast<size_t>(e) * rows * groups_per_row();
    return m;
  }
  __host__ __device__ size_t bytes() const {
    return static_cast<size_t>(rows) * (words_per_row() * 4 + groups_per_row() * 4);
  }
};

// Device-only helpers; host-compiled code (the .cpp op tests) includes this header for QMatrix alone.
#if defined(__CUDACC__)
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + __expf(-x)); }
__device__ __forceinline__ float siluf_(float x) { return x * sigmoidf_(x); }
#endif  // __CUDACC__

}  // namespace lily::cuda
