// CPU-side helpers of the prefill GEMM tests (test_qgemm.cpp, test_moe_prefill.cpp, test_qgemm_wgmma.cpp): the fp16
// dequantisation the GEMM kernels see, a dot product with its tolerance, fp16 host buffers.
#pragma once
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cuda_test_util.h"

namespace lily::cuda::test {

inline constexpr double kAcc = 3e-5;        // fp32 accumulation, relative to the sum of |terms|
inline constexpr double kF16 = 1.0 / 2048;  // fp16 rounding, relative (unit roundoff 2^-11)
inline constexpr double kUlp = 1.0 / 1024;  // one fp16 ulp, relative (worst case, normal numbers)

inline float f16_round(float v) { return f16_bits_to_float(to_f16_bits(v)); }

// Row `row` of m, dequantized and rounded to fp16 exactly as the GEMM kernels see it.
inline void dequant_row_f16(const HostQMatrix& m, size_t row, std::vector<float>& out) {
  out.resize(m.cols);
  const size_t wpr = m.words_per_row(), gpr = m.groups_per_row();
  const int per_word = 32 / m.bits, words_per_group = kQuantGroup / per_word;
  const uint32_t mask = (1u << m.bits) - 1;
  const uint32_t* words = &m.words[row * wpr];
  float* o = out.data();
  for (size_t g = 0; g < gpr; ++g) {
    const float s = bf16_bits_to_float(m.scales[row * gpr + g]),
                b = bf16_bits_to_float(m.biases[row * gpr + g]);
    for (int i = 0; i < words_per_group; ++i) {
      uint32_t w = words[g * words_per_group + i];
      for (int j = 0; j < per_word; ++j, w >>= m.bits)
        *o++ = f16_round(s * static_cast<float>(w & mask) + b);
    }
  }
}

// A dot product and what its tolerance is made of.
struct Dot {
  double dot = 0, abs_sum = 0, max_term = 0, err_in = 0;  // err_in: sum |w_j| * err_j of the inputs
  double tol() const { return kAcc * abs_sum + 2 * kUlp * max_term + err_in + 1e-7; }
};

inline Dot dot_row(const std::vector<float>& w, const float* x, const double* x_err = nullptr) {
  Dot d;
  for (size_t j = 0; j < w.size(); ++j) {
    const double t = static_cast<double>(w[j]) * x[j];
    d.dot += t;
    d.abs_sum += std::fabs(t);
    d.max_term = std::max(d.max_term, std::fabs(t));
    if (x_err) d.err_in += std::fabs(w[j]) * x_err[j];
  }
  return d;
}

inline std::vector<uint16_t> to_f16(const std::vector<float>& v) {
  std::vector<uint16_t> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = to_f16_bits(v[i]);
  return b;
}

inline const __half* as_f16(const DeviceBuffer<uint16_t>& b) { return reinterpret_cast<const __half*>(b.get()); }
inline __half* as_f16_mut(const DeviceBuffer<uint16_t>& b) { return reinterpret_cast<__half*>(b.get()); }


}  // namespace lily::cuda::test
