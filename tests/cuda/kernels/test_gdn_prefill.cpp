// gdn_prefill (eqs 14-19 over T rows) against a host reference of the same equations written from
// src/cpu/delta_net.cpp (double sums), against T decode steps (dispatch::gdn_step with its gated norm), one chunk
// against two, and the split chunked scan against the chunked one, for each GdnScan; plus a timing test (prints
// only).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cuda/kernels/dispatch.cuh"
#include "cuda/kernels/gdn_prefill.cuh"
#include "cuda_test_util.h"
#include "generic_refs.h"

namespace lily::cuda {
namespace {

using test::DeviceBuffer;
using test::Geometry;
using test::kFull;
using test::kTiny;
using test::random_vector;

constexpr int kK = 4;  // conv kernel
// Every scan gdn_prefill has here (GdnScan::by_length picks one of them by T): chunked_wgmma where the GPU and
// the build have wgmma.
std::vector<GdnScan> scans() {
  std::vector<GdnScan> v = {GdnScan::sequential, GdnScan::chunked, GdnScan::chunked_split};
  if (wgmma_built()) v.push_back(GdnScan::chunked_wgmma);
  return v;
}
bool chunked(GdnScan s) { return s != GdnScan::sequential; }
std::string name(GdnScan s) { return scan_name(s); }

struct Weights {
  std::vector<float> conv_w, A_log, dt_bias, norm_w;
};

// As test_gdn.cpp: conv_w ~ N(0, 0.5), A_log ~ N(-0.5, 0.7), dt_bias ~ N(0, 1), norm_w ~ N(1, 0.1).
Weights random_weights(const Geometry& g, uint32_t seed) {
  Weights w;
  w.conv_w = random_vector(static_cast<size_t>(g.conv_dim()) * kK, seed, 0.5f);
  w.A_log = random_vector(g.n_v, seed + 1, 0.7f, -0.5f);
  w.dt_bias = random_vector(g.n_v, seed + 2, 1.0f);
  w.norm_w = random_vector(g.d_v, seed + 3, 0.1f, 1.0f);
  return w;
}

// The carried state: conv ring [K, conv_dim] (position p in slot p % K) and S [n_v, d_k, d_v].
struct State {
  std::vector<float> ring, S;
};

State zero_state(const Geometry& g) {
  return {std::vector<float>(static_cast<size_t>(kK) * g.conv_dim(), 0.0f),
          std::vector<float>(static_cast<size_t>(g.n_v) * g.d_k * g.d_v, 0.0f)};
}
State random_state(const Geometry& g, uint32_t seed) {
  return {random_vector(static_cast<size_t>(kK) * g.conv_dim(), seed), random_vector(static_cast<size_t>(g.n_v) * g.d_k * g.d_v, seed + 1, 0.1f)};
}

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// Eqs 14-19 for T rows at positions pos0.. on the host, the steps of src/cpu/delta_net.cpp (fp32 values, double
// sums); updates st; returns x = norm_w * o / RMS(o_head) * silu(z) [T, n_v*d_v].
std::vector<float> reference(const Geometry& g, const Weights& w, const std::vector<float>& proj, int T, int pos0,
                             State& st) {
  const int C = g.conv_dim(), P = g.gdn_proj(), VD = g.value_dim(), nk = g.n_k, nv = g.n_v, dk = g.d_k, dv = g.d_v;
  const int key_dim = nk * dk, hpk = nv / nk;
  std::vector<float> cc(static_cast<size_t>(T) * C);
  for (int t = 0; t < T; ++t)  // eq 14
    for (int ch = 0; ch < C; ++ch) {
      float acc = 0;
      for (int k = 0; k < kK; ++k) {
        const int p = pos0 + t - (kK - 1) + k;
        const float x = p >= pos0 ? proj[static_cast<size_t>(p - pos0) * P + ch] : st.ring[static_cast<size_t>((p % kK + kK) % kK) * C + ch];
        acc += w.conv_w[static_cast<size_t>(ch) * kK + k] * x;
      }
      cc[static_cast<size_t>(t) * C + ch] = acc * sigmoid(acc);
    }
  for (int t = std::max(0, T - kK); t < T; ++t)
    std::copy_n(&proj[static_cast<size_t>(t) * P], C, &st.ring[static_cast<size_t>((pos0 + t) % kK) * C]);
  std::vector<float> beta(static_cast<size_t>(T) * nv), decay(static_cast<size_t>(T) * nv);
  for (int t = 0; t < T; ++t) {  // eqs 16-17
    float* row = &cc[static_cast<size_t>(t) * C];
    auto l2 = [dk](float* x, float extra) {
      double ss = 0;
      for (int i = 0; i < dk; ++i) ss += static_cast<double>(x[i]) * x[i];
      const float inv = 1.0f / std::sqrt(static_cast<float>(ss) + 1e-6f) * extra;
      for (int i = 0; i < dk; ++i) x[i] *= inv;
    };
    for (int h = 0; h < nk; ++h) {
      l2(row + h * dk, 1.0f / std::sqrt(static_cast<float>(dk)));
      l2(row + key_dim + h * dk, 1.0f);
    }
    const float* b = &proj[static_cast<size_t>(t) * P + C + VD];
    for (int h = 0; h < nv; ++h) {
      beta[static_cast<size_t>(t) * nv + h] = sigmoid(b[h]);
      const float x = b[nv + h] + w.dt_bias[h];
      decay[static_cast<size_t>(t) * nv + h] = std::exp(-std::exp(w.A_log[h]) * (x > 20.0f ? x : std::log1p(std::exp(x))));
    }
  }
  std::vector<float> o(static_cast<size_t>(T) * VD);
  auto heads = [&](int h0, int h1) {  // eq 18, as delta_net.cpp orders it
    std::vector<float> e(dv);
    for (int h = h0; h < h1; ++h) {
      float* S = &st.S[static_cast<size_t>(h) * dk * dv];
      for (int t = 0; t < T; ++t) {
        const float* row = &cc[static_cast<size_t>(t) * C];
        const float* q = row + (h / hpk) * dk;
        const float* k = row + key_dim + (h / hpk) * dk;
        const float* v = row + 2 * key_dim + h * dv;
        const float gd = decay[static_cast<size_t>(t) * nv + h], bt = beta[static_cast<size_t>(t) * nv + h];
        for (int i = 0; i < dk * dv; ++i) S[i] *= gd;
        for (int j = 0; j < dv; ++j) {
          double kv = 0;
          for (int i = 0; i < dk; ++i) kv += static_cast<double>(S[i * dv + j]) * k[i];
          e[j] = static_cast<float>((v[j] - kv) * bt);
        }
        for (int i = 0; i < dk; ++i)
          for (int j = 0; j < dv; ++j) S[i * dv + j] += k[i] * e[j];
        for (int j = 0; j < dv; ++j) {
          double acc = 0;
          for (int i = 0; i < dk; ++i) acc += static_cast<double>(S[i * dv + j]) * q[i];
          o[static_cast<size_t>(t) * VD + h * dv + j] = static_cast<float>(acc);
        }
      }
    }
  };
  const int n_threads = std::max(1, std::min<int>(nv, static_cast<int>(std::thread::hardware_concurrency())));
  std::vector<std::thread> pool;
  for (int i = 0; i < n_threads; ++i) pool.emplace_back(heads, nv * i / n_threads, nv * (i + 1) / n_threads);
  for (auto& th : pool) th.join();
  std::vector<float> x(static_cast<size_t>(T) * VD);
  for (int t = 0; t < T; ++t)  // eq 19
    for (int h = 0; h < nv; ++h) {
      const float* oh = &o[static_cast<size_t>(t) * VD + h * dv];
      const float* z = &proj[static_cast<size_t>(t) * P + C + h * dv];
      double ss = 0;
      for (int j = 0; j < dv; ++j) ss += static_cast<double>(oh[j]) * oh[j];
      const double inv = 1.0 / std::sqrt(ss / dv + 1e-6);
      for (int j = 0; j < dv; ++j)
        x[static_cast<size_t>(t) * VD + h * dv + j] = static_cast<float>(w.norm_w[j] * oh[j] * inv * z[j] / (1.0 + std::exp(-z[j])));
    }
  return x;
}

// Weights and state on the device, scratch for up to max_T rows.
struct DeviceGdn {
  Geometry g;
  DeviceBuffer<float> conv_w, A_log, dt_bias, norm_w, ring, S;
  DeviceBuffer<uint8_t> scratch;
  DeviceBuffer<uint16_t> out;

