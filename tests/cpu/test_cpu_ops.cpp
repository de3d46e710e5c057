// CPU op tests against naive loops: route_top_k (eq 22: ties to the lower index, renormalised weights), rms_norm
// (eqs 1-2), matmul over dense (BF16/F16/F32) and MLX-quantized (4/8-bit) Linear weights, row slices, embed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "cpu/blocks.h"
#include "cpu/ops.h"
#include "model/quant.h"
#include "util/bf16.h"

namespace lily::cpu {
namespace {

std::vector<float> randn(size_t n, uint32_t seed, float std_dev = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, std_dev);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

// ------------------------------------------------------------------------------------------------ route_top_k

TEST(RouteTopK, TiesGoToTheLowerIndex) {
  const float p[5] = {0.1f, 0.3f, 0.3f, 0.2f, 0.1f};
  int idx[4];
  float w[4];
  route_top_k(p, 5, 2, idx, w);
  EXPECT_EQ(idx[0], 1);
  EXPECT_EQ(idx[1], 2);
  EXPECT_FLOAT_EQ(w[0], 0.5f);
  EXPECT_FLOAT_EQ(w[1], 0.5f);
  route_top_k(p, 5, 4, idx, w);  // the tie at 0.1 between experts 0 and 4 goes to 0
  EXPECT_EQ((std::vector<int>(idx, idx + 4)), (std::vector<int>{1, 2, 3, 0}));
  EXPECT_FLOAT_EQ(w[0], 0.3f / 0.9f);
  EXPECT_FLOAT_EQ(w[2], 0.2f / 0.9f);
  EXPECT_FLOAT_EQ(w[3], 0.1f / 0.9f);

  const float flat[8] = {0.125f, 0.125f, 0.125f, 0.125f, 0.125f, 0.125f, 0.125f, 0.125f};
  int fi[3];
  float fw[3];
  route_top_k(flat, 8, 3, fi, fw);
  EXPECT_EQ((std::vector<int>(fi, fi + 3)), (std::vector<int>{0, 1, 2}));
  for (float x : fw) EXPECT_FLOAT_EQ(x, 1.0f / 3);
}

TEST(RouteTopK, MatchesStableSortOnRandomRouters) {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 200; ++trial) {
    const int E = trial % 2 ? 256 : 16, k = trial % 2 ? 8 : 4;
    // Softmax of coarse logits (many exact ties) or fine ones.
    std::vector<float> logits(E), p(E);
    std::uniform_int_distribution<int> coarse(0, 5);
    std::normal_distribution<float> fine(0.0f, 2.0f);
    for (auto& l : logits) l = trial % 3 == 0 ? static_cast<float>(coarse(rng)) : fine(rng);
    float mx = *std::max_element(logits.begin(), logits.end()), sum = 0;
    for (int e = 0; e < E; ++e) sum += p[e] = std::exp(logits[e] - mx);
    for (auto& x : p) x /= sum;

    std::vector<int> order(E);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p[a] > p[b]; });
    std::vector<int> idx(k);
    std::vector<float> w(k);
    route_top_k(p.data(), E, k, idx.data(), w.data());
    float top_sum = 0;
    for (int i = 0; i < k; ++i) top_sum += p[order[i]];
    float wsum = 0;
    for (int i = 0; i < k; ++i) {
      ASSERT_EQ(idx[i], order[i]) << "trial " << trial << " slot " << i;
      EXPECT_NEAR(w[i], p[order[i]] / top_sum, 1e-6f);
      wsum += w[i];
    }
    EXPECT_NEAR(wsum, 1.0f, 1e-5f);
  }
}

// ------------------------------------------------------------------------------------------------ rms_norm

TEST(RmsNorm, MatchesNaive) {
  const int64_t rows = 5, n = 128;
  const float eps = 1e-6f;
  auto x = randn(rows * n, 1, 3.0f), w = randn(n, 2, 0.1f);
  for (auto& v : w) v += 1.0f;
  for (int64_t i = 0; i < n; ++i) x[3 * n + i] = 0.0f;  // a zero row: eps keeps it finite (zeros out)
  std::vector<float> y(rows * n);
  rms_norm(x.data(), w.data(), rows, n, eps, y.data());
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[r * n + i]) * x[r * n + i];
    const double inv = 1.0 / std::sqrt(ss / n + eps);
    for (int64_t i = 0; i < n; ++i) {
      const double want = x[r * n + i] * inv * w[i];
      ASSERT_NEAR(y[r * n + i], want, 1e-5 * std::fabs(want) + 1e-7) << r << "," << i;
      ASSERT_TRUE(std::isfinite(y[r * n + i]));
    }
  }
  // In place, as attention_block uses it for k.
  std::vector<float> z = x;
  rms_norm(z.data(), w.data(), rows, n, eps, z.data());
  EXPECT_EQ(z, y);
}

TEST(Activations, SoftplusSiluSigmoid) {
  for (float x : {-30.0f, -5.0f, -0.5f, 0.0f, 0.7f, 5.0f, 19.0f, 25.0f, 80.0f}) {
    const double sp = std::log1p(std::exp(static_cast<double>(x)));
    EXPECT_NEAR(softplus(x), sp, 1e-6 * std::max(1.0, sp)) << x;
    EXPECT_TRUE(std::isfinite(softplus(x)));
    const double sg = 1.0 / (1.0 + std::exp(-static_cast<double>(x)));
    EXPECT_NEAR(sigmoid(x), sg, 1e-7) << x;
    EXPECT_NEAR(silu(x), x * sg, 1e-6 * std::max(1.0, std::fabs(x * sg))) << x;
  }
}

