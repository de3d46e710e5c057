#include "cuda/kernels/embed.cuh"

namespace lily::cuda {

namespace {

__global__ void embed_lookup_kernel(const __grid_constant__ EmbedParams p) {
  const int row = *p.token;
  const int per_word = 32 / p.table.bits;
  const uint32_t mask = (1u << p.table.bits) - 1;
  const uint32_t* w = p.table.w + static_cast<size_t>(row) * p.table.words_per_row();
  const __nv_bfloat16* s = p.table.scales + static_cast<size_t>(row) * p.table.groups_per_row();
  const __nv_bfloat16* b = p.table.biases + static_cast<size_t>(row) * p.table.groups_per_row();
  for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < p.table.cols; j += gridDim.x * blockDim.x) {
    uint32_t q = (w[j / per_word] >> ((j % per_word) * p.table.bits)) & mask;
    p.h[j] = __bfloat162float(s[j / 64]) * static_cast<float>(q) + __bfloat162float(b[j / 64]);
  }
}

__global__ void advance_position_kernel(int* pos) { *pos += 1; }

}  // namespace

cudaError_t embed_lookup(const EmbedParams& p, cudaStream_t stream) {
  if (!p.table.w || !p.token || !p.h || p.table.cols % 64) return cudaErrorInvalidValue;
  embed_lookup_kernel<<<(p.table.cols + 255) / 256, 256, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t advance_position(int* pos, cudaStream_t stream) {
  advance_position_kernel<<<1, 1, 0, stream>>>(pos);
  return cudaGetLastError();
}

}  // namespace lily::cuda
