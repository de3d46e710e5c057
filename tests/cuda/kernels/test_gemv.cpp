// gemv (src/cuda/kernels/gemv.cu) against a CPU reference on fresh random MLX-quantized matrices.
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <vector>

#include "cuda/kernels/gemv.cuh"
#include "cuda_test_util.h"

namespace lily::cuda::test {
namespace {

struct GemvCase {
  int rows, cols, bits;
  GemvPrologue prologue;
  bool residual;
};

// The prologue on the CPU (eqs 1-2 and 19), in double.
std::vector<float> reference_x(const GemvCase& c, const std::vector<float>& in, const std::vector<float>& norm_w,
                               const std::vector<float>& z, int head_dim, float eps) {
  std::vector<float> x(in);
  if (c.prologue == GemvPrologue::rms_norm) {
    double ss = 0;
    for (float v : in) ss += static_cast<double>(v) * v;
    const double inv = 1.0 / std::sqrt(ss / c.cols + eps);
    for (int e = 0; e < c.cols; ++e) x[e] = static_cast<float>(in[e] * inv * norm_w[e]);
  } else if (c.prologue == GemvPrologue::gated_rms_norm) {
    for (int h = 0; h < c.cols / head_dim; ++h) {
      double ss = 0;
      for (int d = 0; d < head_dim; ++d) ss += static_cast<double>(in[h * head_dim + d]) * in[h * head_dim + d];
      const double inv = 1.0 / std::sqrt(ss / head_dim + eps);
      for (int d = 0; d < head_dim; ++d) {
        const int e = h * head_dim + d;
        const double silu = z[e] / (1.0 + std::exp(-static_cast<double>(z[e])));
        x[e] = static_cast<float>(norm_w[d] * in[e] * inv * silu);
      }
    }
  }
  return x;
}

void run_case(const GemvCase& c, uint32_t seed, int head_dim = 128) {
  SCOPED_TRACE(testing::Message() << "rows " << c.rows << " cols " << c.cols << " bits " << c.bits
                                  << " prologue " << static_cast<int>(c.prologue) << " residual "
                                  << c.residual << " head_dim " << head_dim);
  const float eps = 1e-6f;
  HostQMatrix hm = random_qmatrix(c.rows, c.cols, c.bits, seed);
  const std::vector<float> in = random_vector(c.cols, seed + 1);
  const std::vector<float> norm_w =
      random_vector(c.prologue == GemvPrologue::gated_rms_norm ? head_dim : c.cols, seed + 2, 0.1f, 1.0f);
  const std::vector<float> z = random_vector(c.cols, seed + 3);
  const std::vector<float> residual = random_vector(c.rows, seed + 4);

  DeviceBuffer<float> d_in(in), d_norm(norm_w), d_z(z), d_y(residual);
  GemvParams p;
  p.m = hm.upload();
  p.in = d_in.get();
  p.prologue = c.prologue;
  p.norm_w = d_norm.get();
  p.gate_z = d_z.get();
  p.head_dim = head_dim;
  p.eps = eps;
  p.residual = c.residual ? d_y.get() : nullptr;  // residual aliases y: y = y + W x
  p.y = d_y.get();
  ASSERT_CUDA(gemv(p, nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<float> y = d_y.download();

  // A second run on the same inputs must give the same bits (a moving result is a race).
  ASSERT_CUDA(d_y.upload(residual));
  ASSERT_CUDA(gemv(p, nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<float> y_again = d_y.download();

  const std::vector<float> x = reference_x(c, in, norm_w, z, head_dim, eps);
  int bad = 0;
  for (int r = 0; r < c.rows; ++r) {
    double ref = c.residual ? residual[r] : 0.0, abs_sum = 0.0;
    for (int col = 0; col < c.cols; ++col) {
      const double term = static_cast<double>(hm.dequant(r, col)) * x[col];
      ref += term;
      abs_sum += std::fabs(term);
    }
    // fp32 accumulation of up to 4096 products in a few partial sums: rounding stays well below 1e-5 of the
    // sum of |terms| (worst case ~ cols * 2^-24 = 2.4e-4 for fully adversarial signs, typical ~ 1e-6); the
    // prologue adds rsqrtf/__expf errors of ~1e-6 relative. A wrong nibble, group or row would be >> 1e-3.
    const double tol = 2e-5 * abs_sum + 1e-5 * (c.residual ? std::fabs(residual[r]) + 1.0 : 1.0);
    if (!(std::fabs(y[r] - ref) <= tol) && bad++ < 5) {
      ADD_FAILURE() << "row " << r << ": got " << y[r] << " want " << ref << " (tol " << tol << ")";
    }
    if (y[r] != y_again[r] && bad++ < 5) ADD_FAILURE() << "row " << r << " differs between two runs";
  }
  EXPECT_EQ(bad, 0);
}

TEST(CudaGemv, FourBitShapesNoPrologue) {
  SKIP_WITHOUT_GPU();
  uint32_t seed = 100;
  for (int cols : {512, 1024, 2048, 4096}) {
    for (int rows : {1, 3, 17, 130, 1001}) run_case({rows, cols, 4, GemvPrologue::none, false}, seed++);
  }
  run_case({1, 4096, 4, GemvPrologue::rms_norm, false}, seed++);  // few warps: the prologue's loop path
}

TEST(CudaGemv, FourBitModelShapesRmsNorm) {
  SKIP_WITHOUT_GPU();
  run_case({8192 + 4096 + 64, 2048, 4, GemvPrologue::rms_norm, false}, 200);  // GDN in_proj qkv|z|b|a
  run_case({9216, 2048, 4, GemvPrologue::rms_norm, false}, 201);              // attention q|k|v
  run_case({2048, 512, 4, GemvPrologue::rms_norm, true}, 202);
  run_case({777, 1024, 4, GemvPrologue::rms_norm, false}, 203);
}

TEST(CudaGemv, GatedRmsNormWithResidual) {
  SKIP_WITHOUT_GPU();
  run_case({2048, 4096, 4, GemvPrologue::gated_rms_norm, true}, 300);  // GDN out_proj: h += W GN(o, z)
  run_case({5, 4096, 4, GemvPrologue::gated_rms_norm, false}, 301);
  run_case({33, 2048, 4, GemvPrologue::gated_rms_norm, true}, 302);
  run_case({2048, 4096, 4, GemvPrologue::none, true}, 303);  // attention o_proj: h += W o
}

// The gated prologue's lane-group path for head sizes of 16 * 2^n (1 to 32 lanes a head), and the warp-per-head
// fallback for other sizes (96: 6 lanes).
TEST(CudaGemv, GatedRmsNormHeadSizes) {
  SKIP_WITHOUT_GPU();
  run_case({300, 4096, 4, GemvPrologue::gated_rms_norm, true}, 310, 16);
  run_case({300, 4096, 4, GemvPrologue::gated_rms_norm, true}, 311, 64);
  run_case({300, 4096, 4, GemvPrologue::gated_rms_norm, true}, 312, 256);
  run_case({300, 2048, 4, GemvPrologue::gated_rms_norm, false}, 313, 512);
  run_case({40, 1536, 4, GemvPrologue::gated_rms_norm, true}, 314, 96);
  run_case({40, 3072, 4, GemvPrologue::gated_rms_norm, true}, 315, 96);
}

TEST(CudaGemv, GenericWidthsAndEightBit) {
  SKIP_WITHOUT_GPU();
  run_case({100, 1536, 4, GemvPrologue::none, false}, 400);  // 4-bit width outside the fast set
  run_case({257, 2048, 8, GemvPrologue::none, false}, 401);  // router-sized, 8-bit
  run_case({1, 2048, 8, GemvPrologue::rms_norm, false}, 402);
  run_case({33, 512, 8, GemvPrologue::gated_rms_norm, true}, 403);
}

// Scales/biases that are not 16-byte aligned take the register path instead of the cp.async one.
TEST(CudaGemv, UnalignedScalesUseTheRegisterPath) {
  SKIP_WITHOUT_GPU();
  for (int cols : {512, 2048, 4096}) {
    SCOPED_TRACE(cols);
    const int rows = 301;
    HostQMatrix hm = random_qmatrix(rows, cols, 4, 500 + cols);
    const std::vector<float> in = random_vector(cols, 501), norm_w = random_vector(cols, 502, 0.1f, 1.0f);
    DeviceBuffer<float> d_in(in), d_norm(norm_w), d_y(rows);
    GemvParams p;
    p.m = hm.upload();
    DeviceBuffer<uint16_t> s_off(hm.scales.size() + 1), b_off(hm.biases.size() + 1);  // shifted by 2 bytes
    ASSERT_CUDA(cudaMemcpy(s_off.get() + 1, hm.scales.data(), hm.scales.size() * 2, cudaMemcpyHostToDevice));
    ASSERT_CUDA(cudaMemcpy(b_off.get() + 1, hm.biases.data(), hm.biases.size() * 2, cudaMemcpyHostToDevice));
    p.m.scales = reinterpret_cast<const __nv_bfloat16*>(s_off.get() + 1);
    p.m.biases = reinterpret_cast<const __nv_bfloat16*>(b_off.get() + 1);
    p.in = d_in.get();
    p.prologue = GemvPrologue::rms_norm;
    p.norm_w = d_norm.get();
    p.y = d_y.get();
    ASSERT_CUDA(gemv(p, nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());
    const std::vector<float> y = d_y.download();
    const GemvCase c{rows, cols, 4, GemvPrologue::rms_norm, false};
    const std::vector<float> x = reference_x(c, in, norm_w, {}, 128, 1e-6f);
    for (int r = 0; r < rows; ++r) {
      double ref = 0, abs_sum = 0;
      for (int col = 0; col < cols; ++col) {
        ref += static_cast<double>(hm.dequant(r, col)) * x[col];
        abs_sum += std::fabs(static_cast<double>(hm.dequant(r, col)) * x[col]);
      }
      ASSERT_NEAR(y[r], ref, 2e-5 * abs_sum + 1e-5) << "row " << r;  // tolerance: see run_case
    }
  }
}

// Back-to-back launches on one stream, each consuming the previous output (programmatic dependent launch
// lets a kernel start before its predecessor ends; it must still see the predecessor's results):
// v_{i+1} = v_i + W_i RMSNorm(v_i), 6 steps, against the same chain on the CPU.
TEST(CudaGemv, ChainedLaunchesSeePreviousOutputs) {
  SKIP_WITHOUT_GPU();
  const int n = 2048, steps = 6;
  std::vector<HostQMatrix> w;
  std::vector<QMatrix> dw;
  for (int i = 0; i < steps; ++i) w.push_back(random_qmatrix(n, n, 4, 600 + i));
  for (auto& m : w) dw.push_back(m.upload());
  const std::vector<float> v0 = random_vector(n, 610), norm_w = random_vector(n, 611, 0.1f, 1.0f);
  DeviceBuffer<float> a(v0), b(n), d_norm(norm_w);
  cudaStream_t stream;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (int i = 0; i < steps; ++i) {
    GemvParams p;
    p.m = dw[i];
    p.in = (i % 2 ? b : a).get();
    p.prologue = GemvPrologue::rms_norm;
    p.norm_w = d_norm.get();
    p.residual = p.in;
    p.y = (i % 2 ? a : b).get();
    ASSERT_CUDA(gemv(p, stream));
  }
  ASSERT_CUDA(cudaStreamSynchronize(stream));
  ASSERT_CUDA(cudaStreamDestroy(stream));
  const std::vector<float> got = (steps % 2 ? b : a).download();
  std::vector<float> v = v0;
  const GemvCase c{n, n, 4, GemvPrologue::rms_norm, true};
  for (int i = 0; i < steps; ++i) {
    const std::vector<float> x = reference_x(c, v, norm_w, {}, 128, 1e-6f);
    std::vector<float> next(n);
    for (int r = 0; r < n; ++r) next[r] = static_cast<float>(v[r] + w[i].dot(r, x.data()));
    v = next;
  }
  // Each step adds ~1e-6 relative error (see run_case); 6 steps and |v| ~ 1..10.
  for (int r = 0; r < n; ++r) ASSERT_NEAR(got[r], v[r], 1e-3 * (std::fabs(v[r]) + 1.0)) << "row " << r;
}

TEST(CudaGemv, RejectsBadArguments) {
  SKIP_WITHOUT_GPU();
  HostQMatrix hm = random_qmatrix(4, 512, 4, 7);
  DeviceBuffer<float> in(512), y(4);
  GemvParams p;
  p.m = hm.upload();
  p.in = in.get();
  p.y = y.get();
  GemvParams bad = p;
  bad.m.cols = 500;
  EXPECT_EQ(gemv(bad, nullptr), cudaErrorInvalidValue);
  bad = p;
  bad.m.bits = 3;
  EXPECT_EQ(gemv(bad, nullptr), cudaErrorInvalidValue);
  bad = p;
  bad.prologue = GemvPrologue::rms_norm;  // no norm_w
  EXPECT_EQ(gemv(bad, nullptr), cudaErrorInvalidValue);
  bad = p;
  bad.y = nullptr;
  EXPECT_EQ(gemv(bad, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(gemv(p, nullptr), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// Achieved bandwidth on the model's shapes, weights rotated through a 1 GB pool (cold L2), CUDA-graph replay.
TEST(CudaGemvBench, ModelShapes) {
  SKIP_WITHOUT_GPU();
  const DeviceBuffer<uint16_t> pool = bench_pool(size_t{1} << 30);
  const int max_rows = 248320;
  DeviceBuffer<float> in(random_vector(4096, 5)), norm_w(random_vector(4096, 6, 0.1f, 1.0f)), z(random_vector(4096, 7));
  DeviceBuffer<float> y(random_vector(max_rows, 8));
  struct Shape {
    const char* name;
    int rows, cols, bits;
    GemvPrologue prologue;
    bool residual;
    int iters;
  };
  const Shape shapes[] = {
      {"gemv [12352, 2048] q4 rms_norm (GDN in_proj)", 8192 + 4096 + 64, 2048, 4, GemvPrologue::rms_norm, false, 100},
      {"gemv [9216, 2048] q4 rms_norm (attn q|k|v)", 9216, 2048, 4, GemvPrologue::rms_norm, false, 100},
      {"gemv [2048, 4096] q4 gated + residual", 2048, 4096, 4, GemvPrologue::gated_rms_norm, true, 100},
      {"gemv [2048, 4096] q4 + residual (o_proj)", 2048, 4096, 4, GemvPrologue::none, true, 100},
      {"gemv [248320, 2048] q4 rms_norm (lm_head)", max_rows, 2048, 4, GemvPrologue::rms_norm, false, 12},
      {"gemv [257, 2048] q8 (router-sized, generic)", 257, 2048, 8, GemvPrologue::none, false, 100},
      {"gemv [12352, 2048] q4 rms, register path", -(8192 + 4096 + 64), 2048, 4, GemvPrologue::rms_norm, false, 100},
      {"gemv [248320, 2048] q4 rms, register path", -max_rows, 2048, 4, GemvPrologue::rms_norm, false, 12},
  };
  std::printf("\n");
  for (const Shape& sh_in : shapes) {
    Shape sh = sh_in;
    const bool unaligned = sh.rows < 0;  // scales shifted by 2 bytes: the register-path fallback
    sh.rows = std::abs(sh.rows);
    auto launch = [&](int i, cudaStream_t stream) {
      GemvParams p;
      p.m = bench_qmatrix(pool, sh.rows, sh.cols, sh.bits, i);
      if (unaligned) p.m.scales += 1, p.m.biases += 1;
      p.in = in.get();
      p.prologue = sh.prologue;
      p.norm_w = norm_w.get();
      p.gate_z = z.get();
      p.residual = sh.residual ? y.get() : nullptr;
      p.y = y.get();
      return gemv(p, stream);
    };
    const QMatrix m = bench_qmatrix(pool, sh.rows, sh.cols, sh.bits, 0);
    print_bandwidth(sh.name, graph_time_us(launch, sh.iters), static_cast<double>(m.bytes()));
  }
}

}  // namespace
}  // namespace lily::cuda::test
