// attn_prefill (prep + causal flash attention, eqs 9-12) against plain CPU references on random inputs, against the
// decode path (attn_prep + attn_decode + attn_combine at pos0 + t) row by row, chunked against unchunked, plus a
// timing print at the full geometry (ms and TFLOP/s against the H200's ~790 TFLOP/s dense bf16); then the wgmma
// variant (attn_prefill_wgmma.cu): layout probes, against the reference and the mma.sync kernel, timings.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <set>
#include <vector>

#include "cuda/kernels/attn_prefill.cuh"
#include "cuda/kernels/dispatch.cuh"
#include "cuda_test_util.h"
#include "generic_refs.h"

namespace lily::cuda {
namespace {

using test::bf16_bits_to_float;
using test::f16_bits_to_float;
using test::DeviceBuffer;
using test::Geometry;
using test::random_vector;
using test::to_bf16_bits;

constexpr uint16_t kBf16NaN = 0xFFFF;  // cache rows nobody may read (or, at pos0.., rows the prep must write)
constexpr int kPad = 80;               // NaN rows past pos0 + T: more than a 64-row tile

size_t proj_stride(const Geometry& g) { return static_cast<size_t>(g.attn_proj()); }

// One prefill call: inputs, device buffers, and what the GPU left (caches, q from the scratch, out).
struct Prefill {
  Geometry g;
  int T = 0, pos0 = 0, cap = 0;
  std::vector<float> proj, q_norm, k_norm;
  DeviceBuffer<float> d_proj, d_qn, d_kn;
  DeviceBuffer<uint16_t> d_k, d_v, d_out;
  DeviceBuffer<unsigned char> d_scratch;
  std::vector<uint16_t> k_init, k, v, q, out;  // caches [cap, nkv, D], q [T, nq, D], out [T, nq*D] (k, v, q bf16 bits; out fp16 bits)
  int variant = 0;                             // AttnPrefillParams::variant

  size_t row_elems() const { return static_cast<size_t>(g.nkv) * g.head_dim; }

  // Random projections and norms; cache rows < pos0 random bf16, rows >= pos0 NaN.
  Prefill(const Geometry& geo, int T_, int pos0_, uint32_t seed) : g(geo), T(T_), pos0(pos0_), cap(pos0_ + T_ + kPad) {
    proj = random_vector(static_cast<size_t>(T) * proj_stride(g), seed);
    q_norm = random_vector(g.head_dim, seed + 1, 0.1f, 1.0f);
    k_norm = random_vector(g.head_dim, seed + 2, 0.1f, 1.0f);
    k_init.assign(static_cast<size_t>(cap) * row_elems(), kBf16NaN);
    std::vector<uint16_t> v_init(k_init.size(), kBf16NaN);
    const auto kf = random_vector(static_cast<size_t>(pos0) * row_elems(), seed + 3);
    const auto vf = random_vector(static_cast<size_t>(pos0) * row_elems(), seed + 4);
    for (size_t i = 0; i < kf.size(); ++i) k_init[i] = to_bf16_bits(kf[i]), v_init[i] = to_bf16_bits(vf[i]);
    d_proj = DeviceBuffer<float>(proj);
    d_qn = DeviceBuffer<float>(q_norm);
    d_kn = DeviceBuffer<float>(k_norm);
    d_k = DeviceBuffer<uint16_t>(k_init);
    d_v = DeviceBuffer<uint16_t>(v_init);
    d_out = DeviceBuffer<uint16_t>(static_cast<size_t>(T) * g.nq * g.head_dim);
    d_scratch = DeviceBuffer<unsigned char>(attn_prefill_scratch_bytes(T, g.nq, g.head_dim));
  }

  AttnPrefillParams params() const {
    AttnPrefillParams p;
    p.proj = d_proj.get();
    p.T = T;
    p.pos0 = pos0;
    p.q_norm = d_qn.get();
    p.k_norm = d_kn.get();
    p.nq = g.nq, p.nkv = g.nkv, p.head_dim = g.head_dim, p.rotary_dim = g.rotary_dim;
    p.rope_theta = test::kTheta;
    p.eps = test::kEps;
    p.scale = 1.0f / std::sqrt(static_cast<float>(g.head_dim));
    p.k_cache = reinterpret_cast<__nv_bfloat16*>(d_k.get());
    p.v_cache = reinterpret_cast<__nv_bfloat16*>(d_v.get());
    p.out = reinterpret_cast<__half*>(d_out.get());
    p.scratch = d_scratch.get();
    p.scratch_bytes = d_scratch.size();
    p.variant = variant;
    return p;
  }

