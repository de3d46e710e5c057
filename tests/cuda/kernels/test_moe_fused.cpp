// moe_fused (src/cuda/kernels/moe_fused.cu): the MoE block as one persistent kernel, against the three-kernel chain
// (moe_route + moe_expert_in + moe_expert_out, through dispatch as the decode step calls them) and against a CPU
// reference, on fresh random weights at the model's geometry (E 256, H 2048, I 512, top-8) and the small synthetic
// preset's (E 32, H 1024, I 256, top-8). The fused kernel runs the chain's code for x, the router logits, the
// selection and act, so those should match the chain bit for bit (the counts are printed); h differs only by the
// order of the fp32 sums of the down projections. Any grid size gives the same bits. Then graph replays (the
// barrier must be ready again after every launch), argument checks, and a timing table (chain vs fused in graph
// replay, us per layer).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "cpu/blocks.h"
#include "cuda/kernels/dispatch.cuh"
#include "cuda/kernels/moe.cuh"
#include "generic_refs.h"

namespace lily::cuda::test {
namespace {

struct MoeGeometry {
  int E, H, I, k;
};
constexpr MoeGeometry kModel{256, 2048, 512, 8};
constexpr MoeGeometry kSmallMoe{32, 1024, 256, 8};

// A quantized matrix with uniformly random codes and per-group scales around std / (std of a uniform code), biases
// centring the codes (values of about N(0, std)): random_qmatrix's statistics without quantizing 10^8 floats.
HostQMatrix fast_qmatrix(int rows, int cols, int bits, uint32_t seed, float std = 0.02f) {
  HostQMatrix m;
  m.rows = rows, m.cols = cols, m.bits = bits;
  std::mt19937 rng(seed);
  m.words.resize(rows * m.words_per_row());
  for (uint32_t& w : m.words) w = rng();
  const size_t groups = rows * m.groups_per_row();
  m.scales.resize(groups);
  m.biases.resize(groups);
  const float levels = static_cast<float>((1 << bits) - 1);
  const float code_std = std::sqrt((levels + 1) * (levels + 1) / 12.0f);
  std::uniform_real_distribution<float> jitter(0.75f, 1.25f);
  for (size_t g = 0; g < groups; ++g) {
    const float s = std / code_std * jitter(rng);
    m.scales[g] = to_bf16_bits(s);
    m.biases[g] = to_bf16_bits(-0.5f * levels * bf16_bits_to_float(m.scales[g]));
  }
  return m;
}

// One layer's MoE weights on the host and the device, and its input.
struct Layer {
  MoeGeometry g;
  HostQMatrix router, gate_row, gate, up, down, s_gate, s_up, s_down;
  std::vector<float> h, norm_w;
  DeviceBuffer<float> d_norm;
  MoeFusedParams q;  // after upload(): the device weights, norm_w, eps, top_k (no scratch pointers)

