#include "cpu/ops.h"

#include <vector>

#include "model/quant.h"

namespace lily::cpu {

// Every row gets the same arithmetic whatever T (Linear::dot_row's; for quantized weights and many rows, the
// codes are unpacked once and mlx_dot_codes repeats mlx_dot_row's operations), so a forward of 1+K
// verification rows gives bit for bit the logits K+1 single-token decodes would: speculative decoding's greedy
// output is then the plain loop's, token for token. (Bitwise equality assumes no FMA contraction, as on x86-64
// without -march flags.)
void matmul(ThreadPool& pool, const Linear& W, const float* x, int64_t T, float* y) {
  const int64_t in = W.in, out = W.out;
  if (T < 8 || !W.quantized()) {  // a few rows (decode, verification): unpacking on the fly is cheaper
    pool.parallel_for(out, T == 1 ? 16 : 4, [&](int64_t begin, int64_t end) {
      for (int64_t o = begin; o < end; ++o)
        for (int64_t t = 0; t < T; ++t) y[t * out + o] = W.dot_row(o, x + t * in);
    });
    return;
  }
  const int64_t words = packed_words(in, W.bits), groups = in / kQuantGroup;
  pool.parallel_for(out, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> codes(static_cast<size_t>(in));
    for (int64_t o = begin; o < end; ++o) {
      mlx_unpack_codes(static_cast<const uint32_t*>(W.w) + o * words, in, W.bits, codes.data());
      for (int64_t t = 0; t < T; ++t)
        y[t * out + o] = mlx_dot_codes(codes.data(), W.scales + o * groups, W.biases + o * groups, in, W.bits,
                                       x + t * in);
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