  cudaError_t run() {
    const cudaError_t e = attn_prefill(params(), nullptr);
    if (e != cudaSuccess) return e;
    if (const cudaError_t s = cudaDeviceSynchronize(); s != cudaSuccess) return s;
    k = d_k.download();
    v = d_v.download();
    out = d_out.download();
    q.resize(static_cast<size_t>(T) * g.nq * g.head_dim);  // the scratch starts with q bf16 [T, nq, D]
    return cudaMemcpy(q.data(), d_scratch.get(), q.size() * sizeof(uint16_t), cudaMemcpyDeviceToHost);
  }
};

// Eqs 9-10 and the KV append: q and k within bf16 rounding (2^-9 relative) of the double reference plus fp32 slack
// (the GPU sums x^2 in fp32, its sincosf is within 2 ulp), v exact; cache rows outside pos0 .. pos0+T-1 untouched.
void check_prep(const Prefill& pf) {
  const Geometry& g = pf.g;
  const int D = g.head_dim;
  auto close = [](uint16_t got, float ref) {
    return std::fabs(bf16_bits_to_float(got) - ref) <= std::fabs(ref) * (1.0f / 256) + 3e-5f * std::max(1.0f, std::fabs(ref));
  };
  for (int t = 0; t < pf.T; ++t) {
    const float* row = &pf.proj[t * proj_stride(g)];
    for (int j = 0; j < g.nq; ++j) {
      auto ref = test::rms_norm_ref(row + j * 2 * D, pf.q_norm.data(), D);
      test::rope_ref(ref.data(), g.rotary_dim, pf.pos0 + t);
      for (int d = 0; d < D; ++d)
        ASSERT_TRUE(close(pf.q[(static_cast<size_t>(t) * g.nq + j) * D + d], ref[d]))
            << "q t " << t << " head " << j << " dim " << d << " ref " << ref[d];
    }
    for (int m = 0; m < g.nkv; ++m) {
      auto ref = test::rms_norm_ref(row + g.nq * 2 * D + m * D, pf.k_norm.data(), D);
      test::rope_ref(ref.data(), g.rotary_dim, pf.pos0 + t);
      const size_t base = (static_cast<size_t>(pf.pos0 + t) * g.nkv + m) * D;
      for (int d = 0; d < D; ++d) {
        ASSERT_TRUE(close(pf.k[base + d], ref[d])) << "k t " << t << " head " << m << " dim " << d;
        ASSERT_EQ(pf.v[base + d], to_bf16_bits(row[g.nq * 2 * D + (g.nkv + m) * D + d])) << "v t " << t;
      }
    }
  }
  const size_t lo = static_cast<size_t>(pf.pos0) * pf.row_elems(), hi = static_cast<size_t>(pf.pos0 + pf.T) * pf.row_elems();
  for (size_t i = 0; i < pf.k.size(); ++i) {
    if (i >= lo && i < hi) continue;
    ASSERT_EQ(pf.k[i], pf.k_init[i]) << "k cache element " << i << " touched";
  }
}

// Eqs 11-12 in double for row t, query head j over the bf16 q and cache rows 0..pos0+t exactly as the kernel reads
// them: out[d], and o_abs[d] = sum_r p_r |v_rd| (the scale of the rounding errors of p).
struct RowRef {
  std::vector<double> out, o_abs, sig;
};
RowRef attention_row_ref(const Prefill& pf, int t, int j) {
  const Geometry& g = pf.g;
  const int D = g.head_dim, m = j / (g.nq / g.nkv), n = pf.pos0 + t + 1;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  std::vector<double> q(D), w(n);
  for (int d = 0; d < D; ++d) q[d] = bf16_bits_to_float(pf.q[(static_cast<size_t>(t) * g.nq + j) * D + d]);
  double mx = -INFINITY;
  for (int r = 0; r < n; ++r) {
    const uint16_t* kr = &pf.k[(static_cast<size_t>(r) * g.nkv + m) * D];
    double s = 0;
    for (int d = 0; d < D; ++d) s += q[d] * bf16_bits_to_float(kr[d]);
    mx = std::max(mx, w[r] = s * scale);
  }
  double sum = 0;
  for (int r = 0; r < n; ++r) sum += (w[r] = std::exp(w[r] - mx));
  RowRef ref{std::vector<double>(D, 0.0), std::vector<double>(D, 0.0), std::vector<double>(D)};
  for (int r = 0; r < n; ++r) {
    const uint16_t* vr = &pf.v[(static_cast<size_t>(r) * g.nkv + m) * D];
    for (int d = 0; d < D; ++d) {
      const double vd = bf16_bits_to_float(vr[d]);
      ref.out[d] += w[r] * vd;
      ref.o_abs[d] += w[r] * std::fabs(vd);
    }
  }
  for (int d = 0; d < D; ++d) {
    ref.sig[d] = test::sigmoid_d(pf.proj[t * proj_stride(g) + j * 2 * D + D + d]);
    ref.out[d] = ref.out[d] / sum * ref.sig[d];
    ref.o_abs[d] /= sum;
  }
  return ref;
}

std::vector<int> sample_rows(int T, uint32_t seed) {
  if (T <= 65) {
    std::vector<int> all(T);
    for (int t = 0; t < T; ++t) all[t] = t;
    return all;
  }
  std::set<int> rows = {0, 1, 15, 16, 17, 63, 64, 65, T / 2, T - 2, T - 1};
  std::mt19937 rng(seed);
  for (int i = 0; i < 8; ++i) rows.insert(static_cast<int>(rng() % T));
  std::vector<int> out;
  for (int t : rows)
    if (t < T) out.push_back(t);
  return out;
}

// The kernels round p to bf16 for the P V product (2^-9 relative per term: at most 2^-9 * o_abs after the division)
// and the output to fp16 (2^-11 |out|); everything else is fp32 (scores to ~1e-6). About twice that bound.
void check_attention(const Prefill& pf) {
  const Geometry& g = pf.g;
  const int D = g.head_dim;
  double max_err = 0, max_ratio = 0;
  for (int t : sample_rows(pf.T, pf.T * 7 + pf.pos0)) {
    for (int j = 0; j < g.nq; ++j) {
      const RowRef ref = attention_row_ref(pf, t, j);
      for (int d = 0; d < D; ++d) {
        const double got = f16_bits_to_float(pf.out[(static_cast<size_t>(t) * g.nq + j) * D + d]);
        const double err = std::fabs(got - ref.out[d]);
        const double tol = (std::fabs(ref.out[d]) + ref.o_abs[d] * ref.sig[d]) / 256 + 1e-6;
        max_err = std::max(max_err, std::isnan(err) ? INFINITY : err);
        max_ratio = std::max(max_ratio, std::isnan(err) ? INFINITY : err / tol);
        ASSERT_LE(err, tol) << "t " << t << " head " << j << " dim " << d << ": gpu " << got << " ref " << ref.out[d];
      }
    }
  }
  printf("[prefill] %-5s T %5d pos0 %5d: max |out - ref| = %.2e (%.2f of the tolerance)\n", g.name, pf.T, pf.pos0,
         max_err, max_ratio);
}

void check_case(const Geometry& g, int T, int pos0) {
  SCOPED_TRACE(std::string(g.name) + " T " + std::to_string(T) + " pos0 " + std::to_string(pos0));
  Prefill pf(g, T, pos0, 1000 + T * 3 + pos0);
  ASSERT_NE(pf.d_k.get(), nullptr);
  ASSERT_CUDA(pf.run());
  check_prep(pf);
  if (::testing::Test::HasFatalFailure()) return;
  check_attention(pf);
}

const Geometry kGeometries[] = {test::kFull, test::kSmall, test::kTiny};

TEST(CudaAttnPrefill, MatchesCpuFromEmptyCache) {
  SKIP_WITHOUT_GPU();
  for (const Geometry& g : kGeometries)
    for (int T : {1, 63, 64, 65, 4097}) check_case(g, T, 0);
}

TEST(CudaAttnPrefill, MatchesCpuAfterEarlierChunks) {
  SKIP_WITHOUT_GPU();
  for (const Geometry& g : kGeometries)
    for (auto [T, pos0] : {std::pair{300, 1000}, std::pair{5, 37}, std::pair{1, 130}, std::pair{70, 4096},
                           std::pair{100, 12000}})
      check_case(g, T, pos0);
}

// The same rows in one call or in two chunks: the tiles are aligned to absolute cache rows and each row's mask and
// softmax depend only on its position, so the outputs and the cache are the same bits. (Sizes where neither call
// splits the KV range; a split merges partial sums in another order, which the reference tests cover.)
TEST(CudaAttnPrefill, ChunkedEqualsSingle) {
  SKIP_WITHOUT_GPU();
  for (const Geometry& g : kGeometries) {
    SCOPED_TRACE(g.name);
    constexpr int kT = 200, kSplit = 120;
    Prefill whole(g, kT, 0, 77);
    ASSERT_CUDA(whole.run());
    Prefill chunked(g, kT, 0, 77);  // same inputs; two calls over row ranges of the same buffers
    AttnPrefillParams p = chunked.params();
    p.T = kSplit;
    ASSERT_CUDA(attn_prefill(p, nullptr));
    const size_t stride = proj_stride(g), out_row = static_cast<size_t>(g.nq) * g.head_dim;
    p.proj += kSplit * stride;
    p.T = kT - kSplit;
    p.pos0 = kSplit;
    p.out += kSplit * out_row;
    ASSERT_CUDA(attn_prefill(p, nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());
    const auto out = chunked.d_out.download(), k = chunked.d_k.download(), v = chunked.d_v.download();
    for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], whole.out[i]) << "out element " << i;
    for (size_t i = 0; i < k.size(); ++i) ASSERT_EQ(k[i], whole.k[i]) << "k element " << i;
    for (size_t i = 0; i < v.size(); ++i) ASSERT_EQ(v[i], whole.v[i]) << "v element " << i;
  }
}

// Row t of a prefill against the decode path at pos0 + t over the cache the prefill wrote: attn_prep writes the same
// K/V bits and a q whose bf16 rounding is the prefill's q; attn_decode + attn_combine (fp32 q, split into hi+lo
// bf16, so scores to ~2^-17) then differ from the prefill's output by the prefill's bf16 q (score error ds_r, known
// exactly here: softmax moves by at most 2 max|ds| * o_abs), its bf16 p and fp16 output (as check_attention), and
// the decode's own 1e-4.
TEST(CudaAttnPrefill, MatchesDecodePath) {
  SKIP_WITHOUT_GPU();
  for (const Geometry& g : kGeometries) {
    for (auto [T, pos0] : {std::pair{65, 0}, std::pair{300, 1000}}) {
      SCOPED_TRACE(std::string(g.name) + " T " + std::to_string(T) + " pos0 " + std::to_string(pos0));
      Prefill pf(g, T, pos0, 555 + T);
      ASSERT_CUDA(pf.run());
      const int D = g.head_dim, n_splits = 8;
      DeviceBuffer<float> d_q(static_cast<size_t>(g.nq) * D), part_o(static_cast<size_t>(n_splits) * g.nq * D),
          part_ml(static_cast<size_t>(n_splits) * g.nq * 2), d_dec(static_cast<size_t>(g.nq) * D);
      double max_err = 0;
      for (int t : {0, 1, T / 2, T - 1}) {
        DeviceBuffer<int> d_pos(std::vector<int>{pos0 + t});
        AttnPrepParams pp;
        pp.proj = pf.d_proj.get() + t * proj_stride(g);
        pp.q_norm = pf.d_qn.get();
        pp.k_norm = pf.d_kn.get();
        pp.nq = g.nq, pp.nkv = g.nkv, pp.head_dim = D, pp.rotary_dim = g.rotary_dim, pp.rope_theta = test::kTheta;
        pp.eps = test::kEps;
        pp.pos = d_pos.get();
        pp.q = d_q.get();
        pp.k_cache = reinterpret_cast<__nv_bfloat16*>(pf.d_k.get());
        pp.v_cache = reinterpret_cast<__nv_bfloat16*>(pf.d_v.get());
        ASSERT_CUDA(dispatch::attn_prep(pp, nullptr));
        AttnDecodeParams dp;
        dp.q = d_q.get();
        dp.k_cache = pp.k_cache;
        dp.v_cache = pp.v_cache;
        dp.nq = g.nq, dp.nkv = g.nkv, dp.head_dim = D;
        dp.pos = d_pos.get();
        dp.n_splits = n_splits;
        dp.scale = 1.0f / std::sqrt(static_cast<float>(D));
        dp.part_o = part_o.get();
        dp.part_ml = part_ml.get();
        ASSERT_CUDA(dispatch::attn_decode(dp, nullptr));
        AttnCombineParams cp;
        cp.part_o = part_o.get();
        cp.part_ml = part_ml.get();
        cp.n_splits = n_splits, cp.nq = g.nq, cp.head_dim = D;
        cp.proj = pp.proj;
        cp.out = d_dec.get();
        ASSERT_CUDA(dispatch::attn_combine(cp, nullptr));
        ASSERT_CUDA(cudaDeviceSynchronize());
        const auto q32 = d_q.download(), dec = d_dec.download();
        const auto k = pf.d_k.download(), v = pf.d_v.download();
        ASSERT_TRUE(k == pf.k) << "attn_prep rewrote K row " << pos0 + t << " differently";
        ASSERT_TRUE(v == pf.v) << "attn_prep rewrote V row " << pos0 + t << " differently";
        for (int i = 0; i < g.nq * D; ++i)
          ASSERT_EQ(to_bf16_bits(q32[i]), pf.q[static_cast<size_t>(t) * g.nq * D + i]) << "q t " << t << " elem " << i;
        for (int j = 0; j < g.nq; ++j) {
          const int m = j / (g.nq / g.nkv);
          double ds = 0;  // max over rows of |score(fp32 q) - score(bf16 q)|
          for (int r = 0; r <= pos0 + t; ++r) {
            double s = 0;
            for (int d = 0; d < D; ++d)
              s += (static_cast<double>(q32[j * D + d]) - bf16_bits_to_float(pf.q[(static_cast<size_t>(t) * g.nq + j) * D + d])) *
                   bf16_bits_to_float(pf.k[(static_cast<size_t>(r) * g.nkv + m) * D + d]);
            ds = std::max(ds, std::fabs(s) / std::sqrt(static_cast<double>(D)));
          }
          const RowRef ref = attention_row_ref(pf, t, j);
          for (int d = 0; d < D; ++d) {
            const double got = f16_bits_to_float(pf.out[(static_cast<size_t>(t) * g.nq + j) * D + d]);
            const double err = std::fabs(got - dec[j * D + d]);
            const double tol = std::fabs(dec[j * D + d]) / 256 + (1.0 / 256 + 2 * ds) * ref.o_abs[d] * ref.sig[d] + 1e-4;
            max_err = std::max(max_err, std::isnan(err) ? INFINITY : err);
            ASSERT_LE(err, tol) << "t " << t << " head " << j << " dim " << d << ": prefill " << got << " decode "
                                << dec[j * D + d];
          }
        }
      }
      printf("[prefill vs decode] %-5s T %4d pos0 %4d: max |prefill - decode| = %.2e\n", g.name, T, pos0, max_err);
    }
  }
}

TEST(CudaAttnPrefill, RejectsBadShapes) {
  AttnPrefillParams p;  // null pointers
  EXPECT_EQ(attn_prefill(p, nullptr), cudaErrorInvalidValue);
  alignas(16) static float dummy[64];
  p.proj = p.q_norm = p.k_norm = dummy;
  p.k_cache = p.v_cache = reinterpret_cast<__nv_bfloat16*>(dummy);
  p.out = reinterpret_cast<__half*>(dummy);
  p.scratch = dummy;
  p.scratch_bytes = sizeof dummy;
  p.T = 1;
  p.head_dim = 128;  // not taken
  EXPECT_EQ(attn_prefill(p, nullptr), cudaErrorInvalidValue);
  p.head_dim = 64;
  p.nq = 16, p.nkv = 1;  // group 16 does not pack into 128 rows
  EXPECT_EQ(attn_prefill(p, nullptr), cudaErrorInvalidValue);
  p.nq = 4, p.nkv = 2, p.rotary_dim = 16;
  p.scratch_bytes = attn_prefill_scratch_bytes(1, 4, 64) - 1;  // too little scratch
  EXPECT_EQ(attn_prefill(p, nullptr), cudaErrorInvalidValue);
}

// The timing tests' inputs at the full geometry: a 131,072-row KV cache, 4,096 rows of projections, scratch, the
// q/k norm; repeated random blocks (non-degenerate values: zeros would flatter the hardware).
struct BenchInputs {
  static constexpr int cap = 131072, max_T = 4096;
  const Geometry g = test::kFull;
  const int D = g.head_dim;
  const size_t row_elems = static_cast<size_t>(g.nkv) * D;
  DeviceBuffer<uint16_t> k{cap * row_elems}, v{cap * row_elems}, out{static_cast<size_t>(max_T) * g.nq * D};
  DeviceBuffer<float> proj{static_cast<size_t>(max_T) * proj_stride(g)};
  DeviceBuffer<unsigned char> scratch{attn_prefill_scratch_bytes(max_T, g.nq, D)};
  DeviceBuffer<float> d_norm{random_vector(D, 7, 0.1f, 1.0f)};

