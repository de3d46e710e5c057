// attn_prep / attn_decode / attn_combine against plain CPU references on random inputs (eqs 9-12), plus a benchmark
// that prints the split-KV table (attn_decode + attn_combine time and GB/s for several contexts and n_splits).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <vector>

#include "cpu/ops.h"
#include "cuda/kernels/attention.cuh"
#include "cuda_test_util.h"

namespace lily::cuda {
namespace {

using test::bf16_bits_to_float;
using test::DeviceBuffer;
using test::random_vector;

constexpr int kNq = 16, kNkv = 2, kD = 256, kRot = 64;
constexpr float kTheta = 1e7f;
constexpr uint16_t kBf16NaN = 0xFFFF;  // what cudaMemset(0xFF) leaves in a bf16 cache: rows nobody may read

uint16_t to_bf16_bits(float f) {  // round to nearest even, as __float2bfloat16_rn (finite inputs)
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Eq 10, the same code as src/cpu/attention.cpp apply_rope.
void rope_ref(float* x, int64_t p) {
  const int half = kRot / 2;
  for (int i = 0; i < half; ++i) {
    float inv_freq = static_cast<float>(1.0 / std::pow(static_cast<double>(kTheta), (2.0 * i) / kRot));
    float ang = static_cast<float>(p) * inv_freq;
    float c = std::cos(ang), s = std::sin(ang);
    float x0 = x[i], x1 = x[i + half];
    x[i] = x0 * c - x1 * s;
    x[i + half] = x1 * c + x0 * s;
  }
}

std::vector<uint16_t> read_row(const DeviceBuffer<uint16_t>& cache, int64_t row) {
  std::vector<uint16_t> h(kNkv * kD);
  cudaMemcpy(h.data(), cache.get() + row * kNkv * kD, h.size() * sizeof(uint16_t), cudaMemcpyDeviceToHost);
  return h;
}

TEST(CudaAttention, PrepNormRopeAppend) {
  SKIP_WITHOUT_GPU();
  for (int pos : {0, 1, 1000, 100000}) {
    SCOPED_TRACE("pos " + std::to_string(pos));
    const auto proj = random_vector(kNq * 2 * kD + 2 * kNkv * kD, 100 + pos);
    const auto q_norm = random_vector(kD, 7, 0.1f, 1.0f), k_norm = random_vector(kD, 8, 0.1f, 1.0f);
    const int64_t rows = pos + 2;
    DeviceBuffer<float> d_proj(proj), d_qn(q_norm), d_kn(k_norm), d_q(kNq * kD);
    DeviceBuffer<int> d_pos(std::vector<int>{pos});
    DeviceBuffer<uint16_t> k_cache(rows * kNkv * kD), v_cache(rows * kNkv * kD);
    ASSERT_NE(k_cache.get(), nullptr);
    ASSERT_NE(v_cache.get(), nullptr);
    ASSERT_CUDA(cudaMemset(k_cache.get(), 0xFF, rows * kNkv * kD * 2));
    ASSERT_CUDA(cudaMemset(v_cache.get(), 0xFF, rows * kNkv * kD * 2));
    AttnPrepParams p;
    p.proj = d_proj.get();
    p.q_norm = d_qn.get();
    p.k_norm = d_kn.get();
    p.nq = kNq, p.nkv = kNkv, p.head_dim = kD, p.rotary_dim = kRot, p.rope_theta = kTheta;
    p.pos = d_pos.get();
    p.q = d_q.get();
    p.k_cache = reinterpret_cast<__nv_bfloat16*>(k_cache.get());
    p.v_cache = reinterpret_cast<__nv_bfloat16*>(v_cache.get());
    ASSERT_CUDA(attn_prep(p, nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());

    // Tolerances: the GPU sums x^2 in fp32 (the CPU in double) and its sincosf is within 2 ulp of glibc's; the angle
    // itself is bit-identical (same fp32 inv_freq and product). So q agrees to a few fp32 ulps: 3e-5 relative
    // (|q| <= ~5). k is stored as bf16: within half a bf16 ulp (2^-8 relative) of the CPU value plus that fp32 slack.
    const auto q = d_q.download();
    std::vector<float> ref(kD);
    double max_err = 0;
    for (int j = 0; j < kNq; ++j) {
      cpu::rms_norm(&proj[j * 2 * kD], q_norm.data(), 1, kD, 1e-6f, ref.data());
      rope_ref(ref.data(), pos);
      for (int d = 0; d < kD; ++d) {
        const float err = std::fabs(q[j * kD + d] - ref[d]);
        max_err = std::max(max_err, static_cast<double>(err));
        ASSERT_LE(err, 3e-5f * std::max(1.0f, std::fabs(ref[d]))) << "q head " << j << " dim " << d;
      }
    }
    const auto k_row = read_row(k_cache, pos), v_row = read_row(v_cache, pos);
    for (int m = 0; m < kNkv; ++m) {
      const float* k_src = &proj[kNq * 2 * kD + m * kD];
      const float* v_src = &proj[kNq * 2 * kD + (kNkv + m) * kD];
      cpu::rms_norm(k_src, k_norm.data(), 1, kD, 1e-6f, ref.data());
      rope_ref(ref.data(), pos);
      for (int d = 0; d < kD; ++d) {
        const float k = bf16_bits_to_float(k_row[m * kD + d]);
        ASSERT_LE(std::fabs(k - ref[d]), std::fabs(ref[d]) * (1.0f / 256) + 3e-5f) << "k head " << m << " dim " << d;
        ASSERT_EQ(v_row[m * kD + d], to_bf16_bits(v_src[d])) << "v head " << m << " dim " << d;
      }
    }
    // Only row pos was written.
    for (int64_t other : {static_cast<int64_t>(pos) - 1, static_cast<int64_t>(pos) + 1}) {
      if (other < 0) continue;
      for (uint16_t b : read_row(k_cache, other)) ASSERT_EQ(b, kBf16NaN) << "k row " << other << " touched";
      for (uint16_t b : read_row(v_cache, other)) ASSERT_EQ(b, kBf16NaN) << "v row " << other << " touched";
    }
    printf("[prep] pos %6d: max |q - ref| = %.2e\n", pos, max_err);
  }
}

// Random bf16 K and V caches of n valid rows, followed by 16 rows of NaN that the kernel must never read.
struct Caches {
  int n = 0;
  std::vector<uint16_t> k, v;  // [n, nkv, D] bf16 bits
  DeviceBuffer<uint16_t> d_k, d_v;
};

// ramp > 0 scales key row r by 1 + ramp * r / n: the scores of a head grow along the cache, so its running max
// keeps rising and the online-softmax rescale runs on most tiles.
Caches make_caches(int n, uint32_t seed, float ramp = 0.0f) {
  Caches c;
  c.n = n;
  auto kf = random_vector(static_cast<size_t>(n) * kNkv * kD, seed);
  for (size_t i = 0; i < kf.size(); ++i) kf[i] *= 1.0f + ramp * static_cast<float>(i / (kNkv * kD)) / n;
  const auto vf = random_vector(static_cast<size_t>(n) * kNkv * kD, seed + 1);
  c.k.resize(kf.size());
  c.v.resize(vf.size());
  for (size_t i = 0; i < kf.size(); ++i) c.k[i] = to_bf16_bits(kf[i]), c.v[i] = to_bf16_bits(vf[i]);
  const size_t total = (static_cast<size_t>(n) + 16) * kNkv * kD;
  std::vector<uint16_t> padded(total, kBf16NaN);
  std::copy(c.k.begin(), c.k.end(), padded.begin());
  c.d_k = DeviceBuffer<uint16_t>(padded);
  std::copy(c.v.begin(), c.v.end(), padded.begin());
  c.d_v = DeviceBuffer<uint16_t>(padded);
  return c;
}

// Eqs 11-12 in double over the bf16 cache: out[j] = softmax(q_j K^T * scale) V * sigmoid(gate_j).
std::vector<float> attention_ref(const Caches& c, const std::vector<float>& q, const std::vector<float>& proj) {
  std::vector<float> out(kNq * kD);
  std::vector<double> w(c.n), o(kD);
  const double scale = 1.0 / std::sqrt(static_cast<double>(kD));
  for (int j = 0; j < kNq; ++j) {
    const int m = j / (kNq / kNkv);
    double mx = -INFINITY;
    for (int r = 0; r < c.n; ++r) {
      const uint16_t* kr = &c.k[(static_cast<size_t>(r) * kNkv + m) * kD];
      double s = 0;
      for (int d = 0; d < kD; ++d) s += static_cast<double>(q[j * kD + d]) * bf16_bits_to_float(kr[d]);
      w[r] = s * scale;
      mx = std::max(mx, w[r]);
    }
    double sum = 0;
    for (int r = 0; r < c.n; ++r) sum += (w[r] = std::exp(w[r] - mx));
    std::fill(o.begin(), o.end(), 0.0);
    for (int r = 0; r < c.n; ++r) {
      const uint16_t* vr = &c.v[(static_cast<size_t>(r) * kNkv + m) * kD];
      for (int d = 0; d < kD; ++d) o[d] += w[r] * bf16_bits_to_float(vr[d]);
    }
    for (int d = 0; d < kD; ++d) {
      const double gate = proj[j * 2 * kD + kD + d];
      out[j * kD + d] = static_cast<float>(o[d] / sum / (1.0 + std::exp(-gate)));
    }
  }
  return out;
}

struct DecodeRun {
  DeviceBuffer<float> d_q, d_proj, part_o, part_ml, out;
  DeviceBuffer<int> d_pos;
};

cudaError_t run_decode(const Caches& c, DecodeRun& r, int n_splits, int pos, cudaStream_t stream,
                       const __nv_bfloat16* k_cache = nullptr, const __nv_bfloat16* v_cache = nullptr,
                       bool with_combine = true, bool prefetch_cache = false) {
  AttnDecodeParams dp;
  dp.prefetch_cache = prefetch_cache;
  dp.q = r.d_q.get();
  dp.k_cache = k_cache ? k_cache : reinterpret_cast<const __nv_bfloat16*>(c.d_k.get());
  dp.v_cache = v_cache ? v_cache : reinterpret_cast<const __nv_bfloat16*>(c.d_v.get());
  dp.nq = kNq, dp.nkv = kNkv, dp.head_dim = kD;
  dp.pos = r.d_pos.get() + pos;
  dp.n_splits = n_splits;
  dp.scale = 1.0f / 16.0f;
  dp.part_o = r.part_o.get();
  dp.part_ml = r.part_ml.get();
  CUDA_TRY(attn_decode(dp, stream));
  if (!with_combine) return cudaSuccess;
  AttnCombineParams cp;
  cp.part_o = r.part_o.get();
  cp.part_ml = r.part_ml.get();
  cp.n_splits = n_splits, cp.nq = kNq, cp.head_dim = kD;
  cp.proj = r.d_proj.get();
  cp.out = r.out.get();
  return attn_combine(cp, stream);
}

void check_decode(int n, const std::vector<int>& splits, float ramp = 0.0f) {
  const Caches c = make_caches(n, 1000 + n, ramp);
  ASSERT_NE(c.d_k.get(), nullptr);
  ASSERT_NE(c.d_v.get(), nullptr);
  const auto q = random_vector(kNq * kD, 17 + n, 1.5f);  // scores ~ N(0, 1.5^2): neither flat nor one-hot
  const auto proj = random_vector(kNq * 2 * kD + 2 * kNkv * kD, 23 + n);
  const auto ref = attention_ref(c, q, proj);
  const int max_splits = *std::max_element(splits.begin(), splits.end());
  DecodeRun r{DeviceBuffer<float>(q), DeviceBuffer<float>(proj), DeviceBuffer<float>(size_t{1} * max_splits * kNq * kD),
              DeviceBuffer<float>(size_t{1} * max_splits * kNq * 2), DeviceBuffer<float>(kNq * kD),
              DeviceBuffer<int>(std::vector<int>{n - 1})};
  for (int n_splits : splits) {
    SCOPED_TRACE("n " + std::to_string(n) + " n_splits " + std::to_string(n_splits));
    // NaN partials: a split that fails to write its slot poisons the combined output.
    ASSERT_CUDA(cudaMemset(r.part_o.get(), 0xFF, r.part_o.size() * sizeof(float)));
    ASSERT_CUDA(cudaMemset(r.part_ml.get(), 0xFF, r.part_ml.size() * sizeof(float)));
    ASSERT_CUDA(run_decode(c, r, n_splits, 0, nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());
    const auto out = r.out.download();
    // Tolerance: the scores and p enter the tensor cores as hi+lo bf16 pairs (2^-17 relative), K/V are the same
    // bf16 values as here, accumulation is fp32 (at most n/64 sequential adds per accumulator, 2^-24 each). The
    // outputs are averages of |v| ~ 0.8, so 1e-4 absolute leaves > 10x margin; a wrong mask, split range or
    // rescale shows up as errors of 1e-2 or more (or NaN from the poisoned rows/partials).
    double max_err = 0;
    for (int i = 0; i < kNq * kD; ++i) {
      const double err = std::fabs(out[i] - ref[i]);
      max_err = std::max(max_err, std::isnan(err) ? INFINITY : err);
      ASSERT_LE(err, 1e-4 + 1e-4 * std::fabs(ref[i])) << "head " << i / kD << " dim " << i % kD << ": gpu " << out[i]
                                                      << " ref " << ref[i];
    }
    printf("[decode] n %6d n_splits %4d: max |out - ref| = %.2e\n", n, n_splits, max_err);
    // The decode graph's mode: rows < pos copied before the wait for attn_prep, the tile with row pos after it
    // (out of commit-group order). Same rows, same arithmetic: the same bits.
    ASSERT_CUDA(cudaMemset(r.part_o.get(), 0xFF, r.part_o.size() * sizeof(float)));
    ASSERT_CUDA(cudaMemset(r.part_ml.get(), 0xFF, r.part_ml.size() * sizeof(float)));
    ASSERT_CUDA(run_decode(c, r, n_splits, 0, nullptr, nullptr, nullptr, true, true));
    ASSERT_CUDA(cudaDeviceSynchronize());
    const auto out_prefetched = r.out.download();
    for (int i = 0; i < kNq * kD; ++i)
      ASSERT_EQ(out_prefetched[i], out[i]) << "prefetch_cache, element " << i;
  }
}

TEST(CudaAttention, DecodeCombineMatchesCpu) {
  SKIP_WITHOUT_GPU();
  for (int n : {1, 2, 31, 32, 33, 255, 256, 257, 1000, 4096, 65536}) check_decode(n, {1, 2, 7, 64, 256});
}

TEST(CudaAttention, DecodeCombineRisingScores) {
  SKIP_WITHOUT_GPU();
  for (int n : {1000, 65536}) check_decode(n, {1, 64}, 3.0f);
}

TEST(CudaAttention, DecodeCombineLongContext) {
  SKIP_WITHOUT_GPU();
  check_decode(131073, {1, 64, 1024});
}

TEST(CudaAttention, RejectsBadShapes) {
  AttnDecodeParams dp;  // null pointers
  EXPECT_EQ(attn_decode(dp, nullptr), cudaErrorInvalidValue);
  AttnCombineParams cp;
  EXPECT_EQ(attn_combine(cp, nullptr), cudaErrorInvalidValue);
  AttnPrepParams pp;
  EXPECT_EQ(attn_prep(pp, nullptr), cudaErrorInvalidValue);
}

// Prints the split table: time of attn_decode + attn_combine per token (one layer), of attn_decode alone, and the
// KV bytes / time of the pair. Several caches are rotated so that the bytes come from HBM, not the 60 MB L2;
// launches are replayed from a graph (as in the decode step).
double time_graph_us(cudaStream_t stream, int iters, const std::function<cudaError_t(int)>& launch) {
  constexpr int kReplays = 5;
  cudaGraph_t graph;
  if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess) return -1;
  for (int it = 0; it < iters; ++it)
    if (launch(it) != cudaSuccess) {
      cudaStreamEndCapture(stream, &graph);
      return -1;
    }
  if (cudaStreamEndCapture(stream, &graph) != cudaSuccess) return -1;
  cudaGraphExec_t exec;
  if (cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess) return -1;
  cudaEvent_t t0, t1;
  cudaEventCreate(&t0);
  cudaEventCreate(&t1);
  cudaGraphLaunch(exec, stream);  // warm-up
  cudaEventRecord(t0, stream);
  for (int rep = 0; rep < kReplays; ++rep) cudaGraphLaunch(exec, stream);
  cudaEventRecord(t1, stream);
  float ms = -1;
  if (cudaEventSynchronize(t1) == cudaSuccess) cudaEventElapsedTime(&ms, t0, t1);
  cudaEventDestroy(t0);
  cudaEventDestroy(t1);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  return ms * 1e3 / (iters * kReplays);
}

TEST(CudaAttentionBench, DecodeSplitTable) {
  SKIP_WITHOUT_GPU();
  const size_t cache_rows = 2 * 131072 + 16, row_elems = kNkv * kD;
  DeviceBuffer<uint16_t> k(cache_rows * row_elems), v(cache_rows * row_elems);
  ASSERT_NE(k.get(), nullptr);
  ASSERT_NE(v.get(), nullptr);
  {  // fill with a repeated 4 MiB random block (non-degenerate values; zeros would flatter the hardware)
    std::vector<uint16_t> block(2u << 20);
    const auto f = random_vector(block.size(), 5);
    for (size_t i = 0; i < block.size(); ++i) block[i] = to_bf16_bits(f[i]);
    for (size_t off = 0; off < k.size(); off += block.size()) {
      const size_t n = std::min(block.size(), k.size() - off);
      ASSERT_CUDA(cudaMemcpy(k.get() + off, block.data(), n * 2, cudaMemcpyHostToDevice));
      ASSERT_CUDA(cudaMemcpy(v.get() + off, block.data(), n * 2, cudaMemcpyHostToDevice));
    }
  }
  const std::vector<int> contexts = {1024, 4096, 16384, 32768, 65536, 131072};
  const std::vector<int> split_counts = {1, 8, 16, 32, 64, 66, 128, 132, 256};
  const auto q = random_vector(kNq * kD, 1), proj = random_vector(kNq * 2 * kD + 2 * kNkv * kD, 2);
  std::vector<int> positions;
  for (int n : contexts) positions.push_back(n - 1);
  DecodeRun r{DeviceBuffer<float>(q), DeviceBuffer<float>(proj), DeviceBuffer<float>(size_t{256} * kNq * kD),
              DeviceBuffer<float>(size_t{256} * kNq * 2), DeviceBuffer<float>(kNq * kD), DeviceBuffer<int>(positions)};
  Caches none;
  cudaStream_t stream;
  ASSERT_CUDA(cudaStreamCreate(&stream));
  printf("[attn bench] one layer (nq 16, nkv 2, D 256); floor = KV bytes / 4.27 TB/s\n");
  printf("%8s %8s %10s %10s %10s %10s\n", "context", "n_splits", "pair_us", "decode_us", "pair_GB/s", "floor_us");
  for (size_t ci = 0; ci < contexts.size(); ++ci) {
    const int n = contexts[ci];
    const int instances = std::min<int>(64, (cache_rows - 16) / n);
    const double bytes = static_cast<double>(n) * row_elems * 2 * 2;
    for (int n_splits : split_counts) {
      double us[2];
      for (int with_combine = 1; with_combine >= 0; --with_combine)
        us[with_combine] = time_graph_us(stream, 64, [&](int it) {
          const size_t off = static_cast<size_t>(it % instances) * n * row_elems;
          return run_decode(none, r, n_splits, static_cast<int>(ci), stream,
                            reinterpret_cast<const __nv_bfloat16*>(k.get() + off),
                            reinterpret_cast<const __nv_bfloat16*>(v.get() + off), with_combine == 1);
        });
      ASSERT_GT(us[1], 0) << "benchmark launch failed";
      printf("%8d %8d %10.2f %10.2f %10.1f %10.2f\n", n, n_splits, us[1], us[0], bytes / us[1] * 1e-3, bytes / 4.27e6);
    }
  }
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace lily::cuda
