// The megakernel's Gated DeltaNet step (Opcode::gdn_head) against a CPU reference of eqs 14-18 on fresh random
// inputs and against the chain's gdn_step kernel; the out-projection with eq 19 as its prologue against the CPU
// and the chain's gated gemv; a whole Gated DeltaNet layer (in-projection, step, out-projection) against the kernel
// chain, and timed against it.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <vector>

#include "mk_moe_util.h"
#include "mk_test_util.h"
#include "cuda/kernels/gdn.cuh"
#include "cuda/kernels/gemv.cuh"
#include "cuda/megakernel/step.cuh"

namespace lily::cuda::mk {
namespace {

using test::DeviceBuffer;
using test_util::Carver;
using test_util::device_sms;

constexpr int kNk = 16, kNv = 32, kD = 128, kConv = 2 * kNk * kD + kNv * kD, kValue = kNv * kD;
constexpr int kProj = kConv + kValue + 2 * kNv;

// One layer's recurrent state and step constants, host copies and device buffers.
struct GdnState {
  std::vector<float> proj, ring, conv_w, A_log, dt_bias, norm_w, S;
  int pos = 5;
  DeviceBuffer<float> d_proj, d_ring, d_conv_w, d_A_log, d_dt_bias, d_norm_w, d_S, d_out;
  DeviceBuffer<int> d_pos;

