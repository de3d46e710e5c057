// Shared helpers of the CUDA kernel op tests: skip without a GPU, RAII device buffers, random MLX-quantized
// matrices (made with mlx_quantize from random floats) with a host copy for CPU references.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "cuda/kernels/common.cuh"
#include "model/quant.h"

namespace lily::cuda::test {

inline bool has_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// A compute 9.0 (Hopper) device 0 running this binary's sm_90a code: what the wgmma paths need (a build of
// compute_80 PTX alone has none, and its wgmma launchers refuse with cudaErrorInvalidDeviceFunction).
inline bool is_hopper() {
  cudaDeviceProp prop{};
  return cudaGetDeviceProperties(&prop, 0) == cudaSuccess && prop.major == 9 && prop.minor == 0 && wgmma_built();
}

// First statement of every GPU test: CI has no GPU and must pass.
#define SKIP_WITHOUT_GPU()                                              \
  do {                                                                  \
    if (!::lily::cuda::test::has_gpu()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

// After SKIP_WITHOUT_GPU in the tests of a wgmma path.
#define SKIP_WITHOUT_HOPPER()                                                                                 \
  do {                                                                                                        \
    if (!::lily::cuda::test::is_hopper()) GTEST_SKIP() << "the wgmma path needs a compute 9.0 GPU and sm_90a code"; \
  } while (0)

#define ASSERT_CUDA(expr)                                        \
  do {                                                           \
    const cudaError_t cuda_err_ = (expr);                        \
    ASSERT_EQ(cuda_err_, cudaSuccess) << cudaGetErrorString(cuda_err_); \
  } while (0)

// Device memory for n values of T, freed on destruction.
template <class T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n) : n_(n) {
    if (n > 0 && cudaMalloc(&ptr_, n * sizeof(T)) != cudaSuccess) ptr_ = nullptr;
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() {
    if (ptr_) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(n_, o.n_);
    return *this;
  }

  T* get() const { return ptr_; }
  size_t size() const { return n_; }
  cudaError_t upload(const std::vector<T>& host) {
    return cudaMemcpy(ptr_, host.data(), std::min(n_, host.size()) * sizeof(T), cudaMemcpyHostToDevice);
  }
  cudaError_t zero() { return cudaMemset(ptr_, 0, n_ * sizeof(T)); }
  std::vector<T> download() const {
    std::vector<T> host(n_);
    if (n_ > 0) cudaMemcpy(host.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost);
    return host;
  }

 private:
  T* ptr_ = nullptr;
  size_t n_ = 0;
};

inline float bf16_bits_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// fp16 (the prefill path's activations) to and from its bits, round to nearest even.
inline uint16_t to_f16_bits(float v) { return static_cast<__half_raw>(__float2half_rn(v)).x; }
inline float f16_bits_to_float(uint16_t b) {
  __half_raw r;
  r.x = b;
  return __half2float(__half(r));
}

// A quantized matrix on the host (MLX layout, docs/MODEL.md 2.4) that can be uploaded as a QMatrix. The
// device copy lives as long as this object (upload() keeps the buffers).
struct HostQMatrix {
  int rows = 0, cols = 0, bits = 4;
  std::vector<uint32_t> words;    // [rows, cols*bits/32]
  std::vector<uint16_t> scales;   // bf16 bits [rows, cols/64]
  std::vector<uint16_t> biases;   // bf16 bits [rows, cols/64]

  size_t words_per_row() const { return static_cast<size_t>(cols) * bits / 32; }
  size_t groups_per_row() const { return static_cast<size_t>(cols) / kQuantGroup; }

  // The dequantized value at (r, c), exactly as the kernels see it: bf16 scale * q + bf16 bias in fp32.
  float dequant(int r, int c) const {
    const size_t wpr = words_per_row(), per_word = 32 / bits;
    const uint32_t word = words[r * wpr + c / per_word];
    const uint32_t q = (word >> ((c % per_word) * bits)) & ((1u << bits) - 1);
    const size_t g = static_cast<size_t>(r) * groups_per_row() + c / kQuantGroup;
    return bf16_bits_to_float(scales[g]) * static_cast<float>(q) + bf16_bits_to_float(biases[g]);
  }
  // sum_c dequant(r, c) * x[c] in double (the reference for dot products).
  double dot(int r, const float* x) const {
    double acc = 0;
    for (int c = 0; c < cols; ++c) acc += static_cast<double>(dequant(r, c)) * x[c];
    return acc;
  }

  QMatrix upload() {
    d_words = DeviceBuffer<uint32_t>(words);
    d_scales = DeviceBuffer<uint16_t>(scales);
    d_biases = DeviceBuffer<uint16_t>(biases);
    QMatrix m;
    m.w = d_words.get();
    m.scales = reinterpret_cast<const __nv_bfloat16*>(d_scales.get());
    m.biases = reinterpret_cast<const __nv_bfloat16*>(d_biases.get());
    m.rows = rows;
    m.cols = cols;
    m.bits = bits;
    return m;
  }

  DeviceBuffer<uint32_t> d_words;
  DeviceBuffer<uint16_t> d_scales, d_biases;
};

// rows x cols floats ~ N(0, std), quantized with mlx_quantize.
inline HostQMatrix random_qmatrix(int rows, int cols, int bits, uint32_t seed, float std = 0.02f) {
  HostQMatrix m;
  m.rows = rows;
  m.cols = cols;
  m.bits = bits;
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, std);
  std::vector<float> w(static_cast<size_t>(rows) * cols);
  for (float& v : w) v = dist(rng);
  m.words.resize(rows * m.words_per_row());
  m.scales.resize(rows * m.groups_per_row());
  m.biases.resize(rows * m.groups_per_row());
  mlx_quantize(w.data(), rows, cols, bits, m.words.data(), m.scales.data(), m.biases.data());
  return m;
}

// n floats ~ N(mean, std).
inline std::vector<float> random_vector(size_t n, uint32_t seed, float std = 1.0f, float mean = 0.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(mean, std);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// ---- benchmarks (print, assert nothing) ----------------------------------------------------------------------

// Device memory of `bytes` filled with small random bf16 values (valid weights, scales and biases alike), to
// carve many weight copies out of so that a benchmark reads cold data (> the 60 MB L2).
inline DeviceBuffer<uint16_t> bench_pool(size_t bytes, uint32_t seed = 1) {
  DeviceBuffer<uint16_t> pool(bytes / 2);
  std::vector<uint16_t> chunk((16u << 20) / 2);
  std::mt19937 rng(seed);
  for (uint16_t& v : chunk) v = static_cast<uint16_t>((rng() & 0x80FFu) | 0x3C00u);  // +-[2^-7, 2^-6)
  for (size_t off = 0; off < pool.size(); off += chunk.size()) {
    const size_t n = std::min(chunk.size(), pool.size() - off);
    if (cudaMemcpy(pool.get() + off, chunk.data(), n * 2, cudaMemcpyHostToDevice) != cudaSuccess) break;
  }
  return pool;
}

// A QMatrix view of copy number `copy` of a [rows, cols] matrix laid out back to back inside `pool`.
inline QMatrix bench_qmatrix(const DeviceBuffer<uint16_t>& pool, int rows, int cols, int bits, size_t copy) {
  QMatrix m;
  m.rows = rows, m.cols = cols, m.bits = bits;
  const size_t w_bytes = rows * m.words_per_row() * 4, sb_bytes = rows * m.groups_per_row() * 2;
  const size_t stride = (w_bytes + 2 * sb_bytes + 255) / 256 * 256;
  const size_t n_copies = std::max<size_t>(1, pool.size() * 2 / stride);
  char* base = reinterpret_cast<char*>(pool.get()) + (copy % n_copies) * stride;
  m.w = reinterpret_cast<const uint32_t*>(base);
  m.scales = reinterpret_cast<const __nv_bfloat16*>(base + w_bytes);
  m.biases = reinterpret_cast<const __nv_bfloat16*>(base + w_bytes + sb_bytes);
  return m;
}

// A CUDA graph captured once from launch(stream) on a non-blocking stream of its own and replayed (as the decode
// step replays its graphs); destroys graph, executable and stream with itself.
class CapturedGraph {
 public:
  CapturedGraph() = default;
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  ~CapturedGraph() {
    if (exec_) cudaGraphExecDestroy(exec_);
    if (graph_) cudaGraphDestroy(graph_);
    if (stream_) cudaStreamDestroy(stream_);
  }
  template <class Launch>
  cudaError_t capture(Launch launch) {
    cudaError_t e = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
    if (e != cudaSuccess) return e;
    if ((e = cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal)) != cudaSuccess) return e;
    const cudaError_t launched = launch(stream_);
    e = cudaStreamEndCapture(stream_, &graph_);
    if (launched != cudaSuccess) return launched;
    if (e != cudaSuccess) return e;
    return cudaGraphInstantiate(&exec_, graph_, 0);
  }
  // One replay, waited for.
  cudaError_t replay() {
    const cudaError_t e = cudaGraphLaunch(exec_, stream_);
    return e != cudaSuccess ? e : cudaStreamSynchronize(stream_);
  }

 private:
  cudaStream_t stream_ = nullptr;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

// Mean device microseconds of one launch(i, stream) call: `iters` calls captured in one CUDA graph (as the
// decode step replays them), one warm-up replay, then the median over `reps` timed replays. -1 on error.
template <class Launch>
double graph_time_us(Launch launch, int iters, int reps = 7) {
  cudaStream_t stream;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) return -1;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<float> ms;
  bool ok = cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed) == cudaSuccess;
  for (int i = 0; ok && i < iters; ++i) ok = launch(i, stream) == cudaSuccess;
  ok = cudaStreamEndCapture(stream, &graph) == cudaSuccess && ok;
  ok = ok && cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess;
  ok = ok && cudaGraphLaunch(exec, stream) == cudaSuccess && cudaStreamSynchronize(stream) == cudaSuccess;
  for (int r = 0; ok && r < reps; ++r) {
    cudaEventRecord(start, stream);
    cudaGraphLaunch(exec, stream);
    cudaEventRecord(stop, stream);
    ok = cudaEventSynchronize(stop) == cudaSuccess;
    float t = 0;
    cudaEventElapsedTime(&t, start, stop);
    ms.push_back(t);
  }
  if (exec) cudaGraphExecDestroy(exec);
  if (graph) cudaGraphDestroy(graph);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaStreamDestroy(stream);
  if (!ok || ms.empty()) return -1;
  std::sort(ms.begin(), ms.end());
  return 1000.0 * ms[ms.size() / 2] / iters;
}

