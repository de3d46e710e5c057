// moe_prefill (moe_prefill.cu) against CPU references on fresh random MLX-quantized weights, on each expert-GEMM
// path (qgemm.cu's mma.sync tiles, the few-row tiles and, on a Hopper GPU with sm_90a code, the register-sourced
// wgmma tiles), and its timings (print only).
//
// Tolerances as test_qgemm.cpp; in the MoE block the GPU's fp16 x may differ from the reference's by an ulp where x
// sits at a rounding midpoint (bounded per element below), and the expert activation is rounded to fp16 (2^-11
// relative).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <numeric>
#include <random>
#include <cstdlib>
#include <functional>
#include <vector>

#include <cuda_fp16.h>

#include "cpu/blocks.h"
#include "cuda/kernels/moe_prefill.cuh"
#include "cuda_test_util.h"
#include "qgemm_refs.h"
#include "generic_refs.h"

namespace lily::cuda::test {
namespace {

// ---- moe_prefill
// -----------------------------------------------------------------------------------------------

struct MoeModel {
  int H, E, I, k;
  HostQMatrix router, sgate, gate, up, down, s_gate, s_up, s_down;
  std::vector<float> norm_w;
  QMatrix q_router, q_sgate, q_gate, q_up, q_down, q_sg, q_su, q_sd;

