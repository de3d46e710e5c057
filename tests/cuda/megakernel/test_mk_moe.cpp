// The megakernel's MoE block (Program::add_moe: the 8-bit router, moe_in, moe_out) against a CPU reference in
// double on fresh random weights, with the selection of the chain's moe_route (itself checked against the CPU's
// route_top_k in tests/cuda/kernels/test_moe.cpp), against the chain's three kernels over two layers and two
// steps, on any grid; routing ties; and 40 MoE blocks timed against the chain.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <vector>

#include "mk_moe_util.h"
#include "mk_test_util.h"
#include "cuda/kernels/moe.cuh"
#include "cuda/megakernel/step.cuh"

namespace lily::cuda::mk {
namespace {

using test::DeviceBuffer;
using test::HostQMatrix;
using test_util::device_sms;

constexpr int kH = 2048, kI = 512, kTopK = 8;

double silu(double v) { return v / (1.0 + std::exp(-v)); }

// One layer's weights: the router's rows and the shared expert gate's row in one 8-bit [E + 1, H] matrix.
struct MoeLayer {
  int E;
  HostQMatrix router, gate, up, down, s_gate, s_up, s_down;
  std::vector<float> norm_w;
  QMatrix q_router, q_gate, q_up, q_down, q_s_gate, q_s_up, q_s_down;
  DeviceBuffer<float> d_norm_w, d_logits;

