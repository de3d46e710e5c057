#include "model/quant.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "util/bf16.h"
#include "util/check.h"
#include "util/unaligned.h"

namespace lily {

void mlx_quantize(const float* w, int64_t rows, int64_t cols, int bits, uint32_t* wq, uint16_t* scales,
                  uint16_t* biases) {
  CHECK(bits == 4 || bits == 8, "bits %d", bits);
  CHECK(cols % kQuantGroup == 0, "cols %lld not a multiple of %d", (long long)cols, kQuantGroup);
  const float n_bins = static_cast<float>((1 << bits) - 1);
  const int per_word = 32 / bits;
  const int64_t groups = cols / kQuantGroup;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* x = w + r * cols + g * kQuantGroup;
      float w_min = std::numeric_limits<float>::infinity(), w_max = -w_min;
      for (int j = 0; j < kQuantGroup; ++j) {
        w_max = std::max(w_max, x[j]);
        w_min = std::min(w_min, x[j]);
      }
      // The edge with the larger magnitude gets code 0; the scale is negated when that edge is the max.
      bool mask = std::abs(w_min) > std::abs(w_max);
      float scale = std::max((w_max - w_min) / n_bins, 1e-7f);
      scale = mask ? scale : -scale;
      float edge = mask ? w_min : w_max;
      float q0 = std::rint(edge / scale);
      float bias = 0;
      if (q0 != 0) {
        scale = edge / q0;
        bias = edge;
      }
      uint32_t* out = wq + r * packed_words(cols, bits) + g * (kQuantGroup / per_word);
      for (int j = 0; j < kQuantGroup / per_word; ++j) {
        uint32_t word = 0;
        for (int k = 0; k < per_word; ++k) {
          float q = std::rint((x[j * per_word + k] - bias) / scale);
          q = std::min(std::max(q, 0.0f), n_bins);
          word |= static_cast<uint32_t>(q) << (k * bits);
        }
        out[j] = word;
      }
      scales[r * groups + g] = float_to_bf16_bits(scale);
      biases[r * groups + g] = float_to_bf16_bits(bias);
    }
  }
}

void mlx_dequantize_row(const uint32_t* wq_row, const uint16_t* scales_row, const uint16_t* biases_row,
                        int64_t cols, int bits, float* out) {
  const int per_word = 32 / bits;
  const uint32_t mask = (1u << bits) - 1;
  for (int64_t g = 0; g < cols / kQuantGroup; ++g) {
    float s = bf16_to_float(load_unaligned<uint16_t>(scales_row, g)), b = bf16_to_float(load_unaligned<uint16_t>(biases_row, g));
    const uint32_t* words = wq_row + g * (kQuantGroup / per_word);
    float* o = out + g * kQuantGroup;
    for (int j = 0; j < kQuantGroup; ++j) {
      uint32_t q = (load_unaligned<uint32_t>(words, j / per_word) >> ((j % per_word) * bits)) & mask;
      o[j] = s * static_cast<float>(q) + b;
    }
  }
}

namespace {

// sum_j q_j x_j over one group of 64, with the codes unpacked a word at a time.
template <int kBits>
inline float group_qdot(const uint32_t* words, const float* x) {
  constexpr int kPerWord = 32 / kBits;
  constexpr uint32_t kMask = (1u << kBits) - 1;
  float acc[kPerWord] = {};
  for (int w = 0; w < kQuantGroup / kPerWord; ++w) {
    uint32_t word = load_unaligned<uint32_t>(words, w);
    for (int k = 0; k < kPerWord; ++k) acc[k] += static_cast<float>((word >> (k * kBits)) & kMask) * x[w * kPerWord + k];
  }
  float sum = 0;
  for (int k = 0; k < kPerWord; ++k) sum += acc[k];
  return sum;
}

// group_qdot on unpacked codes: the same partial sums in the same order.
template <int kBits>
inline float group_codes_dot(const float* codes, const float* x) {
  constexpr int kPerWord = 32 / kBits;
  float acc[kPerWord] = {};
  for (int w = 0; w < kQuantGroup / kPerWord; ++w)
    for (int k = 0; k < kPerWord; ++k) acc[k] += codes[w * kPerWord + k] * x[w * kPerWord + k];
  float sum = 0;
  for (int k = 0; k < kPerWord; ++k) sum += acc[k];
  return sum;
}

}  // namespace

void mlx_unpack_codes(const uint32_t* wq_row, int64_t cols, int bits, float* codes) {
  const int per_word = 32 / bits;
  const uint32_t mask = (1u << bits) - 1;
  for (int64_t w = 0; w < cols / per_word; ++w) {
    const uint32_t word = load_unaligned<uint32_t>(wq_row, w);
    for (int k = 0; k < per_word; ++k) codes[w * per_word + k] = static_cast<float>((word >> (k * bits)) & mask);
  }
}

float mlx_dot_codes(const float* codes, const uint16_t* scales_row, const uint16_t* biases_row, int64_t cols,
                    int bits, const float* x) {
  float acc = 0;
  for (int64_t g = 0; g < cols / kQuantGroup; ++g) {
    const float* cg = codes + g * kQuantGroup;
    const float* xg = x + g * kQuantGroup;
    float qx = bits == 4 ? group_codes_dot<4>(cg, xg) : group_codes_dot<8>(cg, xg);
    float sx = 0;
    for (int j = 0; j < kQuantGroup; ++j) sx += xg[j];
    acc += bf16_to_float(load_unaligned<uint16_t>(scales_row, g)) * qx +
           bf16_to_float(load_unaligned<uint16_t>(biases_row, g)) * sx;
  }
  return acc;
}

float mlx_dot_row(const uint32_t* wq_row, const uint16_t* scales_row, const uint16_t* biases_row, int64_t cols,
                  int bits, const float* x) {
  // sum_j (s q_j + b) x_j = s * sum q_j x_j + b * sum x_j, per group.
  const int words_per_group = kQuantGroup * bits / 32;
  float acc = 0;
  for (int64_t g = 0; g < cols / kQuantGroup; ++g) {
    const uint32_t* words = wq_row + g * words_per_group;
    const float* xg = x + g * kQuantGroup;
    float qx = bits == 4 ? group_qdot<4>(words, xg) : group_qdot<8>(words, xg);
    float sx = 0;
    for (int j = 0; j < kQuantGroup; ++j) sx += xg[j];
    acc += bf16_to_float(load_unaligned<uint16_t>(scales_row, g)) * qx +
           bf16_to_float(load_unaligned<uint16_t>(biases_row, g)) * sx;
  }
  return acc;
}

}  // namespace lily
