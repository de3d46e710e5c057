// gdn_fused (src/cuda/kernels/gdn_fused.cu): the Gated DeltaNet decode layer as one persistent kernel, against the
// three-kernel chain as the decode step launches it (gemv gdn_in with the RMSNorm prologue, gdn_step with the
// gated norm and the state prefetched, gemv gdn_out with the residual) and against the CPU, on fresh random
// weights at the model's geometry (32 value heads, 16 key heads, d 128, H 2048, conv 4) and the small preset's
// (16 / 8, H 1024), over consecutive steps with state, conv ring and h carried. The fused kernel runs the chain's
// code and summation orders for x, proj, the step and the out_proj, so every output should match the chain bit
// for bit (the counts are printed; asserted within 1e-6, since another FMA contraction of an inlined helper would
// change last bits without a bug). Any grid size gives the same bits. Then graph replays (the barrier ready again
// after every launch), argument checks, and a timing table (chain vs fused in graph replay, us per layer).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/kernels/dispatch.cuh"
#include "cuda/kernels/gdn.cuh"
#include "generic_refs.h"

namespace lily::cuda::test {
namespace {

// One GDN layer's device weights (everything but the state).
struct DeviceLayer {
  explicit DeviceLayer(const Geometry& geo) : g(geo) {}
  Geometry g;
  QMatrix q_in, q_out;
  DeviceBuffer<float> d_input_norm, d_norm_w, conv_w, A_log, dt_bias;
};

// A layer with random weights kept on the host too, and the CPU reference of its state.
struct Layer : DeviceLayer {
  HostQMatrix in_proj, out_proj;
  GdnRef ref;  // CPU state, advanced by expect_matches_cpu
  std::vector<float> input_norm, norm_w;

  Layer(const Geometry& geo, uint32_t seed)
      : DeviceLayer(geo),
        in_proj(random_qmatrix(geo.gdn_proj(), geo.hidden, 4, seed)),
        out_proj(random_qmatrix(geo.hidden, geo.value_dim(), 4, seed + 1)),
        ref(geo, seed + 2),
        input_norm(random_vector(geo.hidden, seed + 3, 0.1f, 1.0f)),
        norm_w(random_vector(geo.d_v, seed + 4, 0.1f, 1.0f)) {
    q_in = in_proj.upload(), q_out = out_proj.upload();
    d_input_norm = DeviceBuffer<float>(input_norm), d_norm_w = DeviceBuffer<float>(norm_w);
    conv_w = DeviceBuffer<float>(ref.conv_w), A_log = DeviceBuffer<float>(ref.A_log);
    dt_bias = DeviceBuffer<float>(ref.dt_bias);
  }
};

constexpr int kMaxSteps = 8;

// Device state and scratch of one sequence for one layer.
struct State {
  DeviceBuffer<float> h, S, ring, proj, o;
  DeviceBuffer<int> pos;
  DeviceBuffer<unsigned> counter{1};
  State(const DeviceLayer& L, const std::vector<float>& h0)
      : h(h0),
        S(static_cast<size_t>(L.g.n_v) * L.g.d_k * L.g.d_v),
        ring(static_cast<size_t>(kConvKernel) * L.g.conv_dim()),
        proj(L.g.gdn_proj()),
        o(L.g.value_dim()) {
    std::vector<int> positions(kMaxSteps);
    for (int t = 0; t < kMaxSteps; ++t) positions[t] = t;
    pos = DeviceBuffer<int>(positions);
    EXPECT_EQ(S.zero(), cudaSuccess);
    EXPECT_EQ(ring.zero(), cudaSuccess);
    EXPECT_EQ(counter.zero(), cudaSuccess);
  }

