#include "cpu/ops.h"

#include <vector>

namespace lily::cpu {

void matmul(ThreadPool& pool, const Linear& W, const float* x, int64_t T, float* y) {
  const int64_t in = W.in, out = W.out;
  if (T == 1) {
    pool.parallel_for(out, 16, [&](int64_t begin, int64_t end) {
      for (int64_t o = begin; o < end; ++o) y[o] = W.dot_row(o, x);
    });
    return;
  }
  pool.parallel_for(out, 4, [&](int64_t begin, int64_t end) {
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