  DeviceGdn(const Geometry& geo, const Weights& w, const State& st, int max_T)
      : g(geo), conv_w(w.conv_w), A_log(w.A_log), dt_bias(w.dt_bias), norm_w(w.norm_w), ring(st.ring), S(st.S),
        scratch(gdn_prefill_scratch_bytes(max_T, geo.n_k, geo.n_v, geo.d_k, geo.d_v)),
        out(static_cast<size_t>(max_T) * geo.value_dim()) {}

  GdnScan scan = GdnScan::by_length;

  GdnPrefillParams params(const float* proj, int T, int pos0, __half* dst) const {
    GdnPrefillParams p;
    p.scan = scan;
    p.proj = proj;
    p.T = T;
    p.pos0 = pos0;
    p.conv_ring = ring.get();
    p.conv_w = conv_w.get();
    p.A_log = A_log.get();
    p.dt_bias = dt_bias.get();
    p.S = S.get();
    p.n_k = g.n_k, p.n_v = g.n_v, p.d_k = g.d_k, p.d_v = g.d_v, p.kernel = kK;
    p.norm_w = norm_w.get();
    p.eps = 1e-6f;
    p.out = dst;
    p.scratch = scratch.get();
    p.scratch_bytes = scratch.size();
    return p;
  }
  // Prefill of T rows; out rows [0, T) of `out` at row offset out_row.
  cudaError_t prefill(const float* proj, int T, int pos0, int out_row = 0) {
    auto* dst = reinterpret_cast<__half*>(out.get()) + static_cast<size_t>(out_row) * g.value_dim();
    return gdn_prefill(params(proj, T, pos0, dst), nullptr);
  }
  std::vector<float> output(int T) const {
    const auto bits = out.download();
    std::vector<float> x(static_cast<size_t>(T) * g.value_dim());
    for (size_t i = 0; i < x.size(); ++i) x[i] = test::f16_bits_to_float(bits[i]);
    return x;
  }
};

// max |a - b| over the elements; fails (and returns) at the first element over abs_tol + rel_tol * |b|.
double compare(const std::vector<float>& a, const std::vector<float>& b, double abs_tol, double rel_tol,
               const char* what, int row_len) {
  double max_err = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    const double err = std::fabs(static_cast<double>(a[i]) - b[i]);
    max_err = std::max(max_err, std::isnan(err) ? INFINITY : err);
    if (!(err <= abs_tol + rel_tol * std::fabs(b[i]))) {
      ADD_FAILURE() << what << " element " << i << " (row " << i / row_len << ", col " << i % row_len << "): got " << a[i]
                    << " want " << b[i];
      return max_err;
    }
  }
  return max_err;
}

// Elements of a conv ring that differ from the expected ring (which must match exactly: copies of proj values).
size_t ring_mismatches(const std::vector<float>& got, const std::vector<float>& want) {
  size_t n = 0;
  for (size_t i = 0; i < want.size(); ++i) n += got[i] != want[i];
  return n;
}

// Tolerances. S: fp32 on both sides, differing in summation order and FMA contraction (a few 1e-7 relative per
// op; the state is contractive, |k_hat| = 1, beta < 1, decay < 1, so errors do not grow with T): 1e-4 abs + rel as
// test_gdn.cpp. Output: fp16 rounding (<= 2^-11 relative) of x = w * o / RMS * silu(z), |x| ~ 1, whose fp32 error
// is ~1e-5 of the head's RMS times |w silu(z)| (< 5): 2^-8 relative + 5e-4 absolute.
constexpr double kStateTol = 1e-4, kOutRel = 1.0 / 256, kOutAbs = 5e-4;
// The chunked scans in 3xTF32 (a_hi b_hi + a_hi b_lo + a_lo b_hi, only lo x lo ~2^-22 dropped): a numpy model of
// the chunked arithmetic is within ~3e-6 of the RMS on these inputs, so they take the fp32 tolerances above.

// The random operands of one check: weights (seed), a start state (seed + 10) and T rows of projections
// (seed + 20), those also on the device.
struct Inputs {
  Weights w;
  State st;
  std::vector<float> proj;
  DeviceBuffer<float> d_proj;
  Inputs(const Geometry& g, int T, uint32_t seed)
      : w(random_weights(g, seed)),
        st(random_state(g, seed + 10)),
        proj(random_vector(static_cast<size_t>(T) * g.gdn_proj(), seed + 20)),
        d_proj(proj) {}
};

void check_against_reference(const Geometry& g, int T, int pos0, bool random_start, uint32_t seed) {
  SCOPED_TRACE(std::string(g.name) + " T=" + std::to_string(T) + " pos0=" + std::to_string(pos0) +
               (random_start ? " random start state" : " zero start state"));
  const Weights w = random_weights(g, seed);
  const State st0 = random_start ? random_state(g, seed + 10) : zero_state(g);
  const auto proj = random_vector(static_cast<size_t>(T) * g.gdn_proj(), seed + 20);
  const DeviceBuffer<float> d_proj(proj);
  State st = st0;
  const auto x_ref = reference(g, w, proj, T, pos0, st);
  for (GdnScan scan : scans()) {
    SCOPED_TRACE("scan " + name(scan));
    DeviceGdn dev(g, w, st0, T);
    dev.scan = scan;
    ASSERT_CUDA(dev.prefill(d_proj.get(), T, pos0));
    ASSERT_CUDA(cudaDeviceSynchronize());
    const double ex = compare(dev.output(T), x_ref, kOutAbs, kOutRel, "out", g.value_dim());
    const double es = compare(dev.S.download(), st.S, kStateTol, kStateTol, "S", g.d_v);
    EXPECT_EQ(ring_mismatches(dev.ring.download(), st.ring), 0u) << "conv ring";
    printf("[gdn_prefill] %-4s T=%4d pos0=%2d scan %s: max |out - ref| %.2e, max |S - ref| %.2e\n", g.name, T, pos0,
           name(scan).c_str(), ex, es);
  }
}

TEST(CudaGdnPrefill, MatchesReferenceFull) {
  SKIP_WITHOUT_GPU();
  for (int T : {1, 63, 64, 65, 4097}) check_against_reference(kFull, T, 37, true, 100 + T);
  check_against_reference(kFull, 65, 0, false, 7);
  check_against_reference(kFull, 2, 5, true, 8);  // T < kernel: the ring keeps two older vectors
}

TEST(CudaGdnPrefill, MatchesReferenceTiny) {
  SKIP_WITHOUT_GPU();
  for (int T : {1, 63, 64, 65, 4097}) check_against_reference(kTiny, T, 37, true, 200 + T);
  check_against_reference(kTiny, 65, 0, false, 9);
  check_against_reference(kTiny, 3, 6, true, 10);
}

// T rows through gdn_prefill against T calls of dispatch::gdn_step (the decode path) from the same state.
void check_against_decode(const Geometry& g, int T, int pos0, uint32_t seed, GdnScan scan) {
  SCOPED_TRACE(std::string(g.name) + " T=" + std::to_string(T) + " scan " + name(scan));
  const Inputs in(g, T, seed);
  const auto& [w, st, proj, d_proj] = in;
  DeviceGdn pre(g, w, st, T), dec(g, w, st, T);
  pre.scan = scan;
  ASSERT_CUDA(pre.prefill(d_proj.get(), T, pos0));

  std::vector<int> positions(T);
  for (int t = 0; t < T; ++t) positions[t] = pos0 + t;
  const DeviceBuffer<int> d_pos(positions);
  DeviceBuffer<float> d_o(static_cast<size_t>(T) * g.value_dim());
  GdnStepParams sp;
  sp.conv_ring = dec.ring.get();
  sp.conv_w = dec.conv_w.get();
  sp.A_log = dec.A_log.get();
  sp.dt_bias = dec.dt_bias.get();
  sp.S = dec.S.get();
  sp.n_k = g.n_k, sp.n_v = g.n_v, sp.d_k = g.d_k, sp.d_v = g.d_v, sp.kernel = kK;
  // The fast decode kernel applies eq 19 itself (a thread block cluster a head: sm_90 code only); else the host.
  sp.norm_w = sm90_code_built() ? dec.norm_w.get() : nullptr;
  sp.eps = 1e-6f;
  bool fused = false;
  for (int t = 0; t < T; ++t) {
    sp.proj = d_proj.get() + static_cast<size_t>(t) * g.gdn_proj();
    sp.gate_z = sp.proj + g.conv_dim();
    sp.pos = d_pos.get() + t;
    sp.o = d_o.get() + static_cast<size_t>(t) * g.value_dim();
    fused = sp.norm_w && gdn_fast_supported(sp);
    ASSERT_CUDA(dispatch::gdn_step(sp, nullptr));
  }
  ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<float> x_dec = d_o.download();
  if (!fused) {  // eq 19 on the host
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < g.n_v; ++h) {
        float* oh = &x_dec[static_cast<size_t>(t) * g.value_dim() + h * g.d_v];
        const float* z = &proj[static_cast<size_t>(t) * g.gdn_proj() + g.conv_dim() + h * g.d_v];
        double ss = 0;
        for (int j = 0; j < g.d_v; ++j) ss += static_cast<double>(oh[j]) * oh[j];
        const double inv = 1.0 / std::sqrt(ss / g.d_v + 1e-6);
        for (int j = 0; j < g.d_v; ++j) oh[j] = static_cast<float>(w.norm_w[j] * oh[j] * inv * z[j] / (1.0 + std::exp(-z[j])));
      }
  }
  const double ex = compare(pre.output(T), x_dec, kOutAbs, kOutRel, "out vs decode", g.value_dim());
  const double es =
      compare(pre.S.download(), dec.S.download(), kStateTol, kStateTol, "S vs decode", g.d_v);
  EXPECT_EQ(ring_mismatches(pre.ring.download(), dec.ring.download()), 0u) << "conv ring vs decode";
  printf("[gdn_prefill] %-4s T=%d scan %s vs %d decode steps%s: max |out diff| %.2e, max |S diff| %.2e\n", g.name,
         T, name(scan).c_str(), T, fused ? " (gated norm fused)" : "", ex, es);
}