  void fill() {
    ASSERT_NE(k.get(), nullptr);
    ASSERT_NE(v.get(), nullptr);
    std::vector<uint16_t> block(1u << 20);
    const auto f = random_vector(block.size(), 5);
    for (size_t i = 0; i < block.size(); ++i) block[i] = to_bf16_bits(f[i]);
    for (size_t off = 0; off < k.size(); off += block.size()) {
      ASSERT_CUDA(cudaMemcpy(k.get() + off, block.data(), std::min(block.size(), k.size() - off) * 2, cudaMemcpyHostToDevice));
      ASSERT_CUDA(cudaMemcpy(v.get() + off, block.data(), std::min(block.size(), v.size() - off) * 2, cudaMemcpyHostToDevice));
    }
    const auto pf = random_vector(64 * proj_stride(g), 6);
    for (size_t off = 0; off < proj.size(); off += pf.size())
      ASSERT_CUDA(cudaMemcpy(proj.get() + off, pf.data(), std::min(pf.size(), proj.size() - off) * 4, cudaMemcpyHostToDevice));
  }

  // The call for T rows at pos0 on these inputs (flash stage `variant`).
  AttnPrefillParams params(int T, int pos0, int variant = 0) {
    AttnPrefillParams p;
    p.proj = proj.get();
    p.T = T;
    p.pos0 = pos0;
    p.q_norm = p.k_norm = d_norm.get();
    p.nq = g.nq, p.nkv = g.nkv, p.head_dim = D, p.rotary_dim = g.rotary_dim, p.rope_theta = test::kTheta;
    p.k_cache = reinterpret_cast<__nv_bfloat16*>(k.get());
    p.v_cache = reinterpret_cast<__nv_bfloat16*>(v.get());
    p.out = reinterpret_cast<__half*>(out.get());
    p.scratch = scratch.get();
    p.scratch_bytes = scratch.size();
    p.variant = variant;
    return p;
  }

