// moe_route / moe_expert_in / moe_expert_out (src/cuda/kernels/moe.cu) against CPU references on fresh random
// MLX-quantized weights; routing checked with lily::cpu::route_top_k, including ties.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include "cpu/blocks.h"
#include "cuda/kernels/moe.cuh"
#include "cuda_test_util.h"

namespace lily::cuda::test {
namespace {

constexpr float kEps = 1e-6f;

std::vector<float> rms_norm(const std::vector<float>& h, const std::vector<float>& w) {
  double ss = 0;
  for (float v : h) ss += static_cast<double>(v) * v;
  const double inv = 1.0 / std::sqrt(ss / h.size() + kEps);
  std::vector<float> x(h.size());
  for (size_t i = 0; i < h.size(); ++i) x[i] = static_cast<float>(h[i] * inv * w[i]);
  return x;
}

double silu(double v) { return v / (1.0 + std::exp(-v)); }

// Row r of matrix `mat` (rows_per_mat rows each) in a stacked HostQMatrix: (dot, sum of |terms|).
std::pair<double, double> stacked_dot(const HostQMatrix& m, int mat, int rows_per_mat, int r, const float* x) {
  double dot = 0, abs_sum = 0;
  const int row = mat * rows_per_mat + r;
  for (int c = 0; c < m.cols; ++c) {
    const double t = static_cast<double>(m.dequant(row, c)) * x[c];
    dot += t;
    abs_sum += std::fabs(t);
  }
  return {dot, abs_sum};
}

struct RouteOut {
  std::vector<float> x, logits, topk_w, sg;
  std::vector<int> topk_idx;
  std::vector<unsigned> counter;
};

RouteOut run_route(HostQMatrix& router, HostQMatrix& shared_gate, const std::vector<float>& h,
                   const std::vector<float>& norm_w, int top_k) {
  const int E = router.rows, H = router.cols;
  DeviceBuffer<float> d_h(h), d_norm(norm_w), d_x(H), d_logits(E), d_w(top_k), d_sg(1);
  DeviceBuffer<unsigned> d_counter(1);
  DeviceBuffer<int> d_idx(top_k);
  EXPECT_EQ(d_counter.zero(), cudaSuccess);
  MoeRouteParams p;
  p.router = router.upload();
  p.shared_gate = shared_gate.upload();
  p.h = d_h.get();
  p.norm_w = d_norm.get();
  p.eps = kEps;
  p.top_k = top_k;
  p.x = d_x.get();
  p.logits = d_logits.get();
  p.counter = d_counter.get();
  p.topk_idx = d_idx.get();
  p.topk_w = d_w.get();
  p.shared_gate_value = d_sg.get();
  for (int launch = 0; launch < 2; ++launch) EXPECT_EQ(moe_route(p, nullptr), cudaSuccess);  // counter reuse
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return {d_x.download(), d_logits.download(), d_w.download(), d_sg.download(), d_idx.download(),
          d_counter.download()};
}

// The GPU routing against the CPU on the GPU's own logits (exact top-k), and the logits against the CPU.
void check_route(const RouteOut& got, const HostQMatrix& router, const HostQMatrix& shared_gate,
                 const std::vector<float>& x_ref, int top_k) {
  const int E = router.rows;
  EXPECT_EQ(got.counter[0], 0u) << "the last block must reset the counter";
  for (size_t i = 0; i < x_ref.size(); ++i) ASSERT_NEAR(got.x[i], x_ref[i], 1e-5 * (std::fabs(x_ref[i]) + 1));
  for (int e = 0; e <= E; ++e) {
    const auto [ref, abs_sum] = e < E ? stacked_dot(router, 0, E, e, x_ref.data()) : stacked_dot(shared_gate, 0, 1, 0, x_ref.data());
    const double tol = 2e-5 * abs_sum + 1e-6;  // fp32 accumulation (see test_gemv.cpp)
    if (e < E) EXPECT_NEAR(got.logits[e], ref, tol) << "router row " << e;
    else EXPECT_NEAR(got.sg[0], 1.0 / (1.0 + std::exp(-ref)), 1e-5) << "shared gate";
  }
  // Softmax as the CPU MoE does it (float exp, double sum), then lily::cpu::route_top_k.
  std::vector<float> probs(got.logits);
  const float mx = *std::max_element(probs.begin(), probs.end());
  double sum = 0;
  for (float& v : probs) sum += (v = std::exp(v - mx));
  for (float& v : probs) v = static_cast<float>(v / sum);
  std::vector<int> idx(top_k);
  std::vector<float> w(top_k);
  cpu::route_top_k(probs.data(), E, top_k, idx.data(), w.data());
  EXPECT_EQ(got.topk_idx, idx);
  for (int i = 0; i < top_k; ++i) EXPECT_NEAR(got.topk_w[i], w[i], 1e-5 * w[i] + 1e-7);  // fp32 vs double sums
}

TEST(CudaMoe, RouteMatchesCpuTopK) {
  SKIP_WITHOUT_GPU();
  const int E = 256, H = 2048, k = 8;
  HostQMatrix router = random_qmatrix(E, H, 8, 11), shared_gate = random_qmatrix(1, H, 8, 12);
  const std::vector<float> h = random_vector(H, 13), norm_w = random_vector(H, 14, 0.1f, 1.0f);
  const RouteOut got = run_route(router, shared_gate, h, norm_w, k);
  check_route(got, router, shared_gate, rms_norm(h, norm_w), k);
}

TEST(CudaMoe, RouteTiesGoToTheLowerIndex) {
  SKIP_WITHOUT_GPU();
  const int E = 256, H = 2048, k = 8;
  HostQMatrix router = random_qmatrix(E, H, 8, 21), shared_gate = random_qmatrix(1, H, 8, 22);
  const std::vector<float> h = random_vector(H, 23), norm_w = random_vector(H, 24, 0.1f, 1.0f);
  const std::vector<float> x = rms_norm(h, norm_w);
  // Random rows give logits of about N(0, 0.9). Experts 9 and 5 tie at the top, 40..44 follow, and 20 and 3
  // tie for the last slot: only 3 may take it.
  plant_row(router, 9, x, 8.0f);
  copy_row(router, 9, 5);
  for (int i = 0; i < 5; ++i) plant_row(router, 40 + i, x, 7.0f - 0.3f * i);
  plant_row(router, 20, x, 5.0f);
  copy_row(router, 20, 3);
  const RouteOut got = run_route(router, shared_gate, h, norm_w, k);
  EXPECT_EQ(got.logits[5], got.logits[9]);
  EXPECT_EQ(got.logits[3], got.logits[20]);
  EXPECT_EQ(got.topk_idx, (std::vector<int>{5, 9, 40, 41, 42, 43, 44, 3}));
  check_route(got, router, shared_gate, x, k);
}

struct ExpertSetup {
  int E, H, I, k;
  HostQMatrix gate, up, down, s_gate, s_up, s_down;
  std::vector<int> topk_idx;
  std::vector<float> topk_w;
  float sg = 0.37f;
};

// The weights of the input side (gate, up) or of the output side (down) of E experts and the shared one.
ExpertSetup make_experts(int E, int H, int I, int k, uint32_t seed, bool input_side) {
  ExpertSetup s;
  s.E = E, s.H = H, s.I = I, s.k = k;
  if (input_side) {
    s.gate = random_qmatrix(E * I, H, 4, seed);
    s.up = random_qmatrix(E * I, H, 4, seed + 1);
    s.s_gate = random_qmatrix(I, H, 4, seed + 2);
    s.s_up = random_qmatrix(I, H, 4, seed + 3);
  } else {
    s.down = random_qmatrix(E * H, I, 4, seed);
    s.s_down = random_qmatrix(H, I, 4, seed + 1);
  }
  for (int i = 0; i < k; ++i) s.topk_idx.push_back((i * 7 + 3) % E);  // distinct when E >= k is coprime to 7; unordered
  double sum = 0;
  for (int i = 0; i < k; ++i) s.topk_w.push_back(static_cast<float>(1.0 / (i + 2))), sum += s.topk_w.back();
  for (float& w : s.topk_w) w = static_cast<float>(w / sum);
  return s;
}

QMatrix stacked(HostQMatrix& m, int rows_per_mat) {
  QMatrix q = m.upload();
  q.rows = rows_per_mat;
  return q;
}

void check_expert_in(ExpertSetup& s, uint32_t seed) {
  SCOPED_TRACE(testing::Message() << "E " << s.E << " H " << s.H << " I " << s.I << " k " << s.k);
  const std::vector<float> x = random_vector(s.H, seed);
  DeviceBuffer<float> d_x(x), d_act((s.k + 1) * s.I);
  DeviceBuffer<int> d_idx(s.topk_idx);
  MoeExpertInParams p;
  p.gate = stacked(s.gate, s.I);
  p.up = stacked(s.up, s.I);
  p.shared_gate = s.s_gate.upload();
  p.shared_up = s.s_up.upload();
  p.x = d_x.get();
  p.topk_idx = d_idx.get();
  p.top_k = s.k;
  p.act = d_act.get();
  ASSERT_CUDA(moe_expert_in(p, nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<float> act = d_act.download();
  int bad = 0;
  for (int slot = 0; slot <= s.k; ++slot) {
    const bool shared = slot == s.k;
    for (int r = 0; r < s.I; ++r) {
      const auto [g, g_abs] = shared ? stacked_dot(s.s_gate, 0, s.I, r, x.data())
                                     : stacked_dot(s.gate, s.topk_idx[slot], s.I, r, x.data());
      const auto [u, u_abs] = shared ? stacked_dot(s.s_up, 0, s.I, r, x.data())
                                     : stacked_dot(s.up, s.topk_idx[slot], s.I, r, x.data());
      const double ref = silu(g) * u;
      // Each dot within 2e-5 of its sum of |terms| (fp32 accumulation); silu' <= 1.1.
      const double tol = std::fabs(silu(g)) * 2e-5 * u_abs + 1.1 * std::fabs(u) * 2e-5 * g_abs + 1e-6;
      const float v = act[slot * s.I + r];
      if (!(std::fabs(v - ref) <= tol) && bad++ < 5) {
        ADD_FAILURE() << "slot " << slot << " row " << r << ": got " << v << " want " << ref;
      }
    }
  }
  EXPECT_EQ(bad, 0);
}

void check_expert_out(ExpertSetup& s, uint32_t seed) {
  SCOPED_TRACE(testing::Message() << "E " << s.E << " H " << s.H << " I " << s.I << " k " << s.k);
  const std::vector<float> act = random_vector((s.k + 1) * s.I, seed), h = random_vector(s.H, seed + 1);
  DeviceBuffer<float> d_act(act), d_h(h), d_w(s.topk_w), d_sg(std::vector<float>{s.sg});
  DeviceBuffer<int> d_idx(s.topk_idx);
  MoeExpertOutParams p;
  p.down = stacked(s.down, s.H);
  p.shared_down = s.s_down.upload();
  p.act = d_act.get();
  p.topk_idx = d_idx.get();
  p.topk_w = d_w.get();
  p.shared_gate_value = d_sg.get();
  p.top_k = s.k;
  p.h = d_h.get();
  ASSERT_CUDA(moe_expert_out(p, nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<float> got = d_h.download();
  int bad = 0;
  for (int r = 0; r < s.H; ++r) {
    double ref = h[r], bound = 0;
    for (int slot = 0; slot <= s.k; ++slot) {
      const bool shared = slot == s.k;
      const double w = shared ? s.sg : s.topk_w[slot];
      const auto [d, d_abs] = shared ? stacked_dot(s.s_down, 0, s.H, r, &act[slot * s.I])
                                     : stacked_dot(s.down, s.topk_idx[slot], s.H, r, &act[slot * s.I]);
      ref += w * d;
      bound += w * d_abs;
    }
    const double tol = 2e-5 * bound + 1e-6 * (std::fabs(h[r]) + 1);
    if (!(std::fabs(got[r] - ref) <= tol) && bad++ < 5) {
      ADD_FAILURE() << "row " << r << ": got " << got[r] << " want " << ref;
    }
  }
  EXPECT_EQ(bad, 0);
}

TEST(CudaMoe, ExpertInMatchesCpu) {
  SKIP_WITHOUT_GPU();
  ExpertSetup model = make_experts(16, 2048, 512, 8, 31, true);  // the model's H and I, fewer experts
  check_expert_in(model, 32);
  ExpertSetup other = make_experts(6, 1024, 200, 4, 33, true);  // I not a multiple of a block's 16 pairs
  check_expert_in(other, 34);
  ExpertSetup wide = make_experts(3, 4096, 70, 2, 35, true);
  check_expert_in(wide, 36);
}

TEST(CudaMoe, ExpertOutMatchesCpu) {
  SKIP_WITHOUT_GPU();
  ExpertSetup model = make_experts(16, 2048, 512, 8, 41, false);
  check_expert_out(model, 42);
  ExpertSetup other = make_experts(5, 1000, 1024, 3, 43, false);  // H not a multiple of a block's rows
  check_expert_out(other, 44);
}

// The three kernels back to back on one stream (programmatic dependent launch between them), against the CPU
// on the experts and weights the GPU routing chose (the routing itself is checked as in the tests above):
// h += sum_i w_i down_i(silu(gate_i x) * up_i x) + sg * shared(x), x = RMSNorm(h) (eqs 21-25).
TEST(CudaMoe, LayerChainMatchesCpu) {
  SKIP_WITHOUT_GPU();
  const int E = 16, H = 2048, I = 512, k = 4;
  HostQMatrix router = random_qmatrix(E, H, 8, 51), shared_gate = random_qmatrix(1, H, 8, 52);
  ExpertSetup in_w = make_experts(E, H, I, k, 53, true), out_w = make_experts(E, H, I, k, 54, false);
  const std::vector<float> h = random_vector(H, 55), norm_w = random_vector(H, 56, 0.1f, 1.0f);
  DeviceBuffer<float> d_h(h), d_norm(norm_w), d_x(H), d_logits(E), d_w(k), d_sg(1), d_act((k + 1) * I);
  DeviceBuffer<unsigned> d_counter(1);
  DeviceBuffer<int> d_idx(k);
  ASSERT_CUDA(d_counter.zero());
  MoeRouteParams rp;
  rp.router = router.upload(), rp.shared_gate = shared_gate.upload(), rp.h = d_h.get(), rp.norm_w = d_norm.get();
  rp.top_k = k, rp.x = d_x.get(), rp.logits = d_logits.get(), rp.counter = d_counter.get();
  rp.topk_idx = d_idx.get(), rp.topk_w = d_w.get(), rp.shared_gate_value = d_sg.get();
  MoeExpertInParams ip;
  ip.gate = stacked(in_w.gate, I), ip.up = stacked(in_w.up, I), ip.shared_gate = in_w.s_gate.upload();
  ip.shared_up = in_w.s_up.upload(), ip.x = d_x.get(), ip.topk_idx = d_idx.get(), ip.top_k = k, ip.act = d_act.get();
  MoeExpertOutParams op;
  op.down = stacked(out_w.down, H), op.shared_down = out_w.s_down.upload(), op.act = d_act.get();
  op.topk_idx = d_idx.get(), op.topk_w = d_w.get(), op.shared_gate_value = d_sg.get(), op.top_k = k, op.h = d_h.get();
  cudaStream_t stream;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  ASSERT_CUDA(moe_route(rp, stream));
  ASSERT_CUDA(moe_expert_in(ip, stream));
  ASSERT_CUDA(moe_expert_out(op, stream));
  ASSERT_CUDA(cudaStreamSynchronize(stream));
  ASSERT_CUDA(cudaStreamDestroy(stream));
  const std::vector<float> got = d_h.download(), sg = d_sg.download(), wt = d_w.download();
  const std::vector<int> idx = d_idx.download();

  const std::vector<float> x = rms_norm(h, norm_w);
  std::vector<float> act((k + 1) * I);
  for (int slot = 0; slot <= k; ++slot) {
    for (int r = 0; r < I; ++r) {
      const double g = slot < k ? stacked_dot(in_w.gate, idx[slot], I, r, x.data()).first
                                : stacked_dot(in_w.s_gate, 0, I, r, x.data()).first;
      const double u = slot < k ? stacked_dot(in_w.up, idx[slot], I, r, x.data()).first
                                : stacked_dot(in_w.s_up, 0, I, r, x.data()).first;
      act[slot * I + r] = static_cast<float>(silu(g) * u);
    }
  }
  for (int r = 0; r < H; ++r) {
    double ref = h[r], bound = std::fabs(h[r]);
    for (int slot = 0; slot <= k; ++slot) {
      const double w = slot < k ? wt[slot] : sg[0];
      const auto [d, d_abs] = slot < k ? stacked_dot(out_w.down, idx[slot], H, r, &act[slot * I])
                                       : stacked_dot(out_w.s_down, 0, H, r, &act[slot * I]);
      ref += w * d;
      bound += w * d_abs;
    }
    // fp32 through three kernels: the act values carry ~1e-5 relative error into the down projections.
    ASSERT_NEAR(got[r], ref, 1e-4 * bound + 1e-5) << "row " << r;
  }
}

// The selection moved into the expert kernels (moe_route without top-k; moe_expert_in and moe_expert_out take the
// softmax and top-k from the router logits themselves, moe_expert_out before waiting for moe_expert_in) must give
// the same bits as the chain whose routing moe_route selects (checked against the CPU above and here): two layers
// back to back on one stream, as in the decode graph, so that the second layer's early logits reads follow the
// first layer's kernels.
TEST(CudaMoe, LayerChainSelectingInTheExpertKernels) {
  SKIP_WITHOUT_GPU();
  const int E = 32, H = 2048, I = 512, k = 8, layers = 2;
  HostQMatrix router = random_qmatrix(E, H, 8, 61), shared_gate = random_qmatrix(1, H, 8, 62);
  ExpertSetup in_w = make_experts(E, H, I, k, 63, true), out_w = make_experts(E, H, I, k, 64, false);
  const std::vector<float> h = random_vector(H, 65), norm_w = random_vector(H, 66, 0.1f, 1.0f);
  DeviceBuffer<float> d_norm(norm_w), d_x(H), d_logits(E), d_w(k), d_sg(1), d_act((k + 1) * I);
  DeviceBuffer<unsigned> d_counter(1);
  DeviceBuffer<int> d_idx(k);
  ASSERT_CUDA(d_counter.zero());
  const QMatrix q_router = router.upload(), q_sgate = shared_gate.upload();
  const QMatrix q_gate = stacked(in_w.gate, I), q_up = stacked(in_w.up, I), q_sg = in_w.s_gate.upload();
  const QMatrix q_su = in_w.s_up.upload(), q_down = stacked(out_w.down, H), q_sd = out_w.s_down.upload();
  struct ChainOut {
    std::vector<float> h, logits, w;
    std::vector<int> idx;
  };
  // in_experts: moe_expert_in selects and writes its selection, which moe_expert_out reads (the decode step's
  // chain where the fast kernels take the geometry); else moe_route selects.
  auto run = [&](bool in_experts) {
    DeviceBuffer<float> d_h(h);
    MoeRouteParams rp;
    rp.router = q_router, rp.shared_gate = q_sgate, rp.h = d_h.get(), rp.norm_w = d_norm.get(), rp.top_k = k;
    rp.x = d_x.get(), rp.logits = d_logits.get(), rp.shared_gate_value = d_sg.get();
    rp.select_top_k = !in_experts;
    if (!in_experts) rp.counter = d_counter.get(), rp.topk_idx = d_idx.get(), rp.topk_w = d_w.get();
    MoeExpertInParams ip;
    ip.gate = q_gate, ip.up = q_up, ip.shared_gate = q_sg, ip.shared_up = q_su, ip.x = d_x.get(),
    ip.top_k = k;
    ip.act = d_act.get();
    MoeExpertOutParams op;
    op.down = q_down, op.shared_down = q_sd, op.act = d_act.get(), op.shared_gate_value = d_sg.get(),
    op.top_k = k;
    op.h = d_h.get();
    if (in_experts) {
      ip.router_logits = d_logits.get(), ip.n_experts = E;
      ip.topk_idx_out = d_idx.get(), op.topk_idx = d_idx.get();
      ip.topk_w_out = d_w.get(), op.topk_w = d_w.get();
    } else {
      ip.topk_idx = op.topk_idx = d_idx.get();
      op.topk_w = d_w.get();
    }
    cudaStream_t stream;
    EXPECT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    std::vector<float> first_logits;
    for (int layer = 0; layer < layers; ++layer) {
      EXPECT_EQ(moe_route(rp, stream), cudaSuccess);
      EXPECT_EQ(moe_expert_in(ip, stream), cudaSuccess);
      EXPECT_EQ(moe_expert_out(op, stream), cudaSuccess);
      if (layer == 0) {
        EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        first_logits = d_logits.download();
      }
    }
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
    return ChainOut{d_h.download(), first_logits, d_w.download(), d_idx.download()};
  };
  const ChainOut by_route = run(false);
  ASSERT_CUDA(d_idx.zero());
  ASSERT_CUDA(d_w.zero());
  // moe_expert_in writes its selection and moe_expert_out reads it: the same selection, weights and h, bit for bit.
  const ChainOut by_in = run(true);
  EXPECT_EQ(by_in.logits, by_route.logits);
  EXPECT_EQ(by_in.idx, by_route.idx);
  EXPECT_EQ(by_in.w, by_route.w);
  for (int r = 0; r < H; ++r) ASSERT_EQ(by_in.h[r], by_route.h[r]) << "row " << r;
  // The route-selected chain's second-layer routing against the CPU on its own logits.
  const std::vector<float> logits = d_logits.download();
  std::vector<float> probs(logits);
  const float mx = *std::max_element(probs.begin(), probs.end());
  double sum = 0;
  for (float& v : probs) sum += (v = std::exp(v - mx));
  for (float& v : probs) v = static_cast<float>(v / sum);
  std::vector<int> idx(k);
  std::vector<float> w(k);
  cpu::route_top_k(probs.data(), E, k, idx.data(), w.data());
  EXPECT_EQ(by_route.idx, idx);
  for (int i = 0; i < k; ++i) EXPECT_NEAR(by_route.w[i], w[i], 1e-5 * w[i] + 1e-7);
}

TEST(CudaMoe, RejectsBadArguments) {
  SKIP_WITHOUT_GPU();
  MoeExpertInParams in;  // no weights at all
  EXPECT_EQ(moe_expert_in(in, nullptr), cudaErrorInvalidValue);
  MoeExpertOutParams out;
  EXPECT_EQ(moe_expert_out(out, nullptr), cudaErrorInvalidValue);
  MoeRouteParams route;
  EXPECT_EQ(moe_route(route, nullptr), cudaErrorInvalidValue);
  // Selection in the expert kernels is for up to 256 experts (one warp, 8 per lane).
  ExpertSetup w = make_experts(4, 1024, 64, 2, 71, true);
  DeviceBuffer<float> x(1024), act(3 * 64), logits(300);
  EXPECT_EQ(x.zero(), cudaSuccess);
  EXPECT_EQ(logits.zero(), cudaSuccess);
  in.gate = stacked(w.gate, 64), in.up = stacked(w.up, 64), in.shared_gate = w.s_gate.upload();
  in.shared_up = w.s_up.upload(), in.x = x.get(), in.top_k = 2, in.act = act.get();
  in.router_logits = logits.get(), in.n_experts = 4;
  DeviceBuffer<int> sel_idx(2);
  DeviceBuffer<float> sel_w(2);
  EXPECT_EQ(moe_expert_in(in, nullptr), cudaErrorInvalidValue);  // selecting, it must write the selection
  in.topk_idx_out = sel_idx.get();  // ... both halves of it
  EXPECT_EQ(moe_expert_in(in, nullptr), cudaErrorInvalidValue);
  in.topk_w_out = sel_w.get();
  EXPECT_EQ(moe_expert_in(in, nullptr), cudaSuccess);
  in.n_experts = 300;
  EXPECT_EQ(moe_expert_in(in, nullptr), cudaErrorInvalidValue);
  in.router_logits = nullptr;  // and no topk_idx either
  EXPECT_EQ(moe_expert_in(in, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// Full-size MoE (E = 256, H = 2048, I = 512, k = 8) from 453 MB of stacked experts, a different random expert set
// per call (cold L2), CUDA-graph replay.
TEST(CudaMoeBench, FullSize) {
  SKIP_WITHOUT_GPU();
  const int E = 256, H = 2048, I = 512, k = 8, iters = 100;
  const DeviceBuffer<uint16_t> pool = bench_pool(size_t{1} << 30);
  QMatrix gate = bench_qmatrix(pool, E * I, H, 4, 0), up = bench_qmatrix(pool, E * I, H, 4, 1);
  QMatrix down = bench_qmatrix(pool, E * H, I, 4, 2);
  gate.rows = up.rows = I, down.rows = H;
  const QMatrix s_gate = bench_qmatrix(pool, I, H, 4, 3), s_up = bench_qmatrix(pool, I, H, 4, 4);
  const QMatrix s_down = bench_qmatrix(pool, H, I, 4, 5);
  std::mt19937 rng(9);
  std::vector<int> table;
  for (int i = 0; i < iters; ++i) {
    std::vector<int> all(E);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    table.insert(table.end(), all.begin(), all.begin() + k);
  }
  DeviceBuffer<int> d_table(table), d_idx(k);
  DeviceBuffer<float> h(random_vector(H, 10)), norm_w(random_vector(H, 11, 0.1f, 1.0f)), x(random_vector(H, 12));
  DeviceBuffer<float> act(random_vector((k + 1) * I, 13, 0.1f)), logits(E), w(std::vector<float>(k, 1.0f / k));
  DeviceBuffer<float> sg(std::vector<float>{0.5f});
  DeviceBuffer<unsigned> counter(1);
  ASSERT_CUDA(counter.zero());

  auto route_params = [&](int i) {
    MoeRouteParams p;
    p.router = bench_qmatrix(pool, E, H, 8, 2 * i + 100);
    p.shared_gate = bench_qmatrix(pool, 1, H, 8, 2 * i + 101);
    p.h = h.get(), p.norm_w = norm_w.get(), p.top_k = k, p.x = x.get(), p.logits = logits.get();
    p.counter = counter.get(), p.topk_idx = d_idx.get(), p.topk_w = w.get(), p.shared_gate_value = sg.get();
    return p;
  };
  auto in_params = [&](const int* idx) {
    MoeExpertInParams p;
    p.gate = gate, p.up = up, p.shared_gate = s_gate, p.shared_up = s_up;
    p.x = x.get(), p.topk_idx = idx, p.top_k = k, p.act = act.get();
    return p;
  };
  auto out_params = [&](const int* idx) {
    MoeExpertOutParams p;
    p.down = down, p.shared_down = s_down, p.act = act.get(), p.topk_idx = idx, p.topk_w = w.get();
    p.shared_gate_value = sg.get(), p.top_k = k, p.h = h.get();
    return p;
  };
  const double route_bytes = static_cast<double>(route_params(0).router.bytes() + route_params(0).shared_gate.bytes());
  const double in_bytes = (k + 1) * 2.0 * gate.bytes(), out_bytes = (k + 1) * static_cast<double>(down.bytes());
  std::printf("\n");
  print_bandwidth("moe_route [256, 2048] q8 + shared gate",
                  graph_time_us([&](int i, cudaStream_t s) { return moe_route(route_params(i), s); }, iters),
                  route_bytes);
  print_bandwidth("moe_expert_in 9 x [2 x 512, 2048] q4",
                  graph_time_us([&](int i, cudaStream_t s) { return moe_expert_in(in_params(d_table.get() + i * k), s); },
                                iters),
                  in_bytes);
  print_bandwidth("moe_expert_out 9 x [2048, 512] q4 + residual",
                  graph_time_us([&](int i, cudaStream_t s) { return moe_expert_out(out_params(d_table.get() + i * k), s); },
                                iters),
                  out_bytes);
  auto whole = [&](int i, cudaStream_t s) {
    CUDA_TRY(moe_route(route_params(i), s));
    CUDA_TRY(moe_expert_in(in_params(d_idx.get()), s));
    return moe_expert_out(out_params(d_idx.get()), s);
  };
  print_bandwidth("moe route + in + out (one layer)", graph_time_us(whole, iters), route_bytes + in_bytes + out_bytes);
  auto whole_selecting = [&](int i, cudaStream_t s) {  // the decode graph's mode: experts select
    MoeRouteParams rp = route_params(i);
    rp.select_top_k = false;
    MoeExpertInParams ip = in_params(d_idx.get());
    MoeExpertOutParams op = out_params(d_idx.get());
    ip.router_logits = logits.get(), ip.n_experts = E;
    ip.topk_idx_out = d_idx.get(), ip.topk_w_out = w.get();
    CUDA_TRY(moe_route(rp, s));
    CUDA_TRY(moe_expert_in(ip, s));
    return moe_expert_out(op, s);
  };
  print_bandwidth("moe layer, selection in the expert kernels", graph_time_us(whole_selecting, iters),
                  route_bytes + in_bytes + out_bytes);
}

}  // namespace
}  // namespace lily::cuda::test