// One line of a benchmark table: time, bytes, achieved GB/s and the fraction of the H200's 4.27 TB/s.
inline void print_bandwidth(const char* what, double us, double bytes) {
  const double gbps = bytes / (us * 1e3);
  std::printf("%-44s %9.2f us %9.2f MB %8.0f GB/s %5.1f%% of 4.27 TB/s\n", what, us, bytes / 1e6, gbps,
              100.0 * gbps / 4270.0);
}

// Copies row `from` of a quantized matrix over row `to` (same words, scales, biases: identical logits).
inline void copy_row(HostQMatrix& m, int from, int to) {
  std::copy_n(m.words.begin() + from * m.words_per_row(), m.words_per_row(), m.words.begin() + to * m.words_per_row());
  std::copy_n(m.scales.begin() + from * m.groups_per_row(), m.groups_per_row(),
              m.scales.begin() + to * m.groups_per_row());
  std::copy_n(m.biases.begin() + from * m.groups_per_row(), m.groups_per_row(),
              m.biases.begin() + to * m.groups_per_row());
}

// Router row whose logit with x is about `target` (w = a * sign(x), quantized).
inline void plant_row(HostQMatrix& m, int row, const std::vector<float>& x, float target) {
  double l1 = 0;
  for (float v : x) l1 += std::fabs(v);
  std::vector<float> w(x.size());
  for (size_t c = 0; c < x.size(); ++c) w[c] = static_cast<float>((x[c] >= 0 ? target : -target) / l1);
  mlx_quantize(w.data(), 1, m.cols, m.bits, &m.words[row * m.words_per_row()], &m.scales[row * m.groups_per_row()],
               &m.biases[row * m.groups_per_row()]);
}

}  // namespace lily::cuda::test
