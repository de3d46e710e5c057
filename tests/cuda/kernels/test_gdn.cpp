// gdn_step against a plain CPU Gated DeltaNet (eqs 14-18, the same steps as src/cpu/delta_net.cpp) over 20
// consecutive tokens at the full head counts, state and conv ring carried; plus a benchmark that prints time and GB/s.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "cuda/kernels/gdn.cuh"
#include "cuda_test_util.h"

namespace lily::cuda {
namespace {

using test::DeviceBuffer;
using test::random_vector;

constexpr int kNk = 16, kNv = 32, kDk = 128, kDv = 128, kKernel = 4;
constexpr int kKeyDim = kNk * kDk, kValueDim = kNv * kDv, kConvDim = 2 * kKeyDim + kValueDim;  // 8192
constexpr int kProjSize = kConvDim + kValueDim + 2 * kNv;

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// The CPU Gated DeltaNet for one token, written out as in src/cpu/delta_net.cpp (T = 1).
struct GdnRef {
  std::vector<float> conv_w, A_log, dt_bias;
  std::vector<float> conv_state = std::vector<float>((kKernel - 1) * kConvDim, 0.0f);  // last K-1 pre-conv rows
  std::vector<float> S = std::vector<float>(static_cast<size_t>(kNv) * kDk * kDv, 0.0f);

  std::vector<float> step(const std::vector<float>& proj) {
    std::vector<float> cc(kConvDim);
    for (int ch = 0; ch < kConvDim; ++ch) {  // eq 14
      float acc = 0;
      for (int k = 0; k < kKernel - 1; ++k) acc += conv_w[ch * kKernel + k] * conv_state[k * kConvDim + ch];
      acc += conv_w[ch * kKernel + kKernel - 1] * proj[ch];
      cc[ch] = acc * sigmoid(acc);
    }
    std::copy(conv_state.begin() + kConvDim, conv_state.end(), conv_state.begin());
    std::copy(proj.begin(), proj.begin() + kConvDim, conv_state.end() - kConvDim);
    auto l2 = [](float* x, float extra) {  // eq 16
      double ss = 0;
      for (int i = 0; i < kDk; ++i) ss += static_cast<double>(x[i]) * x[i];
      const float inv = 1.0f / std::sqrt(static_cast<float>(ss) + 1e-6f) * extra;
      for (int i = 0; i < kDk; ++i) x[i] *= inv;
    };
    for (int h = 0; h < kNk; ++h) {
      l2(&cc[h * kDk], 1.0f / std::sqrt(static_cast<float>(kDk)));
      l2(&cc[kKeyDim + h * kDk], 1.0f);
    }
    std::vector<float> o(kValueDim), e(kDv);
    for (int h = 0; h < kNv; ++h) {  // eqs 17-18
      const float* b = &proj[kConvDim + kValueDim];
      const float* a = b + kNv;
      const float beta = sigmoid(b[h]);
      const float x = a[h] + dt_bias[h];
      const float decay = std::exp(-std::exp(A_log[h]) * (x > 20.0f ? x : std::log1p(std::exp(x))));
      const int kh = h / (kNv / kNk);
      const float* q = &cc[kh * kDk];
      const float* k = &cc[kKeyDim + kh * kDk];
      const float* v = &cc[2 * kKeyDim + h * kDv];
      float* Sh = &S[static_cast<size_t>(h) * kDk * kDv];
      for (int i = 0; i < kDk * kDv; ++i) Sh[i] *= decay;
      for (int j = 0; j < kDv; ++j) {
        float kv = 0;
        for (int i = 0; i < kDk; ++i) kv += Sh[i * kDv + j] * k[i];
        e[j] = (v[j] - kv) * beta;
      }
      for (int i = 0; i < kDk; ++i)
        for (int j = 0; j < kDv; ++j) Sh[i * kDv + j] += k[i] * e[j];
      for (int j = 0; j < kDv; ++j) {
        float acc = 0;
        for (int i = 0; i < kDk; ++i) acc += Sh[i * kDv + j] * q[i];
        o[h * kDv + j] = acc;
      }
    }
    return o;
  }
};

struct GdnDevice {
  DeviceBuffer<float> proj{static_cast<size_t>(kProjSize)}, ring{static_cast<size_t>(kKernel) * kConvDim};
  DeviceBuffer<float> conv_w, A_log, dt_bias, S{static_cast<size_t>(kNv) * kDk * kDv}, o{static_cast<size_t>(kValueDim)};
  DeviceBuffer<int> pos;