// ------------------------------------------------------------------------------------------------ matmul

// A weight matrix held in one of the storage formats, with a naive element reader written from MODEL.md 2.4.
struct TestWeight {
  int64_t out, in;
  DType dtype;
  int bits = 0;
  std::vector<uint16_t> u16;  // bf16 / f16 values
  std::vector<float> f32;
  std::vector<uint32_t> wq;
  std::vector<uint16_t> scales, biases;

  TestWeight(int64_t o, int64_t i, DType dt, int b, uint32_t seed) : out(o), in(i), dtype(dt), bits(b) {
    auto w = randn(static_cast<size_t>(o * i), seed, 0.2f);
    if (bits) {
      wq.resize(static_cast<size_t>(o * i * bits / 32));
      scales.resize(static_cast<size_t>(o * i / 64));
      biases.resize(scales.size());
      mlx_quantize(w.data(), o, i, bits, wq.data(), scales.data(), biases.data());
    } else if (dtype == DType::f32) {
      f32 = w;
    } else {
      for (float v : w) u16.push_back(dtype == DType::bf16 ? float_to_bf16_bits(v) : float_to_f16_bits(v));
    }
  }
  Linear linear() const {
    Linear l;
    l.out = out, l.in = in, l.bits = bits;
    l.dtype = bits ? DType::u32 : dtype;
    l.w = bits ? static_cast<const void*>(wq.data())
               : dtype == DType::f32 ? static_cast<const void*>(f32.data()) : static_cast<const void*>(u16.data());
    l.scales = bits ? scales.data() : nullptr;
    l.biases = bits ? biases.data() : nullptr;
    return l;
  }
  double at(int64_t o, int64_t i) const {
    if (bits) {
      const int64_t per_word = 32 / bits, k = o * in + i;
      const uint32_t q = (wq[k / per_word] >> (bits * (k % per_word))) & ((1u << bits) - 1);
      return static_cast<double>(bf16_to_float(scales[k / 64])) * q + bf16_to_float(biases[k / 64]);
    }
    if (dtype == DType::f32) return f32[o * in + i];
    return dtype == DType::bf16 ? bf16_to_float(u16[o * in + i]) : f16_to_float(u16[o * in + i]);
  }
};

void expect_matmul_matches(ThreadPool& pool, const TestWeight& tw, const Linear& W, int64_t row0, int64_t T) {
  auto x = randn(static_cast<size_t>(T * W.in), 77u + static_cast<uint32_t>(T));
  std::vector<float> y(static_cast<size_t>(T * W.out), NAN);
  matmul(pool, W, x.data(), T, y.data());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t o = 0; o < W.out; ++o) {
      double want = 0, mag = 0;
      for (int64_t i = 0; i < W.in; ++i) {
        const double term = tw.at(row0 + o, i) * x[t * W.in + i];
        want += term;
        mag += std::fabs(term);
      }
      ASSERT_NEAR(y[t * W.out + o], want, 2e-6 * mag + 1e-7)
          << dtype_name(tw.dtype) << " bits " << tw.bits << " T " << T << " t " << t << " o " << o;
    }
}

TEST(Matmul, DenseAndQuantizedAgainstNaiveLoop) {
  ThreadPool pool(3);  // more chunks than cores: exercises the row split
  struct Case { DType dtype; int bits; };
  for (Case c : {Case{DType::bf16, 0}, Case{DType::f16, 0}, Case{DType::f32, 0}, Case{DType::u32, 4},
                 Case{DType::u32, 8}}) {
    TestWeight tw(37, 192, c.dtype, c.bits, 9u + static_cast<uint32_t>(c.bits));
    const Linear W = tw.linear();
    for (int64_t T : {1, 2, 7}) expect_matmul_matches(pool, tw, W, 0, T);  // T == 1 takes the dot_row path
    // A row slice (as experts are cut out of packed tensors) reads the right rows.
    const Linear S = W.rows(11, 20);
    EXPECT_EQ(S.out, 20);
    for (int64_t T : {1, 3}) expect_matmul_matches(pool, tw, S, 11, T);
  }
}

TEST(Matmul, DotRowAndDequantRowAgree) {
  for (int bits : {0, 4, 8}) {
    TestWeight tw(9, 256, bits ? DType::u32 : DType::bf16, bits, 3);
    const Linear W = tw.linear();
    auto x = randn(256, 4);
    std::vector<float> row(256);
    for (int64_t r = 0; r < W.out; ++r) {
      W.dequant_row(r, row.data());
      double want = 0, mag = 0;
      for (int64_t i = 0; i < 256; ++i) {
        ASSERT_NEAR(row[i], tw.at(r, i), 1e-6 * std::fabs(tw.at(r, i))) << "bits " << bits << " r " << r << " i " << i;
        want += static_cast<double>(row[i]) * x[i];
        mag += std::fabs(static_cast<double>(row[i]) * x[i]);
      }
      EXPECT_NEAR(W.dot_row(r, x.data()), want, 2e-6 * mag) << "bits " << bits;
    }
  }
}

TEST(Embed, RowsOfTheTable) {
  TestWeight tw(50, 128, DType::u32, 4, 21);
  const Linear E = tw.linear();
  const int32_t ids[4] = {0, 49, 7, 7};
  std::vector<float> y(4 * 128);
  embed(E, ids, 4, y.data());
  for (int t = 0; t < 4; ++t)
    for (int i = 0; i < 128; ++i) ASSERT_NEAR(y[t * 128 + i], tw.at(ids[t], i), 1e-6 * std::fabs(tw.at(ids[t], i)));
}

}  // namespace
}  // namespace lily::cpu
