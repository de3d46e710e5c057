// qgemm / qgemm_swiglu / rms_norm_rows (qgemm.cu) against CPU references on fresh random MLX-quantized weights,
// and the prefill GEMM timings (print only).
//
// Tolerances from the arithmetic: the kernels round each dequantized weight to fp16 (the reference does the
// same, so a weight differs only where the two fp32 dequantisations straddle an fp16 rounding midpoint: at
// most one fp16 ulp, 2^-10 relative, of one or two terms) and accumulate in fp32 (~2e-5 of the sum of |terms|,
// see test_gemv). A is fp16 in both.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include <cuda_fp16.h>

#include "cpu/blocks.h"
#include "cuda/kernels/qgemm.cuh"
#include "cuda_test_util.h"
#include "qgemm_refs.h"
#include "generic_refs.h"

namespace lily::cuda::test {
namespace {

// ---- qgemm
// -----------------------------------------------------------------------------------------------------

// split: scratch for split-K (qgemm_split_scratch_bytes(M), or kQgemmSplitScratchMax with big_scratch);
// wgmma: use_wgmma (where built).
void check_qgemm(int M, int N, int K, int bits, GemmOut out, uint32_t seed, bool split = false,
                 bool wgmma = false, bool big_scratch = false) {
  SCOPED_TRACE(testing::Message() << "M " << M << " N " << N << " K " << K << " bits " << bits << " out "
                                  << static_cast<int>(out) << (split ? " split-K scratch" : "")
                                  << (wgmma ? " wgmma" : ""));
  HostQMatrix w = random_qmatrix(N, K, bits, seed);
  std::vector<float> a = random_vector(static_cast<size_t>(M) * K, seed + 1);
  for (float& v : a) v = f16_round(v);
  const int ldc = N + (M % 2) * 3;  // exercise a row stride other than N
  const std::vector<float> c0 = random_vector(static_cast<size_t>(M) * ldc, seed + 2);
  DeviceBuffer<uint16_t> d_a(to_f16(a)), d_cb(to_f16(c0));
  DeviceBuffer<float> d_cf(c0);
  QGemmParams p;
  p.w = w.upload();
  p.a = as_f16(d_a);
  p.M = M;
  p.out = out;
  p.c = out == GemmOut::f16 ? static_cast<void*>(d_cb.get()) : static_cast<void*>(d_cf.get());
  p.ldc = ldc;
  p.use_wgmma = wgmma && wgmma_built();
  const size_t scratch_bytes = big_scratch ? kQgemmSplitScratchMax : qgemm_split_scratch_bytes(M, p.w);
  DeviceBuffer<unsigned char> scratch(split ? std::max<size_t>(1, scratch_bytes) : 1);
  if (split) p.split_scratch = scratch.get(), p.split_scratch_bytes = scratch_bytes;
  ASSERT_CUDA(qgemm(p, nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<float> got(static_cast<size_t>(M) * ldc);
  if (out == GemmOut::f16) {
    const std::vector<uint16_t> b = d_cb.download();
    for (size_t i = 0; i < b.size(); ++i) got[i] = f16_bits_to_float(b[i]);
  } else {
    got = d_cf.download();
  }
  // Rows checked: all, or for many rows the first and last 8 and 24 spread between.
  std::vector<int> rows;
  for (int r = 0; r < M; ++r)
    if (M <= 80 || r < 8 || r >= M - 8 || r % (M / 24) == 0) rows.push_back(r);
  std::vector<std::vector<float>> wr(N);
  for (int n = 0; n < N; ++n) dequant_row_f16(w, n, wr[n]);
  int bad = 0;
  for (int r : rows) {
    for (int n = 0; n < ldc; ++n) {
      const size_t i = static_cast<size_t>(r) * ldc + n;
      if (n >= N) {  // past N: untouched
        const float want = out == GemmOut::f16 ? f16_round(c0[i]) : c0[i];
        if (got[i] != want && bad++ < 5) ADD_FAILURE() << "wrote past N at row " << r << " col " << n;
        continue;
      }
      const Dot d = dot_row(wr[n], &a[static_cast<size_t>(r) * K]);
      double ref = d.dot, tol = d.tol();
      if (out == GemmOut::add_f32) ref += c0[i], tol += 1e-6 * std::fabs(c0[i]);
      if (out == GemmOut::f16) tol += kF16 * std::fabs(ref);
      if (!(std::fabs(got[i] - ref) <= tol) && bad++ < 5) {
        ADD_FAILURE() << "row " << r << " col " << n << ": got " << got[i] << " want " << ref << " tol "
                      << tol;
      }
    }
  }
  EXPECT_EQ(bad, 0);
}

TEST(CudaQgemm, MatchesCpu) {
  SKIP_WITHOUT_GPU();
  uint32_t seed = 100;
  int mode = 0;
  for (int bits : {4, 8})
    for (int K : {128, 2048})
      for (int N : {1, 16, 257, 2048})
        for (int M : {1, 7, 64, 65, 300}) {
          check_qgemm(M, N, K, bits, static_cast<GemmOut>(mode++ % 3), seed += 3);
          if (N == 257 && M == 65) {  // every output mode on one tail shape
            check_qgemm(M, N, K, bits, static_cast<GemmOut>(mode % 3), seed += 3);
            check_qgemm(M, N, K, bits, static_cast<GemmOut>((mode + 1) % 3), seed += 3);
          }
        }
  // Enough row and column tiles for the 128-row tiles (a grid of >= 132 of them), every output mode.
  for (int bits : {4, 8})
    for (int m = 0; m < 3; ++m)
      check_qgemm(2100, 2048 + 7 * m, 128, bits, static_cast<GemmOut>(m), seed += 3);
}

// Split-K for small grids (QGemmParams::split_scratch, add_f32): K in 2..8 parts, summed in order and added.
TEST(CudaQgemm, SplitKMatchesCpu) {
  SKIP_WITHOUT_GPU();
  uint32_t seed = 900;
  int splits = 0;
  for (int bits : {4, 8})
    for (int K : {128, 2048, 4096})
      for (int N : {16, 257, 2048})
        for (int M : {1, 7, 65, 256}) {
          QMatrix w;
          w.rows = N, w.cols = K, w.bits = bits;
          splits += qgemm_split_k_parts(M, w) > 1;
          check_qgemm(M, N, K, bits, GemmOut::add_f32, seed += 3, true, true);  // split: mma.sync anyway
          if (M == 65) check_qgemm(M, N, K, bits, static_cast<GemmOut>(splits % 2), seed += 3, true);
        }
  EXPECT_GT(splits, 20);  // most of these shapes split
  QMatrix big;
  big.rows = 12352, big.cols = 2048, big.bits = 4;
  EXPECT_EQ(qgemm_split_k_parts(4096, big), 1);  // a full grid never splits
  EXPECT_LE(qgemm_split_scratch_bytes(256, big), kQgemmSplitScratchMax);
}

// Rows past the last multiple of 128 that would add a round of tile blocks run as a GEMM of their own
// (qgemm_row_tail): the wgmma grid of gdn_out's shape (N 2048: 1,024 rows are 128 tiles, 1,025 are 144) and an
// mma.sync grid (N 3840: 240 blocks of 264 places at 1,024 rows, 270 at 1,025), every output mode, with and
// without split-K scratch for the tail.
// The rule alone (host code: runs without a GPU too).
TEST(CudaQgemm, RowTailRule) {
  QMatrix w;
  w.cols = 256, w.bits = 4;
  w.rows = 2048;
  EXPECT_EQ(qgemm_row_tail(1025, w, true), 1);
  EXPECT_EQ(qgemm_row_tail(1151, w, true), 127);
  EXPECT_EQ(qgemm_row_tail(1024, w, true), 0);
  EXPECT_EQ(qgemm_row_tail(1025, w, false), 0);  // 144 mma.sync blocks fit the 264 places
  EXPECT_EQ(qgemm_row_tail(100, w, true), 0);
  EXPECT_EQ(qgemm_row_tail(4097, w, true), 0);  // 33 x 8 wide tiles: 264 blocks, 2 rounds like 4,096's 256
  w.rows = 3840;
  EXPECT_EQ(qgemm_row_tail(1025, w, false), 1);
  w.rows = 12352;  // gdn_in: 8 x 49 wide tiles = 392 (3 rounds), 9 x 49 = 441 (4)
  EXPECT_EQ(qgemm_row_tail(1027, w, true), 3);
}

TEST(CudaQgemm, RowTailMatchesCpu) {
  SKIP_WITHOUT_GPU();
  uint32_t seed = 1500;
  int mode = 0;
  for (int bits : {4, 8}) {
    for (int M : {1025, 1090, 1151}) {
      for (const bool wg : {true, false}) {
        if (wg && !wgmma_built()) continue;
        const GemmOut out = static_cast<GemmOut>(mode % 3);
        const bool split = mode++ % 2 == 0;
        check_qgemm(M, wg ? 2048 : 3840, wg ? 256 : 128, bits, out, seed += 3, split, wg, true);
      }
    }
  }
}

TEST(CudaQgemm, SwigluMatchesCpu) {
  SKIP_WITHOUT_GPU();
  struct Case {
    int M, I, K, bits;
  };
  uint32_t seed = 500;
  for (const Case c : {Case{1, 64, 128, 4}, Case{65, 512, 2048, 4}, Case{300, 200, 1024, 4},
                       Case{7, 96, 2048, 8}, Case{130, 512, 512, 8}, Case{2100, 520, 128, 4}}) {
    SCOPED_TRACE(testing::Message() << "M " << c.M << " I " << c.I << " K " << c.K << " bits " << c.bits);
    HostQMatrix g = random_qmatrix(c.I, c.K, c.bits, seed += 3),
                u = random_qmatrix(c.I, c.K, c.bits, seed + 1);
    std::vector<float> a = random_vector(static_cast<size_t>(c.M) * c.K, seed + 2);
    for (float& v : a) v = f16_round(v);
    DeviceBuffer<uint16_t> d_a(to_f16(a)), d_act(static_cast<size_t>(c.M) * c.I);
    QGemmSwigluParams p;
    p.gate = g.upload();
    p.up = u.upload();
    p.a = as_f16(d_a);
    p.M = c.M;
    p.act = reinterpret_cast<__half*>(d_act.get());
    ASSERT_CUDA(qgemm_swiglu(p, nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());
    const std::vector<uint16_t> got = d_act.download();
    std::vector<float> gr, ur;
    int bad = 0;
    for (int n = 0; n < c.I; ++n) {
      dequant_row_f16(g, n, gr);
      dequant_row_f16(u, n, ur);
      for (int r = 0; r < c.M; ++r) {
        const Dot dg = dot_row(gr, &a[static_cast<size_t>(r) * c.K]),
                  du = dot_row(ur, &a[static_cast<size_t>(r) * c.K]);
        const double ref = silu_d(dg.dot) * du.dot;
        const double tol = kF16 * std::fabs(ref) + 1.1 * std::fabs(du.dot) * dg.tol() +
                           std::fabs(silu_d(dg.dot)) * du.tol() + 1e-7;
        const float v = f16_bits_to_float(got[static_cast<size_t>(r) * c.I + n]);
        if (!(std::fabs(v - ref) <= tol) && bad++ < 5) {
          ADD_FAILURE() << "row " << r << " col " << n << ": got " << v << " want " << ref;
        }
      }
    }
    EXPECT_EQ(bad, 0);
  }
}

TEST(CudaQgemm, RmsNormRowsMatchesCpu) {
  SKIP_WITHOUT_GPU();
  for (const int n : {128, 2048, 1000}) {
    const int T = 37;
    const std::vector<float> in = random_vector(static_cast<size_t>(T) * n, 700 + n, 2.0f);
    const std::vector<float> w = random_vector(n, 701 + n, 0.1f, 1.0f);
    DeviceBuffer<float> d_in(in), d_w(w);
    DeviceBuffer<uint16_t> d_out(static_cast<size_t>(T) * n);
    ASSERT_CUDA(rms_norm_rows(d_in.get(), d_w.get(), T, n, kEps,
                              reinterpret_cast<__half*>(d_out.get()), nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());
    const std::vector<uint16_t> got = d_out.download();
    for (int t = 0; t < T; ++t) {
      const std::vector<float> ref = rms_norm_ref(&in[static_cast<size_t>(t) * n], w.data(), n);
      for (int i = 0; i < n; ++i) {
        const float v = f16_bits_to_float(got[static_cast<size_t>(t) * n + i]);
        // One ulp relative, or the subnormal spacing 2^-24 for the smallest values.
        ASSERT_NEAR(v, ref[i], kUlp * std::fabs(ref[i]) + 6e-8) << "row " << t << " col " << i;
      }
    }
  }
}

TEST(CudaQgemm, RejectsBadShapes) {
  SKIP_WITHOUT_GPU();
  HostQMatrix w = random_qmatrix(16, 128, 4, 800);
  DeviceBuffer<uint16_t> a(4 * 128);
  DeviceBuffer<float> c(4 * 16);
  QGemmParams p;
  p.w = w.upload();
  p.a = as_f16(a);
  p.M = 4;
  p.c = c.get();
  EXPECT_EQ(qgemm(p, nullptr), cudaSuccess);
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
  QGemmSwigluParams s;
  EXPECT_EQ(qgemm_swiglu(s, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(rms_norm_rows(nullptr, nullptr, 1, 16, kEps, nullptr, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// ---- timings (print only)
// ----------------------------------------------------------------------------------------

TEST(CudaQgemmBench, DenseShapes) {
  SKIP_WITHOUT_GPU();
  struct Shape {
    const char* name;
    int N, K, bits;
  };
  const Shape shapes[] = {{"gdn in_proj", 12352, 2048, 4}, {"attn in", 9216, 2048, 4},
                          {"out_proj", 2048, 4096, 4},     {"shared gate/up", 512, 2048, 4},
                          {"shared down", 2048, 512, 4},   {"router q8", 256, 2048, 8},
                          {"lm_head", 248320, 2048, 4}};
  const DeviceBuffer<uint16_t> pool = bench_pool(size_t{3} << 30);
  const DeviceBuffer<uint16_t> a = bench_pool(size_t{4096} * 4096 * 2, 7);  // random fp16 activations in +-[1, 1.25)
  DeviceBuffer<float> c(size_t{512} * 248320);
  std::printf("\nqgemm, cold weights (a different copy per call), CUDA-graph replay:\n");
  for (const Shape& s : shapes) {
    for (int M : {4096, 512, 16}) {
      if ((M == 16) != (s.N == 248320) && M != 512) continue;  // lm_head at small M only
      if (s.N == 248320 && M == 4096) continue;
      const int iters = M == 4096 ? 4 : 10;
      const double us = graph_time_us(
          [&](int i, cudaStream_t st) {
            QGemmParams p;
            p.w = bench_qmatrix(pool, s.N, s.K, s.bits, i);
            p.a = as_f16(a);
            p.M = M;
            p.c = c.get();
            return qgemm(p, st);
          },
          iters);
      const double tflops = 2.0 * M * s.N * s.K / (us * 1e6);
      std::printf("  %-16s M %5d N %6d K %5d q%d: %9.1f us %7.1f TFLOP/s (%4.1f%% of 790)\n", s.name, M, s.N,
                  s.K, s.bits, us, tflops, 100 * tflops / 790);
    }
  }
  // Split-K (add_f32 with scratch) against the unsplit tiles at small M.
  DeviceBuffer<unsigned char> split(kQgemmSplitScratchMax);
  std::printf("\nqgemm add_f32 at small M: mma.sync | wgmma | split-K (us):\n");
  for (const Shape& s : shapes) {
    if (s.bits != 4 || s.N == 248320) continue;
    for (int M : {32, 128, 256, 512}) {
      double us[3];
      for (int path = 0; path < 3; ++path) {
        us[path] = graph_time_us(
            [&](int i, cudaStream_t st) {
              QGemmParams p;
              p.w = bench_qmatrix(pool, s.N, s.K, s.bits, i);
              p.a = as_f16(a), p.M = M, p.c = c.get(), p.out = GemmOut::add_f32;
              p.use_wgmma = path == 1 && wgmma_built();
              if (path == 2) p.split_scratch = split.get(), p.split_scratch_bytes = kQgemmSplitScratchMax;
              return qgemm(p, st);
            },
            10);
      }
      std::printf("  %-16s M %5d N %6d K %5d: %8.1f | %8.1f | %8.1f  (%d parts)\n", s.name, M, s.N, s.K, us[0],
                  us[1], us[2], qgemm_split_k_parts(M, bench_qmatrix(pool, s.N, s.K, s.bits, 0)));
    }
  }
  for (int M : {4096, 512}) {
    const double us = graph_time_us(
        [&](int i, cudaStream_t st) {
          QGemmSwigluParams p;
          p.gate = bench_qmatrix(pool, 512, 2048, 4, 2 * i);
          p.up = bench_qmatrix(pool, 512, 2048, 4, 2 * i + 1);
          p.a = as_f16(a);
          p.M = M;
          p.act = reinterpret_cast<__half*>(c.get());
          return qgemm_swiglu(p, st);
        },
        10);
    const double tflops = 4.0 * M * 512 * 2048 / (us * 1e6);
    std::printf("  %-16s M %5d I %6d K %5d q4: %9.1f us %7.1f TFLOP/s\n", "swiglu shared", M, 512, 2048, us,
                tflops);
  }
}

}  // namespace
}  // namespace lily::cuda::test