  MoeModel(int H_, int E_, int I_, int k_, uint32_t seed) : H(H_), E(E_), I(I_), k(k_) {
    router = random_qmatrix(E, H, 8, seed);
    sgate = random_qmatrix(1, H, 8, seed + 1);
    gate = fast_qmatrix(E * I, H, 4, seed + 2);
    up = fast_qmatrix(E * I, H, 4, seed + 3);
    down = fast_qmatrix(E * H, I, 4, seed + 4);
    s_gate = fast_qmatrix(I, H, 4, seed + 5);
    s_up = fast_qmatrix(I, H, 4, seed + 6);
    s_down = fast_qmatrix(H, I, 4, seed + 7);
    norm_w = random_vector(H, seed + 8, 0.1f, 1.0f);
  }
  void upload() {
    q_router = router.upload(), q_sgate = sgate.upload();
    q_gate = gate.upload(), q_up = up.upload(), q_down = down.upload();
    q_gate.rows = q_up.rows = I, q_down.rows = H;
    q_sg = s_gate.upload(), q_su = s_up.upload(), q_sd = s_down.upload();
  }
};

// h after moe_prefill for the rows h (T = h.size() / H) and tile_rows as given (0: moe_prefill's choice); with
// w16, from the experts' fp16 copies (moe_expand_w16).
std::vector<float> run_moe(const MoeModel& m, const std::vector<float>& h, int tile_rows = 0, bool w16 = false) {
  const int T = static_cast<int>(h.size() / m.H);
  DeviceBuffer<float> d_h(h), d_norm(m.norm_w);
  const size_t bytes = moe_prefill_scratch_bytes(T, m.H, m.I, m.I, m.E, m.k);
  DeviceBuffer<unsigned char> scratch(bytes);
  MoePrefillParams p;
  p.router = m.q_router, p.shared_gate = m.q_sgate, p.gate = m.q_gate, p.up = m.q_up, p.down = m.q_down;
  p.shared_gate_proj = m.q_sg, p.shared_up = m.q_su, p.shared_down = m.q_sd;
  p.h = d_h.get(), p.norm_w = d_norm.get(), p.eps = kEps, p.T = T, p.top_k = m.k;
  p.scratch = scratch.get(), p.scratch_bytes = bytes, p.tile_rows = tile_rows;
  DeviceBuffer<uint16_t> copies(w16 ? moe_w16_halves(m.E, m.H, m.I) : 1);
  if (w16) {
    // NaN-poisoned first: every element the tiles read must have been written by the expansion.
    EXPECT_EQ(cudaMemset(copies.get(), 0xFF, copies.size() * 2), cudaSuccess);
    EXPECT_EQ(moe_expand_w16(p, reinterpret_cast<__half*>(copies.get()), nullptr), cudaSuccess);
    p.w16 = reinterpret_cast<const __half*>(copies.get());
  }
  EXPECT_EQ(moe_prefill(p, nullptr), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return d_h.download();
}

// Eqs 20-25 for row t on the CPU, compared with the GPU's h. Returns false (row skipped) where the k-th and
// (k+1)-th router logits are closer than the logits' error bound, so that the two sides may choose
// differently.
bool check_moe_row(const MoeModel& m, const float* h, const float* got, int t, double& worst) {
  const int H = m.H, E = m.E, I = m.I, k = m.k;
  // x = fp16(RMSNorm(h) * w); x_err: one ulp where x is within 1e-5 of an fp16 rounding midpoint, else 0.
  const std::vector<float> xf = rms_norm_ref(h, m.norm_w.data(), H);
  std::vector<float> x(H);
  std::vector<double> x_err(H);
  for (int i = 0; i < H; ++i) {
    x[i] = f16_round(xf[i]);
    const double ulp = std::max(std::ldexp(1.0, std::ilogb(x[i] != 0 ? x[i] : 1e-30f) - 10), std::ldexp(1.0, -24));
    x_err[i] = std::fabs(std::fabs(xf[i] - x[i]) - ulp / 2) < 1e-5 * std::fabs(xf[i]) + 1e-30 ? ulp : 0.0;
  }
  std::vector<float> wr;
  std::vector<double> logit(E), logit_tol(E);
  for (int e = 0; e < E; ++e) {
    dequant_row_f16(m.router, e, wr);
    const Dot d = dot_row(wr, x.data(), x_err.data());
    logit[e] = d.dot, logit_tol[e] = d.tol();
  }
  std::vector<int> order(E);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](int a, int b) { return logit[a] > logit[b] || (logit[a] == logit[b] && a < b); });
  const int kth = order[k - 1], next = order[k];
  if (logit[kth] != logit[next] && logit[kth] - logit[next] <= logit_tol[kth] + logit_tol[next]) return false;
  // Softmax as the CPU MoE does it (float exp, double sum), then lily::cpu::route_top_k.
  std::vector<float> probs(E);
  double sum = 0;
  for (int e = 0; e < E; ++e) sum += (probs[e] = std::exp(static_cast<float>(logit[e] - logit[order[0]])));
  for (float& v : probs) v = static_cast<float>(v / sum);
  std::vector<int> idx(k);
  std::vector<float> wt(k);
  cpu::route_top_k(probs.data(), E, k, idx.data(), wt.data());
  // A renormalised softmax weight moves by at most twice the largest logit error, relatively.
  double w_rel = 0;
  for (int s = 0; s < k; ++s) w_rel = std::max(w_rel, 2 * logit_tol[idx[s]]);
  // Shared gate in fp32 weights (the routing kernel does not round them).
  double sg_logit = 0, sg_abs = 0, sg_err = 0;
  for (int c = 0; c < H; ++c) {
    const double w = m.sgate.dequant(0, c);
    sg_logit += w * x[c], sg_abs += std::fabs(w * x[c]), sg_err += std::fabs(w) * x_err[c];
  }
  const double sg = sigmoid_d(sg_logit), sg_tol = 0.25 * (kAcc * sg_abs + sg_err);

