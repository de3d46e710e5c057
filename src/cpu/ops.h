// Plain fp32 building blocks of the CPU reference backend. Matrix products are split over output rows on the
// thread pool; quantized rows are dequantized on the fly (no bf16/fp32 copy of a 4-bit model ever exists).
#pragma once
#include <cmath>
#include <cstdint>

#include "model/weights.h"
#include "util/thread_pool.h"

namespace lily::cpu {

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline float silu(float x) { return x * sigmoid(x); }
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

// y[t, o] = sum_i W[o, i] x[t, i] for t < T. x: [T, W.in], y: [T, W.out].
void matmul(ThreadPool& pool, const Linear& W, const float* x, int64_t T, float* y);

// Eq 1-2 with a plain multiplier w (the (1+w) shift is applied at load): y = x / RMS(x) * w, per row of n.
void rms_norm(const float* x, const float* w, int64_t rows, int64_t n, float eps, float* y);

// Embedding lookup: rows of E for the given ids (dequantized).
void embed(const Linear& E, const int32_t* ids, int64_t T, float* y);

}  // namespace lily::cpu