TEST(CudaGdnPrefill, MatchesDecodeSteps) {
  SKIP_WITHOUT_GPU();
  for (GdnScan scan : scans()) {
    check_against_decode(kFull, 70, 37, 300, scan);
    check_against_decode(kFull, 3, 1, 301, scan);
    check_against_decode(kTiny, 70, 37, 302, scan);
  }
}

// Two chunks (T1 at pos0, T2 at pos0 + T1) against one chunk of T1 + T2. The sequential scan does the same
// arithmetic row by row, so the results should agree to the bit; asserted within 1e-6 relative, the bit-identical
// fraction printed. The chunked path groups the rows differently (64-row chunks from each call's row 0), so the
// two agree to its tolerances against the reference (bit-identical when the split is a multiple of 64 rows).
void check_chunks(const Geometry& g, int T1, int T2, uint32_t seed, GdnScan scan) {
  SCOPED_TRACE(std::string(g.name) + " T1=" + std::to_string(T1) + " T2=" + std::to_string(T2) + " scan " + name(scan));
  const int T = T1 + T2, pos0 = 37;
  const Inputs in(g, T, seed);
  const auto& [w, st, proj, d_proj] = in;
  DeviceGdn one(g, w, st, T), two(g, w, st, T);
  one.scan = two.scan = scan;
  ASSERT_CUDA(one.prefill(d_proj.get(), T, pos0));
  ASSERT_CUDA(two.prefill(d_proj.get(), T1, pos0));
  ASSERT_CUDA(two.prefill(d_proj.get() + static_cast<size_t>(T1) * g.gdn_proj(), T2, pos0 + T1, T1));
  ASSERT_CUDA(cudaDeviceSynchronize());
  const auto x1 = one.output(T), x2 = two.output(T), s1 = one.S.download(), s2 = two.S.download();
  const double ta = chunked(scan) ? kOutAbs : 1e-6, tr = chunked(scan) ? kOutRel : 1e-6,
               ts = chunked(scan) ? kStateTol : 1e-6;
  const double ex = compare(x2, x1, ta, tr, "out, two chunks vs one", g.value_dim());
  const double es = compare(s2, s1, ts, ts, "S, two chunks vs one", g.d_v);
  EXPECT_EQ(ring_mismatches(two.ring.download(), one.ring.download()), 0u) << "conv ring, two chunks vs one";
  size_t same = 0;
  for (size_t i = 0; i < s1.size(); ++i) same += s1[i] == s2[i];
  printf("[gdn_prefill] %-4s scan %s, %d+%d rows vs %d: %zu of %zu S elements bit-identical, outputs %s (max |out "
         "diff| %.2e, max |S diff| %.2e)\n",
         g.name, name(scan).c_str(), T1, T2, T, same, s1.size(), x1 == x2 ? "bit-identical" : "differ", ex, es);
}

