// gemv (src/cuda/kernels/gemv.cu) against a CPU reference on fresh random MLX-quantized matrices.
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <string>
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

// Whether gemv() runs the shape on the tensor-core kernel (aligned scales: every matrix these tests upload).
bool on_tensor_cores(int bits, int rows, int cols) {
  return bits == 4 && (cols == 4096 || (cols == 2048 && rows >= 65536));
}

double reference_row(const HostQMatrix& hm, int r, const std::vector<float>& x, double residual) {
  double ref = residual;
  for (int col = 0; col < hm.cols; ++col) ref += static_cast<double>(hm.dequant(r, col)) * x[col];
  return ref;
}

// The error bound of row r. fp32 paths: accumulation of up to 4096 products in a few partial sums stays well below
// 1e-5 of the sum of |terms| (worst case ~ cols * 2^-24 = 2.4e-4 for fully adversarial signs, typical ~ 1e-6);
// the prologue adds rsqrtf/__expf errors of ~1e-6 relative. The tensor-core kernel rounds x to fp16: term k
// moves by w_k x_k d_k with independent |d_k| <= 2^-11, whose sum has a standard deviation <= 2^-11 / sqrt(3)
// of the l2 norm of the terms (6 of those here); and it takes the codes through sum_k (1024 + m q) x'_k from an
// fp32 accumulator at -1024 sum_k x'_k (a few 2^-24 of 1024 |scale| |x| a term: 2e-6 of that sum). A wrong
// nibble, group or row is >> this.
double row_tolerance(const HostQMatrix& hm, int r, const std::vector<float>& x, double residual, bool fp16_x) {
  double abs_sum = 0.0, sq_sum = 0.0, offset_sum = 0.0;
  for (int col = 0; col < hm.cols; ++col) {
    const double term = static_cast<double>(hm.dequant(r, col)) * x[col];
    abs_sum += std::fabs(term), sq_sum += term * term;
    const float scale = bf16_bits_to_float(hm.scales[static_cast<size_t>(r) * (hm.cols / 64) + col / 64]);
    offset_sum += 1024.0 * std::fabs(static_cast<double>(scale) * x[col]);
  }
  const double fixed = 1e-5 * (std::fabs(residual) + 1.0);
  const double x16 = 6.0 * std::ldexp(1.0, -11) / std::sqrt(3.0) * std::sqrt(sq_sum);
  return fp16_x ? 2e-5 * abs_sum + x16 + 2e-6 * offset_sum + fixed : 2e-5 * abs_sum + fixed;
}

// c's launch parameters without the output side (residual, y, rows).
GemvParams case_params(const GemvCase& c, const QMatrix& m, const float* in, const float* norm_w, const float* z,
                       int head_dim, float eps) {
  GemvParams p;
  p.m = m;
  p.in = in;
  p.prologue = c.prologue;
  p.norm_w = norm_w;
  p.gate_z = z;
  p.head_dim = head_dim;
  p.eps = eps;
  return p;
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
  GemvParams p = case_params(c, hm.upload(), d_in.get(), d_norm.get(), d_z.get(), head_dim, eps);
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
    const double ref = reference_row(hm, r, x, c.residual ? residual[r] : 0.0);
    const double tol = row_tolerance(hm, r, x, c.residual ? residual[r] : 0.0, on_tensor_cores(c.bits, c.rows, c.cols));
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
  run_case({65536 + 16 * 3 + 5, 2048, 4, GemvPrologue::rms_norm, false}, 204);  // lm_head-sized: tensor cores
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
    for (int r = 0; r < rows; ++r)  // the register path is fp32 at every width
      ASSERT_NEAR(y[r], reference_row(hm, r, x, 0.0), row_tolerance(hm, r, x, 0.0, false)) << "row " << r;
  }
}

