// How long a context fits in a device's free memory: the arithmetic behind `--ctx-size auto` and the load-time
// check of a requested context (CUDA backend), kept pure so that it is tested without a GPU.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "model/config.h"
#include "util/status.h"

namespace lily {

// A sequence's memory: fixed + per_token * capacity bytes. fixed: the Gated DeltaNet layers' conv rings and states
// (and the position); per_token: K and V of every full-attention layer (bf16).
struct SequenceBytes {
  size_t fixed = 0;
  size_t per_token = 0;
};
SequenceBytes sequence_bytes(const ModelConfig& c);

// What must fit beside the weights already resident: one sequence of `context` tokens, the backend's scratch and a
// reserve for the runtime (graphs, the CUDA context's own allocations).
struct ContextFit {
  size_t free_bytes = 0;     // device memory free now (weights already uploaded)
  size_t scratch_bytes = 0;  // scratch still to allocate (prefill chunk, decode)
  size_t reserve_bytes = 0;
  SequenceBytes sequence;
};

// The largest capacity whose sequence fits (0 when not even one token does), at most model_max.
int64_t max_context_that_fits(const ContextFit& f, int64_t model_max);

// ok when `context` tokens fit; else an error naming what it needs, what is free and the largest context that fits.
Status check_context_fits(const ContextFit& f, int64_t context, int64_t model_max, const std::string& device);

// Whether an optional allocation of `extra` bytes (the CUDA backend's fp16 expert copies) leaves room for what a
// server holds beside it: `streams` sequences of `context` tokens and `headroom` more bytes (its session cache),
// on top of f's scratch and reserve. A context below 1 or above model_max never fits.
bool optional_fits(const ContextFit& f, size_t extra, int64_t context, int64_t model_max, int streams,
                   size_t headroom);

}  // namespace lily
