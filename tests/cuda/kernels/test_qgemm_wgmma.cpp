// qgemm's wgmma path (QGemmParams::use_wgmma, src/cuda/kernels/qgemm_wgmma.cu) against the mma.sync path on
// every output element and against a CPU reference on sampled elements, on fresh random MLX-quantized
// weights; exact-integer layout probes that name the misplaced element when a shared-memory layout or a
// descriptor is wrong; and the TFLOP/s of both paths on the prefill's dense shapes (print only).
//
// Tolerances as test_qgemm.cpp: both GPU paths round each dequantized weight to fp16 with the same fp32
// arithmetic (so they see identical weights) and accumulate in fp32 in different orders; the reference rounds
// its weights to fp16 the same way (at most one fp16 ulp apart where the two fp32 dequantisations straddle a
// rounding midpoint) and sums in double.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include <cuda_fp16.h>

#include "cuda/kernels/qgemm.cuh"
#include "cuda_test_util.h"
#include "generic_refs.h"
#include "qgemm_refs.h"

namespace lily::cuda::test {
namespace {

// Runs qgemm on one path into a copy of c0; returns the output as floats.
std::vector<float> run_path(const QGemmParams& base, bool wgmma, const std::vector<float>& c0, bool* ok) {
  QGemmParams p = base;
  p.use_wgmma = wgmma;
  DeviceBuffer<uint16_t> cb(to_f16(c0));
  DeviceBuffer<float> cf(c0);
  p.c = p.out == GemmOut::f16 ? static_cast<void*>(cb.get()) : static_cast<void*>(cf.get());
  const cudaError_t e = qgemm(p, nullptr);
  const cudaError_t s = cudaDeviceSynchronize();
  *ok = e == cudaSuccess && s == cudaSuccess;
  if (!*ok) {
    ADD_FAILURE() << (wgmma ? "wgmma" : "mma.sync")
                  << " path: " << cudaGetErrorString(e != cudaSuccess ? e : s);
    return {};
  }
  if (p.out != GemmOut::f16) return cf.download();
  const std::vector<uint16_t> b = cb.download();
  std::vector<float> got(b.size());
  for (size_t i = 0; i < b.size(); ++i) got[i] = f16_bits_to_float(b[i]);
  return got;
}

// A matrix on the device and its fp16-rounded rows on the host (made once, checked at several M).
struct Weights {
  HostQMatrix host;
  QMatrix dev;
  std::vector<std::vector<float>> rows;  // [N][K] dequantized, fp16-rounded
  std::vector<double> max_abs;           // [N] max |w| of each row
  Weights(int N, int K, int bits, uint32_t seed) : host(fast_qmatrix(N, K, bits, seed)) {
    dev = host.upload();
    rows.resize(N);
    max_abs.assign(N, 0.0);
    for (int n = 0; n < N; ++n) {
      dequant_row_f16(host, n, rows[n]);
      for (float v : rows[n]) max_abs[n] = std::max(max_abs[n], static_cast<double>(std::fabs(v)));
    }
  }
};

// One GEMM's inputs on fresh random values: fp16-exact activations a [M, K], the output's initial c0 at a row stride
// other than N for odd M (so that the epilogue's stride is exercised), and the params of W x a into it.
struct GemmInputs {
  std::vector<float> a, c0;
  int ldc;
  DeviceBuffer<uint16_t> d_a;
  QGemmParams p;
  GemmInputs(const Weights& wt, int M, GemmOut out, uint32_t seed)
      : a(random_vector(static_cast<size_t>(M) * wt.host.cols, seed)),
        c0(random_vector(static_cast<size_t>(M) * (wt.host.rows + (M % 2) * 3), seed + 1)),
        ldc(wt.host.rows + (M % 2) * 3),
        d_a(to_f16(round_f16(a))) {
    a = round_f16(a);
    p.w = wt.dev;
    p.a = as_f16(d_a);
    p.M = M;
    p.out = out;
    p.ldc = ldc;
  }
  static std::vector<float> round_f16(std::vector<float> v) {
    for (float& x : v) x = f16_round(x);
    return v;
  }
};

void check_wgmma(const Weights& wt, int M, GemmOut out, uint32_t seed) {
  const int N = wt.host.rows, K = wt.host.cols;
  const std::vector<std::vector<float>>& w_rows = wt.rows;
  const std::vector<double>& w_max = wt.max_abs;
  SCOPED_TRACE(testing::Message() << "M " << M << " N " << N << " K " << K << " bits " << wt.host.bits
                                  << " out " << static_cast<int>(out));
  GemmInputs in(wt, M, out, seed);
  const std::vector<float>& a = in.a;
  const std::vector<float>& c0 = in.c0;
  const int ldc = in.ldc;
  QGemmParams& p = in.p;
  bool ok_w = false, ok_m = false;
  const std::vector<float> got = run_path(p, true, c0, &ok_w);
  const std::vector<float> base = run_path(p, false, c0, &ok_m);
  if (!ok_w || !ok_m) return;

  // Per-row sum |a| and per-column max |w| bound each output's sum of |terms| (for the all-element check).
  std::vector<double> a_abs(M, 0.0);
  for (int r = 0; r < M; ++r)
    for (int k = 0; k < K; ++k) a_abs[r] += std::fabs(a[static_cast<size_t>(r) * K + k]);
  auto c_init = [&](size_t i) { return out == GemmOut::f16 ? f16_round(c0[i]) : c0[i]; };

  // 1. wgmma against mma.sync, every element (and nothing written past N).
  int bad = 0;
  for (int r = 0; r < M; ++r) {
    for (int n = 0; n < ldc; ++n) {
      const size_t i = static_cast<size_t>(r) * ldc + n;
      if (n >= N) {
        if (got[i] != c_init(i) && bad++ < 5) ADD_FAILURE() << "wrote past N at row " << r << " col " << n;
        continue;
      }
      double tol = 2 * kAcc * a_abs[r] * w_max[n] + 1e-6;
      if (out == GemmOut::add_f32) tol += 1e-6 * std::fabs(c0[i]);
      if (out == GemmOut::f16) tol += kUlp * std::fabs(base[i]);
      if (!(std::fabs(got[i] - base[i]) <= tol) && bad++ < 5) {
        ADD_FAILURE() << "vs mma.sync: row " << r << " col " << n << ": wgmma " << got[i] << " mma.sync "
                      << base[i] << " tol " << tol;
      }
    }
  }
  EXPECT_EQ(bad, 0) << "wgmma vs mma.sync";

  // 2. wgmma against the CPU reference: all rows up to 80, else the first and last 8 and 24 spread between;
  // all columns up to 2048, else every 7th and the last 16.
  std::vector<int> rows, cols;
  for (int r = 0; r < M; ++r)
    if (M <= 80 || r < 8 || r >= M - 8 || r % (M / 24) == 0) rows.push_back(r);
  for (int n = 0; n < N; ++n)
    if (N <= 2048 || n % 7 == 0 || n >= N - 16) cols.push_back(n);
  bad = 0;
  for (int r : rows) {
    const float* x = &a[static_cast<size_t>(r) * K];
    for (int n : cols) {
      const size_t i = static_cast<size_t>(r) * ldc + n;
      double dot = 0, abs_sum = 0, max_term = 0;
      for (int k = 0; k < K; ++k) {
        const double t = static_cast<double>(w_rows[n][k]) * x[k];
        dot += t, abs_sum += std::fabs(t), max_term = std::max(max_term, std::fabs(t));
      }
      double ref = dot, tol = kAcc * abs_sum + 2 * kUlp * max_term + 1e-7;
      if (out == GemmOut::add_f32) ref += c0[i], tol += 1e-6 * std::fabs(c0[i]);
      if (out == GemmOut::f16) tol += kF16 * std::fabs(ref);
      if (!(std::fabs(got[i] - ref) <= tol) && bad++ < 5) {
        ADD_FAILURE() << "vs CPU: row " << r << " col " << n << ": got " << got[i] << " want " << ref
                      << " tol " << tol;
      }
    }
  }
  EXPECT_EQ(bad, 0) << "wgmma vs CPU";
}

// Structured inputs that make a layout error readable (the first thing to look at if MatchesMmaSyncAndCpu
// fails): 8-bit codes with scale 1 and bias 0, so weights and products are small exact integers.
//  (1) A = [I64; I64; ...] (row m has a 1 at column m % 64), W[n][k] = k + 64 (n % 4): C[m][n] = m % 64 + 64
//  (n % 4),
//      so a wrong value v names the weight it came from (column v % 64, row class v / 64): B operand layout;
//  (2) W = I (N = K = 64), A[m][k] = 64 (m % 16) + k: C[m][n] = A[m][n] names the A element it came from.
HostQMatrix exact_q8(int rows, int cols, int (*code)(int, int)) {
  HostQMatrix m;
  m.rows = rows, m.cols = cols, m.bits = 8;
  m.words.assign(rows * m.words_per_row(), 0u);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c)
      m.words[r * m.words_per_row() + c / 4] |= static_cast<uint32_t>(code(r, c) & 0xFF) << (8 * (c % 4));
  m.scales.assign(rows * m.groups_per_row(), to_bf16_bits(1.0f));
  m.biases.assign(rows * m.groups_per_row(), to_bf16_bits(0.0f));
  return m;
}

TEST(CudaQgemmWgmma, LayoutProbes) {
  SKIP_WITHOUT_GPU();
  SKIP_WITHOUT_HOPPER();
  // B probe with 128-wide tiles (one row tile) and with 128 x 256 tiles (132 row tiles), then the A probe.
  for (const int run : {0, 1, 2}) {
    const int probe = run == 2 ? 1 : 0, M = run == 1 ? 132 * 128 : 128, N = probe == 0 ? 256 : 64, K = 64;
    HostQMatrix w = probe == 0 ? exact_q8(N, K, [](int n, int k) { return k + 64 * (n % 4); })
                               : exact_q8(N, K, [](int n, int k) { return n == k ? 1 : 0; });
    std::vector<float> a(static_cast<size_t>(M) * K);
    for (int m = 0; m < M; ++m)
      for (int k = 0; k < K; ++k)
        a[static_cast<size_t>(m) * K + k] = probe == 0 ? (k == m % 64 ? 1.0f : 0.0f) : 64.0f * (m % 16) + k;
    DeviceBuffer<uint16_t> d_a(to_f16(a));
    DeviceBuffer<float> d_c(static_cast<size_t>(M) * N);
    QGemmParams p;
    p.w = w.upload();
    p.a = as_f16(d_a);
    p.M = M;
    p.c = d_c.get();
    p.use_wgmma = true;
    ASSERT_CUDA(qgemm(p, nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());
    const std::vector<float> got = d_c.download();
    int bad = 0;
    for (int m = 0; m < M; ++m)
      for (int n = 0; n < N; ++n) {
        const float want =
            probe == 0 ? static_cast<float>(m % 64 + 64 * (n % 4)) : a[static_cast<size_t>(m) * K + n];
        const float v = got[static_cast<size_t>(m) * N + n];
        if (v == want || bad++ >= 12) continue;
        const int iv = static_cast<int>(v);
        if (probe == 0) {
          ADD_FAILURE() << "B probe: C[" << m << "][" << n << "] = " << v << ", want " << want
                        << (v == iv && iv >= 0 && iv < 256 ? testing::Message()
                                                                 << " (got the weight of k " << iv % 64
                                                                 << ", n % 4 = " << iv / 64 << ")"
                                                           : testing::Message() << " (not a single weight)");
        } else {
          ADD_FAILURE() << "A probe: C[" << m << "][" << n << "] = " << v << ", want " << want
                        << (v == iv && iv >= 0 && iv < 1024
                                ? testing::Message()
                                      << " (got A of k " << iv % 64 << ", m % 16 = " << iv / 64 << ")"
                                : testing::Message() << " (not a single element)");
        }
      }
    EXPECT_EQ(bad, 0) << (probe == 0 ? "B (fp16 W tile) layout, M " : "A tile layout, M ") << M;
  }
}

TEST(CudaQgemmWgmma, MatchesMmaSyncAndCpu) {
  SKIP_WITHOUT_GPU();
  SKIP_WITHOUT_HOPPER();
  uint32_t seed = 9000;
  int mode = 0;
  for (int bits : {4, 8}) {
    for (int K : {128, 2048, 4096}) {
      for (int N : {16, 257, 2048, 12352}) {
        const Weights wt(N, K, bits, seed += 7);
        for (int M : {1, 64, 65, 300, 4096}) {
          // 4096 x 12352 costs ~10 s of host work a case (inputs, every-element comparison): N 12352 is covered
          // at M <= 300 and the 4096-row tiles at N 2048.
          if (M == 4096 && N == 12352) continue;
          // Output modes rotate over the shapes; every mode on the tail shape 65 x 257 and at 4096 x 2048.
          const bool all_modes = (M == 65 && N == 257) || (M == 4096 && N == 2048);
          for (int m = 0; m < (all_modes ? 3 : 1); ++m) {
            check_wgmma(wt, M, static_cast<GemmOut>((mode + m) % 3), seed += 3);
            if (HasFatalFailure()) return;
          }
          ++mode;
        }
      }
    }
  }
}

TEST(CudaQgemmWgmma, DirectCallAndBadShapes) {
  SKIP_WITHOUT_GPU();
  SKIP_WITHOUT_HOPPER();
  HostQMatrix w = fast_qmatrix(16, 128, 4, 77);
  DeviceBuffer<uint16_t> a(std::vector<uint16_t>(4 * 128, to_f16_bits(1.0f)));
  DeviceBuffer<float> c(4 * 16);
  QGemmParams p;
  p.w = w.upload();
  p.a = as_f16(a);
  p.M = 4;
  p.c = c.get();
  EXPECT_EQ(qgemm_wgmma(p, nullptr), cudaSuccess);  // use_wgmma false: the direct entry runs wgmma anyway
  ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<float> got = c.download();
  for (int r = 0; r < 4; ++r)
    for (int n = 0; n < 16; ++n) {
      double ref = 0;
      for (int k = 0; k < 128; ++k) ref += f16_round(w.dequant(n, k));
      EXPECT_NEAR(got[r * 16 + n], ref, 1e-4 * (1 + std::fabs(ref))) << "row " << r << " col " << n;
    }
  p.use_wgmma = true;
  p.ldc = 8;  // < N
  EXPECT_EQ(qgemm(p, nullptr), cudaErrorInvalidValue);
  p.ldc = 0;
  p.M = 0;
  EXPECT_EQ(qgemm(p, nullptr), cudaErrorInvalidValue);
  p.M = 4;
  p.w.cols = 96;  // not a multiple of 64
  EXPECT_EQ(qgemm(p, nullptr), cudaErrorInvalidValue);
  p.w.cols = 128;
  p.w.bits = 3;
  EXPECT_EQ(qgemm(p, nullptr), cudaErrorInvalidValue);
  p.w.bits = 4;
  p.a = reinterpret_cast<const __half*>(reinterpret_cast<const char*>(p.a) + 2);  // not 16-byte aligned
  EXPECT_EQ(qgemm(p, nullptr), cudaErrorInvalidValue);
  DeviceBuffer<uint16_t> w16(16 * 128 + 8);
  EXPECT_EQ(qgemm_expand_w16(p.w, nullptr, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(qgemm_expand_w16(p.w, as_f16_mut(w16) + 1, nullptr), cudaErrorInvalidValue);  // not 16-byte aligned
  p.w.cols = 96;
  EXPECT_EQ(qgemm_expand_w16(p.w, as_f16_mut(w16), nullptr), cudaErrorInvalidValue);
  p.w.cols = 128;
  p.a = as_f16(a);
  for (const int tile_n : {-1, 64, 512}) {  // the test-only width knob takes 0, 128 and 256 only
    p.wgmma_tile_n = tile_n;
    EXPECT_EQ(qgemm_wgmma(p, nullptr), cudaErrorInvalidValue) << "wgmma_tile_n " << tile_n;
  }
}

// W expanded to fp16 first (QGemmParams::w16), then the copying GEMM (qgemm_w16_kernel at the backend's choice of
// width): the same fp16 operands and the same k16 order as the dequantising tiles, so every output bit must be equal.
TEST(CudaQgemmWgmma, W16EqualsDequantisingTiles) {
  SKIP_WITHOUT_GPU();
  SKIP_WITHOUT_HOPPER();
  struct Case {
    int N, K, M, bits;
    GemmOut out;
  };
  const Case cases[] = {{12352, 2048, 1100, 4, GemmOut::f32}, {2048, 4096, 4096, 4, GemmOut::add_f32},
                        {2048, 4096, 300, 4, GemmOut::f16},   {257, 2048, 65, 4, GemmOut::f32},
                        {16, 128, 1, 4, GemmOut::add_f32},    {9216, 2048, 777, 8, GemmOut::f32},
                        {300, 128, 129, 8, GemmOut::f16}};
  uint32_t seed = 12000;
  for (const Case& c : cases) {
    SCOPED_TRACE(testing::Message() << "N " << c.N << " K " << c.K << " M " << c.M << " bits " << c.bits);
    HostQMatrix hw = fast_qmatrix(c.N, c.K, c.bits, seed += 5);
    QGemmParams p;
    p.w = hw.upload();
    DeviceBuffer<uint16_t> a(to_f16(random_vector(static_cast<size_t>(c.M) * c.K, seed + 1)));
    p.a = as_f16(a);
    p.M = c.M;
    p.out = c.out;
    const std::vector<float> c0 = random_vector(static_cast<size_t>(c.M) * c.N, seed + 2);
    // Paths: the dequantising tiles; W expanded by the call; W expanded once beforehand (qgemm_expand_w16, into a
    // buffer first filled with NaN bits, so that a missing expansion cannot pass) and kept (w16_expanded).
    std::vector<float> got[3];
    DeviceBuffer<uint16_t> w16(qgemm_w16_halves(p.w) + 8);
    for (int path = 0; path < 3; ++path) {
      DeviceBuffer<uint16_t> cb(to_f16(c0));
      DeviceBuffer<float> cf(c0);
      p.c = c.out == GemmOut::f16 ? static_cast<void*>(cb.get()) : static_cast<void*>(cf.get());
      p.w16 = path ? as_f16_mut(w16) : nullptr;
      p.w16_bytes = path ? w16.size() * 2 : 0;
      p.w16_expanded = path == 2;
      if (path == 2) {
        ASSERT_CUDA(cudaMemset(w16.get(), 0xff, w16.size() * 2));
        ASSERT_CUDA(qgemm_expand_w16(p.w, as_f16_mut(w16), nullptr));
      }
      ASSERT_CUDA(qgemm_wgmma(p, nullptr));
      ASSERT_CUDA(cudaDeviceSynchronize());
      if (c.out != GemmOut::f16) {
        got[path] = cf.download();
      } else {
        for (uint16_t b : cb.download()) got[path].push_back(f16_bits_to_float(b));
      }
    }
    for (int path = 1; path < 3; ++path) {
      ASSERT_EQ(got[0].size(), got[path].size());
      size_t differ = 0, first = 0;
      for (size_t i = 0; i < got[0].size(); ++i) {
        if (std::memcmp(&got[0][i], &got[path][i], sizeof(float)) != 0 && differ++ == 0) first = i;
      }
      EXPECT_EQ(differ, 0u) << "path " << path << ": first at row " << first / c.N << " col " << first % c.N << ": "
                            << got[path][first] << " against " << got[0][first];
    }
  }
}

// ---- the fp16 copy's tile order

// The fp16 value qgemm_expand_w16 writes for W[n][k], computed on the host with the device's operations (4-bit:
// fmaf(0.5 + q / 256, 256 s, b - 128 s), 8-bit: fmaf(q, s, b), both fp32, then one round-to-nearest to fp16), so
// that the layout check below can ask for equal bits.
uint16_t expanded_bits(const HostQMatrix& m, int n, int k) {
  const int per_word = 32 / m.bits;
  const uint32_t word = m.words[n * m.words_per_row() + k / per_word];
  const uint32_t q = (word >> ((k % per_word) * m.bits)) & ((1u << m.bits) - 1);
  const size_t g = static_cast<size_t>(n) * m.groups_per_row() + k / kQuantGroup;
  const float s = bf16_bits_to_float(m.scales[g]), b = bf16_bits_to_float(m.biases[g]);
  const float v = m.bits == 4 ? std::fmaf(0.5f + static_cast<float>(q) / 256.0f, 256.0f * s, b - 128.0f * s)
                              : std::fmaf(static_cast<float>(q), s, b);
  return to_f16_bits(v);
}

// qgemm_expand_w16's layout, element by element, into a buffer first filled with NaN bits (with 8 guard halves past
// qgemm_w16_halves that must stay NaN): half h of the copy is tile h / 16384 = (row block b, step kt) with b = tile /
// KT, kt = tile % KT; within the tile, row r = (h / 64) % 256 and stored chunk (h / 8) % 8, which holds column chunk
// ((h / 8) % 8) ^ (r & 7); element h % 8 of it. So W[256 b + r][64 kt + 8 (chunk ^ (r & 7)) + h % 8], or +0.0 for the
// padding rows 256 b + r >= N.
TEST(CudaQgemmWgmma, W16CopyTileOrder) {
  SKIP_WITHOUT_GPU();
  SKIP_WITHOUT_HOPPER();
  struct Case {
    int N, K, bits;
  };
  const Case cases[] = {{300, 128, 4}, {300, 128, 8}, {200, 192, 4}, {512, 64, 8}, {12352, 2048, 4}};
  uint32_t seed = 15000;
  for (const Case& c : cases) {
    SCOPED_TRACE(testing::Message() << "N " << c.N << " K " << c.K << " bits " << c.bits);
    HostQMatrix hw = fast_qmatrix(c.N, c.K, c.bits, seed += 11);
    const QMatrix w = hw.upload();
    const size_t halves = qgemm_w16_halves(w);
    ASSERT_EQ(halves, static_cast<size_t>((c.N + 255) / 256) * 256 * c.K);
    DeviceBuffer<uint16_t> w16(halves + 8);
    ASSERT_CUDA(cudaMemset(w16.get(), 0xff, w16.size() * 2));
    ASSERT_CUDA(qgemm_expand_w16(w, as_f16_mut(w16), nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());
    const std::vector<uint16_t> got = w16.download();
    const int KT = c.K / 64;
    size_t bad = 0;
    for (size_t h = 0; h < halves; ++h) {
      const size_t tile = h / 16384;
      const int r = static_cast<int>(h / 64 % 256), chunk = static_cast<int>(h / 8 % 8), e = static_cast<int>(h % 8);
      const int n = static_cast<int>(tile / KT) * 256 + r,
                k = static_cast<int>(tile % KT) * 64 + 8 * (chunk ^ (r & 7)) + e;
      const uint16_t want = n < c.N ? expanded_bits(hw, n, k) : uint16_t{0};
      if (got[h] != want && bad++ < 8) {
        ADD_FAILURE() << "half " << h << " (tile " << tile << ", row " << r << ", stored chunk " << chunk
                      << "): bits 0x" << std::hex << got[h] << ", want 0x" << want << std::dec << " = W[" << n
                      << "][" << k << "]" << (n < c.N ? "" : " (padding row: zero)");
      }
    }
    EXPECT_EQ(bad, 0u) << "elements of the copy not in qgemm_w16_halves's tile order";
    for (size_t h = halves; h < got.size(); ++h) EXPECT_EQ(got[h], 0xffff) << "wrote past the copy at half " << h;
  }
}

// A QGemmParams output buffer holding c0 (fp16 or fp32 by p.out) and its contents as floats after a call.
struct OutBuf {
  DeviceBuffer<uint16_t> h;
  DeviceBuffer<float> f;
  bool f16;
  OutBuf(const std::vector<float>& c0, GemmOut out) : f16(out == GemmOut::f16) {
    if (f16) h = DeviceBuffer<uint16_t>(to_f16(c0));
    else f = DeviceBuffer<float>(c0);
  }
  void* ptr() const { return f16 ? static_cast<void*>(h.get()) : static_cast<void*>(f.get()); }
  std::vector<float> get() const {
    if (!f16) return f.download();
    std::vector<float> v;
    for (uint16_t b : h.download()) v.push_back(f16_bits_to_float(b));
    return v;
  }
};

// Every element of `got` has the bits of the same element of `want` (rows of ldc floats).
void expect_same_bits(const std::vector<float>& got, const std::vector<float>& want, int ldc, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t differ = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0 && differ++ == 0) first = i;
  EXPECT_EQ(differ, 0u) << what << ": " << differ << " elements differ, the first at row " << first / ldc << " col "
                        << first % ldc << ": " << got[first] << " against " << want[first];
}

// The fp16-W kernel on the tile-order copy (qgemm_w16_kernel, 128- and 256-wide tiles forced with
// QGemmParams::wgmma_tile_n, so that both run at every M, N) against the dequantising kernel at the same width, on
// fresh random weights and activations: the same fp16 operands, the same wgmma sequence, so every output bit must be
// equal (asserted on every element, the row padding past N included: all start from the same c0, and nothing may
// be written past N). Then against the CPU reference on sampled elements (tolerance as MatchesMmaSyncAndCpu).
// Shapes: M 1, 127, 128, 129, 255, 256, 257, 4097 (tails in the last 128-row tile), N 12352 (48 x 256 + 64: the
// copy's padded rows), 2048, 300 (one full 256-row tile and a tail) and 200 (< 256), K 2048 and 4096, 4- and 8-bit
// W; the output modes rotate over the row counts, all three at 4097 x 2048 and at 129 x 300. At M 257 the kernel
// also expands W itself (w16_expanded false, into a NaN-filled buffer of its own).
TEST(CudaQgemmWgmma, W16TileOrderEqualsDequantising) {
  SKIP_WITHOUT_GPU();
  SKIP_WITHOUT_HOPPER();
  struct Case {
    int N, K, bits;
  };
  const Case cases[] = {{12352, 2048, 4}, {2048, 4096, 4}, {300, 4096, 8}, {200, 2048, 8}, {12352, 2048, 8}};
  const int Ms[] = {1, 127, 128, 129, 255, 256, 257, 4097};
  uint32_t seed = 16000;
  int mode = 0;
  for (const Case& c : cases) {
    const Weights wt(c.N, c.K, c.bits, seed += 13);
    DeviceBuffer<uint16_t> w16(qgemm_w16_halves(wt.dev)), w16_call(qgemm_w16_halves(wt.dev));
    ASSERT_CUDA(cudaMemset(w16.get(), 0xff, w16.size() * 2));
    ASSERT_CUDA(qgemm_expand_w16(wt.dev, as_f16_mut(w16), nullptr));
    for (const int M : Ms) {
      // 8-bit gdn_in is there for its N tail in 8 bits: M 4097 is covered by the 4-bit case.
      if (M == 4097 && c.N == 12352 && c.bits == 8) continue;
      const bool all_modes = (M == 4097 && c.N == 2048) || (M == 129 && c.N == 300);
      for (int m = 0; m < (all_modes ? 3 : 1); ++m) {
        const GemmOut out = static_cast<GemmOut>((mode + m) % 3);
        SCOPED_TRACE(testing::Message() << "M " << M << " N " << c.N << " K " << c.K << " bits " << c.bits << " out "
                                        << static_cast<int>(out));
        GemmInputs in(wt, M, out, seed += 3);
        const std::vector<float>& a = in.a;
        const std::vector<float>& c0 = in.c0;
        const int ldc = in.ldc;
        QGemmParams& p = in.p;
        for (const int tile_n : {256, 128}) {
          SCOPED_TRACE(testing::Message() << "tiles " << tile_n << " wide");
          p.wgmma_tile_n = tile_n;
          // Paths: 0 the dequantising kernel, 1 qgemm_w16_kernel on the copy, 2 (M 257) qgemm_w16_kernel expanding
          // W first.
          std::vector<float> got[3];
          for (int path = 0; path < (M == 257 ? 3 : 2); ++path) {
            OutBuf cb(c0, out);
            p.c = cb.ptr();
            p.w16 = path == 0 ? nullptr : as_f16_mut(path == 2 ? w16_call : w16);
            p.w16_bytes = path == 0 ? 0 : w16.size() * 2;
            p.w16_expanded = path != 2;
            if (path == 2) ASSERT_CUDA(cudaMemset(w16_call.get(), 0xff, w16_call.size() * 2));
            ASSERT_CUDA(qgemm_wgmma(p, nullptr));
            ASSERT_CUDA(cudaDeviceSynchronize());
            got[path] = cb.get();
          }
          expect_same_bits(got[1], got[0], ldc, "fp16-W kernel vs the dequantising kernel");
          if (M == 257) expect_same_bits(got[2], got[1], ldc, "fp16-W kernel expanding W itself vs on the copy");
          if (HasFailure()) return;

          // Nothing past N (the three paths agree there, so check one against c0) and the CPU reference on sampled
          // elements: all rows up to 80, else the first and last 8 and 16 spread between; all columns up to 512,
          // else every 13th and the last 16.
          auto c_init = [&](size_t i) { return out == GemmOut::f16 ? f16_round(c0[i]) : c0[i]; };
          int bad = 0;
          for (int r = 0; r < M; ++r)
            for (int n = c.N; n < ldc; ++n) {
              const size_t i = static_cast<size_t>(r) * ldc + n;
              if (got[1][i] != c_init(i) && bad++ < 5) ADD_FAILURE() << "wrote past N at row " << r << " col " << n;
            }
          std::vector<int> rows, cols;
          for (int r = 0; r < M; ++r)
            if (M <= 80 || r < 8 || r >= M - 8 || r % (M / 16) == 0) rows.push_back(r);
          for (int n = 0; n < c.N; ++n)
            if (c.N <= 512 || n % 13 == 0 || n >= c.N - 16) cols.push_back(n);
          for (int r : rows) {
            const float* x = &a[static_cast<size_t>(r) * c.K];
            for (int n : cols) {
              const size_t i = static_cast<size_t>(r) * ldc + n;
              const Dot d = dot_row(wt.rows[n], x);
              double ref = d.dot, tol = d.tol();
              if (out == GemmOut::add_f32) ref += c0[i], tol += 1e-6 * std::fabs(c0[i]);
              if (out == GemmOut::f16) tol += kF16 * std::fabs(ref);
              if (!(std::fabs(got[1][i] - ref) <= tol) && bad++ < 5) {
                ADD_FAILURE() << "vs CPU: row " << r << " col " << n << ": got " << got[1][i] << " want " << ref
                              << " tol " << tol;
              }
            }
          }
          EXPECT_EQ(bad, 0) << "fp16-W kernel vs CPU";
          if (HasFailure()) return;
        }
      }
      ++mode;
    }
  }
}

// Exact-integer probe of the fp16-W kernel's W stages on the tile-order copy (read it first if
// W16TileOrderEqualsDequantising fails): 8-bit codes, scale 1, bias 256 kt in step kt (exact in bf16 and, with the
// code, in fp16: at most 1535), code of W[n][k] = k % 64 + 64 (n / 128 % 2) + 128 (n % 2); row m of A has a single 1,
// at column k_m = 3 m % 384 (K = 384: six steps, so the ring wraps and every barrier changes phase). So C[m][n] =
// W[n][k_m] exactly, and a wrong value v names the weight it came from: step v / 256, column v % 64 within it, the
// 128-row half of the copy's 256-row tile (v / 64 % 2) and the row's parity (v / 128 % 2). N = 512 (two tiles of the
// copy); M 256 and 128. Run on the dequantising kernel too: if it fails as well, the probe is wrong, not the copy.
TEST(CudaQgemmWgmma, W16LayoutProbe) {
  SKIP_WITHOUT_GPU();
  SKIP_WITHOUT_HOPPER();
  const int N = 512, K = 384, KT = K / 64;
  HostQMatrix w = exact_q8(N, K, [](int n, int k) { return k % 64 + 64 * (n / 128 % 2) + 128 * (n % 2); });
  for (int n = 0; n < N; ++n)
    for (int kt = 0; kt < KT; ++kt) w.biases[n * KT + kt] = to_bf16_bits(256.0f * kt);
  const QMatrix dw = w.upload();
  DeviceBuffer<uint16_t> w16(qgemm_w16_halves(dw));
  ASSERT_CUDA(qgemm_expand_w16(dw, as_f16_mut(w16), nullptr));
  auto want = [&](int m, int n) {
    const int k = 3 * m % K;
    return static_cast<float>(k % 64 + 64 * (n / 128 % 2) + 128 * (n % 2) + 256 * (k / 64));
  };
  for (const int M : {256, 128}) {
    std::vector<float> a(static_cast<size_t>(M) * K, 0.0f);
    for (int m = 0; m < M; ++m) a[static_cast<size_t>(m) * K + 3 * m % K] = 1.0f;
    DeviceBuffer<uint16_t> d_a(to_f16(a));
    for (int path = 0; path < 3; ++path) {  // qgemm_w16_kernel<256>, qgemm_w16_kernel<128>, the dequantising kernel
      const char* name[3] = {"qgemm_w16_kernel<256>", "qgemm_w16_kernel<128>", "dequantising kernel"};
      SCOPED_TRACE(testing::Message() << name[path] << ", M " << M);
      DeviceBuffer<float> d_c(static_cast<size_t>(M) * N);
      QGemmParams p;
      p.w = dw;
      p.a = as_f16(d_a);
      p.M = M;
      p.c = d_c.get();
      p.wgmma_tile_n = path == 1 ? 128 : 256;
      if (path < 2) p.w16 = as_f16_mut(w16), p.w16_bytes = w16.size() * 2, p.w16_expanded = true;
      ASSERT_CUDA(qgemm_wgmma(p, nullptr));
      ASSERT_CUDA(cudaDeviceSynchronize());
      const std::vector<float> got = d_c.download();
      int bad = 0;
      for (int m = 0; m < M; ++m)
        for (int n = 0; n < N; ++n) {
          const float v = got[static_cast<size_t>(m) * N + n], wv = want(m, n);
          if (v == wv || bad++ >= 12) continue;
          const int iv = static_cast<int>(v);
          testing::Message why;
          if (v == iv && iv >= 0 && iv < 256 * KT) {
            why << " (got the weight of step " << iv / 256 << ", column " << iv % 64 << " of the step, W-tile half "
                << iv / 64 % 2 << ", row parity " << iv / 128 % 2 << "; want step " << 3 * m % K / 64 << ", column "
                << 3 * m % K % 64 << ", half " << n / 128 % 2 << ", parity " << n % 2 << ")";
          } else {
            why << " (not a single weight)";
          }
          ADD_FAILURE() << "C[" << m << "][" << n << "] = " << v << ", want " << wv << why;
        }
      EXPECT_EQ(bad, 0);
    }
  }
}

// ---- timings (print only)
// ----------------------------------------------------------------------------------------

TEST(CudaQgemmWgmmaBench, DenseShapes) {
  SKIP_WITHOUT_GPU();
  SKIP_WITHOUT_HOPPER();
  struct Shape {
    const char* name;
    int N, K, bits;
  };
  const Shape shapes[] = {{"gdn in_proj", 12352, 2048, 4},    {"attn in", 9216, 2048, 4},
                          {"out_proj", 2048, 4096, 4},        {"N 2048 K 2048", 2048, 2048, 4},
                          {"N 12352 K 4096", 12352, 4096, 4}, {"N 2048 K 128", 2048, 128, 4},
                          {"N 257 K 2048", 257, 2048, 4},     {"N 16 K 2048", 16, 2048, 4},
                          {"gdn in_proj q8", 12352, 2048, 8}, {"router q8", 256, 2048, 8}};
  const DeviceBuffer<uint16_t> pool = bench_pool(size_t{3} << 30);
  const DeviceBuffer<uint16_t> a = bench_pool(size_t{4096} * 4096 * 2, 7);  // fp16 activations in +-[1, 1.25)
  DeviceBuffer<float> c(size_t{4096} * 12352);
  DeviceBuffer<uint16_t> w16(size_t{(12352 + 255) / 256 * 256} * 4096);  // the largest shape's qgemm_w16_halves
  for (const int M : {256, 1024, 4096}) {
  std::printf(
      "\nqgemm at M %d, cold weights (a different copy per call), CUDA-graph replay: mma.sync | wgmma | wgmma on "
      "W expanded to fp16 (expansion included)\n",
      M);
  for (const Shape& s : shapes) {
    double tf[3] = {0, 0, 0}, us[3] = {0, 0, 0};
    for (int path = 0; path < 3; ++path) {
      us[path] = graph_time_us(
          [&](int i, cudaStream_t st) {
            QGemmParams p;
            p.w = bench_qmatrix(pool, s.N, s.K, s.bits, i);
            p.a = as_f16(a);
            p.M = M;
            p.c = c.get();
            p.use_wgmma = path >= 1;
            if (path == 2) p.w16 = as_f16_mut(w16), p.w16_bytes = w16.size() * 2;
            return qgemm(p, st);
          },
          4);
      tf[path] = us[path] > 0 ? 2.0 * M * s.N * s.K / (us[path] * 1e6) : 0;
    }
    std::printf("  %-16s N %6d K %5d q%d: %9.1f us %6.1f TFLOP/s | %9.1f us %6.1f TFLOP/s | %9.1f us %6.1f TFLOP/s\n",
                s.name, s.N, s.K, s.bits, us[0], tf[0], us[1], tf[1], us[2], tf[2]);
  }
  }
}

// The fp16-W GEMM on resident copies (expanded once, as the backend keeps them; four copies, one a call, so that W
// comes cold from HBM as in the prefill) at the prefill's dense shapes: qgemm_w16_kernel at 256-wide tiles | what the
// backend runs (256-wide where wgmma_dense_wide, else 128-wide, marked).
TEST(CudaQgemmWgmmaBench, W16Resident) {
  SKIP_WITHOUT_GPU();
  SKIP_WITHOUT_HOPPER();
  struct Shape {
    const char* name;
    int N, K;
  };
  const Shape shapes[] = {{"gdn in_proj", 12352, 2048}, {"attn in", 9216, 2048}, {"out_proj", 2048, 4096}};
  const int kMaxM = 8192;
  const int kIters = 4, copies = kIters;  // a graph of 4 calls, each on a copy of its own (> the L2 together)
  const DeviceBuffer<uint16_t> pool = bench_pool(size_t{256} << 20);
  const DeviceBuffer<uint16_t> a = bench_pool(size_t{kMaxM} * 4096 * 2, 7);  // fp16 activations in +-[1, 1.25)
  DeviceBuffer<float> c(size_t{kMaxM} * 12352);
  for (const Shape& s : shapes) {
    const size_t halves = qgemm_w16_halves(bench_qmatrix(pool, s.N, s.K, 4, 0));
    DeviceBuffer<uint16_t> w16(halves * copies);
    for (int i = 0; i < copies; ++i)
      ASSERT_CUDA(qgemm_expand_w16(bench_qmatrix(pool, s.N, s.K, 4, i), as_f16_mut(w16) + halves * i, nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());
    std::printf(
        "\n%s N %d K %d q4, fp16 W resident (%d copies), CUDA-graph replay: 256-wide tiles | the backend's choice\n",
        s.name, s.N, s.K, copies);
    for (const int M : {1024, 2048, 4096, 8192}) {
      double us[2] = {0, 0}, tf[2] = {0, 0};
      for (int path = 0; path < 2; ++path) {
        us[path] = graph_time_us(
            [&](int i, cudaStream_t st) {
              QGemmParams p;
              p.w = bench_qmatrix(pool, s.N, s.K, 4, i % copies);
              p.a = as_f16(a);
              p.M = M;
              p.c = c.get();
              p.w16 = as_f16_mut(w16) + halves * (i % copies);
              p.w16_bytes = halves * 2;
              p.w16_expanded = true;
              p.wgmma_tile_n = path == 0 ? 256 : 0;
              return qgemm_wgmma(p, st);
            },
            kIters);
        tf[path] = us[path] > 0 ? 2.0 * M * s.N * s.K / (us[path] * 1e6) : 0;
      }
      const bool wide = static_cast<long>((M + 127) / 128) * ((s.N + 255) / 256) >= 132;  // wgmma_dense_wide
      std::printf("  M %5d: %9.1f us %6.1f TFLOP/s | %9.1f us %6.1f TFLOP/s (%s)\n", M, us[0], tf[0], us[1], tf[1],
                  wide ? "256" : "128");
    }
  }
}

}  // namespace
}  // namespace lily::cuda::test
