// attn_fused (src/cuda/kernels/attn_fused.cu): the full-attention decode layer as one persistent kernel, against the
// five-kernel chain as the decode step launches it (gemv attn_in with the RMSNorm prologue, attn_prep, attn_decode
// with prefetch_cache, attn_combine, gemv attn_out with the residual) and against the CPU, on fresh random weights
// at the model's geometry (16 query heads, 2 KV heads, D 256, rotary 64, H 2048) and the small preset's (8 / 1,
// H 1024), over consecutive steps (KV rows appended, h carried) from contexts around the split boundaries (66
// splits: 1,056 rows is 16 a split, 1,057 the first with 32) and a long one. The fused kernel runs the chain's code
// and summation orders for x, proj, q, k, the tiles, the merges, the combine and the out_proj, so every output
// should match the chain bit for bit (counts printed; asserted within 1e-6, since another FMA contraction of an
// inlined helper would change last bits without a bug). Any grid size gives the same bits. Then graph replays (the
// barrier ready again after every launch), argument checks, and a timing table (chain vs fused in graph replay, us
// per layer, at 4K and 32K).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "cuda/kernels/attention.cuh"
#include "cuda/kernels/dispatch.cuh"
#include "generic_refs.h"

namespace lily::cuda::test {
namespace {

constexpr int kSplits = 66;     // CudaBackend's attention_splits: 132 SMs / 2 KV heads
constexpr uint16_t kPoison = 0xFFFF;  // bf16 NaN in cache rows no kernel may read before writing them
constexpr unsigned kLowBits = 0x7FFFFFFFu;  // the barrier counter's arrival count (its top bit flips every launch)

// One attention layer's device weights.
struct DeviceLayer {
  explicit DeviceLayer(const Geometry& geo) : g(geo) {}
  Geometry g;
  QMatrix q_in, q_out;
  DeviceBuffer<float> d_input_norm, d_q_norm, d_k_norm;
};

// A layer with random weights kept on the host too.
struct Layer : DeviceLayer {
  HostQMatrix in_proj, out_proj;
  std::vector<float> input_norm, q_norm, k_norm;
  Layer(const Geometry& geo, uint32_t seed)
      : DeviceLayer(geo),
        in_proj(random_qmatrix(geo.attn_proj(), geo.hidden, 4, seed)),
        out_proj(random_qmatrix(geo.hidden, geo.nq * geo.head_dim, 4, seed + 1)),
        input_norm(random_vector(geo.hidden, seed + 2, 0.1f, 1.0f)),
        q_norm(random_vector(geo.head_dim, seed + 3, 0.1f, 1.0f)),
        k_norm(random_vector(geo.head_dim, seed + 4, 0.1f, 1.0f)) {
    q_in = in_proj.upload(), q_out = out_proj.upload();
    d_input_norm = DeviceBuffer<float>(input_norm);
    d_q_norm = DeviceBuffer<float>(q_norm), d_k_norm = DeviceBuffer<float>(k_norm);
  }
};

// KV caches of `cap` rows: rows < pos0 random bf16 (earlier steps), the rest poisoned.
std::vector<uint16_t> initial_cache(const Geometry& g, int cap, int pos0, uint32_t seed) {
  std::vector<uint16_t> c(static_cast<size_t>(cap) * g.nkv * g.head_dim, kPoison);
  const std::vector<float> r = random_vector(static_cast<size_t>(pos0) * g.nkv * g.head_dim, seed);
  for (size_t i = 0; i < r.size(); ++i) c[i] = to_bf16_bits(r[i]);
  return c;
}

// Device state and scratch of one sequence for one layer; step t runs at position pos0 + t.
struct State {
  int n_splits;
  DeviceBuffer<float> h, proj, q, part_o, part_ml, attn_out;
  DeviceBuffer<uint16_t> k, v;
  DeviceBuffer<int> pos;
  DeviceBuffer<unsigned> counter{1};
  State(const Geometry& g, const std::vector<float>& h0, DeviceBuffer<uint16_t> k0, DeviceBuffer<uint16_t> v0,
        int pos0, int steps, int splits)
      : n_splits(splits),
        h(h0),
        proj(g.attn_proj()),
        q(static_cast<size_t>(g.nq) * g.head_dim),
        part_o(static_cast<size_t>(splits) * g.nq * g.head_dim),
        part_ml(static_cast<size_t>(splits) * g.nq * 2),
        attn_out(static_cast<size_t>(g.nq) * g.head_dim),
        k(std::move(k0)),
        v(std::move(v0)) {
    std::vector<int> positions(steps);
    for (int t = 0; t < steps; ++t) positions[t] = pos0 + t;
    pos = DeviceBuffer<int>(positions);
    EXPECT_EQ(counter.zero(), cudaSuccess);
  }
  __nv_bfloat16* kc() const { return reinterpret_cast<__nv_bfloat16*>(k.get()); }
  __nv_bfloat16* vc() const { return reinterpret_cast<__nv_bfloat16*>(v.get()); }