  GdnFusedParams fused(const DeviceLayer& L, int step, int grid_blocks = 0) const {
    GdnFusedParams p;
    p.in_proj = L.q_in, p.out_proj = L.q_out, p.h = h.get(), p.input_norm = L.d_input_norm.get();
    p.conv_w = L.conv_w.get(), p.A_log = L.A_log.get(), p.dt_bias = L.dt_bias.get(), p.norm_w = L.d_norm_w.get();
    p.conv_ring = ring.get(), p.S = S.get(), p.pos = pos.get() + step;
    p.n_k = L.g.n_k, p.n_v = L.g.n_v, p.d_k = L.g.d_k, p.d_v = L.g.d_v, p.kernel = kConvKernel, p.eps = kEps;
    p.proj = proj.get(), p.o = o.get(), p.barrier = counter.get();
    p.prefetch_state = true, p.grid_blocks = grid_blocks;
    return p;
  }

  // The chain as CudaBackend::enqueue_step launches it.
  cudaError_t chain(const DeviceLayer& L, int step, cudaStream_t stream) const {
    GemvParams in{L.q_in, h.get(), GemvPrologue::rms_norm, L.d_input_norm.get(), nullptr, 0, kEps, nullptr,
                  proj.get()};
    CUDA_TRY(dispatch::gemv(in, stream));
    GdnStepParams g{proj.get(), ring.get(), L.conv_w.get(), L.A_log.get(), L.dt_bias.get(), S.get(),
                    pos.get() + step, L.g.n_k, L.g.n_v, L.g.d_k, L.g.d_v, kConvKernel, o.get()};
    g.prefetch_state = true;
    g.gate_z = proj.get() + L.g.conv_dim(), g.norm_w = L.d_norm_w.get(), g.eps = kEps;
    CUDA_TRY(dispatch::gdn_step(g, stream));
    GemvParams out{L.q_out, o.get(), GemvPrologue::none, nullptr, nullptr, 0, kEps, h.get(), h.get()};
    return dispatch::gemv(out, stream);
  }
};

struct Outputs {
  std::vector<float> h, proj, o, S, ring;
  unsigned counter;
};

Outputs download(const State& s) {
  return {s.h.download(), s.proj.download(), s.o.download(), s.S.download(), s.ring.download(),
          s.counter.download()[0]};
}

// Expected bit for bit (see the header); printed as a count, asserted within 1e-6 relative + absolute.
void expect_same_bits(const char* what, const std::vector<float>& got, const std::vector<float>& want, bool print) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t same = 0;
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    same += std::memcmp(&got[i], &want[i], sizeof(float)) == 0;
    expect_close(what, i, got[i], want[i], 1e-6 * std::fabs(want[i]) + 1e-6, bad);
  }
  if (print) std::printf("%-6s fused vs chain: %zu of %zu bit-identical\n", what, same, got.size());
  EXPECT_EQ(bad, 0) << what;
}

// Eqs 1-2, 13-20 on the CPU, each stage from the GPU's previous one (so tolerances do not compound): proj from
// x = RMSNorm(h) in double; o from the CPU step on the GPU's proj (state carried in L.ref); h from the GPU's o.
void expect_matches_cpu(Layer& L, const std::vector<float>& h_in, const Outputs& got) {
  const Geometry& g = L.g;
  const std::vector<float> x = rms_norm_ref(h_in.data(), L.input_norm.data(), g.hidden);
  int bad = 0;
  for (int r = 0; r < g.gdn_proj(); ++r) {
    const auto [ref, abs_sum] = qdot(L.in_proj, r, x.data());
    expect_close("proj vs cpu", r, got.proj[r], ref, 2e-5 * abs_sum + 1e-6, bad);
  }
  std::vector<float> o = L.ref.step(got.proj);
  for (int h = 0; h < g.n_v; ++h) {  // eq 19 in double
    double ss = 0;
    for (int d = 0; d < g.d_v; ++d) ss += static_cast<double>(o[h * g.d_v + d]) * o[h * g.d_v + d];
    const double inv = 1.0 / std::sqrt(ss / g.d_v + kEps);
    for (int d = 0; d < g.d_v; ++d) {
      const double z = got.proj[g.conv_dim() + h * g.d_v + d];
      o[h * g.d_v + d] = static_cast<float>(L.norm_w[d] * o[h * g.d_v + d] * inv * silu_d(z));
    }
  }
  // test_gdn.cpp's bound for the step with the gated norm fused (fp32 on both sides, orders differ).
  for (int i = 0; i < g.value_dim(); ++i)
    expect_close("o vs cpu", i, got.o[i], o[i], 1e-4 + 1e-4 * std::fabs(o[i]), bad);
  for (size_t i = 0; i < got.S.size(); ++i)
    expect_close("S vs cpu", i, got.S[i], L.ref.S[i], 1e-4 + 1e-4 * std::fabs(L.ref.S[i]), bad);
  for (int r = 0; r < g.hidden; ++r) {
    const auto [ref, abs_sum] = qdot(L.out_proj, r, got.o.data());
    expect_close("h vs cpu", r, got.h[r], h_in[r] + ref, 2e-5 * (abs_sum + std::fabs(h_in[r])) + 1e-6, bad);
  }
  EXPECT_EQ(bad, 0);
}