TEST(CudaGdnPrefill, TwoChunksEqualOne) {
  SKIP_WITHOUT_GPU();
  for (GdnScan scan : scans()) {
    check_chunks(kFull, 100, 61, 400, scan);
    check_chunks(kFull, 2, 70, 401, scan);
    check_chunks(kFull, 64, 129, 403, scan);  // chunk-aligned split: the chunked path groups rows alike
    check_chunks(kTiny, 33, 1, 402, scan);
  }
}

// chunked_split against chunked on the same inputs. Same operands, same three exact partial products per k-step
// (tf32 x tf32 is exact in fp32); the split scan sums each product's hi*hi, lo*hi and hi*lo in accumulators of their
// own, the chunked scan chains them into one: per product of K terms the chain rounds the running sum 3K/8 times,
// the split scan K/8 times + twice, each rounding <= 2^-23 of sum_k |a_k b_k|, so |split - chunked| <= (K/2 + 2)
// 2^-23 sum_k |a_k b_k|: 7.9e-6 of sum |a b| at K = 128 (V' = U - W S), 4.1e-6 at K = 64 (the update), 62x below
// tf32's operand rounding (2^-11), whose effect on these inputs was modelled and measured (o ~1.1e-2 of its head's
// RMS, S ~1.1e-3). Both propagate linearly through the same contractive recurrence, so: o <= 1.8e-4 of the RMS
// (x |w silu(z)| < 4: 7e-4 absolute), S <= 1.8e-5. Asserted: S 5e-5 abs + rel, output 1e-3 absolute + 2^-9
// relative (the fp16 rounding of x may flip by one ulp when the fp32 values straddle a rounding boundary).
// chunked_wgmma chains the three products of a k-step into one accumulator as chunked does, on the tensor cores'
// fp32 accumulation (rounded or truncated a step, <= 2^-22 of the running sum): inside the same bound.
constexpr double kSplitOutAbs = 1e-3, kSplitOutRel = 1.0 / 512, kSplitStateTol = 5e-5;