  AttnFusedParams fused(const DeviceLayer& L, int step, int grid_blocks = 0) const {
    AttnFusedParams p;
    p.in_proj = L.q_in, p.out_proj = L.q_out, p.h = h.get(), p.input_norm = L.d_input_norm.get();
    p.q_norm = L.d_q_norm.get(), p.k_norm = L.d_k_norm.get();
    p.nq = L.g.nq, p.nkv = L.g.nkv, p.head_dim = L.g.head_dim, p.rotary_dim = L.g.rotary_dim;
    p.rope_theta = kTheta, p.eps = kEps, p.scale = 1.0f / std::sqrt(static_cast<float>(L.g.head_dim));
    p.pos = pos.get() + step, p.k_cache = kc(), p.v_cache = vc(), p.n_splits = n_splits;
    p.proj = proj.get(), p.part_o = part_o.get(), p.part_ml = part_ml.get(), p.attn_out = attn_out.get();
    p.barrier = counter.get(), p.prefetch_cache = true, p.grid_blocks = grid_blocks;
    return p;
  }

  // The chain as CudaBackend::enqueue_step launches it.
  cudaError_t chain(const DeviceLayer& L, int step, cudaStream_t stream) const {
    const Geometry& g = L.g;
    GemvParams in{L.q_in, h.get(), GemvPrologue::rms_norm, L.d_input_norm.get(), nullptr, 0, kEps, nullptr,
                  proj.get()};
    CUDA_TRY(dispatch::gemv(in, stream));
    AttnPrepParams prep{proj.get(), L.d_q_norm.get(), L.d_k_norm.get(), g.nq, g.nkv, g.head_dim, g.rotary_dim,
                        kTheta, kEps, pos.get() + step, q.get(), kc(), vc()};
    CUDA_TRY(dispatch::attn_prep(prep, stream));
    AttnDecodeParams dec{q.get(), kc(), vc(), g.nq, g.nkv, g.head_dim, pos.get() + step, n_splits,
                         1.0f / std::sqrt(static_cast<float>(g.head_dim)), part_o.get(), part_ml.get()};
    dec.prefetch_cache = true;
    CUDA_TRY(dispatch::attn_decode(dec, stream));
    AttnCombineParams comb{part_o.get(), part_ml.get(), n_splits, g.nq, g.head_dim, proj.get(), attn_out.get()};
    CUDA_TRY(dispatch::attn_combine(comb, stream));
    GemvParams out{L.q_out, attn_out.get(), GemvPrologue::none, nullptr, nullptr, 0, kEps, h.get(), h.get()};
    return dispatch::gemv(out, stream);
  }
};

struct Outputs {
  std::vector<float> h, proj, part_o, part_ml, attn_out;
  std::vector<uint16_t> k, v;
  unsigned counter;
};

Outputs download(const State& s) {
  return {s.h.download(),      s.proj.download(), s.part_o.download(), s.part_ml.download(),
          s.attn_out.download(), s.k.download(),  s.v.download(),      s.counter.download()[0]};
}

// Expected bit for bit (see the header); printed as a count, asserted within 1e-6 relative + absolute.
void expect_same_bits(const char* what, const std::vector<float>& got, const std::vector<float>& want, bool print) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t same = 0;
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(float)) == 0) {
      ++same;  // includes the -inf maxima of empty splits
    } else {
      expect_close(what, i, got[i], want[i], 1e-6 * std::fabs(want[i]) + 1e-6, bad);
    }
  }
  if (print) std::printf("%-9s fused vs chain: %zu of %zu bit-identical\n", what, same, got.size());
  EXPECT_EQ(bad, 0) << what;
}

