#include "cpu/ops.h"

#include <vector>

namespace lily::cpu {

// Every row gets the same arithmetic whatever T (the weight row dequantized, then one ordered dot), so a
// forward of 1+K verification rows gives bit for bit the logits K+1 single-token decodes would: speculative
// decoding's greedy output is then the plain loop's, token for token.
void matmul(ThreadPool& pool, const Linear& W, const float* x, int64_t T, float* y) {
  const int64_t in = W.in, out = W.out;
  pool.parallel_for(out, T == 1 ? 16 : 4, [&](int64_t begin, int64_t end) {
    std::vector<float> row(static_cast<size_t>(in));
    for (int64_t o = begin; o < end; ++o) {
      W.dequant_row(o, row.data());
      for (int64_t t = 0; t < T; ++t) {
        const float* xt = x + t * in;
        float acc = 0;
        for (int64_t i = 0; i < in; ++i) acc += row[i] * xt[i];
        y[t * out + o] = acc;
      }
    }
  });
}

void rms_norm(const float* x, const float* w, int64_t rows, int64_t n, float eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    float inv = 1.0f / std::sqrt(static_cast<float>(ss / n) + eps);
    for (int64_t i = 0; i < n; ++i) y[r * n + i] = xr[i] * inv * w[i];
  }
}

void embed(const Linear& E, const int32_t* ids, int64_t T, float* y) {
  for (int64_t t = 0; t < T; ++t) E.dequant_row(ids[t], y + t * E.in);
}

}  // namespace lily::cpu
