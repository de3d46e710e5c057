// MLX affine quantization (docs/MODEL.md 2.4): hand-computed groups (packing, negative scales, the edge snap),
// a 10-line reference quantizer written from the spec, round-trip error bounds, and mlx_dot_row against the dot
// product of the dequantized row.
#include "model/quant.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "util/bf16.h"

namespace lily {
namespace {

// Code j of a packed row, read as MODEL.md 2.4 says: word j/per_word, shift bits*(j%per_word), LSB first.
uint32_t code_at(const uint32_t* words, int64_t j, int bits) {
  const int per_word = 32 / bits;
  return (words[j / per_word] >> (bits * (j % per_word))) & ((1u << bits) - 1);
}

// w = scale * q + bias with bf16 scale and bias.
float dequant_at(const uint32_t* row, const uint16_t* scales, const uint16_t* biases, int64_t j, int bits) {
  return bf16_to_float(scales[j / 64]) * static_cast<float>(code_at(row, j, bits)) + bf16_to_float(biases[j / 64]);
}

struct Quantized {
  std::vector<uint32_t> wq;
  std::vector<uint16_t> scales, biases;
};

Quantized quantize(const std::vector<float>& w, int64_t rows, int64_t cols, int bits) {
  Quantized q;
  q.wq.assign(static_cast<size_t>(rows * cols * bits / 32), 0xdeadbeef);
  q.scales.assign(static_cast<size_t>(rows * cols / 64), 0);
  q.biases.assign(q.scales.size(), 0);
  mlx_quantize(w.data(), rows, cols, bits, q.wq.data(), q.scales.data(), q.biases.data());
  return q;
}

TEST(Quant, PackedWords) {
  EXPECT_EQ(packed_words(2048, 4), 256);
  EXPECT_EQ(packed_words(2048, 8), 512);
  EXPECT_EQ(packed_words(512, 4), 64);
}

// w_j = 0.25 * (j % 16) - 1: min -1, max 2.75. |max| >= |min|, so the max is the edge at code 0 and the scale is
// negated: scale = -(3.75 / 15) = -0.25, bias = 2.75, code_j = 15 - j % 16.
TEST(Quant, HandComputed4BitNegativeScale) {
  std::vector<float> w(64);
  for (int j = 0; j < 64; ++j) w[j] = 0.25f * static_cast<float>(j % 16) - 1.0f;
  Quantized q = quantize(w, 1, 64, 4);
  ASSERT_EQ(q.wq.size(), 8u);
  EXPECT_EQ(bf16_to_float(q.scales[0]), -0.25f);
  EXPECT_EQ(bf16_to_float(q.biases[0]), 2.75f);
  // Word 0 holds j = 0..7 (codes 15..8) at shifts 0, 4, ..., 28; word 1 holds codes 7..0.
  for (int k = 0; k < 8; k += 2) {
    EXPECT_EQ(q.wq[k], 0x89ABCDEFu) << "word " << k;
    EXPECT_EQ(q.wq[k + 1], 0x01234567u) << "word " << k + 1;
  }
  // Little-endian bytes: byte b holds element 2b in its low nibble and 2b+1 in its high nibble.
  uint8_t bytes[4];
  std::memcpy(bytes, &q.wq[0], 4);
  EXPECT_EQ(bytes[0], 0xEF);  // element 0 -> code 15 (low), element 1 -> code 14 (high)
  EXPECT_EQ(bytes[3], 0x89);
  for (int j = 0; j < 64; ++j) {
    EXPECT_EQ(code_at(q.wq.data(), j, 4), static_cast<uint32_t>(15 - j % 16)) << j;
    EXPECT_EQ(dequant_at(q.wq.data(), q.scales.data(), q.biases.data(), j, 4), w[j]) << j;  // exact
  }
  std::vector<float> back(64);
  mlx_dequantize_row(q.wq.data(), q.scales.data(), q.biases.data(), 64, 4, back.data());
  EXPECT_EQ(back, w);
}

// The mirror image: w_j = 0.25 * (j % 16) - 2.75, |min| > |max|: the min is the edge, the scale stays positive.
TEST(Quant, HandComputed4BitPositiveScale) {
  std::vector<float> w(64);
  for (int j = 0; j < 64; ++j) w[j] = 0.25f * static_cast<float>(j % 16) - 2.75f;
  Quantized q = quantize(w, 1, 64, 4);
  EXPECT_EQ(bf16_to_float(q.scales[0]), 0.25f);
  EXPECT_EQ(bf16_to_float(q.biases[0]), -2.75f);
  EXPECT_EQ(q.wq[0], 0x76543210u);
  EXPECT_EQ(q.wq[1], 0xFEDCBA98u);
  std::vector<float> back(64);
  mlx_dequantize_row(q.wq.data(), q.scales.data(), q.biases.data(), 64, 4, back.data());
  EXPECT_EQ(back, w);
}

// w_j = -0.9375 + 0.125 (j % 16): |min| == |max|, so the max is the edge and the scale negative. The plain scale
// would be -1.875/15 = -0.125; the edge snap makes it edge / rint(edge / scale) = 0.9375 / rint(-7.5) = 0.9375 / -8
// = -0.1171875 (rint: half to even), so 0 is exactly code 8, and the min needs code rint(16) = 16, clamped to 15.
// (All values are exact in float and bf16.)
TEST(Quant, EdgeSnapAndEqualMagnitudes) {
  std::vector<float> w(64);
  for (int j = 0; j < 64; ++j) w[j] = -0.9375f + 0.125f * static_cast<float>(j % 16);
  Quantized q = quantize(w, 1, 64, 4);
  EXPECT_EQ(bf16_to_float(q.scales[0]), -0.1171875f);
  EXPECT_EQ(bf16_to_float(q.biases[0]), 0.9375f);
  const uint32_t want[16] = {15, 15, 14, 13, 12, 11, 10, 9, 7, 6, 5, 4, 3, 2, 1, 0};  // rint(16 - 16k/15), clamped
  for (int j = 0; j < 64; ++j) EXPECT_EQ(code_at(q.wq.data(), j, 4), want[j % 16]) << j;
  EXPECT_EQ(dequant_at(q.wq.data(), q.scales.data(), q.biases.data(), 0, 4), -0.8203125f);  // -0.9375 clamped
  EXPECT_EQ(bf16_to_float(q.scales[0]) * 8 + bf16_to_float(q.biases[0]), 0.0f);
}

// 8 bits, 4 codes per word: w_0 = 0, w_j = j (1..62), w_63 = 63.75. Edge = max, scale = -63.75/255 = -0.25,
// bias = 63.75, code_j = (63.75 - w_j) * 4.
TEST(Quant, HandComputed8Bit) {
  std::vector<float> w(64);
  for (int j = 0; j < 64; ++j) w[j] = static_cast<float>(j);
  w[63] = 63.75f;
  Quantized q = quantize(w, 1, 64, 8);
  ASSERT_EQ(q.wq.size(), 16u);
  EXPECT_EQ(bf16_to_float(q.scales[0]), -0.25f);
  EXPECT_EQ(bf16_to_float(q.biases[0]), 63.75f);
  EXPECT_EQ(q.wq[0], 0xF3F7FBFFu);   // codes 255, 251, 247, 243 at shifts 0, 8, 16, 24
  EXPECT_EQ(q.wq[15], 0x00070B0Fu);  // j = 60..63: codes 15, 11, 7, 0
  for (int j = 0; j < 64; ++j) {
    EXPECT_EQ(code_at(q.wq.data(), j, 8), static_cast<uint32_t>(std::lround((63.75f - w[j]) * 4))) << j;
    EXPECT_EQ(dequant_at(q.wq.data(), q.scales.data(), q.biases.data(), j, 8), w[j]) << j;
  }
}

// Groups and rows land where MODEL.md says: row r, group g -> words [r * cols*bits/32 + g * 64*bits/32, ...),
// scales[r * cols/64 + g]. Quantizing a matrix equals quantizing each group alone and placing it there.
TEST(Quant, RowAndGroupLayout) {
  const int64_t rows = 3, cols = 192, groups = cols / 64;
  for (int bits : {4, 8}) {
    std::mt19937 rng(11u + bits);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> w(rows * cols);
    for (int64_t i = 0; i < rows * cols; ++i) w[i] = nd(rng) * static_cast<float>(1 + i / 64);  // per-group scale
    Quantized q = quantize(w, rows, cols, bits);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        std::vector<float> one(w.begin() + r * cols + g * 64, w.begin() + r * cols + g * 64 + 64);
        Quantized alone = quantize(one, 1, 64, bits);
        SCOPED_TRACE("bits " + std::to_string(bits) + " row " + std::to_string(r) + " group " + std::to_string(g));
        EXPECT_EQ(q.scales[r * groups + g], alone.scales[0]);
        EXPECT_EQ(q.biases[r * groups + g], alone.biases[0]);
        const int64_t words = 64 * bits / 32;
        for (int64_t k = 0; k < words; ++k) EXPECT_EQ(q.wq[r * cols * bits / 32 + g * words + k], alone.wq[k]);
      }
    // Distinct groups really differ (so the comparison above can catch a misplaced group).
    EXPECT_NE(q.scales[0], q.scales[1]);
  }
}

// A reference quantizer for one group written from the text of MODEL.md 2.4.
void reference_group(const float* x, int bits, uint32_t* codes, float* scale_out, float* bias_out) {
  const float n_bins = static_cast<float>((1 << bits) - 1);
  float lo = x[0], hi = x[0];
  for (int j = 1; j < 64; ++j) lo = std::min(lo, x[j]), hi = std::max(hi, x[j]);
  float scale = std::max((hi - lo) / n_bins, 1e-7f);
  const bool min_edge = std::fabs(lo) > std::fabs(hi);  // else the max is the edge and the scale negated
  float edge = min_edge ? lo : hi, bias = 0;
  if (!min_edge) scale = -scale;
  float q0 = std::nearbyint(edge / scale);
  if (q0 != 0) scale = edge / q0, bias = edge;
  for (int j = 0; j < 64; ++j) codes[j] = static_cast<uint32_t>(std::clamp(std::nearbyint((x[j] - bias) / scale), 0.0f, n_bins));
  *scale_out = scale, *bias_out = bias;
}

std::vector<float> gaussian_matrix(int64_t n, uint32_t seed, float std_dev) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, std_dev);
  std::vector<float> w(static_cast<size_t>(n));
  for (auto& v : w) v = nd(rng);
  return w;
}