void check_split(const Geometry& g, int T, uint32_t seed, GdnScan split) {
  SCOPED_TRACE(std::string(g.name) + " T=" + std::to_string(T) + " " + name(split));
  const Inputs in(g, T, seed);
  const auto& [w, st, proj, d_proj] = in;
  DeviceGdn a(g, w, st, T), b(g, w, st, T);
  a.scan = split, b.scan = GdnScan::chunked;
  ASSERT_CUDA(a.prefill(d_proj.get(), T, 37));
  ASSERT_CUDA(b.prefill(d_proj.get(), T, 37));
  ASSERT_CUDA(cudaDeviceSynchronize());
  const auto xa = a.output(T), xb = b.output(T), sa = a.S.download(), sb = b.S.download();
  const double ex = compare(xa, xb, kSplitOutAbs, kSplitOutRel, "out, split vs chunked", g.value_dim());
  const double es = compare(sa, sb, kSplitStateTol, kSplitStateTol, "S, split vs chunked", g.d_v);
  size_t same_x = 0, same_s = 0;
  for (size_t i = 0; i < xa.size(); ++i) same_x += xa[i] == xb[i];
  for (size_t i = 0; i < sa.size(); ++i) same_s += sa[i] == sb[i];
  printf("[gdn_prefill] %-4s T=%4d %s vs chunked: %zu of %zu outputs, %zu of %zu S elements "
         "bit-identical (max |out diff| %.2e, max |S diff| %.2e)\n",
         g.name, T, name(split).c_str(), same_x, xa.size(), same_s, sa.size(), ex, es);
}

