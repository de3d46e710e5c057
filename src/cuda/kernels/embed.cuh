// Small per-step kernels of the decode graph:
//  embed_lookup: h = dequantized row `*token` of the embedding (eq 4). Moves H/2 bytes (4-bit).
//  advance_position: *pos += 1 at the end of a step (the graph reads positions from device memory);
//  advance_positions: the same for every row of a several-row step.
//  embed_rows: the prefill form of embed_lookup: h[t] = dequantized row tokens[t] for T rows. Moves T*H/2 bytes.
//  set_position: *pos = value (after a prefill chunk, so that the decode graph continues from it).
#pragma once
#include "cuda/kernels/common.cuh"

namespace lily::cuda {

struct EmbedParams {
  QMatrix table;             // [V, H]
  const int* token = nullptr;
  float* h = nullptr;        // out [H]
};

cudaError_t embed_lookup(const EmbedParams& p, cudaStream_t stream);
cudaError_t advance_position(int* pos, cudaStream_t stream);
// advance_position for the n sequences of a several-row decode step, in one launch.
struct PositionList {
  int* pos[kMaxBatchRows];
  int n = 0;
};
cudaError_t advance_positions(const PositionList& list, cudaStream_t stream);
cudaError_t embed_rows(const QMatrix& table, const int* tokens, int T, float* h, cudaStream_t stream);
cudaError_t set_position(int* pos, int value, cudaStream_t stream);

}  // namespace lily::cuda