// kSteps consecutive steps (state, ring and h carried) through the chain and the fused kernel on the full grid:
// every output against the chain and the CPU; then, from the same starting point, each step on the small grids
// must give the full grid's bits.
void check_layer(const Geometry& geo, uint32_t seed, const std::vector<int>& grids) {
  SCOPED_TRACE(geo.name);
  constexpr int kSteps = 5;
  Layer L(geo, seed);
  const std::vector<float> h0 = random_vector(geo.hidden, seed + 10);
  State chain(L, h0), fused(L, h0);
  std::vector<std::vector<float>> h_before(kSteps);
  std::vector<Outputs> fused_out;
  for (int t = 0; t < kSteps; ++t) {
    SCOPED_TRACE("step " + std::to_string(t));
    h_before[t] = fused.h.download();
    ASSERT_CUDA(chain.chain(L, t, nullptr));
    ASSERT_CUDA(gdn_fused(fused.fused(L, t), nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());
    const Outputs c = download(chain), f = download(fused);
    const bool print = t == 0 || t == kSteps - 1;
    if (print) std::printf("[%s] step %d\n", geo.name, t);
    expect_same_bits("proj", f.proj, c.proj, print);
    expect_same_bits("o", f.o, c.o, print);
    expect_same_bits("S", f.S, c.S, print);
    expect_same_bits("h", f.h, c.h, print);
    EXPECT_EQ(f.ring, c.ring);
    EXPECT_EQ(f.counter, 0u) << "the barrier counter must be back at zero";
    expect_matches_cpu(L, h_before[t], f);
    fused_out.push_back(f);
  }
  for (int blocks : grids) {
    SCOPED_TRACE(testing::Message() << blocks << " blocks");
    State few(L, h0);
    for (int t = 0; t < kSteps; ++t) {
      ASSERT_CUDA(gdn_fused(few.fused(L, t, blocks), nullptr));
      ASSERT_CUDA(cudaDeviceSynchronize());
      const Outputs f = download(few);
      EXPECT_EQ(f.proj, fused_out[t].proj) << "step " << t;
      EXPECT_EQ(f.o, fused_out[t].o) << "step " << t;
      EXPECT_EQ(f.S, fused_out[t].S) << "step " << t;
      EXPECT_EQ(f.h, fused_out[t].h) << "step " << t;
      EXPECT_EQ(f.counter, 0u) << "step " << t;
    }
  }
}

TEST(CudaGdnFused, ModelGeometryMatchesChainAndCpu) {
  SKIP_WITHOUT_GPU();
  check_layer(kFull, 101, {1, 5, 40});  // 1 and 5 blocks step several heads each; 40 leave 8 blocks without one
}

TEST(CudaGdnFused, SmallGeometryMatchesChainAndCpu) {
  SKIP_WITHOUT_GPU();
  check_layer(kSmall, 201, {1, 3});
}

// Two fused layers back to back (PDL between them; separate states, as the decode step's layers) captured once in
// a graph and replayed 5 times: replay n must give the bits of the same two launches run eagerly for the n-th
// time, and leave the barrier counter at zero.
TEST(CudaGdnFused, GraphReplayLeavesTheBarrierReady) {
  SKIP_WITHOUT_GPU();
  constexpr int kReplays = 5;
  for (const Geometry& g : {kFull, kSmall}) {
    SCOPED_TRACE(g.name);
    Layer L(g, 301);
    const std::vector<float> h0 = random_vector(g.hidden, 302);
    State eager_a(L, h0), eager_b(L, h0), a(L, h0), b(L, h0);
    // Both layers work on layer a's h (the residual stream); b has its own state and scratch.
    auto second = [&](const State& first, const State& own) {
      GdnFusedParams p = own.fused(L, 0);
      p.h = first.h.get();
      return p;
    };
    std::vector<std::vector<float>> want_h, want_S;
    for (int replay = 0; replay < kReplays; ++replay) {
      ASSERT_CUDA(gdn_fused(eager_a.fused(L, 0), nullptr));
      ASSERT_CUDA(gdn_fused(second(eager_a, eager_b), nullptr));
      ASSERT_CUDA(cudaDeviceSynchronize());
      want_h.push_back(eager_a.h.download());
      want_S.push_back(eager_b.S.download());
    }
    cudaStream_t stream;
    ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    const cudaError_t e1 = gdn_fused(a.fused(L, 0), stream), e2 = gdn_fused(second(a, b), stream);
    ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
    ASSERT_CUDA(e1);
    ASSERT_CUDA(e2);
    ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    for (int replay = 0; replay < kReplays; ++replay) {
      ASSERT_CUDA(cudaGraphLaunch(exec, stream));
      ASSERT_CUDA(cudaStreamSynchronize(stream));
      EXPECT_EQ(a.h.download(), want_h[replay]) << "replay " << replay;
      EXPECT_EQ(b.S.download(), want_S[replay]) << "replay " << replay;
      EXPECT_EQ(a.counter.download()[0], 0u) << "replay " << replay;
      EXPECT_EQ(b.counter.download()[0], 0u) << "replay " << replay;
    }
    ASSERT_CUDA(cudaGraphExecDestroy(exec));
    ASSERT_CUDA(cudaGraphDestroy(graph));
    ASSERT_CUDA(cudaStreamDestroy(stream));
  }
}

TEST(CudaGdnFused, RejectsBadArguments) {
  SKIP_WITHOUT_GPU();
  GdnFusedParams none;
  EXPECT_FALSE(gdn_fused_supported(none));
  EXPECT_EQ(gdn_fused(none, nullptr), cudaErrorInvalidValue);
  Layer L(kSmall, 501);
  State s(L, random_vector(kSmall.hidden, 502));
  GdnFusedParams p = s.fused(L, 0);
  EXPECT_TRUE(gdn_fused_supported(p));
  p.grid_blocks = 1 << 20;  // more blocks than can be resident: the barriers would never open
  EXPECT_EQ(gdn_fused(p, nullptr), cudaErrorCooperativeLaunchTooLarge);
  p = s.fused(L, 0);
  p.barrier = nullptr;
  EXPECT_EQ(gdn_fused(p, nullptr), cudaErrorInvalidValue);
  p = s.fused(L, 0);
  p.d_v = 64;  // d_v != 128: no instance
  EXPECT_EQ(gdn_fused(p, nullptr), cudaErrorInvalidValue);
  p = s.fused(L, 0);
  p.o += 1;  // o must be 16-byte aligned
  EXPECT_EQ(gdn_fused(p, nullptr), cudaErrorInvalidValue);
  p = s.fused(L, 0);
  p.in_proj.rows -= 1;  // not q|k|v|z|b|a of this geometry
  EXPECT_EQ(gdn_fused(p, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// The model's GDN layer from cold weights (a different in/out_proj copy per call) and 30 rotating states (as the
// 30 layers of a step), in CUDA-graph replay: the chain (3 kernels) against the fused kernel on every resident
// block. Prints us per layer; asserts nothing about speed.
TEST(CudaGdnFusedBench, FullSize) {
  SKIP_WITHOUT_GPU();
  const Geometry& g = kFull;
  constexpr int kLayers = 30, kIters = 90;
  const DeviceBuffer<uint16_t> pool = bench_pool(size_t{1} << 30);
  DeviceLayer L(g);
  L.d_input_norm = DeviceBuffer<float>(random_vector(g.hidden, 602, 0.1f, 1.0f));
  L.d_norm_w = DeviceBuffer<float>(random_vector(g.d_v, 603, 0.1f, 1.0f));
  L.conv_w = DeviceBuffer<float>(random_vector(static_cast<size_t>(g.conv_dim()) * kConvKernel, 604, 0.5f));
  L.A_log = DeviceBuffer<float>(random_vector(g.n_v, 605, 0.7f, -0.5f));
  L.dt_bias = DeviceBuffer<float>(random_vector(g.n_v, 606));
  std::vector<State> states;
  for (int i = 0; i < kLayers; ++i) states.emplace_back(L, random_vector(g.hidden, 607));
  DeviceBuffer<float> h(random_vector(g.hidden, 608));
  auto weights = [&](int i) {  // copy i of both projections, out of the 1 GB pool
    L.q_in = bench_qmatrix(pool, g.gdn_proj(), g.hidden, 4, 2 * i);
    L.q_out = bench_qmatrix(pool, g.hidden, g.value_dim(), 4, 2 * i + 1);
  };
  auto chain = [&](int i, cudaStream_t s) {
    weights(i);
    const State& st = states[i % kLayers];
    GemvParams in{L.q_in, h.get(), GemvPrologue::rms_norm, L.d_input_norm.get(), nullptr, 0, kEps, nullptr,
                  st.proj.get()};
    CUDA_TRY(dispatch::gemv(in, s));
    GdnStepParams gp{st.proj.get(), st.ring.get(), L.conv_w.get(), L.A_log.get(), L.dt_bias.get(), st.S.get(),
                     st.pos.get(), g.n_k, g.n_v, g.d_k, g.d_v, kConvKernel, st.o.get()};
    gp.prefetch_state = true;
    gp.gate_z = st.proj.get() + g.conv_dim(), gp.norm_w = L.d_norm_w.get(), gp.eps = kEps;
    CUDA_TRY(dispatch::gdn_step(gp, s));
    GemvParams out{L.q_out, st.o.get(), GemvPrologue::none, nullptr, nullptr, 0, kEps, h.get(), h.get()};
    return dispatch::gemv(out, s);
  };
  auto fused = [&](int i, cudaStream_t s, int grid_blocks) {
    weights(i);
    GdnFusedParams p = states[i % kLayers].fused(L, 0, grid_blocks);
    p.h = h.get();
    return gdn_fused(p, s);
  };
  weights(0);
  const double bytes = static_cast<double>(L.q_in.bytes() + L.q_out.bytes()) + 2.0 * g.n_v * g.d_k * g.d_v * 4;
  std::printf("\nGated DeltaNet decode layer H %d, %d value heads, graph replay, cold weights (us per layer):\n",
              g.hidden, g.n_v);
  print_bandwidth("chain: gemv gdn_in + gdn_step + gemv gdn_out", graph_time_us(chain, kIters), bytes);
  print_bandwidth("fused, every resident block",
                  graph_time_us([&](int i, cudaStream_t s) { return fused(i, s, 0); }, kIters), bytes);
}

}  // namespace
}  // namespace lily::cuda::test