  Layer(MoeGeometry geo, uint32_t seed) : g(geo) {
    router = fast_qmatrix(g.E, g.H, 8, seed), gate_row = fast_qmatrix(1, g.H, 8, seed + 1);  // logits ~ N(0, 0.9)
    gate = fast_qmatrix(g.E * g.I, g.H, 4, seed + 2), up = fast_qmatrix(g.E * g.I, g.H, 4, seed + 3);
    down = fast_qmatrix(g.E * g.H, g.I, 4, seed + 4);
    s_gate = fast_qmatrix(g.I, g.H, 4, seed + 5), s_up = fast_qmatrix(g.I, g.H, 4, seed + 6);
    s_down = fast_qmatrix(g.H, g.I, 4, seed + 7);
    h = random_vector(g.H, seed + 8), norm_w = random_vector(g.H, seed + 9, 0.1f, 1.0f);
  }
  // Experts 9 and 5 tie at the top, 24..28 follow, 20 and 3 tie for the last place: only 3 may take it.
  void plant_ties() {
    const std::vector<float> x = rms_norm_ref(h.data(), norm_w.data(), g.H);
    plant_row(router, 9, x, 8.0f);
    copy_row(router, 9, 5);
    for (int i = 0; i < 5; ++i) plant_row(router, 24 + i, x, 7.0f - 0.3f * i);
    plant_row(router, 20, x, 5.0f);
    copy_row(router, 20, 3);
  }
  void upload() {
    auto stacked = [](HostQMatrix& m, int rows) {
      QMatrix d = m.upload();
      d.rows = rows;
      return d;
    };
    q.router = router.upload(), q.shared_gate_row = gate_row.upload();
    q.gate = stacked(gate, g.I), q.up = stacked(up, g.I), q.down = stacked(down, g.H);
    q.shared_gate = s_gate.upload(), q.shared_up = s_up.upload(), q.shared_down = s_down.upload();
    d_norm = DeviceBuffer<float>(norm_w);
    q.norm_w = d_norm.get(), q.eps = kEps, q.top_k = g.k;
  }
};

// Device scratch and outputs of one MoE block.
struct Buffers {
  DeviceBuffer<float> h, logits, sg, act, topk_w;
  DeviceBuffer<int> topk_idx;
  DeviceBuffer<unsigned> counter;
  explicit Buffers(const Layer& L)
      : h(L.h), logits(L.g.E), sg(1), act((L.g.k + 1) * L.g.I), topk_w(L.g.k), topk_idx(L.g.k), counter(1) {
    EXPECT_EQ(counter.zero(), cudaSuccess);
  }
  MoeFusedParams fused(const Layer& L, int grid_blocks = 0) {
    MoeFusedParams p = L.q;
    p.h = h.get(), p.logits = logits.get(), p.shared_gate_value = sg.get(), p.act = act.get();
    p.barrier = counter.get(), p.topk_idx = topk_idx.get(), p.topk_w = topk_w.get(), p.grid_blocks = grid_blocks;
    return p;
  }
};

struct Outputs {
  std::vector<float> h, logits, sg, act, topk_w;
  std::vector<int> topk_idx;
  unsigned counter;
};

Outputs download(const Buffers& r) {
  return {r.h.download(),      r.logits.download(),   r.sg.download(), r.act.download(),
          r.topk_w.download(), r.topk_idx.download(), r.counter.download()[0]};
}

Outputs run_fused(const Layer& L, int grid_blocks) {
  Buffers r(L);
  EXPECT_EQ(moe_fused(r.fused(L, grid_blocks), nullptr), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return download(r);
}

// The chain as the decode step launches it where the fast kernels do not select (moe_route selects).
Outputs run_chain(const Layer& L) {
  Buffers r(L);
  DeviceBuffer<float> x(L.g.H);
  MoeRouteParams rp;
  rp.router = L.q.router, rp.shared_gate = L.q.shared_gate_row, rp.h = r.h.get(), rp.norm_w = L.q.norm_w;
  rp.eps = kEps, rp.top_k = L.g.k, rp.x = x.get(), rp.logits = r.logits.get(), rp.counter = r.counter.get();
  rp.topk_idx = r.topk_idx.get(), rp.topk_w = r.topk_w.get(), rp.shared_gate_value = r.sg.get();
  MoeExpertInParams ip{L.q.gate, L.q.up, L.q.shared_gate, L.q.shared_up, x.get(), r.topk_idx.get(), L.g.k,
                       r.act.get()};
  MoeExpertOutParams op{L.q.down, L.q.shared_down, r.act.get(), r.topk_idx.get(), r.topk_w.get(), r.sg.get(),
                        L.g.k, r.h.get()};
  EXPECT_EQ(dispatch::moe_route(rp, nullptr), cudaSuccess);
  EXPECT_EQ(dispatch::moe_expert_in(ip, nullptr), cudaSuccess);
  EXPECT_EQ(dispatch::moe_expert_out(op, nullptr), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return download(r);
}

// sum_s w_s |down_s . act_s| per output row (the tolerance scale of the down projections), from the GPU's act.
std::vector<double> down_bound(const Layer& L, const Outputs& r) {
  std::vector<double> bound(L.g.H);
  for (int row = 0; row < L.g.H; ++row) {
    for (int s = 0; s <= L.g.k; ++s) {
      const double w = s < L.g.k ? r.topk_w[s] : r.sg[0];
      const float* a = &r.act[static_cast<size_t>(s) * L.g.I];
      bound[row] += std::fabs(w) * (s < L.g.k ? qdot(L.down, r.topk_idx[s] * L.g.H + row, a).second
                                              : qdot(L.s_down, row, a).second);
    }
  }
  return bound;
}

// Values the fused kernel computes with the chain's code (x, logits, shared gate, routing weights, act): expected
// bit for bit; printed as a count, asserted within 1e-6 (relative + absolute), since another FMA contraction of
// the same inlined helper in another kernel would change last bits without a bug (wrong rows or experts: O(1)).
void expect_same_bits(const char* what, const std::vector<float>& got, const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t same = 0;
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    same += std::memcmp(&got[i], &want[i], sizeof(float)) == 0;
    expect_close(what, i, got[i], want[i], 1e-6 * std::fabs(want[i]) + 1e-6, bad);
  }
  std::printf("%-14s fused vs chain: %zu of %zu bit-identical\n", what, same, got.size());
  EXPECT_EQ(bad, 0) << what;
}

// The selection exactly; h within fp32 reordering of the down sums (each within 2e-5 of its sum of |terms|, so two
// orders within 4e-5).
void expect_matches_chain(const Layer& L, const Outputs& fused, const Outputs& chain) {
  EXPECT_EQ(fused.topk_idx, chain.topk_idx);
  expect_same_bits("logits", fused.logits, chain.logits);
  expect_same_bits("shared gate", fused.sg, chain.sg);
  expect_same_bits("routing w", fused.topk_w, chain.topk_w);
  expect_same_bits("act", fused.act, chain.act);
  EXPECT_EQ(fused.counter, 0u) << "the barrier counter must be back at zero";
  const std::vector<double> bound = down_bound(L, fused);
  int bad = 0;
  for (int row = 0; row < L.g.H; ++row) {
    expect_close("h vs chain", row, fused.h[row], chain.h[row], 4e-5 * bound[row] + 1e-6 * (std::fabs(L.h[row]) + 1),
                 bad);
  }
  EXPECT_EQ(bad, 0);
}

// Eqs 1-2, 21-25 on the CPU: logits and shared gate from x in double; the selection by lily::cpu::route_top_k on
// the softmax of the GPU's logits (exact top-k; ties are planted to be exact in fp32); act and h in double.
void expect_matches_cpu(const Layer& L, const Outputs& got) {
  const MoeGeometry& g = L.g;
  const std::vector<float> x = rms_norm_ref(L.h.data(), L.norm_w.data(), g.H);
  int bad = 0;
  for (int e = 0; e < g.E; ++e) {
    const auto [ref, abs_sum] = qdot(L.router, e, x.data());
    expect_close("logit", e, got.logits[e], ref, 2e-5 * abs_sum + 1e-6, bad);
  }
  const double sg = sigmoid_d(qdot(L.gate_row, 0, x.data()).first);
  expect_close("shared gate", 0, got.sg[0], sg, 1e-5, bad);
  std::vector<float> probs(got.logits);
  const float mx = *std::max_element(probs.begin(), probs.end());
  double sum = 0;
  for (float& v : probs) sum += (v = std::exp(v - mx));
  for (float& v : probs) v = static_cast<float>(v / sum);
  std::vector<int> idx(g.k);
  std::vector<float> w(g.k);
  cpu::route_top_k(probs.data(), g.E, g.k, idx.data(), w.data());
  EXPECT_EQ(got.topk_idx, idx);
  for (int i = 0; i < g.k; ++i) expect_close("routing weight", i, got.topk_w[i], w[i], 1e-5 * w[i] + 1e-7, bad);
  std::vector<float> act((g.k + 1) * g.I);
  for (int s = 0; s <= g.k; ++s) {
    for (int r = 0; r < g.I; ++r) {
      const auto [gd, g_abs] = s < g.k ? qdot(L.gate, idx[s] * g.I + r, x.data()) : qdot(L.s_gate, r, x.data());
      const auto [ud, u_abs] = s < g.k ? qdot(L.up, idx[s] * g.I + r, x.data()) : qdot(L.s_up, r, x.data());
      act[s * g.I + r] = static_cast<float>(silu_d(gd) * ud);
      // Each dot within 2e-5 of its sum of |terms|; silu' <= 1.1.
      const double tol = std::fabs(silu_d(gd)) * 2e-5 * u_abs + 1.1 * std::fabs(ud) * 2e-5 * g_abs + 1e-6;
      expect_close("act", s * g.I + r, got.act[s * g.I + r], act[s * g.I + r], tol, bad);
    }
  }
  for (int row = 0; row < g.H; ++row) {
    double ref = L.h[row], bound = std::fabs(L.h[row]);
    for (int s = 0; s <= g.k; ++s) {
      const double ws = s < g.k ? w[s] : sg;
      const auto [d, d_abs] = s < g.k ? qdot(L.down, idx[s] * g.H + row, &act[s * g.I])
                                      : qdot(L.s_down, row, &act[s * g.I]);
      ref += ws * d;
      bound += ws * d_abs;
    }
    // fp32 through the three phases: act carries ~1e-5 relative error into the down projections.
    expect_close("h vs cpu", row, got.h[row], ref, 1e-4 * bound + 1e-5, bad);
  }
  EXPECT_EQ(bad, 0);
}

// Fused (every resident block, and a few blocks looping over the units) against the chain and the CPU.
void check_layer(Layer& L, const std::vector<int>& grids) {
  SCOPED_TRACE(testing::Message() << "E " << L.g.E << " H " << L.g.H << " I " << L.g.I << " k " << L.g.k);
  L.upload();
  const Outputs chain = run_chain(L), fused = run_fused(L, 0);
  expect_matches_chain(L, fused, chain);
  expect_matches_cpu(L, fused);
  for (int blocks : grids) {
    const Outputs few = run_fused(L, blocks);
    EXPECT_EQ(few.act, fused.act) << blocks << " blocks";
    EXPECT_EQ(few.h, fused.h) << blocks << " blocks";
    EXPECT_EQ(few.counter, 0u) << blocks << " blocks";
  }
}

TEST(CudaMoeFused, ModelGeometryMatchesChainAndCpu) {
  SKIP_WITHOUT_GPU();
  Layer L(kModel, 101);
  check_layer(L, {1, 7});
}

TEST(CudaMoeFused, SmallGeometryMatchesChainAndCpu) {
  SKIP_WITHOUT_GPU();
  Layer L(kSmallMoe, 201);
  check_layer(L, {1, 3});
}

TEST(CudaMoeFused, RoutingTiesGoToTheLowerIndex) {
  SKIP_WITHOUT_GPU();
  for (const MoeGeometry& g : {kModel, kSmallMoe}) {
    Layer L(g, 301);
    L.plant_ties();
    L.upload();
    const Outputs fused = run_fused(L, 0);
    EXPECT_EQ(fused.logits[5], fused.logits[9]);
    EXPECT_EQ(fused.logits[3], fused.logits[20]);
    EXPECT_EQ(fused.topk_idx, (std::vector<int>{5, 9, 24, 25, 26, 27, 28, 3}));
    expect_matches_chain(L, fused, run_chain(L));
    expect_matches_cpu(L, fused);
  }
}

// Two fused layers back to back (PDL between them) captured once in a graph and replayed 5 times (the graph as the
// decode step's: kernels only): replay n must give the bits of launches 2n+1 and 2n+2 run eagerly on the same
// h, and leave the barrier counter at zero.
TEST(CudaMoeFused, GraphReplayLeavesTheBarrierReady) {
  SKIP_WITHOUT_GPU();
  constexpr int kReplays = 5;
  for (const MoeGeometry& g : {kModel, kSmallMoe}) {
    SCOPED_TRACE(testing::Message() << "H " << g.H);
    Layer L(g, 401);
    L.upload();
    Buffers eager(L);
    std::vector<std::vector<float>> want;
    for (int replay = 0; replay < kReplays; ++replay) {
      ASSERT_CUDA(moe_fused(eager.fused(L), nullptr));
      ASSERT_CUDA(moe_fused(eager.fused(L), nullptr));
      ASSERT_CUDA(cudaDeviceSynchronize());
      want.push_back(eager.h.download());
    }

    Buffers r(L);
    cudaStream_t stream;
    ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    const cudaError_t first = moe_fused(r.fused(L), stream), second = moe_fused(r.fused(L), stream);
    ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
    ASSERT_CUDA(first);
    ASSERT_CUDA(second);
    ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    for (int replay = 0; replay < kReplays; ++replay) {
      ASSERT_CUDA(cudaGraphLaunch(exec, stream));
      ASSERT_CUDA(cudaStreamSynchronize(stream));
      EXPECT_EQ(r.h.download(), want[replay]) << "replay " << replay;
      EXPECT_EQ(r.counter.download()[0], 0u) << "replay " << replay;
    }
    ASSERT_CUDA(cudaGraphExecDestroy(exec));
    ASSERT_CUDA(cudaGraphDestroy(graph));
    ASSERT_CUDA(cudaStreamDestroy(stream));
  }
}

TEST(CudaMoeFused, RejectsBadArguments) {
  SKIP_WITHOUT_GPU();
  MoeFusedParams none;
  EXPECT_FALSE(moe_fused_supported(none));
  EXPECT_EQ(moe_fused(none, nullptr), cudaErrorInvalidValue);
  Layer L(kSmallMoe, 501);
  L.upload();
  Buffers r(L);
  MoeFusedParams p = r.fused(L);
  EXPECT_TRUE(moe_fused_supported(p));
  p.grid_blocks = 1 << 20;  // more blocks than can be resident: the barrier would never open
  EXPECT_EQ(moe_fused(p, nullptr), cudaErrorCooperativeLaunchTooLarge);
  p = r.fused(L);
  p.barrier = nullptr;
  EXPECT_EQ(moe_fused(p, nullptr), cudaErrorInvalidValue);
  p = r.fused(L);
  p.top_k = 17;
  EXPECT_EQ(moe_fused(p, nullptr), cudaErrorInvalidValue);
  p = r.fused(L);
  p.gate.rows = p.up.rows = p.shared_gate.rows = p.shared_up.rows = 128;  // I = 128: no instance
  EXPECT_EQ(moe_fused(p, nullptr), cudaErrorInvalidValue);
  p = r.fused(L);
  p.act += 1;  // act must be 16-byte aligned
  EXPECT_EQ(moe_fused(p, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// The model's MoE layer from 1 GB of cold weights (a different router copy, hence different experts, per call),
// in CUDA-graph replay: the chain in both selection modes against the fused kernel on every resident block and
// on one block per SM. Prints; asserts nothing about speed.
TEST(CudaMoeFusedBench, FullSize) {
  SKIP_WITHOUT_GPU();
  const int E = 256, H = 2048, I = 512, k = 8, iters = 100;
  const DeviceBuffer<uint16_t> pool = bench_pool(size_t{1} << 30);
  QMatrix gate = bench_qmatrix(pool, E * I, H, 4, 0), up = bench_qmatrix(pool, E * I, H, 4, 1);
  QMatrix down = bench_qmatrix(pool, E * H, I, 4, 2);
  gate.rows = up.rows = I, down.rows = H;
  const QMatrix s_gate = bench_qmatrix(pool, I, H, 4, 3), s_up = bench_qmatrix(pool, I, H, 4, 4);
  const QMatrix s_down = bench_qmatrix(pool, H, I, 4, 5);
  DeviceBuffer<float> h(random_vector(H, 10)), norm_w(random_vector(H, 11, 0.1f, 1.0f)), x(H), logits(E);
  DeviceBuffer<float> act((k + 1) * I), w(k), sg(1);
  DeviceBuffer<int> idx(k);
  DeviceBuffer<unsigned> counters(2);
  ASSERT_CUDA(counters.zero());
  auto router = [&](int i) { return bench_qmatrix(pool, E, H, 8, 2 * i + 100); };
  auto gate_row = [&](int i) { return bench_qmatrix(pool, 1, H, 8, 2 * i + 101); };
  auto chain = [&](int i, cudaStream_t s, bool experts_select) {
    MoeRouteParams rp;
    rp.router = router(i), rp.shared_gate = gate_row(i), rp.h = h.get(), rp.norm_w = norm_w.get(), rp.top_k = k;
    rp.x = x.get(), rp.logits = logits.get(), rp.counter = counters.get(), rp.topk_idx = idx.get();
    rp.topk_w = w.get(), rp.shared_gate_value = sg.get(), rp.select_top_k = !experts_select;
    MoeExpertInParams ip{gate, up, s_gate, s_up, x.get(), idx.get(), k, act.get()};
    MoeExpertOutParams op{down, s_down, act.get(), idx.get(), w.get(), sg.get(), k, h.get()};
    if (experts_select) ip.router_logits = op.router_logits = logits.get(), ip.n_experts = op.n_experts = E;
    CUDA_TRY(moe_route(rp, s));
    CUDA_TRY(moe_expert_in(ip, s));
    return moe_expert_out(op, s);
  };
  auto fused = [&](int i, cudaStream_t s, int grid_blocks) {
    MoeFusedParams p;
    p.router = router(i), p.shared_gate_row = gate_row(i), p.gate = gate, p.up = up, p.down = down;
    p.shared_gate = s_gate, p.shared_up = s_up, p.shared_down = s_down, p.h = h.get(), p.norm_w = norm_w.get();
    p.top_k = k, p.logits = logits.get(), p.shared_gate_value = sg.get(), p.act = act.get();
    p.barrier = counters.get() + 1, p.grid_blocks = grid_blocks;
    return moe_fused(p, s);
  };
  int device = 0, sms = 0;
  ASSERT_CUDA(cudaGetDevice(&device));
  ASSERT_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const double bytes = static_cast<double>(router(0).bytes() + gate_row(0).bytes()) +
                       (k + 1) * (2.0 * gate.bytes() + static_cast<double>(down.bytes()));
  std::printf("\nMoE layer E %d H %d I %d top-%d, graph replay, cold weights (us per layer):\n", E, H, I, k);
  print_bandwidth("chain, moe_route selects",
                  graph_time_us([&](int i, cudaStream_t s) { return chain(i, s, false); }, iters), bytes);
  print_bandwidth("chain, expert kernels select (decode default)",
                  graph_time_us([&](int i, cudaStream_t s) { return chain(i, s, true); }, iters), bytes);
  print_bandwidth("fused, every resident block",
                  graph_time_us([&](int i, cudaStream_t s) { return fused(i, s, 0); }, iters), bytes);
  print_bandwidth("fused, one block per SM",
                  graph_time_us([&](int i, cudaStream_t s) { return fused(i, s, sms); }, iters), bytes);
}

}  // namespace
}  // namespace lily::cuda::test
