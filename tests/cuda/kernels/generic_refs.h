// Plain CPU references and the model geometries shared by the generic-kernel tests (test_generic.cpp,
// test_generic_fast.cpp). Each reference is the few lines of the equation (docs/MODEL.md numbering), in double
// where a sum is long, written from src/cpu/*.cpp.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "cuda/kernels/gemv.cuh"
#include "cuda_test_util.h"

namespace lily::cuda::test {

// The decode-relevant dims of a synthetic preset (src/model/synth.cpp synth_config).
struct Geometry {
  const char* name;
  int hidden, nq, nkv, head_dim, rotary_dim;
  int n_k, n_v, d_k, d_v;
  int n_experts, top_k, inter;
  int conv_dim() const { return 2 * n_k * d_k + n_v * d_v; }
  int value_dim() const { return n_v * d_v; }
  int gdn_proj() const { return conv_dim() + value_dim() + 2 * n_v; }
  int attn_proj() const { return nq * 2 * head_dim + 2 * nkv * head_dim; }
};
inline constexpr Geometry kTiny{"tiny", 128, 4, 2, 64, 16, 2, 4, 64, 64, 16, 4, 64};
inline constexpr Geometry kSmall{"small", 1024, 8, 1, 256, 64, 8, 16, 128, 128, 32, 8, 256};
inline constexpr Geometry kFull{"full", 2048, 16, 2, 256, 64, 16, 32, 128, 128, 256, 8, 512};
inline constexpr int kConvKernel = 4;
inline constexpr float kTheta = 1e7f;
inline constexpr float kEps = 1e-6f;

inline uint16_t to_bf16_bits(float f) {  // round to nearest even, as __float2bfloat16_rn (finite inputs)
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Fast random quantized matrix (random codes and group scales; values of about N(0, 0.02)-like spread): the
// full-geometry tensors are too large for random_qmatrix's quantization of random floats.
inline HostQMatrix fast_qmatrix(int rows, int cols, int bits, uint32_t seed) {
  HostQMatrix m;
  m.rows = rows, m.cols = cols, m.bits = bits;
  std::mt19937 rng(seed);
  m.words.resize(rows * m.words_per_row());
  for (uint32_t& w : m.words) w = static_cast<uint32_t>(rng());
  m.scales.resize(rows * m.groups_per_row());
  m.biases.resize(rows * m.groups_per_row());
  const float levels = static_cast<float>((1 << bits) - 1);
  std::uniform_real_distribution<float> u(0.6f, 1.4f);
  for (size_t g = 0; g < m.scales.size(); ++g) {
    const float s = 0.07f / levels * u(rng);
    m.scales[g] = to_bf16_bits(s);
    m.biases[g] = to_bf16_bits(-s * levels * 0.5f * u(rng));
  }
  return m;
}

inline double sigmoid_d(double x) { return 1.0 / (1.0 + std::exp(-x)); }
inline double silu_d(double x) { return x * sigmoid_d(x); }

// Eqs 1-2 (multiplier form): in / RMS(in) * w.
inline std::vector<float> rms_norm_ref(const float* in, const float* w, int n, float eps = kEps) {
  double ss = 0;
  for (int i = 0; i < n; ++i) ss += static_cast<double>(in[i]) * in[i];
  const double inv = 1.0 / std::sqrt(ss / n + eps);
  std::vector<float> y(n);
  for (int i = 0; i < n; ++i) y[i] = static_cast<float>(in[i] * inv * w[i]);
  return y;
}

// The GEMV prologue (gemv.cuh): x from in.
inline std::vector<float> gemv_x_ref(GemvPrologue prologue, const std::vector<float>& in, const std::vector<float>& norm_w,
                                     const std::vector<float>& z, int head_dim) {
  const int cols = static_cast<int>(in.size());
  if (prologue == GemvPrologue::rms_norm) return rms_norm_ref(in.data(), norm_w.data(), cols);
  std::vector<float> x(in);
  if (prologue == GemvPrologue::gated_rms_norm) {  // eq 19 per head
    for (int h = 0; h < cols / head_dim; ++h) {
      const std::vector<float> y = rms_norm_ref(&in[h * head_dim], norm_w.data(), head_dim);
      for (int d = 0; d < head_dim; ++d) x[h * head_dim + d] = static_cast<float>(y[d] * silu_d(z[h * head_dim + d]));
    }
  }
  return x;
}

// Row `row` of a (possibly stacked) host matrix times x: (dot, sum of |terms|). fp32 accumulation on the GPU
// stays within ~2e-5 of the sum of |terms| (see test_gemv.cpp), which the tests use as their tolerance scale.
inline std::pair<double, double> qdot(const HostQMatrix& m, int row, const float* x) {
  double dot = 0, abs_sum = 0;
  for (int c = 0; c < m.cols; ++c) {
    const double t = static_cast<double>(m.dequant(row, c)) * x[c];
    dot += t;
    abs_sum += std::fabs(t);
  }
  return {dot, abs_sum};
}

// Eq 10 on one head vector, as src/cpu/attention.cpp apply_rope.
inline void rope_ref(float* x, int rot, int64_t pos) {
  const int half = rot / 2;
  for (int i = 0; i < half; ++i) {
    const float inv_freq = static_cast<float>(1.0 / std::pow(static_cast<double>(kTheta), (2.0 * i) / rot));
    const float ang = static_cast<float>(pos) * inv_freq;
    const float c = std::cos(ang), s = std::sin(ang);
    const float x0 = x[i], x1 = x[i + half];
    x[i] = x0 * c - x1 * s;
    x[i + half] = x1 * c + x0 * s;
  }
}

// Eqs 11-12 in double over bf16 caches [n, nkv, D]: out[j] = softmax(q_j K^T / sqrt(D)) V * sigmoid(gate_j).
inline std::vector<float> attention_ref(const Geometry& g, int n, const std::vector<uint16_t>& k,
                                        const std::vector<uint16_t>& v, const std::vector<float>& q,
                                        const std::vector<float>& proj) {
  const int D = g.head_dim;
  std::vector<float> out(static_cast<size_t>(g.nq) * D);
  std::vector<double> w(n), o(D);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  for (int j = 0; j < g.nq; ++j) {
    const int m = j / (g.nq / g.nkv);
    double mx = -INFINITY;
    for (int r = 0; r < n; ++r) {
      const uint16_t* kr = &k[(static_cast<size_t>(r) * g.nkv + m) * D];
      double s = 0;
      for (int d = 0; d < D; ++d) s += static_cast<double>(q[j * D + d]) * bf16_bits_to_float(kr[d]);
      mx = std::max(mx, w[r] = s * scale);
    }
    double sum = 0;
    for (int r = 0; r < n; ++r) sum += (w[r] = std::exp(w[r] - mx));
    std::fill(o.begin(), o.end(), 0.0);
    for (int r = 0; r < n; ++r) {
      const uint16_t* vr = &v[(static_cast<size_t>(r) * g.nkv + m) * D];
      for (int d = 0; d < D; ++d) o[d] += w[r] * bf16_bits_to_float(vr[d]);
    }
    for (int d = 0; d < D; ++d) out[j * D + d] = static_cast<float>(o[d] / sum * sigmoid_d(proj[j * 2 * D + D + d]));
  }
  return out;
}

// The CPU Gated DeltaNet for one token (eqs 14-18), as src/cpu/delta_net.cpp with T = 1.
struct GdnRef {
  Geometry g;
  std::vector<float> conv_w, A_log, dt_bias;
  std::vector<float> conv_state, S;  // [K-1, conv_dim] oldest first; [n_v, d_k, d_v]

  explicit GdnRef(const Geometry& geo, uint32_t seed)
      : g(geo),
        conv_w(random_vector(static_cast<size_t>(geo.conv_dim()) * kConvKernel, seed, 0.5f)),
        A_log(random_vector(geo.n_v, seed + 1, 0.7f, -0.5f)),
        dt_bias(random_vector(geo.n_v, seed + 2)),
        conv_state(static_cast<size_t>(kConvKernel - 1) * geo.conv_dim(), 0.0f),
        S(static_cast<size_t>(geo.n_v) * geo.d_k * geo.d_v, 0.0f) {}

  std::vector<float> step(const std::vector<float>& proj) {
    const int C = g.conv_dim(), K = kConvKernel, dk = g.d_k, dv = g.d_v, key_dim = g.n_k * dk;
    std::vector<float> cc(C);
    for (int ch = 0; ch < C; ++ch) {  // eq 14
      float acc = 0;
      for (int k = 0; k < K - 1; ++k) acc += conv_w[ch * K + k] * conv_state[k * C + ch];
      acc += conv_w[ch * K + K - 1] * proj[ch];
      cc[ch] = static_cast<float>(silu_d(acc));
    }
    std::copy(conv_state.begin() + C, conv_state.end(), conv_state.begin());
    std::copy(proj.begin(), proj.begin() + C, conv_state.end() - C);
    auto l2 = [dk](float* x, float extra) {  // eq 16
      double ss = 0;
      for (int i = 0; i < dk; ++i) ss += static_cast<double>(x[i]) * x[i];
      const float inv = 1.0f / std::sqrt(static_cast<float>(ss) + 1e-6f) * extra;
      for (int i = 0; i < dk; ++i) x[i] *= inv;
    };
    for (int h = 0; h < g.n_k; ++h) {
      l2(&cc[h * dk], 1.0f / std::sqrt(static_cast<float>(dk)));
      l2(&cc[key_dim + h * dk], 1.0f);
    }
    std::vector<float> o(g.value_dim()), e(dv);
    const float* b = &proj[C + g.value_dim()];
    const float* a = b + g.n_v;
    for (int h = 0; h < g.n_v; ++h) {  // eqs 17-18
      const double beta = sigmoid_d(b[h]), x = a[h] + dt_bias[h];
      const double decay = std::exp(-std::exp(A_log[h]) * (x > 20.0 ? x : std::log1p(std::exp(x))));
      const int kh = h / (g.n_v / g.n_k);
      const float* q = &cc[kh * dk];
      const float* k = &cc[key_dim + kh * dk];
      const float* v = &cc[2 * key_dim + h * dv];
      float* Sh = &S[static_cast<size_t>(h) * dk * dv];
      for (int i = 0; i < dk * dv; ++i) Sh[i] = static_cast<float>(Sh[i] * decay);
      for (int j = 0; j < dv; ++j) {
        double kv = 0;
        for (int i = 0; i < dk; ++i) kv += static_cast<double>(Sh[i * dv + j]) * k[i];
        e[j] = static_cast<float>((v[j] - kv) * beta);
      }
      for (int i = 0; i < dk; ++i)
        for (int j = 0; j < dv; ++j) Sh[i * dv + j] += k[i] * e[j];
      for (int j = 0; j < dv; ++j) {
        double acc = 0;
        for (int i = 0; i < dk; ++i) acc += static_cast<double>(Sh[i * dv + j]) * q[i];
        o[h * dv + j] = static_cast<float>(acc);
      }
    }
    return o;
  }
};

// Counts mismatches |got - want| > tol, reporting the first five; returns the count.
inline int expect_close(const char* what, size_t i, double got, double want, double tol, int& bad) {
  if (!(std::fabs(got - want) <= tol) && bad++ < 5) {
    ADD_FAILURE() << what << " [" << i << "]: got " << got << " want " << want << " (tol " << tol << ")";
  }
  return bad;
}

}  // namespace lily::cuda::test