  // Useful causal FLOPs of that call: 4 * nq * D * sum_t (pos0 + t + 1).
  double causal_flops(int T, int pos0) const {
    double pairs = 0;
    for (int t = 0; t < T; ++t) pairs += pos0 + t + 1;
    return 4.0 * g.nq * D * pairs;
  }
};

// Prints ms and TFLOP/s (useful causal FLOPs 4 * nq * D * sum_t (pos0+t+1)) at the full geometry; prep included.
TEST(CudaAttnPrefillBench, Timing) {
  SKIP_WITHOUT_GPU();
  BenchInputs in;
  ASSERT_NO_FATAL_FAILURE(in.fill());
  printf("[prefill bench] full geometry (nq 16, nkv 2, D 256), prep + flash, vs 790 TFLOP/s dense bf16\n");
  printf("%6s %7s %10s %10s %8s\n", "T", "pos0", "ms", "TFLOP/s", "of_peak");
  for (auto [T, pos0] : {std::pair{4096, 0}, std::pair{4096, 28672}, std::pair{4096, 126976}, std::pair{512, 0},
                         std::pair{1024, 0}, std::pair{2048, 0}, std::pair{256, 0}, std::pair{64, 65536},
                         std::pair{1, 131000}}) {
    const AttnPrefillParams p = in.params(T, pos0);
    const double us = test::graph_time_us([&](int, cudaStream_t s) { return attn_prefill(p, s); }, 2, 5);
    ASSERT_GT(us, 0) << "benchmark launch failed";
    const double tflops = in.causal_flops(T, pos0) / (us * 1e-6) * 1e-12;
    printf("%6d %7d %10.3f %10.1f %7.1f%%\n", T, pos0, us * 1e-3, tflops, 100.0 * tflops / 790.0);
  }
}

// ---- the wgmma flash stage (AttnPrefillParams::variant 1, attn_prefill_wgmma.cu) --------------------------------
// Validation order for a first GPU run (one filter, CudaAttnPrefillWgmma*): layout probes, then the reference and
// cross-kernel checks, then the timings.

bool wgmma_available() {
  cudaDeviceProp prop{};
  return cudaGetDeviceProperties(&prop, 0) == cudaSuccess && prop.major == 9 && prop.minor == 0 &&
         attn_prefill_wgmma_built();
}

#define SKIP_WITHOUT_WGMMA()                                                                       \
  do {                                                                                             \
    if (!wgmma_available()) GTEST_SKIP() << "the wgmma attention needs a compute 9.0 GPU (sm_90a build)"; \
  } while (0)

// GQA groups 8 (the model: 16 positions x 8 heads a block), 2 and 1 (a warpgroup spans 64 positions of one head:
// the per-warpgroup tile skip and several diagonal tiles a block).
constexpr Geometry kGroup2{"g2", 1024, 4, 2, 256, 64, 8, 16, 128, 128, 32, 8, 256};
constexpr Geometry kGroup1{"g1", 1024, 2, 2, 256, 64, 8, 16, 128, 128, 32, 8, 256};

// Structured inputs through the flash stage alone (flash_only: q written straight into the scratch, the cache rows
// given), exact in bf16 / fp16, so that a misplaced element names itself. Query row t of head j looks at exactly
// one cache row, r*(t, j) = (13 t + 29 j + 7) mod (pos0 + t + 1) (always visible): q = 64 e_dim(r*), K row r =
// 64 e_dim(r) with dim(r) = 37 r mod 256 (a bijection over the 256 dims, so every 64-dim sub-tile and k-step of
// Q K^T is used): the score is 4096 for r* and 0 for every other row, so p is exactly 1 for r* and exactly 0
// elsewhere (exp2(-369) underflows; a tile without r* seen first is rescaled by alpha = 0). The gates are 30
// (sigmoid = 1.0f). Then out[t, j, d] = V[r*, m(j), d] exactly:
//  - the S probe: V[r, m, d] = r (kv head 0) or -(r + 1) (kv head 1): a wrong value names the cache row (and
//    kv head) that the row's softmax picked: Q K^T or its mask misplaced;
//  - the V probe: V[r, m, d] = d or -(d + 1): a wrong value names the dim that P V read: the MN-major V
//    descriptor (leading / stride byte offsets, swizzle) misplaced.
// Both variants run it: variant 0 passing proves the probe itself.
TEST(CudaAttnPrefillWgmma, LayoutProbes) {
  SKIP_WITHOUT_GPU();
  const bool have_wgmma = wgmma_available();
  if (!have_wgmma) printf("[wgmma probe] no wgmma build for this device: variant 0 only\n");
  for (const Geometry& g : {test::kFull, kGroup1}) {
    for (auto [T, pos0] : {std::pair{256, 0}, std::pair{130, 126}}) {
      const int D = g.head_dim, n = pos0 + T, cap = n + kPad, group = g.nq / g.nkv;
      auto dim_of = [](int r) { return (37 * r) % 256; };
      auto target = [&](int t, int j) { return (13 * t + 29 * j + 7) % (pos0 + t + 1); };
      std::vector<uint16_t> q(static_cast<size_t>(T) * g.nq * D, 0), k(static_cast<size_t>(cap) * g.nkv * D, kBf16NaN);
      for (int t = 0; t < T; ++t)
        for (int j = 0; j < g.nq; ++j) q[(static_cast<size_t>(t) * g.nq + j) * D + dim_of(target(t, j))] = to_bf16_bits(64.0f);
      for (int r = 0; r < n; ++r)
        for (int m = 0; m < g.nkv; ++m)
          for (int d = 0; d < D; ++d) k[(static_cast<size_t>(r) * g.nkv + m) * D + d] = to_bf16_bits(d == dim_of(r) ? 64.0f : 0.0f);
      const std::vector<float> proj(static_cast<size_t>(T) * proj_stride(g), 30.0f), norm(D, 1.0f);
      DeviceBuffer<float> d_proj(proj), d_norm(norm);
      DeviceBuffer<uint16_t> d_k(k), d_out(static_cast<size_t>(T) * g.nq * D);
      DeviceBuffer<unsigned char> d_scratch(attn_prefill_scratch_bytes(T, g.nq, D));
      ASSERT_CUDA(cudaMemcpy(d_scratch.get(), q.data(), q.size() * 2, cudaMemcpyHostToDevice));
      for (int probe = 0; probe < 2; ++probe) {  // 0: S probe (V = row), 1: V probe (V = dim)
        std::vector<uint16_t> v(k.size(), kBf16NaN);
        for (int r = 0; r < n; ++r)
          for (int m = 0; m < g.nkv; ++m)
            for (int d = 0; d < D; ++d) {
              const float x = static_cast<float>(probe == 0 ? r : d);
              v[(static_cast<size_t>(r) * g.nkv + m) * D + d] = to_bf16_bits(m == 0 ? x : -(x + 1));
            }
        DeviceBuffer<uint16_t> d_v(v);
        for (int variant = 0; variant < (have_wgmma ? 2 : 1); ++variant) {
          AttnPrefillParams p;
          p.proj = d_proj.get();
          p.T = T;
          p.pos0 = pos0;
          p.q_norm = p.k_norm = d_norm.get();
          p.nq = g.nq, p.nkv = g.nkv, p.head_dim = D, p.rotary_dim = g.rotary_dim;
          p.scale = 1.0f / 16;
          p.k_cache = reinterpret_cast<__nv_bfloat16*>(d_k.get());
          p.v_cache = reinterpret_cast<__nv_bfloat16*>(d_v.get());
          p.out = reinterpret_cast<__half*>(d_out.get());
          p.scratch = d_scratch.get();
          p.scratch_bytes = d_scratch.size();
          p.variant = variant;
          p.flash_only = true;
          ASSERT_CUDA(cudaMemset(d_out.get(), 0xFF, d_out.size() * 2));  // NaN: unwritten outputs show
          ASSERT_CUDA(attn_prefill(p, nullptr));
          ASSERT_CUDA(cudaDeviceSynchronize());
          const auto out = d_out.download();
          int bad = 0;
          for (int t = 0; t < T; ++t)
            for (int j = 0; j < g.nq; ++j) {
              const int rs = target(t, j), m = j / group;
              for (int d = 0; d < D; ++d) {
                const float x = static_cast<float>(probe == 0 ? rs : d), want = m == 0 ? x : -(x + 1);
                const float got = f16_bits_to_float(out[(static_cast<size_t>(t) * g.nq + j) * D + d]);
                if (got == want) continue;
                if (++bad > 8) continue;
                const int named = got >= 0 ? static_cast<int>(got) : static_cast<int>(-got) - 1;
                ADD_FAILURE() << (probe == 0 ? "S probe" : "V probe") << " variant " << variant << " " << g.name << " T "
                              << T << " pos0 " << pos0 << ": out[t " << t << "][head " << j << "][dim " << d << "] = " << got
                              << ", want " << want << (probe == 0 ? " (cache row " : " (dim ") << (probe == 0 ? rs : d)
                              << " of kv head " << m << "); got " << (probe == 0 ? "cache row " : "dim ") << named
                              << " of kv head " << (got >= 0 ? 0 : 1) << (std::isnan(got) ? " (NaN: not written or NaN read)" : "");
              }
            }
          EXPECT_EQ(bad, 0) << (probe == 0 ? "S probe" : "V probe") << " variant " << variant << " " << g.name << " T " << T
                            << " pos0 " << pos0;
          printf("[wgmma probe] %s variant %d %-4s T %3d pos0 %3d: %d wrong of %zu\n", probe == 0 ? "S" : "V", variant,
                 g.name, T, pos0, bad, out.size());
        }
      }
    }
  }
}

// The wgmma variant against the fp64 reference (check_attention: the same bf16-P tolerance, both kernels round p
// to bf16 for P V) on sampled rows, and against the mma.sync kernel on every output: the two see the same q and
// cache bits and the same tile order; their scores differ only by fp32 summation order (~1e-6 relative, so p by
// < 1e-4 relative and the running maxima by as little, which cancels in O / l), and each rounds its p to bf16
// (2^-9 relative each, l sums the unrounded p in both): the outputs differ by at most (2^-8 + 1e-4)
// sum_r p_r |v_rd| / l <= (2^-8 + 1e-4) max_r |v_rd| (times the gate) plus both fp16 roundings (2^-11 |out| each).
void check_wgmma_case(const Geometry& g, int T, int pos0) {
  SCOPED_TRACE(std::string(g.name) + " T " + std::to_string(T) + " pos0 " + std::to_string(pos0));
  Prefill pf(g, T, pos0, 4242 + T * 5 + pos0);
  ASSERT_NE(pf.d_k.get(), nullptr);
  ASSERT_CUDA(pf.run());  // variant 0
  const std::vector<uint16_t> old_out = pf.out;
  pf.variant = 1;
  ASSERT_CUDA(cudaMemset(pf.d_out.get(), 0xFF, pf.d_out.size() * 2));
  ASSERT_CUDA(pf.run());  // the prep writes the same bits again
  check_prep(pf);
  if (::testing::Test::HasFatalFailure()) return;
  check_attention(pf);
  if (::testing::Test::HasFatalFailure()) return;
  const int D = g.head_dim, group = g.nq / g.nkv;
  std::vector<double> vmax(static_cast<size_t>(g.nkv) * D, 0.0);  // max_r |v[r, m, d]| over the visible rows
  for (int r = 0; r < pos0 + T; ++r)
    for (int i = 0; i < g.nkv * D; ++i)
      vmax[i] = std::max(vmax[i], static_cast<double>(std::fabs(bf16_bits_to_float(pf.v[static_cast<size_t>(r) * g.nkv * D + i]))));
  size_t same = 0, bad = 0;
  double max_diff = 0;
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < g.nq; ++j)
      for (int d = 0; d < D; ++d) {
        const size_t i = (static_cast<size_t>(t) * g.nq + j) * D + d;
        same += pf.out[i] == old_out[i];
        const double a = f16_bits_to_float(pf.out[i]), b = f16_bits_to_float(old_out[i]);
        const double sig = test::sigmoid_d(pf.proj[t * proj_stride(g) + j * 2 * D + D + d]);
        const double tol =
            vmax[(j / group) * D + d] * sig * (1.0 / 256 + 1e-4) + (std::fabs(a) + std::fabs(b)) / 1024 + 1e-6;
        const double diff = std::fabs(a - b);
        max_diff = std::max(max_diff, std::isnan(diff) ? INFINITY : diff);
        if (!(diff <= tol) && ++bad <= 5)
          ADD_FAILURE() << "wgmma vs mma.sync: t " << t << " head " << j << " dim " << d << ": " << a << " vs " << b;
      }
  EXPECT_EQ(bad, 0u);
  printf("[wgmma vs mma.sync] %-4s T %5d pos0 %5d: max diff %.2e, %.1f%% bit-identical\n", g.name, T, pos0, max_diff,
         100.0 * same / pf.out.size());
}