  MoeLayer(int experts, uint32_t seed, bool tied_router = false) : E(experts) {
    router = test::random_qmatrix(E + 1, kH, 8, seed);
    if (tied_router) {
      for (int e = 1; e < E; ++e) test::copy_row(router, 0, e);
    }
    gate = test::random_qmatrix(E * kI, kH, 4, seed + 1);
    up = test::random_qmatrix(E * kI, kH, 4, seed + 2);
    down = test::random_qmatrix(E * kH, kI, 4, seed + 3);
    s_gate = test::random_qmatrix(kI, kH, 4, seed + 4);
    s_up = test::random_qmatrix(kI, kH, 4, seed + 5);
    s_down = test::random_qmatrix(kH, kI, 4, seed + 6);
    norm_w = test::random_vector(kH, seed + 7, 0.1f, 1.0f);
    q_router = router.upload();
    q_gate = gate.upload(), q_up = up.upload(), q_down = down.upload();
    q_gate.rows = q_up.rows = kI, q_down.rows = kH;
    q_s_gate = s_gate.upload(), q_s_up = s_up.upload(), q_s_down = s_down.upload();
    d_norm_w = DeviceBuffer<float>(norm_w);
    d_logits = DeviceBuffer<float>(E + 1);
  }
  MoeArgs args() const {
    MoeArgs a;
    a.gate = q_gate, a.up = q_up, a.down = q_down, a.s_gate = q_s_gate, a.s_up = q_s_up, a.s_down = q_s_down;
    a.n_experts = E, a.top_k = kTopK, a.inter = kI;
    return a;
  }
  // The router rows [0, E) and the shared gate row E as the chain's two matrices.
  QMatrix router_rows() const {
    QMatrix m = q_router;
    m.rows = E;
    return m;
  }
  QMatrix shared_gate_row() const {
    QMatrix m = q_router;
    m.rows = 1;
    m.w += static_cast<size_t>(E) * m.words_per_row();
    m.scales += static_cast<size_t>(E) * m.groups_per_row();
    m.biases += static_cast<size_t>(E) * m.groups_per_row();
    return m;
  }
};

// The chain's three kernels for one layer, h in place; the selection moe_route took lands in idx / w / sg.
struct Chain {
  DeviceBuffer<float> x{kH}, w{kTopK}, sg{1}, act{(kTopK + 1) * kI};
  DeviceBuffer<int> idx{kTopK};
  DeviceBuffer<unsigned> counter{1};
  Chain() { (void)counter.zero(); }
  cudaError_t layer(const MoeLayer& L, float* h, cudaStream_t s) {
    MoeRouteParams rp;
    rp.router = L.router_rows(), rp.shared_gate = L.shared_gate_row(), rp.h = h, rp.norm_w = L.d_norm_w.get();
    rp.top_k = kTopK, rp.x = x.get(), rp.logits = L.d_logits.get(), rp.counter = counter.get();
    rp.topk_idx = idx.get(), rp.topk_w = w.get(), rp.shared_gate_value = sg.get();
    MoeExpertInParams ip;
    ip.gate = L.q_gate, ip.up = L.q_up, ip.shared_gate = L.q_s_gate, ip.shared_up = L.q_s_up, ip.x = x.get();
    ip.topk_idx = idx.get(), ip.top_k = kTopK, ip.act = act.get();
    MoeExpertOutParams op;
    op.down = L.q_down, op.shared_down = L.q_s_down, op.act = act.get(), op.topk_idx = idx.get(), op.topk_w = w.get();
    op.shared_gate_value = sg.get(), op.top_k = kTopK, op.h = h;
    CUDA_TRY(moe_route(rp, s));
    CUDA_TRY(moe_expert_in(ip, s));
    return moe_expert_out(op, s);
  }
};

// The block in double from h, for the given selection: h + sg * shared(x) + sum_r w_r expert_{idx_r}(x), and the
// bound on fp32 rounding (sum of |terms|, as test_moe.cpp).
std::vector<double> reference(const MoeLayer& L, const std::vector<float>& h, const std::vector<int>& idx,
                              const std::vector<float>& w, float sg, std::vector<double>& bound) {
  double ss = 0;
  for (float v : h) ss += static_cast<double>(v) * v;
  const double inv = 1.0 / std::sqrt(ss / kH + 1e-6);
  std::vector<float> x(kH);
  for (int i = 0; i < kH; ++i) x[i] = static_cast<float>(h[i] * inv * L.norm_w[i]);
  std::vector<float> act((kTopK + 1) * kI);
  for (int s = 0; s <= kTopK; ++s) {
    for (int r = 0; r < kI; ++r) {
      const double g = s == 0 ? L.s_gate.dot(r, x.data()) : L.gate.dot(idx[s - 1] * kI + r, x.data());
      const double u = s == 0 ? L.s_up.dot(r, x.data()) : L.up.dot(idx[s - 1] * kI + r, x.data());
      act[s * kI + r] = static_cast<float>(silu(g) * u);
    }
  }
  std::vector<double> out(kH);
  bound.assign(kH, 0.0);
  for (int r = 0; r < kH; ++r) {
    double acc = h[r], b = std::fabs(h[r]);
    for (int s = 0; s <= kTopK; ++s) {
      const double ws = s == 0 ? sg : w[s - 1];
      const HostQMatrix& D = s == 0 ? L.s_down : L.down;
      const int row = s == 0 ? r : idx[s - 1] * kH + r;
      double d = 0, d_abs = 0;
      for (int c = 0; c < kI; ++c) {
        const double t = static_cast<double>(D.dequant(row, c)) * act[s * kI + c];
        d += t, d_abs += std::fabs(t);
      }
      acc += ws * d, b += ws * d_abs;
    }
    out[r] = acc, bound[r] = b;
  }
  return out;
}

Result<Program> build(const std::vector<std::unique_ptr<MoeLayer>>& layers, float* h, float* act, int n_blocks) {
  Program p;
  int h_op = -1;
  for (const auto& L : layers) {
    ASSIGN_OR_RETURN(h_op, p.add_moe(L->q_router, L->args(), h, L->d_norm_w.get(), L->d_logits.get(), act, h_op));
  }
  RETURN_IF_ERROR(p.schedule(n_blocks));
  return p;
}

std::vector<float> run_mk(const std::vector<std::unique_ptr<MoeLayer>>& layers, const std::vector<float>& h0,
                          int n_blocks, int steps, std::vector<unsigned long long>* counters = nullptr,
                          Program* program = nullptr) {
  DeviceBuffer<float> h(h0), act((kTopK + 1) * kI);
  auto p = build(layers, h.get(), act.get(), n_blocks);
  EXPECT_TRUE(p.ok()) << p.status().message();
  if (!p.ok()) return {};
  auto d = DeviceProgram::upload(*p);
  EXPECT_TRUE(d.ok());
  if (!d.ok()) return {};
  for (int s = 0; s < steps; ++s) EXPECT_EQ((*d)->launch(nullptr), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  if (counters) *counters = *(*d)->counters();
  if (program) *program = *p;
  return h.download();
}

double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) d = std::max(d, std::fabs(double(a[i]) - b[i])), scale = std::max(scale, std::fabs(double(b[i])));
  return d / scale;
}

// One layer against the CPU in double with the chain's selection; the same bits on any grid.
TEST(MkMoe, BlockMatchesCpuWithTheChainsSelection) {
  SKIP_WITHOUT_STEP();
  std::vector<std::unique_ptr<MoeLayer>> layers;
  layers.push_back(std::make_unique<MoeLayer>(32, 9101));
  const std::vector<float> h0 = test::random_vector(kH, 9102);
  Chain chain;
  DeviceBuffer<float> h_chain(h0);
  ASSERT_CUDA(chain.layer(*layers[0], h_chain.get(), nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<int> idx = chain.idx.download();
  const std::vector<float> w = chain.w.download(), sg = chain.sg.download();
  std::vector<double> bound;
  const std::vector<double> ref = reference(*layers[0], h0, idx, w, sg[0], bound);

  std::vector<unsigned long long> counters;
  Program prog;
  const std::vector<float> got = run_mk(layers, h0, device_sms(), 1, &counters, &prog);
  ASSERT_EQ(got.size(), static_cast<size_t>(kH));
  double worst = 0;
  for (int r = 0; r < kH; ++r) {
    worst = std::max(worst, std::fabs(got[r] - ref[r]) / (bound[r] + 1e-6));
    ASSERT_NEAR(got[r], ref[r], 1e-4 * bound[r] + 1e-5) << "row " << r;
  }
  std::printf("moe block vs CPU: worst |err| / bound %.3g; vs the chain %.3g of max |h|\n", worst,
              max_rel_diff(got, h_chain.download()));
  for (size_t o = 0; o < counters.size(); ++o) EXPECT_EQ(counters[o], prog.signals_per_step(static_cast<int>(o)));
  for (int n_blocks : {1, 7}) EXPECT_EQ(run_mk(layers, h0, n_blocks, 1), got) << n_blocks << " blocks";
  EXPECT_EQ(run_mk(layers, h0, device_sms(), 1), got) << "run to run";
}

// All router rows equal: every logit ties, the selection is experts 0..7 (the lower index), weights 1/8.
TEST(MkMoe, RoutingTiesGoToTheLowerIndex) {
  SKIP_WITHOUT_STEP();
  std::vector<std::unique_ptr<MoeLayer>> layers;
  layers.push_back(std::make_unique<MoeLayer>(32, 9201, true));
  const std::vector<float> h0 = test::random_vector(kH, 9202);
  std::vector<int> idx(kTopK);
  for (int i = 0; i < kTopK; ++i) idx[i] = i;
  const std::vector<float> w(kTopK, 1.0f / kTopK);
  // The shared gate's logit from the router's own rows (row E is not tied).
  Chain chain;
  DeviceBuffer<float> h_chain(h0);
  ASSERT_CUDA(chain.layer(*layers[0], h_chain.get(), nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
  EXPECT_EQ(chain.idx.download(), idx) << "the chain's tie rule";
  std::vector<double> bound;
  const std::vector<double> ref = reference(*layers[0], h0, idx, w, chain.sg.download()[0], bound);
  const std::vector<float> got = run_mk(layers, h0, device_sms(), 1);
  ASSERT_EQ(got.size(), static_cast<size_t>(kH));
  for (int r = 0; r < kH; ++r) ASSERT_NEAR(got[r], ref[r], 1e-4 * bound[r] + 1e-5) << "row " << r;
}

// Two layers, two steps (the counters' targets move on; the second layer's selection follows the first's output):
// against the chain; the same bits on any grid.
TEST(MkMoe, TwoLayersTwoStepsMatchTheChain) {
  SKIP_WITHOUT_STEP();
  std::vector<std::unique_ptr<MoeLayer>> layers;
  layers.push_back(std::make_unique<MoeLayer>(64, 9301));
  layers.push_back(std::make_unique<MoeLayer>(64, 9311));
  const std::vector<float> h0 = test::random_vector(kH, 9302);
  Chain chain;
  DeviceBuffer<float> h_chain(h0);
  for (int step = 0; step < 2; ++step) {
    for (const auto& L : layers) ASSERT_CUDA(chain.layer(*L, h_chain.get(), nullptr));
  }
  ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<float> want = h_chain.download();
  const std::vector<float> got = run_mk(layers, h0, device_sms(), 2);
  ASSERT_EQ(got.size(), want.size());
  const double d = max_rel_diff(got, want);
  std::printf("two moe layers x two steps vs the chain: %.3g of max |h|\n", d);
  EXPECT_LE(d, 1e-5);
  EXPECT_EQ(run_mk(layers, h0, 5, 2), got) << "5 blocks";
}

// Stage (c): 40 MoE blocks of a step (router 8-bit + 9 experts' gate / up / down: ~16.5 MB a layer, 660 MB, floor
// ~155 us), weights cold (the stacks are carved from a 6 GB pool; each layer routes on its own logits).
TEST(MkMoeBench, FortyLayers) {
  SKIP_WITHOUT_STEP();
  const DeviceBuffer<uint16_t> pool = test::bench_pool(size_t{6} << 30, 12);
  std::vector<std::unique_ptr<test_util::BenchMoe>> layers;
  for (int l = 0; l < 40; ++l) layers.push_back(std::make_unique<test_util::BenchMoe>(pool, l));
  DeviceBuffer<float> h(test::random_vector(kH, 13)), norm_w(test::random_vector(kH, 14, 0.1f, 1.0f));
  DeviceBuffer<float> act((kTopK + 1) * kI);
  test_util::BenchMoe::Scratch scratch;
  double bytes = 0;
  for (const auto& L : layers) bytes += L->bytes();
  auto chain = [&](int, cudaStream_t s) {
    for (const auto& L : layers) CUDA_TRY(L->chain(h.get(), norm_w.get(), scratch, s));
    return cudaSuccess;
  };
  std::printf("\n");
  test::print_bandwidth("40 moe blocks, chain (120 launches)", test::graph_time_us(chain, 10), bytes);
  Program p;
  int h_op = -1;
  for (const auto& L : layers) {
    auto id = L->add_to(p, h.get(), norm_w.get(), act.get(), h_op);
    ASSERT_TRUE(id.ok()) << id.status().message();
    h_op = *id;
  }
  ASSERT_TRUE(p.schedule(device_sms()).ok());
  auto d = DeviceProgram::upload(p);
  ASSERT_TRUE(d.ok());
  test::print_bandwidth("40 moe blocks, megakernel",
                        test::graph_time_us([&](int, cudaStream_t s) { return (*d)->launch(s); }, 10), bytes);
  test_util::print_timeline(p, **d, 9);
}

}  // namespace
}  // namespace lily::cuda::mk
