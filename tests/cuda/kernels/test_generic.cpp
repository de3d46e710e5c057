// The generic decode kernels (src/cuda/kernels/generic.cuh) against plain CPU references (generic_refs.h) on the
// tiny and small synthetic geometries (src/model/synth.cpp), on fresh random inputs and random MLX-quantized
// weights. The generic-vs-fast comparison at full size and the predicate check are in test_generic_fast.cpp.
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "cpu/blocks.h"
#include "cuda/kernels/generic.cuh"
#include "generic_refs.h"

namespace lily::cuda::test {
namespace {

// ---- gemv ----------------------------------------------------------------------------------------------------

struct GemvCase {
  int rows, cols, bits;
  GemvPrologue prologue;
  int head_dim;  // gated_rms_norm
  bool residual;
};

void check_gemv(const GemvCase& c, uint32_t seed) {
  SCOPED_TRACE(testing::Message() << "rows " << c.rows << " cols " << c.cols << " bits " << c.bits << " prologue "
                                  << static_cast<int>(c.prologue) << " residual " << c.residual);
  HostQMatrix hm = random_qmatrix(c.rows, c.cols, c.bits, seed);
  const std::vector<float> in = random_vector(c.cols, seed + 1), z = random_vector(c.cols, seed + 3);
  const std::vector<float> norm_w =
      random_vector(c.prologue == GemvPrologue::gated_rms_norm ? c.head_dim : c.cols, seed + 2, 0.1f, 1.0f);
  const std::vector<float> residual = random_vector(c.rows, seed + 4);
  DeviceBuffer<float> d_in(in), d_norm(norm_w), d_z(z), d_y(residual);
  GemvParams p;
  p.m = hm.upload();
  p.in = d_in.get();
  p.prologue = c.prologue;
  p.norm_w = d_norm.get();
  p.gate_z = d_z.get();
  p.head_dim = c.head_dim;
  p.residual = c.residual ? d_y.get() : nullptr;  // aliases y, as the decode step's residual adds
  p.y = d_y.get();
  ASSERT_CUDA(gemv_generic(p, nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<float> y = d_y.download();
  const std::vector<float> x = gemv_x_ref(c.prologue, in, norm_w, z, c.head_dim);
  int bad = 0;
  for (int r = 0; r < c.rows; ++r) {
    const auto [dot, abs_sum] = qdot(hm, r, x.data());
    const double base = c.residual ? residual[r] : 0.0;
    // fp32 accumulation (a lane sums cols/32/8 words in order, then a 32-lane tree): well within 2e-5 of the
    // sum of |terms|; the prologue (fp32 sums of squares, expf) adds ~1e-6 relative. A wrong nibble, group or
    // scale is ~1e-2 of the sum.
    expect_close("y", r, y[r], base + dot, 2e-5 * abs_sum + 1e-6 * (std::fabs(base) + 1), bad);
  }
  EXPECT_EQ(bad, 0);
}

// Every matrix of a decode step at the geometry (docs/MODEL.md: fused in-projections, gated out-projections).
void check_gemv_geometry(const Geometry& g, int lm_rows, uint32_t seed) {
  SCOPED_TRACE(g.name);
  check_gemv({g.gdn_proj(), g.hidden, 4, GemvPrologue::rms_norm, 0, false}, seed);               // GDN in_proj
  check_gemv({g.hidden, g.value_dim(), 4, GemvPrologue::gated_rms_norm, g.d_v, true}, seed + 10);  // GDN out_proj
  check_gemv({g.attn_proj(), g.hidden, 4, GemvPrologue::rms_norm, 0, false}, seed + 20);         // attention in
  check_gemv({g.hidden, g.nq * g.head_dim, 4, GemvPrologue::none, 0, true}, seed + 30);          // o_proj
  check_gemv({lm_rows, g.hidden, 4, GemvPrologue::rms_norm, 0, false}, seed + 40);               // lm_head
  check_gemv({g.n_experts, g.hidden, 8, GemvPrologue::rms_norm, 0, false}, seed + 50);           // router, 8-bit
}

TEST(CudaGeneric, GemvTinyGeometry) {
  SKIP_WITHOUT_GPU();
  check_gemv_geometry(kTiny, 151936, 100);  // the full vocabulary: rows >> the grid (grid-stride loop)
}

TEST(CudaGeneric, GemvSmallGeometry) {
  SKIP_WITHOUT_GPU();
  check_gemv_geometry(kSmall, 5003, 200);
}

TEST(CudaGeneric, GemvOddShapes) {
  SKIP_WITHOUT_GPU();
  check_gemv({1, 64, 4, GemvPrologue::none, 0, false}, 300);
  check_gemv({3, 192, 8, GemvPrologue::gated_rms_norm, 64, true}, 301);
  check_gemv({37, 320, 4, GemvPrologue::gated_rms_norm, 32, false}, 302);  // head_dim 32: 10 heads, 8 warps
  check_gemv({50, 16384, 4, GemvPrologue::rms_norm, 0, true}, 303);      // 64 KiB of x: opt-in shared memory
}

TEST(CudaGeneric, RejectsBadShapes) {
  GemvParams gp;  // null pointers
  EXPECT_EQ(gemv_generic(gp, nullptr), cudaErrorInvalidValue);
  EXPECT_FALSE(gemv_fast_supported(gp));
  MoeRouteParams rp;
  EXPECT_EQ(moe_route_generic(rp, nullptr), cudaErrorInvalidValue);
  MoeExpertInParams ip;
  EXPECT_EQ(moe_expert_in_generic(ip, nullptr), cudaErrorInvalidValue);
  MoeExpertOutParams op;
  EXPECT_EQ(moe_expert_out_generic(op, nullptr), cudaErrorInvalidValue);
  AttnPrepParams pp;
  EXPECT_EQ(attn_prep_generic(pp, nullptr), cudaErrorInvalidValue);
  AttnDecodeParams dp;
  EXPECT_EQ(attn_decode_generic(dp, nullptr), cudaErrorInvalidValue);
  AttnCombineParams cp;
  EXPECT_EQ(attn_combine_generic(cp, nullptr), cudaErrorInvalidValue);
  GdnStepParams sp;
  EXPECT_EQ(gdn_step_generic(sp, nullptr), cudaErrorInvalidValue);
}

// ---- MoE -----------------------------------------------------------------------------------------------------

void check_route(const Geometry& g, uint32_t seed) {
  const int E = g.n_experts, H = g.hidden, k = g.top_k;
  HostQMatrix router = random_qmatrix(E, H, 8, seed), shared_gate = random_qmatrix(1, H, 8, seed + 1);
  const std::vector<float> h = random_vector(H, seed + 2), norm_w = random_vector(H, seed + 3, 0.1f, 1.0f);
  DeviceBuffer<float> d_h(h), d_norm(norm_w), d_x(H), d_logits(E), d_w(k), d_sg(1);
  DeviceBuffer<int> d_idx(k);
  DeviceBuffer<unsigned> d_counter(1);
  ASSERT_CUDA(d_counter.zero());
  MoeRouteParams p;
  p.router = router.upload(), p.shared_gate = shared_gate.upload(), p.h = d_h.get(), p.norm_w = d_norm.get();
  p.top_k = k, p.x = d_x.get(), p.logits = d_logits.get(), p.counter = d_counter.get();
  p.topk_idx = d_idx.get(), p.topk_w = d_w.get(), p.shared_gate_value = d_sg.get();
  for (int launch = 0; launch < 2; ++launch) ASSERT_CUDA(moe_route_generic(p, nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
  EXPECT_EQ(d_counter.download()[0], 0u);
  const std::vector<float> x = d_x.download(), logits = d_logits.download(), w = d_w.download();
  const std::vector<int> idx = d_idx.download();
  const std::vector<float> x_ref = rms_norm_ref(h.data(), norm_w.data(), H);
  int bad = 0;
  for (int i = 0; i < H; ++i) expect_close("x", i, x[i], x_ref[i], 1e-5 * (std::fabs(x_ref[i]) + 1), bad);
  for (int e = 0; e < E; ++e) {
    const auto [dot, abs_sum] = qdot(router, e, x_ref.data());
    expect_close("logit", e, logits[e], dot, 2e-5 * abs_sum + 1e-6, bad);
  }
  const auto [sg_dot, sg_abs] = qdot(shared_gate, 0, x_ref.data());
  expect_close("shared gate", 0, d_sg.download()[0], sigmoid_d(sg_dot), 2e-5 * sg_abs + 1e-6, bad);
  // Softmax as the CPU MoE (float exp, double sum) on the GPU's own logits, then lily::cpu::route_top_k: the
  // selection must be exact; the weights agree to fp32 rounding.
  std::vector<float> probs(logits);
  const float mx = *std::max_element(probs.begin(), probs.end());
  double sum = 0;
  for (float& v : probs) sum += (v = std::exp(v - mx));
  for (float& v : probs) v = static_cast<float>(v / sum);
  std::vector<int> idx_ref(k);
  std::vector<float> w_ref(k);
  cpu::route_top_k(probs.data(), E, k, idx_ref.data(), w_ref.data());
  EXPECT_EQ(idx, idx_ref);
  for (int i = 0; i < k; ++i) expect_close("topk_w", i, w[i], w_ref[i], 1e-5 * w_ref[i] + 1e-7, bad);
  EXPECT_EQ(bad, 0);
}

struct Experts {
  HostQMatrix gate, up, down, s_gate, s_up, s_down;
  std::vector<int> idx;
  std::vector<float> w;
  float sg = 0.37f;
};

Experts make_experts(const Geometry& g, uint32_t seed) {
  const int E = g.n_experts, H = g.hidden, I = g.inter, k = g.top_k;
  Experts x;
  x.gate = random_qmatrix(E * I, H, 4, seed), x.up = random_qmatrix(E * I, H, 4, seed + 1);
  x.down = random_qmatrix(E * H, I, 4, seed + 2);
  x.s_gate = random_qmatrix(I, H, 4, seed + 3), x.s_up = random_qmatrix(I, H, 4, seed + 4);
  x.s_down = random_qmatrix(H, I, 4, seed + 5);
  double sum = 0;
  for (int i = 0; i < k; ++i) {
    x.idx.push_back((i * 5 + 3) % E);  // distinct (E is 16 or 32, coprime to 5), unordered
    x.w.push_back(static_cast<float>(1.0 / (i + 2)));
    sum += x.w.back();
  }
  for (float& v : x.w) v = static_cast<float>(v / sum);
  return x;
}

QMatrix stacked(HostQMatrix& m, int rows_per_mat) {
  QMatrix q = m.upload();
  q.rows = rows_per_mat;
  return q;
}

void check_experts(const Geometry& g, uint32_t seed) {
  const int H = g.hidden, I = g.inter, k = g.top_k;
  Experts ex = make_experts(g, seed);
  const std::vector<float> x = random_vector(H, seed + 10), h = random_vector(H, seed + 11);
  DeviceBuffer<float> d_x(x), d_act((k + 1) * I), d_h(h), d_w(ex.w), d_sg(std::vector<float>{ex.sg});
  DeviceBuffer<int> d_idx(ex.idx);
  MoeExpertInParams ip;
  ip.gate = stacked(ex.gate, I), ip.up = stacked(ex.up, I), ip.shared_gate = ex.s_gate.upload();
  ip.shared_up = ex.s_up.upload(), ip.x = d_x.get(), ip.topk_idx = d_idx.get(), ip.top_k = k, ip.act = d_act.get();
  ASSERT_CUDA(moe_expert_in_generic(ip, nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<float> act = d_act.download();
  int bad = 0;
  for (int slot = 0; slot <= k; ++slot) {
    for (int r = 0; r < I; ++r) {
      const bool shared = slot == k;
      const int row = shared ? r : ex.idx[slot] * I + r;
      const auto [gd, g_abs] = qdot(shared ? ex.s_gate : ex.gate, row, x.data());
      const auto [ud, u_abs] = qdot(shared ? ex.s_up : ex.up, row, x.data());
      // Each dot within 2e-5 of its sum of |terms|; silu' <= 1.1.
      const double tol = std::fabs(silu_d(gd)) * 2e-5 * u_abs + 1.1 * std::fabs(ud) * 2e-5 * g_abs + 1e-6;
      expect_close("act", slot * I + r, act[slot * I + r], silu_d(gd) * ud, tol, bad);
    }
  }
  // expert_out on the GPU's act (its own inputs are then exact).
  MoeExpertOutParams op;
  op.down = stacked(ex.down, H), op.shared_down = ex.s_down.upload(), op.act = d_act.get();
  op.topk_idx = d_idx.get(), op.topk_w = d_w.get(), op.shared_gate_value = d_sg.get(), op.top_k = k, op.h = d_h.get();
  ASSERT_CUDA(moe_expert_out_generic(op, nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<float> h_new = d_h.download();
  for (int r = 0; r < H; ++r) {
    double ref = h[r], bound = 0;
    for (int slot = 0; slot <= k; ++slot) {
      const bool shared = slot == k;
      const double w = shared ? ex.sg : ex.w[slot];
      const auto [d, d_abs] = qdot(shared ? ex.s_down : ex.down, shared ? r : ex.idx[slot] * H + r, &act[slot * I]);
      ref += w * d;
      bound += w * d_abs;
    }
    expect_close("h", r, h_new[r], ref, 2e-5 * bound + 1e-6 * (std::fabs(h[r]) + 1), bad);
  }
  EXPECT_EQ(bad, 0);
}

TEST(CudaGeneric, MoeTinyAndSmall) {
  SKIP_WITHOUT_GPU();
  for (const Geometry& g : {kTiny, kSmall}) {
    SCOPED_TRACE(g.name);
    check_route(g, 400);
    check_experts(g, 410);
  }
}

// ---- attention -----------------------------------------------------------------------------------------------

void check_attn_prep(const Geometry& g, int pos) {
  SCOPED_TRACE(testing::Message() << g.name << " pos " << pos);
  const int D = g.head_dim, rows = pos + 2;
  const auto proj = random_vector(g.attn_proj(), 500 + pos);
  const auto q_norm = random_vector(D, 501, 0.1f, 1.0f), k_norm = random_vector(D, 502, 0.1f, 1.0f);
  DeviceBuffer<float> d_proj(proj), d_qn(q_norm), d_kn(k_norm), d_q(g.nq * D);
  DeviceBuffer<int> d_pos(std::vector<int>{pos});
  DeviceBuffer<uint16_t> k_cache(size_t{1} * rows * g.nkv * D), v_cache(size_t{1} * rows * g.nkv * D);
  ASSERT_CUDA(cudaMemset(k_cache.get(), 0xFF, k_cache.size() * 2));
  ASSERT_CUDA(cudaMemset(v_cache.get(), 0xFF, v_cache.size() * 2));
  AttnPrepParams p;
  p.proj = d_proj.get(), p.q_norm = d_qn.get(), p.k_norm = d_kn.get();
  p.nq = g.nq, p.nkv = g.nkv, p.head_dim = D, p.rotary_dim = g.rotary_dim, p.rope_theta = kTheta;
  p.pos = d_pos.get(), p.q = d_q.get();
  p.k_cache = reinterpret_cast<__nv_bfloat16*>(k_cache.get());
  p.v_cache = reinterpret_cast<__nv_bfloat16*>(v_cache.get());
  ASSERT_CUDA(attn_prep_generic(p, nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
  // q: fp32 sums of squares vs double, sincosf within 2 ulp of glibc, the same fp32 angle: a few fp32 ulps (3e-5
  // relative, |q| <= ~5). k in bf16: half a bf16 ulp (2^-8 relative) plus that. v: the exact bf16 rounding.
  const auto q = d_q.download();
  const auto kc = k_cache.download(), vc = v_cache.download();
  int bad = 0;
  for (int j = 0; j < g.nq + g.nkv; ++j) {
    const bool is_q = j < g.nq;
    const float* src = is_q ? &proj[j * 2 * D] : &proj[g.nq * 2 * D + (j - g.nq) * D];
    std::vector<float> ref = rms_norm_ref(src, is_q ? q_norm.data() : k_norm.data(), D);
    rope_ref(ref.data(), g.rotary_dim, pos);
    for (int d = 0; d < D; ++d) {
      if (is_q) {
        expect_close("q", j * D + d, q[j * D + d], ref[d], 3e-5 * std::max(1.0f, std::fabs(ref[d])), bad);
        continue;
      }
      const size_t at = (static_cast<size_t>(pos) * g.nkv + (j - g.nq)) * D + d;
      expect_close("k", at, bf16_bits_to_float(kc[at]), ref[d], std::fabs(ref[d]) / 256 + 3e-5, bad);
      const float v_src = proj[g.nq * 2 * D + (g.nkv + j - g.nq) * D + d];
      if (vc[at] != to_bf16_bits(v_src) && bad++ < 5) ADD_FAILURE() << "v [" << at << "]";
    }
  }
  for (size_t i = 0; i < kc.size(); ++i) {  // only row pos was written
    if (i / (g.nkv * D) == static_cast<size_t>(pos)) continue;
    if ((kc[i] != 0xFFFF || vc[i] != 0xFFFF) && bad++ < 5) ADD_FAILURE() << "cache element " << i << " touched";
  }
  EXPECT_EQ(bad, 0);
}

// Random bf16 caches of n valid rows followed by 8 NaN rows nobody may read; decode + combine, both generic,
// against attention_ref, for several split counts, with NaN-poisoned partials (an unwritten split shows).
void check_attn_decode(const Geometry& g, int n, const std::vector<int>& splits, uint32_t seed) {
  const int D = g.head_dim;
  const size_t row = static_cast<size_t>(g.nkv) * D;
  std::vector<uint16_t> k((n + 8) * row, 0xFFFF), v((n + 8) * row, 0xFFFF);
  const auto kf = random_vector(n * row, seed), vf = random_vector(n * row, seed + 1);
  for (size_t i = 0; i < n * row; ++i) k[i] = to_bf16_bits(kf[i]), v[i] = to_bf16_bits(vf[i]);
  const auto q = random_vector(g.nq * D, seed + 2, 1.5f);  // scores ~ N(0, 1.5^2): neither flat nor one-hot
  const auto proj = random_vector(g.attn_proj(), seed + 3);
  const auto ref = attention_ref(g, n, k, v, q, proj);
  const int max_splits = *std::max_element(splits.begin(), splits.end());
  DeviceBuffer<uint16_t> d_k(k), d_v(v);
  DeviceBuffer<float> d_q(q), d_proj(proj), part_o(size_t{1} * max_splits * g.nq * D), part_ml(max_splits * g.nq * 2);
  DeviceBuffer<float> out(g.nq * D);
  DeviceBuffer<int> d_pos(std::vector<int>{n - 1});
  for (int n_splits : splits) {
    SCOPED_TRACE(testing::Message() << g.name << " n " << n << " n_splits " << n_splits);
    ASSERT_CUDA(cudaMemset(part_o.get(), 0xFF, part_o.size() * sizeof(float)));
    ASSERT_CUDA(cudaMemset(part_ml.get(), 0xFF, part_ml.size() * sizeof(float)));
    const AttnDecodeParams dp{d_q.get(), reinterpret_cast<const __nv_bfloat16*>(d_k.get()),
                              reinterpret_cast<const __nv_bfloat16*>(d_v.get()), g.nq, g.nkv, D, d_pos.get(),
                              n_splits, 1.0f / std::sqrt(static_cast<float>(D)), part_o.get(), part_ml.get()};
    const AttnCombineParams cp{part_o.get(), part_ml.get(), n_splits, g.nq, D, d_proj.get(), out.get()};
    ASSERT_CUDA(attn_decode_generic(dp, nullptr));
    ASSERT_CUDA(attn_combine_generic(cp, nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());
    const auto got = out.download();
    // fp32 scores and accumulation (<= n/4 sequential adds per accumulator) against double over the same bf16
    // K/V; outputs are averages of |v| ~ 0.8: 2e-5 leaves a wide margin, a wrong row range or merge is >= 1e-2.
    int bad = 0;
    for (size_t i = 0; i < got.size(); ++i) expect_close("out", i, got[i], ref[i], 2e-5 + 2e-5 * std::fabs(ref[i]), bad);
    EXPECT_EQ(bad, 0);
  }
}

TEST(CudaGeneric, AttentionTinyAndSmall) {
  SKIP_WITHOUT_GPU();
  for (const Geometry& g : {kTiny, kSmall}) {
    for (int pos : {0, 1, 77, 5000}) check_attn_prep(g, pos);
    for (int n : {1, 2, 17, 300}) check_attn_decode(g, n, {1, 3, 66}, 600 + n);
  }
}

// ---- Gated DeltaNet ------------------------------------------------------------------------------------------

void check_gdn(const Geometry& g, int steps, uint32_t seed) {
  SCOPED_TRACE(g.name);
  GdnRef ref(g, seed);
  std::vector<int> positions(steps);
  for (int t = 0; t < steps; ++t) positions[t] = t;
  DeviceBuffer<float> d_proj(g.gdn_proj()), ring(size_t{1} * kConvKernel * g.conv_dim()), conv_w(ref.conv_w);
  DeviceBuffer<float> A_log(ref.A_log), dt_bias(ref.dt_bias), S(ref.S.size()), o(g.value_dim());
  DeviceBuffer<int> d_pos(positions);
  ASSERT_CUDA(ring.zero());
  ASSERT_CUDA(S.zero());
  std::vector<std::vector<float>> projs;
  for (int t = 0; t < steps; ++t) {
    SCOPED_TRACE("step " + std::to_string(t));
    projs.push_back(random_vector(g.gdn_proj(), seed + 100 + t));
    const auto o_ref = ref.step(projs.back());
    ASSERT_CUDA(d_proj.upload(projs.back()));
    const GdnStepParams p{d_proj.get(), ring.get(), conv_w.get(), A_log.get(), dt_bias.get(), S.get(),
                          d_pos.get() + t, g.n_k, g.n_v, g.d_k, g.d_v, kConvKernel, o.get()};
    ASSERT_CUDA(gdn_step_generic(p, nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());
    // fp32 throughout on both sides (the reference's long sums in double): a few 1e-7 relative per op, growing
    // slowly with the carried state; 1e-4 is > 10x that and far below an indexing error (~|o|).
    const auto got = o.download();
    int bad = 0;
    for (size_t i = 0; i < got.size(); ++i) expect_close("o", i, got[i], o_ref[i], 1e-4 + 1e-4 * std::fabs(o_ref[i]), bad);
    ASSERT_EQ(bad, 0);
  }
  const auto s_got = S.download();
  int bad = 0;
  for (size_t i = 0; i < s_got.size(); ++i) expect_close("S", i, s_got[i], ref.S[i], 1e-4 + 1e-4 * std::fabs(ref.S[i]), bad);
  const auto ring_got = ring.download();  // the pre-conv vector of position t in slot t % K
  for (int t = steps - kConvKernel; t < steps; ++t)
    for (int ch = 0; ch < g.conv_dim(); ++ch)
      expect_close("ring", ch, ring_got[(t % kConvKernel) * g.conv_dim() + ch], projs[t][ch], 0.0, bad);
  EXPECT_EQ(bad, 0);
}

TEST(CudaGeneric, GdnTinyAndSmall) {
  SKIP_WITHOUT_GPU();
  check_gdn(kTiny, 12, 700);
  check_gdn(kSmall, 9, 800);
}

}  // namespace
}  // namespace lily::cuda::test