TEST(CudaGdnPrefill, SplitMatchesChunkedWithinBound) {
  SKIP_WITHOUT_GPU();
  for (GdnScan split : scans()) {
    if (split != GdnScan::chunked_split && split != GdnScan::chunked_wgmma) continue;
    for (int T : {65, 4097}) {
      check_split(kFull, T, 640 + T, split);
      check_split(kTiny, T, 650 + T, split);
    }
  }
}

TEST(CudaGdnPrefill, DefaultScanByLength) {
  GdnPrefillParams p;
  p.d_k = p.d_v = 128;
  const bool wg = wgmma_built();
  const GdnScan small = wg ? GdnScan::chunked_wgmma : GdnScan::chunked;
  const GdnScan split = wg ? GdnScan::chunked_wgmma : GdnScan::chunked_split;
  for (auto [T, want] : {std::pair{1, GdnScan::sequential}, {255, GdnScan::sequential}, {256, small},
                         {511, small}, {512, split}, {4096, split}}) {
    p.T = T;
    EXPECT_EQ(scan_for(p), want) << "T " << T;
  }
  p.d_v = 64, p.T = 4096;  // the chunked scans need d_v = d_k
  EXPECT_EQ(scan_for(p), GdnScan::sequential);
  p.scan = GdnScan::chunked;
  EXPECT_EQ(scan_for(p), GdnScan::chunked);
}