// Eqs 2, 5, 7-12 on the CPU, each stage from the GPU's previous one (so tolerances do not compound): proj from
// x = RMSNorm(h) in double; the chain's q and the fused kernel's cache row pos from the CPU prep of the GPU's
// proj; attn_out from the CPU attention over the fused kernel's caches with the chain's q; h from the GPU's
// attn_out.
void expect_matches_cpu(const Layer& L, int pos, const std::vector<float>& h_in, const Outputs& got,
                        const std::vector<float>& chain_q) {
  const Geometry& g = L.g;
  const int D = g.head_dim;
  const std::vector<float> x = rms_norm_ref(h_in.data(), L.input_norm.data(), g.hidden);
  int bad = 0;
  for (int r = 0; r < g.attn_proj(); ++r) {
    const auto [ref, abs_sum] = qdot(L.in_proj, r, x.data());
    expect_close("proj vs cpu", r, got.proj[r], ref, 2e-5 * abs_sum + 1e-6, bad);
  }
  // Eqs 9-10; tolerances of CudaAttention.PrepNormRopeAppend (fp32 sums and sincosf vs double and glibc).
  for (int j = 0; j < g.nq; ++j) {
    std::vector<float> q = rms_norm_ref(&got.proj[static_cast<size_t>(j) * 2 * D], L.q_norm.data(), D);
    rope_ref(q.data(), g.rotary_dim, pos);
    for (int d = 0; d < D; ++d)
      expect_close("q vs cpu", j * D + d, chain_q[j * D + d], q[d], 3e-5 * std::max(1.0f, std::fabs(q[d])), bad);
  }
  for (int m = 0; m < g.nkv; ++m) {
    const float* k_src = &got.proj[static_cast<size_t>(g.nq) * 2 * D + m * D];
    const float* v_src = &got.proj[static_cast<size_t>(g.nq) * 2 * D + (g.nkv + m) * D];
    std::vector<float> k = rms_norm_ref(k_src, L.k_norm.data(), D);
    rope_ref(k.data(), g.rotary_dim, pos);
    const size_t row = (static_cast<size_t>(pos) * g.nkv + m) * D;
    for (int d = 0; d < D; ++d) {
      expect_close("k row vs cpu", d, bf16_bits_to_float(got.k[row + d]), k[d], std::fabs(k[d]) / 256 + 3e-5, bad);
      if (got.v[row + d] != to_bf16_bits(v_src[d]) && bad++ < 5) ADD_FAILURE() << "v row dim " << d;
    }
  }
  // Eqs 11-12 (test_attention.cpp's tolerance: hi+lo bf16 splits, fp32 accumulation).
  const std::vector<float> ref = attention_ref(g, pos + 1, got.k, got.v, chain_q, got.proj);
  for (size_t i = 0; i < ref.size(); ++i)
    expect_close("attn_out vs cpu", i, got.attn_out[i], ref[i], 1e-4 + 1e-4 * std::fabs(ref[i]), bad);
  for (int r = 0; r < g.hidden; ++r) {
    const auto [dot, abs_sum] = qdot(L.out_proj, r, got.attn_out.data());
    expect_close("h vs cpu", r, got.h[r], h_in[r] + dot, 2e-5 * (abs_sum + std::fabs(h_in[r])) + 1e-6, bad);
  }
  EXPECT_EQ(bad, 0);
}

