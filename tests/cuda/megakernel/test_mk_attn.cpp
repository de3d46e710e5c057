// The megakernel's gated attention (Opcode::attn_part / attn_merge, eqs 9-12) on fresh random inputs: against a CPU
// reference in double and the chain's attn_prep / attn_decode / attn_combine, the row it appends to the caches, the
// same bits on any grid, and timed against the chain at 4K, 32K and 128K rows.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "cpu/ops.h"
#include "mk_test_util.h"
#include "cuda/kernels/attention.cuh"
#include "cuda/megakernel/step.cuh"

namespace lily::cuda::mk {
namespace {

using test::bf16_bits_to_float;
using test::DeviceBuffer;
using test_util::device_sms;

constexpr int kNq = kAttnQHeads, kNkv = kAttnKvHeads, kD = kAttnDim, kRot = kAttnRotary;
constexpr int kProj = kNq * 2 * kD + 2 * kNkv * kD;
constexpr float kTheta = 1e7f;
constexpr uint16_t kNaN = 0xFFFF;  // cache rows at and past pos: the megakernel must write row pos, read none past it

uint16_t to_bf16(float f) {  // round to nearest even (finite inputs), as __float2bfloat16_rn
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

void rope(float* x, int p) {  // eq 10, as src/cpu/attention.cpp
  for (int i = 0; i < kRot / 2; ++i) {
    const float inv_freq = static_cast<float>(1.0 / std::pow(static_cast<double>(kTheta), (2.0 * i) / kRot));
    const float ang = static_cast<float>(p) * inv_freq, c = std::cos(ang), s = std::sin(ang);
    const float x0 = x[i], x1 = x[i + kRot / 2];
    x[i] = x0 * c - x1 * s;
    x[i + kRot / 2] = x1 * c + x0 * s;
  }
}

// One layer's inputs at position pos: the projection, the norms and caches of pos + 16 rows (rows < pos random
// bf16, the rest NaN), a copy of the caches for the chain, and the ops' outputs.
struct AttnCase {
  int pos, n_splits;
  std::vector<float> proj, q_norm, k_norm;
  std::vector<uint16_t> cache_k, cache_v;
  DeviceBuffer<float> d_proj, d_qn, d_kn, part_o, part_ml, out, q;
  DeviceBuffer<uint16_t> d_k, d_v;
  DeviceBuffer<int> d_pos;

  AttnCase(int p, int splits, uint32_t seed) : pos(p), n_splits(splits) {
    proj = test::random_vector(kProj, seed);
    q_norm = test::random_vector(kD, seed + 1, 0.1f, 1.0f);
    k_norm = test::random_vector(kD, seed + 2, 0.1f, 1.0f);
    const size_t rows = static_cast<size_t>(pos) + 16;
    cache_k.assign(rows * kNkv * kD, kNaN);
    cache_v.assign(rows * kNkv * kD, kNaN);
    const auto kf = test::random_vector(static_cast<size_t>(pos) * kNkv * kD, seed + 3, 1.5f);
    const auto vf = test::random_vector(static_cast<size_t>(pos) * kNkv * kD, seed + 4);
    for (size_t i = 0; i < kf.size(); ++i) cache_k[i] = to_bf16(kf[i]), cache_v[i] = to_bf16(vf[i]);
    d_proj = DeviceBuffer<float>(proj), d_qn = DeviceBuffer<float>(q_norm), d_kn = DeviceBuffer<float>(k_norm);
    part_o = DeviceBuffer<float>(static_cast<size_t>(splits) * kNq * kD);
    part_ml = DeviceBuffer<float>(static_cast<size_t>(splits) * kNq * 2);
    out = DeviceBuffer<float>(kNq * kD), q = DeviceBuffer<float>(kNq * kD);
    d_pos = DeviceBuffer<int>(std::vector<int>{pos});
    reset();
  }
  void reset() {
    d_k = DeviceBuffer<uint16_t>(cache_k);
    d_v = DeviceBuffer<uint16_t>(cache_v);
    cudaMemset(part_o.get(), 0xFF, part_o.size() * sizeof(float));  // NaN: a unit that skips its slot shows
    cudaMemset(part_ml.get(), 0xFF, part_ml.size() * sizeof(float));
  }
  AttnArgs args() {
    AttnArgs a;
    a.proj = d_proj.get(), a.q_norm = d_qn.get(), a.k_norm = d_kn.get(), a.pos = d_pos.get();
    a.k_cache = reinterpret_cast<__nv_bfloat16*>(d_k.get()), a.v_cache = reinterpret_cast<__nv_bfloat16*>(d_v.get());
    a.part_o = part_o.get(), a.part_ml = part_ml.get(), a.n_splits = n_splits, a.rope_theta = kTheta;
    return a;
  }
  cudaError_t chain(cudaStream_t stream) {
    AttnPrepParams pp;
    pp.proj = d_proj.get(), pp.q_norm = d_qn.get(), pp.k_norm = d_kn.get(), pp.rope_theta = kTheta;
    pp.pos = d_pos.get(), pp.q = q.get();
    pp.k_cache = reinterpret_cast<__nv_bfloat16*>(d_k.get()), pp.v_cache = reinterpret_cast<__nv_bfloat16*>(d_v.get());
    CUDA_TRY(attn_prep(pp, stream));
    AttnDecodeParams dp;
    dp.q = q.get(), dp.k_cache = pp.k_cache, dp.v_cache = pp.v_cache, dp.pos = d_pos.get();
    dp.n_splits = n_splits, dp.scale = 1.0f / 16.0f, dp.part_o = part_o.get(), dp.part_ml = part_ml.get();
    CUDA_TRY(attn_decode(dp, stream));
    AttnCombineParams cp;
    cp.part_o = part_o.get(), cp.part_ml = part_ml.get(), cp.n_splits = n_splits, cp.proj = d_proj.get();
    cp.out = out.get();
    return attn_combine(cp, stream);
  }
};

// Eqs 9-12 in double (fp32 norms and RoPE as the CPU engine), over the cache rows < pos and the given row pos.
std::vector<double> reference(const AttnCase& c, const std::vector<uint16_t>& k_pos, const std::vector<uint16_t>& v_pos) {
  std::vector<double> out(kNq * kD);
  std::vector<float> q(kD);
  std::vector<double> w(c.pos + 1), o(kD);
  for (int j = 0; j < kNq; ++j) {
    const int m = j / (kNq / kNkv);
    cpu::rms_norm(&c.proj[j * 2 * kD], c.q_norm.data(), 1, kD, 1e-6f, q.data());
    rope(q.data(), c.pos);
    auto key = [&](int r, int d) {
      return bf16_bits_to_float(r < c.pos ? c.cache_k[(static_cast<size_t>(r) * kNkv + m) * kD + d] : k_pos[m * kD + d]);
    };
    auto val = [&](int r, int d) {
      return bf16_bits_to_float(r < c.pos ? c.cache_v[(static_cast<size_t>(r) * kNkv + m) * kD + d] : v_pos[m * kD + d]);
    };
    double mx = -INFINITY;
    for (int r = 0; r <= c.pos; ++r) {
      double s = 0;
      for (int d = 0; d < kD; ++d) s += static_cast<double>(q[d]) * key(r, d);
      mx = std::max(mx, w[r] = s / 16.0);
    }
    double sum = 0;
    for (int r = 0; r <= c.pos; ++r) sum += (w[r] = std::exp(w[r] - mx));
    std::fill(o.begin(), o.end(), 0.0);
    for (int r = 0; r <= c.pos; ++r)
      for (int d = 0; d < kD; ++d) o[d] += w[r] * val(r, d);
    for (int d = 0; d < kD; ++d) {
      const double gate = c.proj[j * 2 * kD + kD + d];
      out[j * kD + d] = o[d] / sum / (1.0 + std::exp(-gate));
    }
  }
  return out;
}

std::vector<float> run_mk(AttnCase& c, int n_blocks) {
  c.reset();
  Program p;
  auto op = p.add_attention(c.args(), c.out.get(), -1);
  EXPECT_TRUE(op.ok()) << op.status().message();
  if (!op.ok() || !test_util::run_once(p, n_blocks)) return {};
  return c.out.download();
}

std::vector<uint16_t> cache_row(const DeviceBuffer<uint16_t>& cache, int row) {
  std::vector<uint16_t> h(kNkv * kD);
  cudaMemcpy(h.data(), cache.get() + static_cast<size_t>(row) * kNkv * kD, h.size() * 2, cudaMemcpyDeviceToHost);
  return h;
}

// Positions around the 16-row chunk rounding and the 32-row pages, one split and a few (several pages a unit:
// the 5-page ring wraps), the chain's 66.
TEST(MkAttn, MatchesCpuAndTheChainAndAppendsTheRow) {
  SKIP_WITHOUT_STEP();
  struct Case {
    int pos, splits;
  };
  for (const Case cs : {Case{0, 66}, Case{1, 66}, Case{15, 66}, Case{31, 7}, Case{32, 1}, Case{33, 66}, Case{1000, 66},
                        Case{1000, 7}, Case{4095, 66}, Case{4097, 3}}) {
    SCOPED_TRACE("pos " + std::to_string(cs.pos) + ", " + std::to_string(cs.splits) + " splits");
    AttnCase c(cs.pos, cs.splits, 9100 + cs.pos + cs.splits);
    const std::vector<float> got = run_mk(c, device_sms());
    ASSERT_EQ(got.size(), static_cast<size_t>(kNq * kD));
    const std::vector<uint16_t> k_pos = cache_row(c.d_k, cs.pos), v_pos = cache_row(c.d_v, cs.pos);
    // Row pos appended: v exactly (rounded once), k within half a bf16 ulp of the CPU's norm and RoPE (plus the fp32
    // slack of the sum of squares' order); no row past it touched.
    std::vector<float> kref(kD);
    for (int m = 0; m < kNkv; ++m) {
      cpu::rms_norm(&c.proj[kNq * 2 * kD + m * kD], c.k_norm.data(), 1, kD, 1e-6f, kref.data());
      rope(kref.data(), cs.pos);
      for (int d = 0; d < kD; ++d) {
        ASSERT_LE(std::fabs(bf16_bits_to_float(k_pos[m * kD + d]) - kref[d]), std::fabs(kref[d]) / 256 + 3e-5f)
            << "k head " << m << " dim " << d;
        ASSERT_EQ(v_pos[m * kD + d], to_bf16(c.proj[kNq * 2 * kD + (kNkv + m) * kD + d])) << "v head " << m;
      }
    }
    for (uint16_t b : cache_row(c.d_k, cs.pos + 1)) ASSERT_EQ(b, kNaN) << "row pos + 1 written";
    // Against the CPU: the scores and O in fp32 from exact bf16 K / V; outputs are averages of |v| ~ 0.8.
    const std::vector<double> ref = reference(c, k_pos, v_pos);
    double worst = 0;
    for (int i = 0; i < kNq * kD; ++i) {
      const double err = std::fabs(got[i] - ref[i]);
      worst = std::max(worst, std::isnan(err) ? INFINITY : err);
      ASSERT_LE(err, 1e-4 + 1e-4 * std::fabs(ref[i])) << "head " << i / kD << " dim " << i % kD;
    }
    // The same bits on 1 and 7 blocks (several units an instruction) and on a second run.
    for (int n_blocks : {1, 7, device_sms()}) EXPECT_EQ(run_mk(c, n_blocks), got) << n_blocks << " blocks";
    // The chain on the same inputs (its own appended row): within both bounds.
    c.reset();
    ASSERT_CUDA(c.chain(nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());
    const std::vector<float> chain = c.out.download();
    double d_chain = 0;
    for (int i = 0; i < kNq * kD; ++i) d_chain = std::max(d_chain, std::fabs(double(chain[i]) - got[i]));
    EXPECT_LE(d_chain, 2e-4);
    std::printf("attention pos %5d, %2d splits: max |err| vs CPU %.2e, vs the chain %.2e\n", cs.pos, cs.splits, worst,
                d_chain);
  }
}

TEST(MkProgram, RefusesWhatTheAttentionCannotRun) {
  float* f = reinterpret_cast<float*>(uintptr_t{1} << 20);
  AttnArgs a;
  a.proj = a.q_norm = a.k_norm = f, a.part_o = a.part_ml = f;
  a.k_cache = a.v_cache = reinterpret_cast<__nv_bfloat16*>(f);
  a.pos = reinterpret_cast<const int*>(f);
  a.n_splits = 66;
  Program p;
  auto ok = p.add_attention(a, f, -1);
  ASSERT_TRUE(ok.ok()) << ok.status().message();
  EXPECT_EQ(p.ops()[0].code, Opcode::attn_part);
  EXPECT_EQ(p.ops()[1].code, Opcode::attn_merge);
  EXPECT_EQ(p.ops()[1].wait[0], 0);
  ASSERT_TRUE(p.schedule(132).ok());
  EXPECT_EQ(p.signals_per_step(0), 132u);  // 2 kv heads x 66 splits
  EXPECT_EQ(p.signals_per_step(1), 128u);  // 16 query heads x 8 slices of 32 dimensions
  AttnArgs bad = a;
  bad.n_splits = 133;
  EXPECT_FALSE(Program().add_attention(bad, f, -1).ok()) << "133 splits";
  bad = a;
  bad.k_cache = nullptr;
  EXPECT_FALSE(Program().add_attention(bad, f, -1).ok()) << "no cache";
  bad = a;
  bad.proj = f + 1;
  EXPECT_FALSE(Program().add_attention(bad, f, -1).ok()) << "misaligned projection";
}

// ---- timing (prints, asserts nothing) ------------------------------------------------------------------------

// One attention layer's step at 4K, 32K and 128K rows: the chain's three kernels (66 splits, one graph) against the
// megakernel's two ops (one launch). Bytes: the cache rows (pos + 1) x 2 x 256 x 2 x 2 (K and V), floor at 4.27 TB/s.
TEST(MkAttnBench, OneLayer) {
  SKIP_WITHOUT_STEP();
  std::printf("\n");
  for (int pos : {4095, 32767, 131071}) {
    AttnCase c(pos, device_sms() / 2, 9300);
    const double bytes = (pos + 1.0) * kNkv * kD * 2 * 2;
    char name[80];
    std::snprintf(name, sizeof name, "attention %dK, chain (3 launches)", (pos + 1) / 1024);
    test::print_bandwidth(name, test::graph_time_us([&](int, cudaStream_t s) { return c.chain(s); }, 10), bytes);
    Program p;
    ASSERT_TRUE(p.add_attention(c.args(), c.out.get(), -1).ok());
    ASSERT_TRUE(p.schedule(device_sms()).ok());
    auto d = DeviceProgram::upload(p);
    ASSERT_TRUE(d.ok());
    const DeviceProgram& dp = **d;
    std::snprintf(name, sizeof name, "attention %dK, megakernel", (pos + 1) / 1024);
    test::print_bandwidth(name, test::graph_time_us([&](int, cudaStream_t s) { return dp.launch(s); }, 10), bytes);
    test_util::print_timeline(p, **d, 2);
  }
}

}  // namespace
}  // namespace lily::cuda::mk