  std::vector<double> ref(h, h + H), tol(H);
  for (int i = 0; i < H; ++i) tol[i] = 1e-6 * std::fabs(h[i]) + 1e-6;
  std::vector<float> act(I), wg, wu;
  std::vector<double> act_err(I);
  for (int s = 0; s <= k; ++s) {
    const bool shared = s == k;
    const HostQMatrix& G = shared ? m.s_gate : m.gate;
    const HostQMatrix& U = shared ? m.s_up : m.up;
    const HostQMatrix& D = shared ? m.s_down : m.down;
    const size_t e = shared ? 0 : idx[s];
    for (int j = 0; j < I; ++j) {
      dequant_row_f16(G, e * I + j, wg);
      dequant_row_f16(U, e * I + j, wu);
      const Dot g = dot_row(wg, x.data(), x_err.data()), u = dot_row(wu, x.data(), x_err.data());
      const double a = silu_d(g.dot) * u.dot;
      act[j] = static_cast<float>(a);
      act_err[j] =
          kF16 * std::fabs(a) + 1.1 * std::fabs(u.dot) * g.tol() + std::fabs(silu_d(g.dot)) * u.tol();
    }
    const double w = shared ? sg : wt[s];
    for (int r = 0; r < H; ++r) {
      dequant_row_f16(D, e * H + r, wr);
      const Dot y = dot_row(wr, act.data(), act_err.data());
      ref[r] += w * y.dot;
      tol[r] += w * y.tol() + (shared ? sg_tol : (w_rel + 1e-6) * w) * std::fabs(y.dot);
    }
  }
  int bad = 0;
  for (int r = 0; r < H; ++r) {
    worst = std::max(worst, std::fabs(got[r] - ref[r]) / tol[r]);
    if (!(std::fabs(got[r] - ref[r]) <= tol[r]) && bad++ < 5) {
      ADD_FAILURE() << "row " << t << " col " << r << ": got " << got[r] << " want " << ref[r] << " tol "
                    << tol[r];
    }
  }
  EXPECT_EQ(bad, 0) << "row " << t;
  return true;
}

// Rows checked: all up to 8, else the first and last 4 and `spread` between.
std::vector<int> rows_to_check(int T, int spread) {
  std::vector<int> rows;
  for (int t = 0; t < T; ++t)
    if (T <= 8 || t < 4 || t >= T - 4 || (t % std::max(1, T / spread)) == T / (2 * spread)) rows.push_back(t);
  return rows;
}

// Returns the GPU's h.
std::vector<float> check_moe(const MoeModel& m, const std::vector<float>& h, int spread, int tile_rows = 0,
                             bool w16 = false) {
  const int T = static_cast<int>(h.size() / m.H);
  SCOPED_TRACE(testing::Message() << "H " << m.H << " E " << m.E << " I " << m.I << " k " << m.k << " T " << T
                                  << " tile_rows " << tile_rows << (w16 ? " (fp16 copies)" : ""));
  const std::vector<float> got = run_moe(m, h, tile_rows, w16);
  const std::vector<float> again = run_moe(m, h, tile_rows, w16);
  EXPECT_TRUE(got == again) << "moe_prefill must be deterministic";
  int checked = 0, skipped = 0;
  double worst = 0;
  for (int t : rows_to_check(T, spread)) {
    const size_t off = static_cast<size_t>(t) * m.H;
    (check_moe_row(m, &h[off], &got[off], t, worst) ? checked : skipped)++;
  }
  std::printf(
      "moe_prefill H %d E %d T %d tile_rows %d%s: %d rows checked, %d skipped (k-th/(k+1)-th logit within "
      "the error), largest |error| / tolerance %.3f\n",
      m.H, m.E, T, tile_rows, w16 ? " (fp16 copies)" : "", checked, skipped, worst);
  EXPECT_GT(checked, 0);
  return got;
}

TEST(CudaMoePrefill, RejectsBadArguments) {
  SKIP_WITHOUT_GPU();
  MoePrefillParams m;  // no weights, no rows
  EXPECT_EQ(moe_prefill(m, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(moe_prefill_scratch_bytes(0, 2048, 512, 512, 256, 8), 0u);
}

TEST(CudaMoePrefill, TinyGeometry) {
  SKIP_WITHOUT_GPU();
  MoeModel m(128, 16, 64, 4, 900);
  m.upload();
  for (int T : {1, 63, 64, 65, 300}) check_moe(m, random_vector(static_cast<size_t>(T) * m.H, 901 + T), 24);
  check_moe(m, random_vector(size_t{300} * m.H, 950), 8, 128);
  // The few-row tiles (launch_grouped_few), below, at and past kFewRows rows an expert (300 rows: ~75 each).
  for (int T : {1, 7, 8, 9, 63, 64, 65, 300})
    check_moe(m, random_vector(static_cast<size_t>(T) * m.H, 960 + T), 24, 32);
}

TEST(CudaMoePrefill, SmallGeometry) {
  SKIP_WITHOUT_GPU();
  MoeModel m(1024, 32, 256, 8, 1000);
  m.upload();
  for (int T : {1, 65, 700}) check_moe(m, random_vector(static_cast<size_t>(T) * m.H, 1001 + T), 12);
  for (int T : {1, 65, 700}) check_moe(m, random_vector(static_cast<size_t>(T) * m.H, 1051 + T), 12, 32);
}

TEST(CudaMoePrefill, FullGeometry) {
  SKIP_WITHOUT_GPU();
  MoeModel m(2048, 256, 512, 8, 1100);
  m.upload();
  for (int T : {1, 63, 64, 65}) check_moe(m, random_vector(static_cast<size_t>(T) * m.H, 1101 + T), 4);
  const std::vector<float> h = random_vector(size_t{4097} * m.H, 1200);
  check_moe(m, h, 16);
  check_moe(m, h, 4, 128);  // the other tile size on the same rows
  check_moe(m, h, 4, 32);   // and the few-row tiles (~128 rows an expert: several tiles each)
  // (T = 1 at this geometry is a near-tie row for seed 1151, skipped by the check: 3 rows instead)
  for (int T : {3, 63, 64, 65, 256, 1025}) check_moe(m, random_vector(static_cast<size_t>(T) * m.H, 1150 + T), 4, 32);
}

// Uneven loads: every row shares one dominant direction, and router row 7 is planted on it, so expert 7 takes
// every row, the other slots go to the few experts that direction prefers, and most experts get none.
// Routing ties: router rows 9 and 5 are identical (a tie near the top for every row); 40..43 come next, and
// 20 and 3 are identical and tie for the last slot, which only 3 may take. Plants m's router (call before
// upload) and returns T rows of h.
std::vector<float> plant_uneven(MoeModel& m, int T) {
  const std::vector<float> common = random_vector(m.H, 1301);
  std::vector<float> h = random_vector(static_cast<size_t>(T) * m.H, 1302, 0.2f);
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < m.H; ++i) h[static_cast<size_t>(t) * m.H + i] += common[i];
  std::vector<float> x = rms_norm_ref(common.data(), m.norm_w.data(), m.H);
  auto plant = [&](int row, float target) {
    double l1 = 0;
    for (float v : x) l1 += std::fabs(v);
    std::vector<float> w(m.H);
    for (int c = 0; c < m.H; ++c) w[c] = static_cast<float>((x[c] >= 0 ? target : -target) / l1);
    mlx_quantize(w.data(), 1, m.H, 8, &m.router.words[row * m.router.words_per_row()],
                 &m.router.scales[row * m.router.groups_per_row()],
                 &m.router.biases[row * m.router.groups_per_row()]);
  };
  auto copy_row = [&](int from, int to) {
    HostQMatrix& r = m.router;
    std::copy_n(r.words.begin() + from * r.words_per_row(), r.words_per_row(),
                r.words.begin() + to * r.words_per_row());
    std::copy_n(r.scales.begin() + from * r.groups_per_row(), r.groups_per_row(),
                r.scales.begin() + to * r.groups_per_row());
    std::copy_n(r.biases.begin() + from * r.groups_per_row(), r.groups_per_row(),
                r.biases.begin() + to * r.groups_per_row());
  };
  plant(7, 12.0f);
  plant(9, 9.0f);
  copy_row(9, 5);
  for (int i = 0; i < 4; ++i) plant(40 + i, 8.5f - 0.5f * i);
  plant(20, 6.0f);
  copy_row(20, 3);
  return h;
}

TEST(CudaMoePrefill, OneExpertTakesEveryRowAndTies) {
  SKIP_WITHOUT_GPU();
  MoeModel m(2048, 256, 512, 8, 1300);
  const std::vector<float> h = plant_uneven(m, 2049);
  m.upload();
  check_moe(m, h, 8);
  check_moe(m, h, 4, 128);
  check_moe(m, h, 4, 32);
  const std::vector<float> h256(h.begin(), h.begin() + size_t{256} * m.H);  // expert 7: 256 rows = 8 tiles
  check_moe(m, h256, 8, 32);
}

// The cases of the 192-row tiles (the register-sourced ones, tile_rows kMoeRsTileRows = 192, launch_grouped_rs, and
// those on the fp16 copies), check(model, h, spread) on each: a geometry with H = I = 512 (K of both GEMMs one
// multiple of 512: 8 steps, more than the ring's 6) at T from 1 row to ~256 rows an expert (two tiles each: a full one and a tail; 1 to 6 chunks of 32 rows), the full geometry at
// the chunk boundaries and 4,097 rows, and the uneven loads (expert 7 takes all 2,049 rows: 11 tiles).
void for_each_192_row_case(const std::function<void(const MoeModel&, const std::vector<float>&, int)>& check) {
  MoeModel mid(512, 16, 512, 4, 1700);
  mid.upload();
  for (int T : {1, 7, 33, 64, 65, 191, 192, 193, 300, 1025})
    check(mid, random_vector(static_cast<size_t>(T) * mid.H, 1701 + T), 12);
  MoeModel full(2048, 256, 512, 8, 1100);
  full.upload();
  for (int T : {3, 64, 65, 256}) check(full, random_vector(static_cast<size_t>(T) * full.H, 1750 + T), 4);
  check(full, random_vector(size_t{4097} * full.H, 1200), 4);
  MoeModel uneven(2048, 256, 512, 8, 1300);
  const std::vector<float> h = plant_uneven(uneven, 2049);
  uneven.upload();
  check(uneven, h, 8);
}

TEST(CudaMoePrefillRs, AgainstCpu) {
  SKIP_WITHOUT_GPU();
  SKIP_WITHOUT_HOPPER();
  for_each_192_row_case([](const MoeModel& m, const std::vector<float>& h, int spread) {
    check_moe(m, h, spread, kMoeRsTileRows);
  });
}

// The tiles on the experts' resident fp16 copies (MoePrefillParams::w16, launch_grouped_w16) against the CPU on
// the register-sourced tiles' cases, and against those tiles' outputs (the same fp16 weights, the same k16
// products: the count of differing elements is printed).
void check_w16(const MoeModel& m, const std::vector<float>& h, int spread) {
  const std::vector<float> got = check_moe(m, h, spread, kMoeRsTileRows, true);
  const std::vector<float> rs = run_moe(m, h, kMoeRsTileRows);
  size_t differ = 0;
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != rs[i]) ++differ, worst = std::max(worst, std::fabs(double{got[i]} - rs[i]) / (std::fabs(rs[i]) + 1e-6));
  std::printf("  fp16 copies vs register-sourced tiles: %zu of %zu elements differ (worst relative %.2e)\n", differ,
              got.size(), worst);
}

TEST(CudaMoePrefillW16, AgainstCpu) {
  SKIP_WITHOUT_GPU();
  SKIP_WITHOUT_HOPPER();
  for_each_192_row_case(check_w16);
}

TEST(CudaMoePrefillW16, RejectsWhatItDoesNotTake) {
  SKIP_WITHOUT_GPU();
  MoeModel m(128, 16, 64, 4, 900);  // H 128, I 64: expandable
  m.upload();
  MoePrefillParams p;
  p.router = m.q_router, p.gate = m.q_gate, p.up = m.q_up, p.down = m.q_down;
  p.shared_gate_proj = m.q_sg, p.shared_up = m.q_su, p.shared_down = m.q_sd;
  EXPECT_EQ(moe_expand_w16(p, nullptr, nullptr), cudaErrorInvalidValue);
  DeviceBuffer<uint16_t> out(moe_w16_halves(m.E, m.H, m.I));
  __half* const o = reinterpret_cast<__half*>(out.get());
  EXPECT_EQ(moe_expand_w16(p, o, nullptr), cudaSuccess);
  MoePrefillParams bad = p;
  bad.shared_up.rows = 32;  // the shared expert's shape differs from the routed ones'
  EXPECT_EQ(moe_expand_w16(bad, o, nullptr), cudaErrorInvalidValue);
  bad = p;
  bad.gate.bits = 8;
  EXPECT_EQ(moe_expand_w16(bad, o, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(moe_expand_w16(p, o + 1, nullptr), cudaErrorInvalidValue);  // not 16-byte aligned
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// ---- timings (print only)
// ----------------------------------------------------------------------------------------

// One moe_prefill layer at full geometry (E 256, H 2048, I 512, k 8), cold weights, CUDA-graph replay: us.
// With w16, the experts' fp16 copies (of the first graph iteration's matrices: each layer's 1.6 GB is far past the
// L2, so one copy is as cold as many; the routing, not the values, sets the work).
double moe_layer_us(const DeviceBuffer<uint16_t>& pool, int T, int tile_rows, const __half* w16 = nullptr) {
  const int E = 256, H = 2048, I = 512, k = 8;
  const size_t bytes = moe_prefill_scratch_bytes(T, H, I, I, E, k);
  DeviceBuffer<unsigned char> scratch(bytes);
  DeviceBuffer<float> h(random_vector(static_cast<size_t>(T) * H, 1400)), norm_w(random_vector(H, 1401, 0.1f, 1.0f));
  return graph_time_us(
      [&](int i, cudaStream_t st) {
        MoePrefillParams p;
        const size_t base = 16 * static_cast<size_t>(i);
        // Router rows are random bf16 patterns (bench_pool): loads come out uneven, as with real weights.
        p.router = bench_qmatrix(pool, E, H, 8, base);
        p.shared_gate = bench_qmatrix(pool, 1, H, 8, base + 1);
        p.gate = bench_qmatrix(pool, E * I, H, 4, base + 2);
        p.up = bench_qmatrix(pool, E * I, H, 4, base + 3);
        p.down = bench_qmatrix(pool, E * H, I, 4, base + 4);
        p.gate.rows = p.up.rows = I, p.down.rows = H;
        p.shared_gate_proj = bench_qmatrix(pool, I, H, 4, base + 5);
        p.shared_up = bench_qmatrix(pool, I, H, 4, base + 6);
        p.shared_down = bench_qmatrix(pool, H, I, 4, base + 7);
        p.h = h.get(), p.norm_w = norm_w.get(), p.T = T, p.top_k = k;
        p.scratch = scratch.get(), p.scratch_bytes = bytes, p.tile_rows = tile_rows, p.w16 = w16;
        return moe_prefill(p, st);
      },
      3, 3);
}

TEST(CudaMoePrefillBench, FullGeometry) {
  SKIP_WITHOUT_GPU();
  const int H = 2048, I = 512, k = 8;
  const DeviceBuffer<uint16_t> pool = bench_pool(size_t{3} << 30);
  std::printf("\nmoe_prefill full geometry (E 256, H 2048, I 512, k 8), cold weights, CUDA-graph replay:\n");
  // LILY_MOE_BENCH_T=256,1024 times only those T (e.g. to profile one shape under ncu).
  std::vector<int> Ts = {4096, 2048, 1536, 1024, 768, 512, 256};
  if (const char* env = std::getenv("LILY_MOE_BENCH_T")) {
    Ts.clear();
    for (const char* q = env; *q;) {
      char* end = nullptr;
      const long v = std::strtol(q, &end, 10);
      if (end == q) break;
      if (v >= 1 && v <= 65536) Ts.push_back(static_cast<int>(v));
      q = *end == ',' ? end + 1 : end;
    }
  }
  // The fp16 copies of the first iteration's experts (moe_layer_us).
  DeviceBuffer<uint16_t> copies(wgmma_built() ? moe_w16_halves(256, H, I) : 1);
  if (wgmma_built()) {
    MoePrefillParams p;
    p.router = bench_qmatrix(pool, 256, H, 8, 0);
    p.gate = bench_qmatrix(pool, 256 * I, H, 4, 2), p.up = bench_qmatrix(pool, 256 * I, H, 4, 3);
    p.down = bench_qmatrix(pool, 256 * H, I, 4, 4);
    p.gate.rows = p.up.rows = I, p.down.rows = H;
    p.shared_gate_proj = bench_qmatrix(pool, I, H, 4, 5), p.shared_up = bench_qmatrix(pool, I, H, 4, 6);
    p.shared_down = bench_qmatrix(pool, H, I, 4, 7);
    ASSERT_CUDA(moe_expand_w16(p, reinterpret_cast<__half*>(copies.get()), nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());
  }
  for (int T : Ts) {
    for (const int tile_rows : {0, 32, 64, 128, kMoeRsTileRows, -1}) {
      if ((tile_rows == kMoeRsTileRows || tile_rows < 0) && !wgmma_built()) continue;
      const bool w16 = tile_rows < 0;  // the fp16 copies' tiles
      const double us = moe_layer_us(pool, T, w16 ? kMoeRsTileRows : tile_rows,
                                     w16 ? reinterpret_cast<const __half*>(copies.get()) : nullptr);
      const double flops = 2.0 * T * (k + 1) * 3.0 * H * I;  // routed + shared expert
      std::printf(
          "  T %5d tile_rows %3d%s: %9.1f us  %6.2f us/token  experts %6.1f TFLOP/s (%4.1f%% of 790)\n", T,
          w16 ? kMoeRsTileRows : tile_rows, w16 ? " (fp16 copies)" : tile_rows ? "" : " (auto)", us, us / T,
          flops / (us * 1e6), 100 * flops / (us * 1e6) / 790);
    }
    // The same expert FLOPs as two dense GEMMs over T k rows (perfectly even loads, no gather): what the
    // grouped GEMMs would take if routing cost nothing.
    DeviceBuffer<uint16_t> a(static_cast<size_t>(T) * k * H), act(static_cast<size_t>(T) * k * I);
    DeviceBuffer<float> y(static_cast<size_t>(T) * k * H);
    ASSERT_CUDA(a.zero());
    ASSERT_CUDA(act.zero());
    const double us_in = graph_time_us(
        [&](int i, cudaStream_t st) {
          QGemmSwigluParams p;
          p.gate = bench_qmatrix(pool, I, H, 4, 2 * i);
          p.up = bench_qmatrix(pool, I, H, 4, 2 * i + 1);
          p.a = as_f16(a), p.M = T * k, p.act = reinterpret_cast<__half*>(act.get());
          return qgemm_swiglu(p, st);
        },
        3);
    const double us_out = graph_time_us(
        [&](int i, cudaStream_t st) {
          QGemmParams p;
          p.w = bench_qmatrix(pool, H, I, 4, i);
          p.a = as_f16(act), p.M = T * k, p.c = y.get();
          return qgemm(p, st);
        },
        3);
    std::printf(
        "  dense stand-ins, M = T k = %d: swiglu [2 x 512, 2048] %8.1f us %6.1f TFLOP/s, down [2048, 512] "
        "%8.1f us "
        "%6.1f TFLOP/s\n",
        T * k, us_in, 4.0 * T * k * I * H / (us_in * 1e6), us_out, 2.0 * T * k * I * H / (us_out * 1e6));
  }
}

}  // namespace
}  // namespace lily::cuda::test