void point_at(GdnPrefillParams& p, float* dummy, __half* out) {
  p.proj = p.conv_w = p.A_log = p.dt_bias = p.norm_w = dummy;
  p.conv_ring = p.S = dummy;
  p.out = out;
  p.scratch = dummy;
  p.scratch_bytes = ~size_t{0};
}

TEST(CudaGdnPrefill, RejectsBadShapes) {
  GdnPrefillParams p;  // null pointers
  EXPECT_EQ(gdn_prefill(p, nullptr), cudaErrorInvalidValue);
  float dummy[4];
  __half out[4];
  point_at(p, dummy, out);
  p.T = 1;
  p.d_k = 96;  // only 64 and 128
  EXPECT_EQ(gdn_prefill(p, nullptr), cudaErrorInvalidValue);
  p.d_k = 128, p.d_v = 48;  // d_v a multiple of 32
  EXPECT_EQ(gdn_prefill(p, nullptr), cudaErrorInvalidValue);
  p.d_v = 128, p.kernel = 3;
  EXPECT_EQ(gdn_prefill(p, nullptr), cudaErrorInvalidValue);
  p.kernel = 4, p.n_v = 24;  // n_v a multiple of n_k
  EXPECT_EQ(gdn_prefill(p, nullptr), cudaErrorInvalidValue);
  p.n_v = 32, p.T = 0;
  EXPECT_EQ(gdn_prefill(p, nullptr), cudaErrorInvalidValue);
  p.T = 1, p.scan = static_cast<GdnScan>(7);
  EXPECT_EQ(gdn_prefill(p, nullptr), cudaErrorInvalidValue);
  p.scan = GdnScan::chunked, p.d_v = 64;  // the chunked scans need d_v = d_k
  EXPECT_EQ(gdn_prefill(p, nullptr), cudaErrorInvalidValue);
  p.scan = GdnScan::chunked_split;  // ... the split one too
  EXPECT_EQ(gdn_prefill(p, nullptr), cudaErrorInvalidValue);
  p.d_v = 128;
  p.scan = GdnScan::by_length, p.scratch_bytes = 16;
  EXPECT_EQ(gdn_prefill(p, nullptr), cudaErrorInvalidValue);
}

// Milliseconds per layer at full geometry (30 such layers in the model), for each scan (prep and norm kernels
// included); inputs ~ N(0, 1). by_length (the default) picks by T.
TEST(CudaGdnPrefillBench, FullGeometry) {
  SKIP_WITHOUT_GPU();
  const Geometry& g = kFull;
  constexpr int kMaxT = 4096;
  const Weights w = random_weights(g, 500);
  DeviceGdn dev(g, w, random_state(g, 510), kMaxT);
  const DeviceBuffer<float> d_proj(random_vector(static_cast<size_t>(kMaxT) * g.gdn_proj(), 520));
  for (int T : {64, 128, 256, 512, 1024, 4096})
    for (GdnScan scan : {GdnScan::by_length, GdnScan::sequential, GdnScan::chunked, GdnScan::chunked_split,
                         GdnScan::chunked_wgmma}) {
      if (scan == GdnScan::chunked_wgmma && !wgmma_built()) continue;
      const double us = test::graph_time_us(
          [&](int, cudaStream_t s) {
            GdnPrefillParams p = dev.params(d_proj.get(), T, 37, reinterpret_cast<__half*>(dev.out.get()));
            p.scan = scan;
            return gdn_prefill(p, s);
          },
          5, 5);
      printf("[gdn_prefill bench] full T=%4d, scan %-13s: %.3f ms per layer (%.1f ns per row), x30 layers %.2f ms\n",
             T, name(scan).c_str(), us * 1e-3, us * 1e3 / T, 30 * us * 1e-3);
    }
}

}  // namespace
}  // namespace lily::cuda