TEST(Quant, MatchesSpecReferenceOnRandomGroups) {
  const int64_t rows = 64, cols = 256;
  for (int bits : {4, 8}) {
    auto w = gaussian_matrix(rows * cols, 7u + bits, 0.02f);
    for (int64_t i = 0; i < 64; ++i) w[i] = 0.0f;                     // an all-zero group: q0 = 0, bias 0
    for (int64_t i = cols; i < cols + 64; ++i) w[i] = 0.3f;           // a constant group
    for (int64_t i = 2 * cols; i < 2 * cols + 64; ++i) w[i] = std::fabs(w[i]);  // one-signed group
    Quantized q = quantize(w, rows, cols, bits);
    int negative = 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < cols / 64; ++g) {
        uint32_t codes[64];
        float s, b;
        reference_group(&w[r * cols + g * 64], bits, codes, &s, &b);
        const int64_t gi = r * (cols / 64) + g;
        ASSERT_EQ(q.scales[gi], float_to_bf16_bits(s)) << "bits " << bits << " row " << r << " group " << g;
        ASSERT_EQ(q.biases[gi], float_to_bf16_bits(b)) << "bits " << bits << " row " << r << " group " << g;
        for (int j = 0; j < 64; ++j)
          ASSERT_EQ(code_at(q.wq.data() + r * cols * bits / 32, g * 64 + j, bits), codes[j]) << "element " << j;
        negative += s < 0;
      }
    EXPECT_GT(negative, rows * cols / 64 / 4) << "negative scales must occur on symmetric data";
    std::vector<float> back(cols);
    mlx_dequantize_row(q.wq.data(), q.scales.data(), q.biases.data(), cols, bits, back.data());
    for (int j = 0; j < 64; ++j) EXPECT_EQ(back[j], 0.0f);  // the zero group dequantizes to exact zeros
    mlx_dequantize_row(q.wq.data() + cols * bits / 32, &q.scales[4], &q.biases[4], cols, bits, back.data());
    for (int j = 0; j < 64; ++j) EXPECT_EQ(back[j], round_bf16(0.3f));  // constant: code 0, bias = the value
  }
}

