#include "cuda/kernels/embed.cuh"

namespace lily::cuda {

namespace {

// Row `row` of the table into h (threads of the block's x dimension stride over the columns).
__device__ void embed_row(const QMatrix& table, int row, float* h, int first, int stride) {
  const int per_word = 32 / table.bits;
  const uint32_t mask = (1u << table.bits) - 1;
  const uint32_t* w = table.w + static_cast<size_t>(row) * table.words_per_row();
  const __nv_bfloat16* s = table.scales + static_cast<size_t>(row) * table.groups_per_row();
  const __nv_bfloat16* b = table.biases + static_cast<size_t>(row) * table.groups_per_row();
  for (int j = first; j < table.cols; j += stride) {
    uint32_t q = (w[j / per_word] >> ((j % per_word) * table.bits)) & mask;
    h[j] = __bfloat162float(s[j / 64]) * static_cast<float>(q) + __bfloat162float(b[j / 64]);
  }
}

__global__ void embed_rows_kernel(const QMatrix table, const int* tokens, float* h) {
  embed_row(table, tokens[blockIdx.x], h + static_cast<size_t>(blockIdx.x) * table.cols, threadIdx.x, blockDim.x);
}

__global__ void set_position_kernel(int* pos, int value) { *pos = value; }

__global__ void embed_lookup_kernel(const __grid_constant__ EmbedParams p) {
  const trace::BlockTrace trace_block(trace::kEmbed);
  embed_row(p.table, *p.token, p.h, blockIdx.x * blockDim.x + threadIdx.x, gridDim.x * blockDim.x);
}

__global__ void advance_position_kernel(int* pos) {
  const trace::BlockTrace trace_block(trace::kAdvance); *pos += 1; }

__global__ void advance_positions_kernel(const PositionList list) {
  const trace::BlockTrace trace_block(trace::kAdvance);
  if (static_cast<int>(threadIdx.x) < list.n) *list.pos[threadIdx.x] += 1;
}

}  // namespace

cudaError_t advance_positions(const PositionList& list, cudaStream_t stream) {
  if (list.n < 1 || list.n > kMaxBatchRows) return cudaErrorInvalidValue;
  for (int r = 0; r < list.n; ++r)
    if (!list.pos[r]) return cudaErrorInvalidValue;
  advance_positions_kernel<<<1, 32, 0, stream>>>(list);
  return cudaGetLastError();
}

cudaError_t embed_lookup(const EmbedParams& p, cudaStream_t stream) {
  if (!p.table.w || !p.token || !p.h || p.table.cols % 64) return cudaErrorInvalidValue;
  embed_lookup_kernel<<<(p.table.cols + 255) / 256, 256, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t embed_rows(const QMatrix& table, const int* tokens, int T, float* h, cudaStream_t stream) {
  if (!table.w || !tokens || !h || T < 1 || table.cols % 64) return cudaErrorInvalidValue;
  embed_rows_kernel<<<T, 256, 0, stream>>>(table, tokens, h);
  return cudaGetLastError();
}

cudaError_t set_position(int* pos, int value, cudaStream_t stream) {
  set_position_kernel<<<1, 1, 0, stream>>>(pos, value);
  return cudaGetLastError();
}

cudaError_t advance_position(int* pos, cudaStream_t stream) {
  advance_position_kernel<<<1, 1, 0, stream>>>(pos);
  return cudaGetLastError();
}

}  // namespace lily::cuda