  GdnStepParams params(int step) const {
    GdnStepParams p;
    p.proj = proj.get();
    p.conv_ring = ring.get();
    p.conv_w = conv_w.get();
    p.A_log = A_log.get();
    p.dt_bias = dt_bias.get();
    p.S = S.get();
    p.pos = pos.get() + step;
    p.n_k = kNk, p.n_v = kNv, p.d_k = kDk, p.d_v = kDv, p.kernel = kKernel;
    p.o = o.get();
    return p;
  }
};

// prefetch_state: pos, S and the conv ring read before the wait for the previous kernel (the decode graph's mode;
// valid here because every step is synchronised, as graph replays are).
// fused_norm: eq 19 in the kernel (a cluster per head): o is then x = norm_w * o / RMS(o_head) * silu(z).
void check_steps_against_cpu(bool prefetch_state, bool fused_norm = false) {
  SCOPED_TRACE(prefetch_state ? "state prefetched" : "state after the wait");
  SCOPED_TRACE(fused_norm ? "gated norm fused" : "o");
  const std::vector<float> norm_w = random_vector(kDv, 5, 0.1f, 1.0f);
  const DeviceBuffer<float> d_norm(norm_w);
  GdnRef ref;
  ref.conv_w = random_vector(static_cast<size_t>(kConvDim) * kKernel, 1, 0.5f);
  ref.A_log = random_vector(kNv, 2, 0.7f, -0.5f);
  ref.dt_bias = random_vector(kNv, 3, 1.0f);
  constexpr int kSteps = 20;
  std::vector<int> positions(kSteps);
  for (int t = 0; t < kSteps; ++t) positions[t] = t;
  GdnDevice dev;
  dev.conv_w = DeviceBuffer<float>(ref.conv_w);
  dev.A_log = DeviceBuffer<float>(ref.A_log);
  dev.dt_bias = DeviceBuffer<float>(ref.dt_bias);
  dev.pos = DeviceBuffer<int>(positions);
  ASSERT_CUDA(dev.ring.zero());
  ASSERT_CUDA(dev.S.zero());

  std::vector<std::vector<float>> projs;
  for (int t = 0; t < kSteps; ++t) {
    SCOPED_TRACE("step " + std::to_string(t));
    projs.push_back(random_vector(kProjSize, 100 + t));
    auto o_ref = ref.step(projs.back());
    if (fused_norm) {  // eq 19 in double on the CPU's o
      for (int h = 0; h < kNv; ++h) {
        double ss = 0;
        for (int d = 0; d < kDv; ++d) ss += static_cast<double>(o_ref[h * kDv + d]) * o_ref[h * kDv + d];
        const double inv = 1.0 / std::sqrt(ss / kDv + 1e-6);
        for (int d = 0; d < kDv; ++d) {
          const double z = projs.back()[kConvDim + h * kDv + d];
          o_ref[h * kDv + d] =
              static_cast<float>(norm_w[d] * o_ref[h * kDv + d] * inv * z / (1.0 + std::exp(-z)));
        }
      }
    }
    ASSERT_CUDA(dev.proj.upload(projs.back()));
    ASSERT_CUDA(dev.o.zero());
    GdnStepParams p = dev.params(t);
    p.prefetch_state = prefetch_state;
    if (fused_norm) p.gate_z = dev.proj.get() + kConvDim, p.norm_w = d_norm.get(), p.eps = 1e-6f;
    ASSERT_CUDA(gdn_step(p, nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());
    const auto o = dev.o.download();
    // Tolerance: fp32 throughout on both sides; they differ in summation order (fp32 tree vs double for the norms,
    // o as S'^T q + e (k.q) instead of S^T q) and FMA contraction: a few 1e-7 relative per op, growing slowly as
    // the state carries over 20 steps. 1e-4 (abs + rel) is > 10x that and far below any indexing error (~|o|).
    double max_err = 0;
    for (int i = 0; i < kValueDim; ++i) {
      const double err = std::fabs(o[i] - o_ref[i]);
      max_err = std::max(max_err, std::isnan(err) ? INFINITY : err);
      ASSERT_LE(err, 1e-4 + 1e-4 * std::fabs(o_ref[i])) << "head " << i / kDv << " col " << i % kDv << ": gpu " << o[i]
                                                       << " ref " << o_ref[i];
    }
    if (t == 0 || t == kSteps - 1) printf("[gdn] step %2d: max |o - ref| = %.2e\n", t, max_err);
  }
  const auto S = dev.S.download();
  double max_s = 0;
  for (size_t i = 0; i < S.size(); ++i) {
    max_s = std::max(max_s, std::fabs(static_cast<double>(S[i]) - ref.S[i]));
    ASSERT_LE(std::fabs(S[i] - ref.S[i]), 1e-4 + 1e-4 * std::fabs(ref.S[i])) << "S element " << i;
  }
  printf("[gdn] final state: max |S - ref| = %.2e\n", max_s);
  // The ring holds the last K pre-conv vectors, vector of position t in slot t % K.
  const auto ring = dev.ring.download();
  for (int t = kSteps - kKernel; t < kSteps; ++t)
    for (int ch = 0; ch < kConvDim; ++ch)
      ASSERT_EQ(ring[(t % kKernel) * kConvDim + ch], projs[t][ch]) << "ring slot " << t % kKernel << " ch " << ch;
}

TEST(CudaGdn, StepMatchesCpuOver20Tokens) {
  SKIP_WITHOUT_GPU();
  check_steps_against_cpu(false);
}

TEST(CudaGdn, StepWithPrefetchedStateMatchesCpu) {
  SKIP_WITHOUT_GPU();
  check_steps_against_cpu(true);
}

// The out_proj's gated RMSNorm fused into the step (the decode graph's mode, with the state prefetched). x = o / RMS
// * w * silu(z) has |x| ~ 1, o relative errors of ~1e-6 carry over: the same 1e-4 (abs + rel) bound holds.
TEST(CudaGdn, StepWithFusedGatedNormMatchesCpu) {
  SKIP_WITHOUT_GPU();
  if (!sm90_code_built()) GTEST_SKIP() << "eq 19 in gdn_step needs thread block clusters (sm_90 code)";
  check_steps_against_cpu(true, true);
}

TEST(CudaGdn, RejectsBadShapes) {
  GdnStepParams p;  // null pointers
  EXPECT_EQ(gdn_step(p, nullptr), cudaErrorInvalidValue);
}

// One graph of `iters` chained steps over rotating states, replayed `replays` times: mean time of a step. (Chained
// gdn_steps overlap with programmatic dependent launch; in the decode graph a GEMV precedes each.)
void bench_steps(const GdnDevice& dev, float* states, size_t state_elems, int iters, int replays,
                 int n_states, bool prefetch, const float* norm_w = nullptr) {
  cudaStream_t stream;
  ASSERT_CUDA(cudaStreamCreate(&stream));
  cudaGraph_t graph;
  ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int it = 0; it < iters; ++it) {
    GdnStepParams p = dev.params(0);
    p.S = states + (it % n_states) * state_elems;
    p.prefetch_state = prefetch;
    if (norm_w) p.gate_z = dev.proj.get() + kConvDim, p.norm_w = norm_w;
    ASSERT_CUDA(gdn_step(p, stream));
  }
  ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  ASSERT_CUDA(cudaGraphLaunch(exec, stream));
  cudaEvent_t t0, t1;
  ASSERT_CUDA(cudaEventCreate(&t0));
  ASSERT_CUDA(cudaEventCreate(&t1));
  ASSERT_CUDA(cudaEventRecord(t0, stream));
  for (int rep = 0; rep < replays; ++rep) ASSERT_CUDA(cudaGraphLaunch(exec, stream));
  ASSERT_CUDA(cudaEventRecord(t1, stream));
  ASSERT_CUDA(cudaEventSynchronize(t1));
  float ms = 0;
  ASSERT_CUDA(cudaEventElapsedTime(&ms, t0, t1));
  const double us = ms * 1e3 / (iters * replays), bytes = state_elems * 8.0;
  printf("[gdn bench] gdn_step full size%s: %.2f us, %.1f GB/s on the state (floor %.2f us at 4.27 TB/s)\n",
         norm_w     ? ", state prefetched, gated norm fused"
         : prefetch ? ", state prefetched"
                    : "",
         us, bytes / us * 1e-3, bytes / 4.27e6);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaEventDestroy(t0);
  cudaEventDestroy(t1);
  cudaStreamDestroy(stream);
}

// Prints the time of one gdn_step at full size; 48 states (96 MiB, like 48 layers) are rotated so that S comes from
// HBM, not the 60 MB L2. Launches are replayed from a graph.
TEST(CudaGdnBench, StepFullSize) {
  SKIP_WITHOUT_GPU();
  constexpr int kStates = 48, kIters = 48, kReplays = 20;
  const size_t state_elems = static_cast<size_t>(kNv) * kDk * kDv;
  DeviceBuffer<float> states(state_elems * kStates);
  ASSERT_NE(states.get(), nullptr);
  ASSERT_CUDA(cudaMemset(states.get(), 0, states.size() * sizeof(float)));
  GdnDevice dev;
  dev.conv_w = DeviceBuffer<float>(random_vector(static_cast<size_t>(kConvDim) * kKernel, 1, 0.5f));
  dev.A_log = DeviceBuffer<float>(random_vector(kNv, 2, 0.7f, -0.5f));
  dev.dt_bias = DeviceBuffer<float>(random_vector(kNv, 3));
  dev.pos = DeviceBuffer<int>(std::vector<int>{7});
  ASSERT_CUDA(dev.proj.upload(random_vector(kProjSize, 4)));
  ASSERT_CUDA(dev.ring.zero());
  for (bool prefetch : {false, true})
    bench_steps(dev, states.get(), state_elems, kIters, kReplays, kStates, prefetch);
  const DeviceBuffer<float> norm_w(random_vector(kDv, 5, 0.1f, 1.0f));
  if (sm90_code_built()) bench_steps(dev, states.get(), state_elems, kIters, kReplays, kStates, true, norm_w.get());
}
}  // namespace
}  // namespace lily::cuda
