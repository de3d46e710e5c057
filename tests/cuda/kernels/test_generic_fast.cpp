// The generic decode kernels (generic.cuh) against the fast ones on the full model geometry (they must agree to
// fp32 rounding), and the *_fast_supported predicates against what the fast launchers really accept.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "cuda/kernels/generic.cuh"
#include "generic_refs.h"

namespace lily::cuda::test {
namespace {

// ---- gemv ----------------------------------------------------------------------------------------------------

void gemv_fast_vs_generic(int rows, int cols, int bits, GemvPrologue prologue, bool residual, uint32_t seed) {
  SCOPED_TRACE(testing::Message() << "rows " << rows << " cols " << cols << " bits " << bits);
  const int head_dim = 128;
  HostQMatrix hm = random_qmatrix(rows, cols, bits, seed);
  const std::vector<float> in = random_vector(cols, seed + 1), z = random_vector(cols, seed + 2);
  const std::vector<float> norm_w =
      random_vector(prologue == GemvPrologue::gated_rms_norm ? head_dim : cols, seed + 3, 0.1f, 1.0f);
  const std::vector<float> res = random_vector(rows, seed + 4);
  DeviceBuffer<float> d_in(in), d_z(z), d_norm(norm_w), y_fast(res), y_gen(res);
  GemvParams p;
  p.m = hm.upload();
  p.in = d_in.get(), p.prologue = prologue, p.norm_w = d_norm.get(), p.gate_z = d_z.get(), p.head_dim = head_dim;
  p.residual = residual ? y_fast.get() : nullptr, p.y = y_fast.get();
  ASSERT_TRUE(gemv_fast_supported(p));
  ASSERT_CUDA(gemv(p, nullptr));
  p.residual = residual ? y_gen.get() : nullptr, p.y = y_gen.get();
  ASSERT_CUDA(gemv_generic(p, nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
  const auto a = y_fast.download(), b = y_gen.download();
  const std::vector<float> x = gemv_x_ref(prologue, in, norm_w, z, head_dim);
  int bad = 0;
  for (int r = 0; r < rows; ++r) {  // each within 2e-5 of the sum of |terms| of the exact value
    const double abs_sum = qdot(hm, r, x.data()).second;
    expect_close("y", r, b[r], a[r], 4e-5 * abs_sum + 2e-6 * (std::fabs(res[r]) + 1), bad);
  }
  EXPECT_EQ(bad, 0);
}

TEST(CudaGenericVsFast, Gemv) {
  SKIP_WITHOUT_GPU();
  const Geometry& g = kFull;
  gemv_fast_vs_generic(g.gdn_proj(), g.hidden, 4, GemvPrologue::rms_norm, false, 10);
  gemv_fast_vs_generic(g.hidden, g.value_dim(), 4, GemvPrologue::gated_rms_norm, true, 20);
  gemv_fast_vs_generic(g.hidden, g.inter, 4, GemvPrologue::none, true, 30);
  gemv_fast_vs_generic(g.n_experts + 1, g.hidden, 8, GemvPrologue::rms_norm, false, 40);
}

// ---- MoE -----------------------------------------------------------------------------------------------------

TEST(CudaGenericVsFast, Moe) {
  SKIP_WITHOUT_GPU();
  const int E = kFull.n_experts, H = kFull.hidden, I = kFull.inter, k = kFull.top_k;
  const int E_stack = 12;  // stacked expert weights: fewer than E keeps the host quantization quick
  HostQMatrix router = random_qmatrix(E, H, 8, 50), sgate = random_qmatrix(1, H, 8, 51);
  HostQMatrix gate = random_qmatrix(E_stack * I, H, 4, 52), up = random_qmatrix(E_stack * I, H, 4, 53);
  HostQMatrix down = random_qmatrix(E_stack * H, I, 4, 54), s_gate = random_qmatrix(I, H, 4, 55);
  HostQMatrix s_up = random_qmatrix(I, H, 4, 56), s_down = random_qmatrix(H, I, 4, 57);
  const std::vector<float> h = random_vector(H, 58), norm_w = random_vector(H, 59, 0.1f, 1.0f);
  std::vector<int> idx(k);
  for (int i = 0; i < k; ++i) idx[i] = (i * 5 + 7) % E_stack;  // distinct
  const std::vector<float> w = {0.3f, 0.2f, 0.15f, 0.1f, 0.1f, 0.07f, 0.05f, 0.03f};
  DeviceBuffer<float> d_h(h), d_norm(norm_w);
  DeviceBuffer<unsigned> counter(1);
  ASSERT_CUDA(counter.zero());
  struct Out {
    DeviceBuffer<float> x, logits, w, sg, act, h;
    DeviceBuffer<int> idx;
  };
  Out out[2];  // 0: fast, 1: generic
  MoeRouteParams rp;
  rp.router = router.upload(), rp.shared_gate = sgate.upload(), rp.h = d_h.get(), rp.norm_w = d_norm.get();
  rp.top_k = k, rp.counter = counter.get();
  MoeExpertInParams ip;
  ip.gate = gate.upload(), ip.up = up.upload(), ip.shared_gate = s_gate.upload(), ip.shared_up = s_up.upload();
  ip.gate.rows = ip.up.rows = I, ip.top_k = k;
  MoeExpertOutParams op;
  op.down = down.upload(), op.shared_down = s_down.upload(), op.top_k = k;
  op.down.rows = H;
  const std::vector<float> act_in = random_vector((k + 1) * I, 60), x_in = random_vector(H, 61);
  for (int v = 0; v < 2; ++v) {
    Out& o = out[v];
    o.x = DeviceBuffer<float>(H), o.logits = DeviceBuffer<float>(E), o.w = DeviceBuffer<float>(w);
    o.sg = DeviceBuffer<float>(std::vector<float>{0.4f}), o.act = DeviceBuffer<float>((k + 1) * I);
    o.h = DeviceBuffer<float>(h), o.idx = DeviceBuffer<int>(k);
    rp.x = o.x.get(), rp.logits = o.logits.get(), rp.topk_idx = o.idx.get(), rp.topk_w = o.w.get();
    rp.shared_gate_value = o.sg.get();
    ASSERT_TRUE(moe_fast_supported(rp));
    ASSERT_CUDA(v == 0 ? moe_route(rp, nullptr) : moe_route_generic(rp, nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());
    // The experts run on fixed inputs (x, the expert list, act): the routing is compared separately below, and
    // its random top-8 lies outside the 12 stacked experts.
    DeviceBuffer<float> d_x(x_in);
    DeviceBuffer<int> d_idx(idx);
    ip.x = d_x.get(), ip.topk_idx = d_idx.get(), ip.act = o.act.get();
    ASSERT_TRUE(moe_fast_supported(ip));
    ASSERT_CUDA(v == 0 ? moe_expert_in(ip, nullptr) : moe_expert_in_generic(ip, nullptr));
    DeviceBuffer<float> d_act(act_in), d_w(w), d_sg(std::vector<float>{0.4f});
    op.act = d_act.get(), op.topk_idx = d_idx.get(), op.topk_w = d_w.get(), op.shared_gate_value = d_sg.get();
    op.h = o.h.get();
    ASSERT_TRUE(moe_fast_supported(op));
    ASSERT_CUDA(v == 0 ? moe_expert_out(op, nullptr) : moe_expert_out_generic(op, nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());
  }
  EXPECT_EQ(counter.download()[0], 0u);
  const std::vector<float> x_ref = rms_norm_ref(h.data(), norm_w.data(), H);
  int bad = 0;
  const auto xa = out[0].x.download(), xb = out[1].x.download();
  for (int i = 0; i < H; ++i) expect_close("x", i, xb[i], xa[i], 2e-5 * (std::fabs(xa[i]) + 1), bad);
  const auto la = out[0].logits.download(), lb = out[1].logits.download();
  for (int e = 0; e < E; ++e) expect_close("logit", e, lb[e], la[e], 4e-5 * qdot(router, e, x_ref.data()).second + 2e-6, bad);
  EXPECT_EQ(out[0].idx.download(), out[1].idx.download());
  const auto wa = out[0].w.download(), wb = out[1].w.download();
  for (int i = 0; i < k; ++i) expect_close("topk_w", i, wb[i], wa[i], 2e-5 * wa[i] + 1e-7, bad);
  expect_close("sg", 0, out[1].sg.download()[0], out[0].sg.download()[0], 4e-5 * qdot(sgate, 0, x_ref.data()).second + 2e-6, bad);
  const auto aa = out[0].act.download(), ab = out[1].act.download();
  for (int s = 0; s <= k; ++s)
    for (int r = 0; r < I; ++r) {
      const int row = s < k ? idx[s] * I + r : r;
      const auto [gd, g_abs] = qdot(s < k ? gate : s_gate, row, x_in.data());
      const auto [ud, u_abs] = qdot(s < k ? up : s_up, row, x_in.data());
      // Each dot within 2e-5 of its sum of |terms| on both sides; silu' <= 1.1.
      const double tol = 4e-5 * (1.1 * std::fabs(ud) * g_abs + std::fabs(silu_d(gd)) * u_abs) + 2e-6;
      expect_close("act", s * I + r, ab[s * I + r], aa[s * I + r], tol, bad);
    }
  const auto ha = out[0].h.download(), hb = out[1].h.download();
  for (int r = 0; r < H; ++r) {
    double bound = 0;
    for (int s = 0; s <= k; ++s)
      bound += (s < k ? w[s] : 0.4) * qdot(s < k ? down : s_down, s < k ? idx[s] * H + r : r, &act_in[s * I]).second;
    expect_close("h", r, hb[r], ha[r], 4e-5 * bound + 2e-6 * (std::fabs(h[r]) + 1), bad);
  }
  EXPECT_EQ(bad, 0);
}

// ---- attention -----------------------------------------------------------------------------------------------

TEST(CudaGenericVsFast, Attention) {
  SKIP_WITHOUT_GPU();
  const Geometry& g = kFull;
  const int D = g.head_dim, n = 3000, pos = n - 1;
  const size_t row = static_cast<size_t>(g.nkv) * D;
  const auto proj = random_vector(g.attn_proj(), 70);
  const auto q_norm = random_vector(D, 71, 0.1f, 1.0f), k_norm = random_vector(D, 72, 0.1f, 1.0f);
  // Rows 0..pos-1: random bf16; row pos is appended by attn_prep (each variant into its own copy).
  std::vector<uint16_t> k(n * row), v(n * row);
  const auto kf = random_vector(n * row, 73), vf = random_vector(n * row, 74);
  for (size_t i = 0; i < n * row; ++i) k[i] = to_bf16_bits(kf[i]), v[i] = to_bf16_bits(vf[i]);
  DeviceBuffer<float> d_proj(proj), d_qn(q_norm), d_kn(k_norm);
  DeviceBuffer<int> d_pos(std::vector<int>{pos});
  DeviceBuffer<float> q[2] = {DeviceBuffer<float>(g.nq * D), DeviceBuffer<float>(g.nq * D)};
  DeviceBuffer<uint16_t> kc[2] = {DeviceBuffer<uint16_t>(k), DeviceBuffer<uint16_t>(k)};
  DeviceBuffer<uint16_t> vc[2] = {DeviceBuffer<uint16_t>(v), DeviceBuffer<uint16_t>(v)};
  for (int variant = 0; variant < 2; ++variant) {  // 0: fast, 1: generic
    const AttnPrepParams pp{d_proj.get(), d_qn.get(), d_kn.get(), g.nq, g.nkv, D, g.rotary_dim, kTheta, kEps,
                            d_pos.get(), q[variant].get(), reinterpret_cast<__nv_bfloat16*>(kc[variant].get()),
                            reinterpret_cast<__nv_bfloat16*>(vc[variant].get())};
    ASSERT_TRUE(attn_fast_supported(pp));
    ASSERT_CUDA(variant == 0 ? attn_prep(pp, nullptr) : attn_prep_generic(pp, nullptr));
  }
  ASSERT_CUDA(cudaDeviceSynchronize());
  int bad = 0;
  const auto qa = q[0].download(), qb = q[1].download();
  for (size_t i = 0; i < qa.size(); ++i) expect_close("q", i, qb[i], qa[i], 6e-5 * std::max(1.0f, std::fabs(qa[i])), bad);
  const auto ka = kc[0].download(), kb = kc[1].download(), va = vc[0].download(), vb = vc[1].download();
  for (size_t i = pos * row; i < n * row; ++i) {  // adjacent bf16 values at most (both round ~equal fp32 values)
    const float a = bf16_bits_to_float(ka[i]);
    expect_close("k", i, bf16_bits_to_float(kb[i]), a, std::fabs(a) / 128 + 6e-5, bad);
  }
  EXPECT_TRUE(std::equal(ka.begin(), ka.begin() + pos * row, kb.begin())) << "rows before pos must be untouched";
  EXPECT_EQ(va, vb);
  EXPECT_EQ(bad, 0);

  // Decode + combine on the fast kernels' cache, all four pairings, against the double reference and each other.
  const auto ref = attention_ref(g, n, ka, va, qa, proj);
  for (int n_splits : {1, 7, 66}) {
    DeviceBuffer<float> part_o[2] = {DeviceBuffer<float>(size_t{1} * n_splits * g.nq * D),
                                     DeviceBuffer<float>(size_t{1} * n_splits * g.nq * D)};
    DeviceBuffer<float> part_ml[2] = {DeviceBuffer<float>(n_splits * g.nq * 2), DeviceBuffer<float>(n_splits * g.nq * 2)};
    for (int dec = 0; dec < 2; ++dec) {
      const AttnDecodeParams dp{q[0].get(), reinterpret_cast<const __nv_bfloat16*>(kc[0].get()),
                                reinterpret_cast<const __nv_bfloat16*>(vc[0].get()), g.nq, g.nkv, D, d_pos.get(),
                                n_splits, 1.0f / 16.0f, part_o[dec].get(), part_ml[dec].get()};
      ASSERT_TRUE(attn_fast_supported(dp));
      ASSERT_CUDA(dec == 0 ? attn_decode(dp, nullptr) : attn_decode_generic(dp, nullptr));
    }
    std::vector<float> outs[4];
    for (int pair = 0; pair < 4; ++pair) {
      const int dec = pair / 2, comb = pair % 2;
      DeviceBuffer<float> out(g.nq * D);
      const AttnCombineParams cp{part_o[dec].get(), part_ml[dec].get(), n_splits, g.nq, D, d_proj.get(), out.get()};
      ASSERT_TRUE(attn_fast_supported(cp));
      ASSERT_CUDA(comb == 0 ? attn_combine(cp, nullptr) : attn_combine_generic(cp, nullptr));
      ASSERT_CUDA(cudaDeviceSynchronize());
      outs[pair] = out.download();
    }
    for (int pair = 0; pair < 4; ++pair) {
      SCOPED_TRACE(testing::Message() << "n_splits " << n_splits << " decode " << (pair / 2 ? "generic" : "fast")
                                      << " combine " << (pair % 2 ? "generic" : "fast"));
      // The fast kernel is within 1e-4 of the double reference (test_attention.cpp), the generic within 2e-5.
      for (size_t i = 0; i < ref.size(); ++i) {
        expect_close("out vs ref", i, outs[pair][i], ref[i], 1e-4 + 1e-4 * std::fabs(ref[i]), bad);
        expect_close("out vs fast", i, outs[pair][i], outs[0][i], 1.2e-4 + 1.2e-4 * std::fabs(ref[i]), bad);
      }
    }
  }
  EXPECT_EQ(bad, 0);
}

// ---- Gated DeltaNet ------------------------------------------------------------------------------------------

TEST(CudaGenericVsFast, Gdn) {
  SKIP_WITHOUT_GPU();
  const Geometry& g = kFull;
  constexpr int kSteps = 6;
  GdnRef ref(g, 80);  // only for its random weights
  std::vector<int> positions(kSteps);
  for (int t = 0; t < kSteps; ++t) positions[t] = t;
  DeviceBuffer<float> d_proj(g.gdn_proj()), conv_w(ref.conv_w), A_log(ref.A_log), dt_bias(ref.dt_bias);
  DeviceBuffer<int> d_pos(positions);
  DeviceBuffer<float> ring[2], S[2], o[2];
  for (int v = 0; v < 2; ++v) {
    ring[v] = DeviceBuffer<float>(size_t{1} * kConvKernel * g.conv_dim()), S[v] = DeviceBuffer<float>(ref.S.size());
    o[v] = DeviceBuffer<float>(g.value_dim());
    ASSERT_CUDA(ring[v].zero());
    ASSERT_CUDA(S[v].zero());
  }
  int bad = 0;
  for (int t = 0; t < kSteps; ++t) {
    ASSERT_CUDA(d_proj.upload(random_vector(g.gdn_proj(), 90 + t)));
    for (int v = 0; v < 2; ++v) {
      const GdnStepParams p{d_proj.get(), ring[v].get(), conv_w.get(), A_log.get(), dt_bias.get(), S[v].get(),
                            d_pos.get() + t, g.n_k, g.n_v, g.d_k, g.d_v, kConvKernel, o[v].get()};
      ASSERT_TRUE(gdn_fast_supported(p));
      ASSERT_CUDA(v == 0 ? gdn_step(p, nullptr) : gdn_step_generic(p, nullptr));
    }
    ASSERT_CUDA(cudaDeviceSynchronize());
    const auto a = o[0].download(), b = o[1].download();
    // Both fp32; they differ in summation order (the fast kernel: S'^T q + e (k.q), tree sums): 1e-4 as in
    // test_gdn.cpp, far below an indexing error (~|o|).
    for (size_t i = 0; i < a.size(); ++i) expect_close("o", i, b[i], a[i], 1e-4 + 1e-4 * std::fabs(a[i]), bad);
  }
  const auto sa = S[0].download(), sb = S[1].download();
  for (size_t i = 0; i < sa.size(); ++i) expect_close("S", i, sb[i], sa[i], 1e-4 + 1e-4 * std::fabs(sa[i]), bad);
  EXPECT_EQ(ring[0].download(), ring[1].download());
  EXPECT_EQ(bad, 0);
}

}  // namespace
}  // namespace lily::cuda::test