  explicit GdnState(uint32_t seed) {
    proj = test::random_vector(kProj, seed);
    ring = test::random_vector(4 * kConv, seed + 1);
    conv_w = test::random_vector(kConv * 4, seed + 2, 0.5f);
    A_log = test::random_vector(kNv, seed + 3, 0.5f);
    dt_bias = test::random_vector(kNv, seed + 4, 0.5f);
    norm_w = test::random_vector(kD, seed + 5, 0.1f, 1.0f);
    S = test::random_vector(static_cast<size_t>(kNv) * kD * kD, seed + 6, 0.1f);
    d_proj = DeviceBuffer<float>(proj), d_ring = DeviceBuffer<float>(ring), d_conv_w = DeviceBuffer<float>(conv_w);
    d_A_log = DeviceBuffer<float>(A_log), d_dt_bias = DeviceBuffer<float>(dt_bias), d_norm_w = DeviceBuffer<float>(norm_w);
    d_S = DeviceBuffer<float>(S), d_out = DeviceBuffer<float>(kValue), d_pos = DeviceBuffer<int>(std::vector<int>{pos});
  }
  void reset() {
    d_ring.upload(ring);
    d_S.upload(S);
  }
  GdnArgs args() const {
    GdnArgs g;
    g.proj = d_proj.get(), g.conv_ring = d_ring.get(), g.conv_w = d_conv_w.get(), g.A_log = d_A_log.get();
    g.dt_bias = d_dt_bias.get(), g.S = d_S.get(), g.pos = d_pos.get();
    g.n_k = kNk, g.n_v = kNv;
    return g;
  }
};

// Eqs 14-18 in double: o = S^T q_hat (before eq 19) and the new state.
void reference(const GdnState& st, std::vector<double>& out, std::vector<double>& S_new) {
  const int K = 4;
  std::vector<double> cc(kConv);
  for (int ch = 0; ch < kConv; ++ch) {
    double acc = 0;
    for (int t = 0; t < K - 1; ++t) acc += st.conv_w[ch * K + t] * st.ring[((st.pos + 1 + t) % K) * kConv + ch];
    acc += st.conv_w[ch * K + K - 1] * st.proj[ch];
    cc[ch] = acc / (1.0 + std::exp(-acc));
  }
  out.assign(kValue, 0.0);
  S_new.assign(st.S.size(), 0.0);
  for (int h = 0; h < kNv; ++h) {
    const int kh = h / (kNv / kNk);
    const double* q = &cc[kh * kD];
    const double* k = &cc[kNk * kD + kh * kD];
    const double* v = &cc[2 * kNk * kD + h * kD];
    double qq = 0, kk = 0;
    for (int i = 0; i < kD; ++i) qq += q[i] * q[i], kk += k[i] * k[i];
    std::vector<double> qh(kD), kh_(kD);
    for (int i = 0; i < kD; ++i) qh[i] = q[i] / std::sqrt(qq + 1e-6) / std::sqrt(double(kD)), kh_[i] = k[i] / std::sqrt(kk + 1e-6);
    const double beta = 1.0 / (1.0 + std::exp(-double(st.proj[kConv + kValue + h])));
    const double a = st.proj[kConv + kValue + kNv + h] + st.dt_bias[h];
    const double softplus = a > 20 ? a : std::log1p(std::exp(a));
    const double decay = std::exp(-std::exp(double(st.A_log[h])) * softplus);
    for (int j = 0; j < kD; ++j) {
      double kv = 0;
      for (int i = 0; i < kD; ++i) kv += decay * st.S[(size_t(h) * kD + i) * kD + j] * kh_[i];
      const double e = (v[j] - kv) * beta;
      double acc = 0;
      for (int i = 0; i < kD; ++i) {
        const double s = decay * st.S[(size_t(h) * kD + i) * kD + j] + kh_[i] * e;
        S_new[(size_t(h) * kD + i) * kD + j] = s;
        acc += s * qh[i];
      }
      out[h * kD + j] = acc;
    }
  }
}

std::vector<float> run_heads(GdnState& st, int n_blocks) {
  st.reset();
  Program p;
  auto op = p.add_gdn_heads(st.args(), st.d_out.get(), -1);
  EXPECT_TRUE(op.ok()) << op.status().message();
  if (!op.ok() || !test_util::run_once(p, n_blocks)) return {};
  return st.d_out.download();
}

TEST(MkGdn, HeadsMatchCpuAndTheChainKernel) {
  SKIP_WITHOUT_STEP();
  GdnState st(8101);
  const std::vector<float> out = run_heads(st, device_sms());
  ASSERT_EQ(out.size(), static_cast<size_t>(kValue));
  const std::vector<float> S = st.d_S.download(), ring = st.d_ring.download();
  std::vector<double> ref_out, ref_S;
  reference(st, ref_out, ref_S);
  double worst_o = 0, worst_S = 0, o_scale = 0;
  for (int i = 0; i < kValue; ++i) worst_o = std::max(worst_o, std::fabs(out[i] - ref_out[i])), o_scale = std::max(o_scale, std::fabs(ref_out[i]));
  for (size_t i = 0; i < S.size(); ++i) worst_S = std::max(worst_S, std::fabs(S[i] - ref_S[i]));
  std::printf("gdn heads vs CPU: max |o err| %.3g (max |o| %.3g), max |S err| %.3g\n", worst_o, o_scale, worst_S);
  EXPECT_LE(worst_o, 1e-4 * o_scale);
  EXPECT_LE(worst_S, 1e-5);
  for (int ch = 0; ch < kConv; ++ch) ASSERT_EQ(ring[(st.pos % 4) * kConv + ch], st.proj[ch]) << "ring slot, channel " << ch;

  // Bit-identical on any grid (1 and 5 blocks: several units an instruction) and run to run; against the chain's
  // gdn_step (o before eq 19) within rounding.
  for (int n_blocks : {1, 5, device_sms()}) EXPECT_EQ(run_heads(st, n_blocks), out) << n_blocks << " blocks";
  st.reset();
  GdnStepParams g{st.d_proj.get(), st.d_ring.get(), st.d_conv_w.get(), st.d_A_log.get(), st.d_dt_bias.get(),
                  st.d_S.get(), st.d_pos.get(), kNk, kNv, kD, kD, 4, st.d_out.get()};
  ASSERT_CUDA(gdn_step(g, nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<float> chain_out = st.d_out.download(), chain_S = st.d_S.download();
  double d_o = 0, d_S = 0;
  for (int i = 0; i < kValue; ++i) d_o = std::max(d_o, std::fabs(double(chain_out[i]) - out[i]));
  for (size_t i = 0; i < S.size(); ++i) d_S = std::max(d_S, std::fabs(double(chain_S[i]) - S[i]));
  std::printf("gdn heads vs gdn_step kernel: max |o diff| %.3g, max |S diff| %.3g\n", d_o, d_S);
  EXPECT_LE(d_o, 1e-4 * o_scale);
  EXPECT_LE(d_S, 1e-5);
}

// The out-projection with eq 19 as its prologue (add_gated_gemv) against the CPU in double: y = residual + W
// (norm_w * o / RMS(o_head) * silu(z)) within rounding; the same bits on any grid; the chain's gated gemv within
// kChainX16.
TEST(MkGdn, GatedOutProjectionMatchesCpuAndTheChain) {
  SKIP_WITHOUT_STEP();
  constexpr int kRows = 2048;
  test::HostQMatrix hm = test::random_qmatrix(kRows, kValue, 4, 8151);
  const std::vector<float> o = test::random_vector(kValue, 8152, 3.0f), z = test::random_vector(kValue, 8153, 2.0f);
  const std::vector<float> norm_w = test::random_vector(kD, 8154, 0.1f, 1.0f), res = test::random_vector(kRows, 8155);
  DeviceBuffer<float> d_o(o), d_z(z), d_norm(norm_w), d_res(res), d_y(kRows);
  const QMatrix dm = hm.upload();
  std::vector<double> x(kValue);
  for (int hd = 0; hd < kNv; ++hd) {
    double ss = 0;
    for (int j = 0; j < kD; ++j) ss += double(o[hd * kD + j]) * o[hd * kD + j];
    const double inv = 1.0 / std::sqrt(ss / kD + 1e-6);
    for (int j = 0; j < kD; ++j) {
      const double zz = z[hd * kD + j];
      x[hd * kD + j] = norm_w[j] * o[hd * kD + j] * inv * zz / (1.0 + std::exp(-zz));
    }
  }
  auto run = [&](int n_blocks) -> std::vector<float> {
    Program p;
    auto op = p.add_gated_gemv(dm, d_o.get(), d_z.get(), d_norm.get(), d_y.get(), {}, d_res.get());
    EXPECT_TRUE(op.ok()) << op.status().message();
    if (!op.ok() || !test_util::run_once(p, n_blocks)) return {};
    return d_y.download();
  };
  const std::vector<float> mk = run(device_sms());
  ASSERT_EQ(mk.size(), static_cast<size_t>(kRows));
  int bad = 0;
  double worst_ratio = 0;
  for (int r = 0; r < kRows; ++r) {
    double ref = res[r], abs_sum = 0;
    for (int c = 0; c < kValue; ++c) {
      const double w = hm.dequant(r, c);
      ref += w * x[c], abs_sum += std::fabs(w * x[c]);
    }
    const double tol = 3e-5 * abs_sum + 1e-5 * (std::fabs(ref) + 1.0);
    worst_ratio = std::max(worst_ratio, std::fabs(mk[r] - ref) / tol);
    if (!(std::fabs(mk[r] - ref) <= tol) && bad++ < 5) ADD_FAILURE() << "row " << r << ": " << mk[r] << " vs " << ref;
  }
  EXPECT_EQ(bad, 0);
  std::printf("gated out-projection vs CPU: worst error %.2f of the tolerance\n", worst_ratio);
  for (int n_blocks : {1, 7}) EXPECT_EQ(run(n_blocks), mk) << n_blocks << " blocks";
  GemvParams chain{dm, d_o.get(), GemvPrologue::gated_rms_norm, d_norm.get(), d_z.get(), kD, 1e-6f, d_res.get(),
                   d_y.get()};
  ASSERT_CUDA(gemv(chain, nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<float> chain_y = d_y.download();
  double diff = 0, ymax = 0;
  for (int r = 0; r < kRows; ++r) diff = std::max(diff, std::fabs(double(chain_y[r]) - mk[r])), ymax = std::max(ymax, std::fabs(double(chain_y[r])));
  std::printf("gated out-projection vs the chain's gated gemv: max |diff| %.3g of max |y| %.3g\n", diff, ymax);
  EXPECT_LE(diff, test_util::kChainX16 * ymax);
}

// ---- a whole Gated DeltaNet layer ------------------------------------------------------------------------------

// n_layers Gated DeltaNet layers: h -> in_proj (RMSNorm) -> proj -> heads -> o -> out_proj (eq 19 prologue) + h -> h.
// The chain runs eq 19 in gdn_step (fused) and a plain out-projection gemv.
struct GdnLayers {
  int n;
  std::vector<QMatrix> w_in, w_out;
  std::vector<std::unique_ptr<GdnState>> st;
  DeviceBuffer<float> h, norm_in;
  std::vector<float> h0;
  GdnLayers(int n_layers, Carver& carve, uint32_t seed) : n(n_layers) {
    h0 = test::random_vector(2048, seed);
    h = DeviceBuffer<float>(h0);
    norm_in = DeviceBuffer<float>(test::random_vector(2048, seed + 1, 0.1f, 1.0f));
    for (int l = 0; l < n; ++l) {
      w_in.push_back(carve.next(kProj, 2048)), w_out.push_back(carve.next(2048, kValue));
      st.push_back(std::make_unique<GdnState>(seed + 100 * l));
    }
  }
  void reset() {
    h.upload(h0);
    for (auto& s : st) s->reset();
  }
  // With `moe` (one per layer), each layer ends with its MoE block, as the model's do.
  std::vector<const test_util::BenchMoe*> moe;
  DeviceBuffer<float> act{9 * 512};
  test_util::BenchMoe::Scratch moe_scratch;

  Result<Program> program(int n_blocks) {
    Program p;
    int prev = -1;
    for (int l = 0; l < n; ++l) {
      GdnState& s = *st[l];
      std::vector<int> waits;
      if (prev >= 0) waits.push_back(prev);
      ASSIGN_OR_RETURN(const int in, p.add_gemv(w_in[l], h.get(), s.d_proj.get(), waits, norm_in.get()));
      ASSIGN_OR_RETURN(const int heads, p.add_gdn_heads(s.args(), s.d_out.get(), in));
      ASSIGN_OR_RETURN(prev, p.add_gated_gemv(w_out[l], s.d_out.get(), s.d_proj.get() + kConv, s.d_norm_w.get(),
                                              h.get(), {heads}, h.get()));
      if (!moe.empty()) {
        ASSIGN_OR_RETURN(prev, moe[l]->add_to(p, h.get(), norm_in.get(), act.get(), prev));
      }
    }
    RETURN_IF_ERROR(p.schedule(n_blocks));
    return p;
  }
  cudaError_t chain(cudaStream_t stream) {
    for (int l = 0; l < n; ++l) {
      GdnState& s = *st[l];
      GemvParams in{w_in[l], h.get(), GemvPrologue::rms_norm, norm_in.get(), nullptr, 0, 1e-6f, nullptr, s.d_proj.get()};
      CUDA_TRY(gemv(in, stream));
      GdnStepParams g{s.d_proj.get(), s.d_ring.get(), s.d_conv_w.get(), s.d_A_log.get(), s.d_dt_bias.get(),
                      s.d_S.get(), s.d_pos.get(), kNk, kNv, kD, kD, 4, s.d_out.get()};
      g.gate_z = s.d_proj.get() + kConv, g.norm_w = s.d_norm_w.get(), g.eps = 1e-6f;
      CUDA_TRY(gdn_step(g, stream));
      GemvParams out{w_out[l], s.d_out.get(), GemvPrologue::none, nullptr, nullptr, 0, 1e-6f, h.get(), h.get()};
      CUDA_TRY(gemv(out, stream));
      if (!moe.empty()) CUDA_TRY(moe[l]->chain(h.get(), norm_in.get(), moe_scratch, stream));
    }
    return cudaSuccess;
  }
};

// Two layers with random quantized weights: the megakernel's h and states against the chain's.
TEST(MkGdn, LayersMatchTheKernelChain) {
  SKIP_WITHOUT_STEP();
  const DeviceBuffer<uint16_t> pool = test::bench_pool(size_t{64} << 20, 9);
  Carver carve{pool};
  GdnLayers layers(2, carve, 8201);
  layers.reset();
  ASSERT_CUDA(layers.chain(nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<float> chain_h = layers.h.download(), chain_S = layers.st[1]->d_S.download();
  auto prog = layers.program(device_sms());
  ASSERT_TRUE(prog.ok()) << prog.status().message();
  auto d = DeviceProgram::upload(*prog);
  ASSERT_TRUE(d.ok());
  layers.reset();
  ASSERT_CUDA((*d)->launch(nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<float> mk_h = layers.h.download(), mk_S = layers.st[1]->d_S.download();
  double dh = 0, hmax = 0, dS = 0, Smax = 0;
  for (int i = 0; i < 2048; ++i) dh = std::max(dh, std::fabs(double(mk_h[i]) - chain_h[i])), hmax = std::max(hmax, std::fabs(double(chain_h[i])));
  for (size_t i = 0; i < mk_S.size(); ++i) {
    dS = std::max(dS, std::fabs(double(mk_S[i]) - chain_S[i]));
    Smax = std::max(Smax, std::fabs(double(chain_S[i])));
  }
  std::printf("gdn layers: max |h diff| %.3g of max |h| %.3g; max |S diff| %.3g of max |S| %.3g\n", dh, hmax, dS, Smax);
  EXPECT_TRUE(std::isfinite(hmax) && std::isfinite(Smax));
  EXPECT_LE(dh, test_util::kChainX16 * hmax);
  // The second layer's state is built from the first layer's h, which carries the chain's fp16-x rounding.
  EXPECT_LE(dS, test_util::kChainX16 * Smax);
}

// Stage (b): the 30 Gated DeltaNet layers of a step (projections 568 MB + states 2 x 63 MB: 694 MB, floor 163 us).
TEST(MkGdnBench, ThirtyLayers) {
  SKIP_WITHOUT_STEP();
  const DeviceBuffer<uint16_t> pool = test::bench_pool(size_t{600} << 20, 10);
  Carver carve{pool};
  GdnLayers layers(30, carve, 8301);
  double bytes = 0;
  for (int l = 0; l < 30; ++l) bytes += static_cast<double>(layers.w_in[l].bytes() + layers.w_out[l].bytes()) + 2.0 * kNv * kD * kD * 4;
  std::printf("\n");
  test::print_bandwidth("gdn layers, chain (90 launches)", test::graph_time_us([&](int, cudaStream_t s) { return layers.chain(s); }, 10), bytes);
  auto prog = layers.program(device_sms());
  ASSERT_TRUE(prog.ok()) << prog.status().message();
  auto d = DeviceProgram::upload(*prog);
  ASSERT_TRUE(d.ok());
  const DeviceProgram& dp = **d;
  test::print_bandwidth("gdn layers, megakernel", test::graph_time_us([&](int, cudaStream_t s) { return dp.launch(s); }, 10),
                        bytes);
  test_util::print_timeline(*prog, **d, 6);
}

// n Gated DeltaNet layers, each with its MoE block, their weights carved from benchmark pools.
struct GdnMoeLayers {
  DeviceBuffer<uint16_t> pool, moe_pool;
  Carver carve;
  GdnLayers layers;
  std::vector<std::unique_ptr<test_util::BenchMoe>> moe;
  GdnMoeLayers(int n, size_t pool_bytes, size_t moe_pool_bytes, uint32_t seed)
      : pool(test::bench_pool(pool_bytes, seed)), moe_pool(test::bench_pool(moe_pool_bytes, seed + 1)), carve{pool},
        layers(n, carve, seed + 2) {
    for (int l = 0; l < n; ++l) {
      moe.push_back(std::make_unique<test_util::BenchMoe>(moe_pool, l));
      layers.moe.push_back(moe.back().get());
    }
  }
  double bytes() const {
    double b = 0;
    for (int l = 0; l < layers.n; ++l)
      b += static_cast<double>(layers.w_in[l].bytes() + layers.w_out[l].bytes()) + 2.0 * kNv * kD * kD * 4 + moe[l]->bytes();
    return b;
  }
};

// Two Gated DeltaNet layers with their MoE blocks over two steps against the kernel chain, and the same bits on any
// grid.
TEST(MkLayers, GdnLayersWithMoeMatchTheChain) {
  SKIP_WITHOUT_STEP();
  GdnMoeLayers with_moe(2, size_t{64} << 20, size_t{1} << 30, 21);
  GdnLayers& layers = with_moe.layers;
  constexpr int kSteps = 2;
  layers.reset();
  for (int s = 0; s < kSteps; ++s) ASSERT_CUDA(layers.chain(nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<float> chain = layers.h.download();
  auto run = [&](int n_blocks) -> std::vector<float> {
    auto prog = layers.program(n_blocks);
    EXPECT_TRUE(prog.ok()) << prog.status().message();
    if (!prog.ok()) return {};
    auto d = DeviceProgram::upload(*prog);
    EXPECT_TRUE(d.ok());
    if (!d.ok()) return {};
    layers.reset();
    for (int s = 0; s < kSteps; ++s) EXPECT_EQ((*d)->launch(nullptr), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return layers.h.download();
  };
  const std::vector<float> got = run(device_sms());
  ASSERT_EQ(got.size(), chain.size());
  double dh = 0, hmax = 0;
  for (size_t i = 0; i < chain.size(); ++i) {
    dh = std::max(dh, std::fabs(double(got[i]) - chain[i]));
    hmax = std::max(hmax, std::fabs(double(chain[i])));
  }
  std::printf("gdn + moe layers x %d steps vs the chain: %.3g of max |h| %.3g\n", kSteps, dh / hmax, hmax);
  EXPECT_TRUE(std::isfinite(hmax));
  EXPECT_LE(dh, test_util::kChainX16 * hmax);
  for (int n_blocks : {1, 7}) EXPECT_EQ(run(n_blocks), got) << n_blocks << " blocks";
}

// Stages (b) + (c): 30 Gated DeltaNet layers, each with its MoE block (694 MB + 30 x 16.5 MB = 1,189 MB, floor
// 278 us): the routing-dependent fetches with the rest of the layer around them.
TEST(MkLayerBench, ThirtyGdnLayersWithMoe) {
  SKIP_WITHOUT_STEP();
  GdnMoeLayers with_moe(30, size_t{600} << 20, size_t{6} << 30, 10);
  GdnLayers& layers = with_moe.layers;
  const double bytes = with_moe.bytes();
  std::printf("\n");
  test::print_bandwidth("gdn + moe layers, chain (180 launches)",
                        test::graph_time_us([&](int, cudaStream_t s) { return layers.chain(s); }, 10), bytes);
  auto prog = layers.program(device_sms());
  ASSERT_TRUE(prog.ok()) << prog.status().message();
  auto d = DeviceProgram::upload(*prog);
  ASSERT_TRUE(d.ok());
  test::print_bandwidth("gdn + moe layers, megakernel",
                        test::graph_time_us([&](int, cudaStream_t s) { return (*d)->launch(s); }, 10), bytes);
  test_util::print_timeline(*prog, **d, 12);
}

}  // namespace
}  // namespace lily::cuda::mk