// kSteps consecutive steps from context pos0 (KV rows appended, h carried) through the chain and the fused kernel
// on the full grid: every output against the chain and the CPU; then, from the same starting point, each step on
// the small grids must give the full grid's bits.
void check_layer(const Geometry& geo, uint32_t seed, int pos0, int n_splits, const std::vector<int>& grids) {
  SCOPED_TRACE(testing::Message() << geo.name << " pos0 " << pos0 << " n_splits " << n_splits);
  constexpr int kSteps = 3;
  const Layer L(geo, seed);
  const std::vector<float> h0 = random_vector(geo.hidden, seed + 10);
  const int cap = pos0 + kSteps + 16;
  const std::vector<uint16_t> k0 = initial_cache(geo, cap, pos0, seed + 11);
  const std::vector<uint16_t> v0 = initial_cache(geo, cap, pos0, seed + 12);
  auto make = [&] {
    return State(geo, h0, DeviceBuffer<uint16_t>(k0), DeviceBuffer<uint16_t>(v0), pos0, kSteps, n_splits);
  };
  State chain = make(), fused = make();
  std::vector<Outputs> fused_out;
  for (int t = 0; t < kSteps; ++t) {
    SCOPED_TRACE("step " + std::to_string(t));
    const std::vector<float> h_before = fused.h.download();
    ASSERT_CUDA(chain.chain(L, t, nullptr));
    ASSERT_CUDA(attn_fused(fused.fused(L, t), nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());
    const Outputs c = download(chain), f = download(fused);
    const bool print = t == 0 || t == kSteps - 1;
    if (print) std::printf("[%s] pos %d, %d splits\n", geo.name, pos0 + t, n_splits);
    expect_same_bits("proj", f.proj, c.proj, print);
    expect_same_bits("part_o", f.part_o, c.part_o, print);
    expect_same_bits("part_ml", f.part_ml, c.part_ml, print);
    expect_same_bits("attn_out", f.attn_out, c.attn_out, print);
    expect_same_bits("h", f.h, c.h, print);
    EXPECT_TRUE(f.k == c.k) << "k cache differs from the chain's";
    EXPECT_TRUE(f.v == c.v) << "v cache differs from the chain's";
    EXPECT_EQ(f.counter & kLowBits, 0u) << "the barrier's arrival count must be back at zero";
    expect_matches_cpu(L, pos0 + t, h_before, f, chain.q.download());
    fused_out.push_back(f);
  }
  for (int blocks : grids) {
    SCOPED_TRACE(testing::Message() << blocks << " blocks");
    State few = make();
    for (int t = 0; t < kSteps; ++t) {
      ASSERT_CUDA(attn_fused(few.fused(L, t, blocks), nullptr));
      ASSERT_CUDA(cudaDeviceSynchronize());
      const Outputs f = download(few);
      EXPECT_EQ(f.proj, fused_out[t].proj) << "step " << t;
      EXPECT_TRUE(f.part_o == fused_out[t].part_o) << "step " << t;
      EXPECT_EQ(f.attn_out, fused_out[t].attn_out) << "step " << t;
      EXPECT_EQ(f.h, fused_out[t].h) << "step " << t;
      EXPECT_TRUE(f.k == fused_out[t].k && f.v == fused_out[t].v) << "step " << t;
      EXPECT_EQ(f.counter & kLowBits, 0u) << "step " << t;
    }
  }
}

// Contexts (rows cached before the first step; step t attends pos0 + t + 1 rows): empty, one row, a tile boundary,
// 1054 and 1055 (the steps attend 1,055-1,058 rows: 66 x 16 = 1,056 rows is the last count with 16 rows a split),
// 4K and 32K.
TEST(CudaAttnFused, ModelGeometryMatchesChainAndCpu) {
  SKIP_WITHOUT_GPU();
  for (int pos0 : {0, 1, 255, 1054, 1055, 4096, 32767})
    check_layer(kFull, 101 + pos0, pos0, kSplits, pos0 == 255 || pos0 == 4096 ? std::vector<int>{1, 5, 67}
                                                                              : std::vector<int>{});
}

TEST(CudaAttnFused, SmallGeometryMatchesChainAndCpu) {
  SKIP_WITHOUT_GPU();
  for (int n_splits : {1, 7, kSplits})
    for (int pos0 : {0, 100, 2000}) check_layer(kSmall, 201 + pos0, pos0, n_splits, {1, 3});
}

// Two fused layers back to back (PDL between them; separate caches and scratch, as the decode step's layers)
// captured once in a graph and replayed 5 times: replay n must give the bits of the same two launches run eagerly
// for the n-th time, and leave the barrier's arrival count at zero.
TEST(CudaAttnFused, GraphReplayLeavesTheBarrierReady) {
  SKIP_WITHOUT_GPU();
  constexpr int kReplays = 5, kPos = 300;
  for (const Geometry& g : {kFull, kSmall}) {
    SCOPED_TRACE(g.name);
    const Layer L(g, 301);
    const std::vector<float> h0 = random_vector(g.hidden, 302);
    const std::vector<uint16_t> k0 = initial_cache(g, kPos + 16, kPos, 303);
    const std::vector<uint16_t> v0 = initial_cache(g, kPos + 16, kPos, 304);
    auto make = [&] {
      return State(g, h0, DeviceBuffer<uint16_t>(k0), DeviceBuffer<uint16_t>(v0), kPos, 1, kSplits);
    };
    State eager_a = make(), eager_b = make(), a = make(), b = make();
    // Both layers work on layer a's h (the residual stream); b has its own caches and scratch.
    auto second = [&](const State& first, const State& own) {
      AttnFusedParams p = own.fused(L, 0);
      p.h = first.h.get();
      return p;
    };
    std::vector<std::vector<float>> want_h, want_out;
    for (int replay = 0; replay < kReplays; ++replay) {
      ASSERT_CUDA(attn_fused(eager_a.fused(L, 0), nullptr));
      ASSERT_CUDA(attn_fused(second(eager_a, eager_b), nullptr));
      ASSERT_CUDA(cudaDeviceSynchronize());
      want_h.push_back(eager_a.h.download());
      want_out.push_back(eager_b.attn_out.download());
    }
    cudaStream_t stream;
    ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    const cudaError_t e1 = attn_fused(a.fused(L, 0), stream), e2 = attn_fused(second(a, b), stream);
    ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
    ASSERT_CUDA(e1);
    ASSERT_CUDA(e2);
    ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    for (int replay = 0; replay < kReplays; ++replay) {
      ASSERT_CUDA(cudaGraphLaunch(exec, stream));
      ASSERT_CUDA(cudaStreamSynchronize(stream));
      EXPECT_EQ(a.h.download(), want_h[replay]) << "replay " << replay;
      EXPECT_EQ(b.attn_out.download(), want_out[replay]) << "replay " << replay;
      EXPECT_EQ(a.counter.download()[0] & kLowBits, 0u) << "replay " << replay;
      EXPECT_EQ(b.counter.download()[0] & kLowBits, 0u) << "replay " << replay;
    }
    ASSERT_CUDA(cudaGraphExecDestroy(exec));
    ASSERT_CUDA(cudaGraphDestroy(graph));
    ASSERT_CUDA(cudaStreamDestroy(stream));
  }
}

TEST(CudaAttnFused, RejectsBadArguments) {
  SKIP_WITHOUT_GPU();
  AttnFusedParams none;
  EXPECT_FALSE(attn_fused_supported(none));
  EXPECT_EQ(attn_fused(none, nullptr), cudaErrorInvalidValue);
  const Layer L(kSmall, 501);
  const std::vector<uint16_t> k0 = initial_cache(kSmall, 32, 8, 503);
  State s(kSmall, random_vector(kSmall.hidden, 502), DeviceBuffer<uint16_t>(k0), DeviceBuffer<uint16_t>(k0), 8, 1,
          kSplits);
  AttnFusedParams p = s.fused(L, 0);
  EXPECT_TRUE(attn_fused_supported(p));
  p.grid_blocks = 1 << 20;  // more blocks than can be resident: the barriers would never open
  EXPECT_EQ(attn_fused(p, nullptr), cudaErrorCooperativeLaunchTooLarge);
  p = s.fused(L, 0);
  p.barrier = nullptr;
  EXPECT_EQ(attn_fused(p, nullptr), cudaErrorInvalidValue);
  p = s.fused(L, 0);
  p.head_dim = 128;  // not the decode kernel's head_dim
  EXPECT_EQ(attn_fused(p, nullptr), cudaErrorInvalidValue);
  p = s.fused(L, 0);
  p.attn_out += 1;  // attn_out must be 16-byte aligned
  EXPECT_EQ(attn_fused(p, nullptr), cudaErrorInvalidValue);
  p = s.fused(L, 0);
  p.in_proj.rows -= 1;  // not q|gate, k, v of this geometry
  EXPECT_EQ(attn_fused(p, nullptr), cudaErrorInvalidValue);
  p = s.fused(L, 0);
  p.n_splits = 0;
  EXPECT_EQ(attn_fused(p, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// The model's attention layer from cold weights (a different in/out_proj copy per call) and 10 rotating caches (as
// the 10 layers of a step) at 4K and 32K, in CUDA-graph replay: the chain (5 kernels) against the fused kernel on
// every resident block. Prints us per layer; asserts nothing about speed.
TEST(CudaAttnFusedBench, FullSize) {
  SKIP_WITHOUT_GPU();
  const Geometry& g = kFull;
  constexpr int kLayers = 10, kIters = 60;
  const DeviceBuffer<uint16_t> pool = bench_pool(size_t{1} << 30);
  DeviceLayer L(g);
  L.d_input_norm = DeviceBuffer<float>(random_vector(g.hidden, 602, 0.1f, 1.0f));
  L.d_q_norm = DeviceBuffer<float>(random_vector(g.head_dim, 603, 0.1f, 1.0f));
  L.d_k_norm = DeviceBuffer<float>(random_vector(g.head_dim, 604, 0.1f, 1.0f));
  DeviceBuffer<float> h(random_vector(g.hidden, 605));
  std::printf("\nattention decode layer H %d, %d/%d heads, D %d, %d splits, graph replay, cold weights "
              "(us per layer):\n", g.hidden, g.nq, g.nkv, g.head_dim, kSplits);
  for (int ctx : {4096, 32768}) {
    const size_t cache_elems = (static_cast<size_t>(ctx) + 16) * g.nkv * g.head_dim;
    std::vector<State> states;
    auto filled = [&] {  // bf16 0x3C3C = 0.0115 everywhere: valid rows for the kernels to read
      DeviceBuffer<uint16_t> c(cache_elems);
      EXPECT_EQ(cudaMemset(c.get(), 0x3C, cache_elems * 2), cudaSuccess);
      return c;
    };
    for (int i = 0; i < kLayers; ++i)
      states.emplace_back(g, random_vector(g.hidden, 606), filled(), filled(), ctx, 1, kSplits);
    auto weights = [&](int i) {  // copy i of both projections, out of the 1 GB pool
      L.q_in = bench_qmatrix(pool, g.attn_proj(), g.hidden, 4, 2 * i);
      L.q_out = bench_qmatrix(pool, g.hidden, g.nq * g.head_dim, 4, 2 * i + 1);
    };
    auto chain = [&](int i, cudaStream_t s) {
      weights(i);
      const State& st = states[i % kLayers];
      GemvParams in{L.q_in, h.get(), GemvPrologue::rms_norm, L.d_input_norm.get(), nullptr, 0, kEps, nullptr,
                    st.proj.get()};
      CUDA_TRY(dispatch::gemv(in, s));
      AttnPrepParams prep{st.proj.get(), L.d_q_norm.get(), L.d_k_norm.get(), g.nq, g.nkv, g.head_dim, g.rotary_dim,
                          kTheta, kEps, st.pos.get(), st.q.get(), st.kc(), st.vc()};
      CUDA_TRY(dispatch::attn_prep(prep, s));
      AttnDecodeParams dec{st.q.get(), st.kc(), st.vc(), g.nq, g.nkv, g.head_dim, st.pos.get(), kSplits,
                           1.0f / std::sqrt(static_cast<float>(g.head_dim)), st.part_o.get(), st.part_ml.get()};
      dec.prefetch_cache = true;
      CUDA_TRY(dispatch::attn_decode(dec, s));
      AttnCombineParams comb{st.part_o.get(), st.part_ml.get(), kSplits, g.nq, g.head_dim, st.proj.get(),
                             st.attn_out.get()};
      CUDA_TRY(dispatch::attn_combine(comb, s));
      GemvParams out{L.q_out, st.attn_out.get(), GemvPrologue::none, nullptr, nullptr, 0, kEps, h.get(), h.get()};
      return dispatch::gemv(out, s);
    };
    auto fused = [&](int i, cudaStream_t s) {
      weights(i);
      AttnFusedParams p = states[i % kLayers].fused(L, 0);
      p.h = h.get();
      return attn_fused(p, s);
    };
    weights(0);
    const double bytes =
        static_cast<double>(L.q_in.bytes() + L.q_out.bytes()) + 2.0 * (ctx + 1) * g.nkv * g.head_dim * 2;
    char label[96];
    std::snprintf(label, sizeof label, "context %d: chain (5 kernels)", ctx);
    print_bandwidth(label, graph_time_us(chain, kIters), bytes);
    std::snprintf(label, sizeof label, "context %d: fused, every resident block", ctx);
    print_bandwidth(label, graph_time_us(fused, kIters), bytes);
  }
}

}  // namespace
}  // namespace lily::cuda::test