// Round trip: |w - deq| <= |s|/2 for an element whose code is not clamped, plus the bf16 rounding of s and b
// (|ds| q + |db| <= 2^-8 (|s| q + |b|)). The edge snap can shrink |s| below (max-min)/n_bins, so values at the far
// end clamp to n_bins; their error is at most n_bins (rint(a) - a) / a |s| <= |s| (a = |edge| / s0 >= n_bins/2).
TEST(Quant, RoundTripErrorBound) {
  const int64_t rows = 128, cols = 512;
  for (int bits : {4, 8}) {
    const float n_bins = static_cast<float>((1 << bits) - 1);
    auto w = gaussian_matrix(rows * cols, 100u + bits, 0.05f);
    Quantized q = quantize(w, rows, cols, bits);
    std::vector<float> back(cols);
    double sum_sq_err = 0, sum_sq = 0;
    int n_clamped_over_half = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const uint32_t* row = q.wq.data() + r * cols * bits / 32;
      const uint16_t* sr = &q.scales[r * cols / 64];
      const uint16_t* br = &q.biases[r * cols / 64];
      mlx_dequantize_row(row, sr, br, cols, bits, back.data());
      for (int64_t j = 0; j < cols; ++j) {
        const float s = std::fabs(bf16_to_float(sr[j / 64])), b = std::fabs(bf16_to_float(br[j / 64]));
        const float code = static_cast<float>(code_at(row, j, bits));
        const float bf16_slack = (s * code + b) / 256.0f + 1e-7f;
        const float err = std::fabs(back[j] - w[r * cols + j]);
        ASSERT_EQ(back[j], dequant_at(row, sr, br, j, bits));
        if (code < n_bins) {
          ASSERT_LE(err, s / 2 + bf16_slack) << "bits " << bits << " row " << r << " col " << j;
        } else {
          ASSERT_LE(err, s * 1.0001f + bf16_slack) << "bits " << bits << " row " << r << " col " << j;
          n_clamped_over_half += err > s / 2 + bf16_slack;
        }
        sum_sq_err += static_cast<double>(err) * err;
        sum_sq += static_cast<double>(w[r * cols + j]) * w[r * cols + j];
      }
    }
    const double rel = std::sqrt(sum_sq_err / sum_sq);
    std::printf("[quant] %d-bit round trip: relative RMS error %.4f, %d far-edge clamps beyond |s|/2\n", bits, rel,
                n_clamped_over_half);
    EXPECT_LT(rel, bits == 4 ? 0.12 : 0.01);  // gaussian groups of 64: step ~ 4.8 sigma / n_bins
  }
}

TEST(Quant, DotRowEqualsDotOfDequantizedRow) {
  const int64_t rows = 16, cols = 320;
  for (int bits : {4, 8}) {
    auto w = gaussian_matrix(rows * cols, 5u + bits, 0.1f);
    auto x = gaussian_matrix(cols, 99u, 1.0f);
    Quantized q = quantize(w, rows, cols, bits);
    for (int64_t r = 0; r < rows; ++r) {
      const uint32_t* row = q.wq.data() + r * cols * bits / 32;
      const uint16_t* sr = &q.scales[r * cols / 64];
      const uint16_t* br = &q.biases[r * cols / 64];
      double want = 0, mag = 0;
      for (int64_t j = 0; j < cols; ++j) {
        double term = static_cast<double>(dequant_at(row, sr, br, j, bits)) * x[j];
        want += term;
        mag += std::fabs(term);
      }
      float got = mlx_dot_row(row, sr, br, cols, bits, x.data());
      EXPECT_NEAR(got, want, 1e-5 * mag + 1e-6) << "bits " << bits << " row " << r;
    }
  }
}

}  // namespace
}  // namespace lily