TEST(CudaAttnPrefillWgmma, MatchesMmaSyncAndCpu) {
  SKIP_WITHOUT_GPU();
  SKIP_WITHOUT_WGMMA();
  for (int pos0 : {0, 4096, 28672})
    for (int T : {1, 63, 64, 65, 300, 4096}) check_wgmma_case(test::kFull, T, pos0);
  for (const Geometry& g : {test::kSmall, kGroup2, kGroup1})
    for (auto [T, pos0] : {std::pair{65, 0}, std::pair{300, 1000}, std::pair{1, 130}}) check_wgmma_case(g, T, pos0);
}

TEST(CudaAttnPrefillWgmma, RejectsWhatItDoesNotTake) {
  SKIP_WITHOUT_GPU();
  Prefill pf(test::kTiny, 4, 0, 9);  // head_dim 64: the wgmma variant takes 256 only
  AttnPrefillParams p = pf.params();
  p.variant = 1;
  EXPECT_EQ(attn_prefill(p, nullptr), cudaErrorInvalidValue);
  p.variant = 2;
  EXPECT_EQ(attn_prefill(p, nullptr), cudaErrorInvalidValue);
}

// TFLOP/s of the two variants (useful causal FLOPs, prep included) at the full geometry.
TEST(CudaAttnPrefillWgmmaBench, Timing) {
  SKIP_WITHOUT_GPU();
  SKIP_WITHOUT_WGMMA();
  BenchInputs in;
  ASSERT_NO_FATAL_FAILURE(in.fill());
  printf("[prefill wgmma bench] full geometry, prep + flash, TFLOP/s of the causal FLOPs (790 = dense bf16 peak)\n");
  printf("%6s %7s %12s %12s %10s %10s\n", "T", "pos0", "mma.sync ms", "wgmma ms", "TFLOP/s", "TFLOP/s");
  for (auto [T, pos0] : {std::pair{4096, 0}, std::pair{4096, 28672}, std::pair{4096, 126976}, std::pair{1024, 0},
                         std::pair{64, 65536}}) {
    double us[2];
    for (int variant = 0; variant < 2; ++variant) {
      const AttnPrefillParams p = in.params(T, pos0, variant);
      us[variant] = test::graph_time_us([&](int, cudaStream_t s) { return attn_prefill(p, s); }, 2, 5);
      ASSERT_GT(us[variant], 0) << "benchmark launch failed, variant " << variant;
    }
    const double flops = in.causal_flops(T, pos0);
    printf("%6d %7d %12.3f %12.3f %10.1f %10.1f\n", T, pos0, us[0] * 1e-3, us[1] * 1e-3, flops / us[0] * 1e-6,
           flops / us[1] * 1e-6);
  }
}

}  // namespace
}  // namespace lily::cuda