// gemv_rows: n activation rows against one matrix in one launch. Each row must be bit-identical to gemv() of that
// row alone (batch invariance: the tensor-core kernel's columns are independent, the prologue per row the
// same) and within the bound of the CPU reference; rows of x and y strided as the decode step lays them out.
void run_rows_case(const GemvCase& c, int n, uint32_t seed) {
  SCOPED_TRACE(testing::Message() << "rows " << c.rows << " cols " << c.cols << " prologue "
                                  << static_cast<int>(c.prologue) << " residual " << c.residual << " n " << n);
  const float eps = 1e-6f;
  const int head_dim = 128, in_stride = c.cols + 4, out_stride = c.rows + 12;  // strides: multiples of 4 floats
  HostQMatrix hm = random_qmatrix(c.rows, c.cols, c.bits, seed);
  const std::vector<float> norm_w =
      random_vector(c.prologue == GemvPrologue::gated_rms_norm ? head_dim : c.cols, seed + 2, 0.1f, 1.0f);
  const std::vector<float> in = random_vector(n * in_stride, seed + 1), z = random_vector(n * in_stride, seed + 3);
  const std::vector<float> residual = random_vector(n * out_stride, seed + 4);
  DeviceBuffer<float> d_in(in), d_norm(norm_w), d_z(z), d_y(residual), d_one(residual);
  GemvParams p = case_params(c, hm.upload(), d_in.get(), d_norm.get(), d_z.get(), head_dim, eps);
  p.n_rows = n;
  p.in_stride = in_stride, p.z_stride = in_stride, p.out_stride = out_stride;
  p.residual = c.residual ? d_y.get() : nullptr;
  p.y = d_y.get();
  ASSERT_CUDA(gemv_rows(p, nullptr));
  GemvParams alone = p;
  alone.residual = c.residual ? d_one.get() : nullptr;
  alone.y = d_one.get();
  for (int r = 0; r < n; ++r) ASSERT_CUDA(gemv(gemv_row(alone, r), nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<float> y = d_y.download(), y_one = d_one.download();
  int bad = 0, differ = 0;
  for (int r = 0; r < n; ++r) {
    const std::vector<float> in_r(in.begin() + r * in_stride, in.begin() + r * in_stride + c.cols);
    const std::vector<float> z_r(z.begin() + r * in_stride, z.begin() + r * in_stride + c.cols);
    const std::vector<float> x = reference_x(c, in_r, norm_w, z_r, head_dim, eps);
    for (int row = 0; row < c.rows; ++row) {
      const size_t i = static_cast<size_t>(r) * out_stride + row;
      const double res = c.residual ? residual[i] : 0.0;
      const double ref = reference_row(hm, row, x, res);
      if (!(std::fabs(y[i] - ref) <= row_tolerance(hm, row, x, res, on_tensor_cores(c.bits, c.rows, c.cols))) && bad++ < 5)
        ADD_FAILURE() << "activation row " << r << " row " << row << ": got " << y[i] << " want " << ref;
      if (y[i] != y_one[i] && differ++ < 5)
        ADD_FAILURE() << "activation row " << r << " row " << row << ": " << y[i] << " beside others, " << y_one[i]
                      << " alone";
    }
  }
  for (size_t i = 0; i < residual.size(); ++i) {  // the padding between output rows is untouched
    if (static_cast<int>(i % out_stride) >= c.rows && y[i] != residual[i] && bad++ < 5)
      ADD_FAILURE() << "padding element " << i << " was written";
  }
  EXPECT_EQ(bad, 0);
  EXPECT_EQ(differ, 0);
}

TEST(CudaGemv, SeveralRowsEqualEachRowAlone) {
  SKIP_WITHOUT_GPU();
  uint32_t seed = 700;
  for (int n : {2, 3, 5, 8}) {
    run_rows_case({8192 + 4096 + 64, 2048, 4, GemvPrologue::rms_norm, false}, n, seed++);  // GDN in_proj
    run_rows_case({2048, 4096, 4, GemvPrologue::gated_rms_norm, true}, n, seed++);          // GDN out_proj
    run_rows_case({2048, 4096, 4, GemvPrologue::none, true}, n, seed++);                    // attention o_proj
    run_rows_case({1001, 2048, 4, GemvPrologue::none, false}, n, seed++);  // a partial last 16-row group
  }
  for (int n : {2, 8}) run_rows_case({65536 + 5, 2048, 4, GemvPrologue::rms_norm, false}, n, seed++);  // lm_head-sized
  run_rows_case({17, 1024, 4, GemvPrologue::rms_norm, true}, 4, seed++);  // one launch per row
  run_rows_case({300, 2048, 8, GemvPrologue::rms_norm, false}, 3, seed++);
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
  std::vector<double> bound(n, 0.0);  // the sum over the steps of each step's bound (row_tolerance)
  const GemvCase c{n, n, 4, GemvPrologue::rms_norm, true};
  for (int i = 0; i < steps; ++i) {
    const std::vector<float> x = reference_x(c, v, norm_w, {}, 128, 1e-6f);
    std::vector<float> next(n);
    for (int r = 0; r < n; ++r) {
      next[r] = static_cast<float>(v[r] + w[i].dot(r, x.data()));
      bound[r] += row_tolerance(w[i], r, x, v[r], on_tensor_cores(4, n, n));
    }
    v = next;
  }
  // An error in one step moves the next step's RMSNorm input; through 6 steps that stays within a few times the
  // sum of the steps' bounds.
  for (int r = 0; r < n; ++r) ASSERT_NEAR(got[r], v[r], 4.0 * bound[r]) << "row " << r;
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

// Several activation rows against one matrix (gemv_rows, the decode step of several sequences): us a launch at
// 1, 2, 4 and 8 rows on the model's shapes, cold weights, graph replay.
TEST(CudaGemvBench, SeveralRows) {
  SKIP_WITHOUT_GPU();
  const DeviceBuffer<uint16_t> pool = bench_pool(size_t{1} << 30);
  const int max_rows = 248320, n_max = kMaxBatchRows;
  DeviceBuffer<float> in(random_vector(n_max * 4096, 5)), norm_w(random_vector(4096, 6, 0.1f, 1.0f));
  DeviceBuffer<float> z(random_vector(n_max * 4096, 7)), y(random_vector(n_max * max_rows, 8));
  struct Shape {
    const char* name;
    int rows, cols;
    GemvPrologue prologue;
    bool residual;
    int iters;
  };
  const Shape shapes[] = {
      {"gdn_in [12352, 2048] rms_norm", 8192 + 4096 + 64, 2048, GemvPrologue::rms_norm, false, 100},
      {"gdn_out [2048, 4096] gated + residual", 2048, 4096, GemvPrologue::gated_rms_norm, true, 100},
      {"attn_out [2048, 4096] + residual", 2048, 4096, GemvPrologue::none, true, 100},
      {"lm_head [248320, 2048] rms_norm", max_rows, 2048, GemvPrologue::rms_norm, false, 12},
  };
  std::printf("\n");
  for (const Shape& sh : shapes) {
    for (int n : {1, 2, 4, 8}) {
      auto launch = [&](int i, cudaStream_t stream) {
        GemvParams p;
        p.m = bench_qmatrix(pool, sh.rows, sh.cols, 4, i);
        p.in = in.get();
        p.prologue = sh.prologue;
        p.norm_w = norm_w.get();
        p.gate_z = z.get();
        p.n_rows = n;
        p.in_stride = p.z_stride = sh.cols, p.out_stride = sh.rows;
        p.residual = sh.residual ? y.get() : nullptr;
        p.y = y.get();
        return gemv_rows(p, stream);
      };
      const QMatrix m = bench_qmatrix(pool, sh.rows, sh.cols, 4, 0);
      const std::string name = std::string(sh.name) + ", " + std::to_string(n) + " rows";
      print_bandwidth(name.c_str(), graph_time_us(launch, sh.iters), static_cast<double>(m.bytes()));
    }
  }
}

}  // namespace
}  // namespace lily::cuda::test
