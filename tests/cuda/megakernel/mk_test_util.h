// Shared helpers of the megakernel tests: the skip macro, the SM count, distinct weight matrices carved from a
// pool (no two share bytes: a cold L2 for the timing tests).
#pragma once
#include <cuda_runtime.h>

#include <cstdio>
#include <string>

#include "../kernels/cuda_test_util.h"
#include "cuda/megakernel/step.cuh"

namespace lily::cuda::mk::test_util {

#define SKIP_WITHOUT_STEP()                                                                     \
  do {                                                                                          \
    SKIP_WITHOUT_GPU();                                                                         \
    if (!::lily::cuda::mk::step_supported()) GTEST_SKIP() << "the megakernel needs an sm_90a build on a Hopper GPU"; \
  } while (0)

// The bound of the megakernel (fp32 activations) against the kernel chain, as a fraction of max |h|: the chain's out
// projections round x to fp16 on the tensor cores (2^-11 of each term; ~3e-4 of a typical output over 4,096 random
// terms, so a few times that at the maximum).
inline constexpr double kChainX16 = 2e-3;

inline int device_sms() {
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  return prop.multiProcessorCount;
}

// n distinct [rows, cols] 4-bit matrices carved back to back from one pool.
struct Carver {
  const test::DeviceBuffer<uint16_t>& pool;
  size_t offset = 0;
  QMatrix next(int rows, int cols) {
    QMatrix m;
    m.rows = rows, m.cols = cols, m.bits = 4;
    const size_t w = static_cast<size_t>(rows) * cols / 2, sb = static_cast<size_t>(rows) * cols / 32;
    char* base = reinterpret_cast<char*>(pool.get()) + offset;
    m.w = reinterpret_cast<const uint32_t*>(base);
    m.scales = reinterpret_cast<const __nv_bfloat16*>(base + w);
    m.biases = reinterpret_cast<const __nv_bfloat16*>(base + w + sb);
    offset += (w + 2 * sb + 255) / 256 * 256;
    return m;
  }
};

// Schedules p on n_blocks, uploads it and runs one step; false (a test failure recorded) if any of it fails.
inline bool run_once(Program& p, int n_blocks) {
  const Status st = p.schedule(n_blocks);
  if (!st.ok()) {
    ADD_FAILURE() << st.message();
    return false;
  }
  auto d = DeviceProgram::upload(p);
  if (!d.ok()) {
    ADD_FAILURE() << d.status().message();
    return false;
  }
  if ((*d)->launch(nullptr) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) {
    ADD_FAILURE() << "the step failed: " << cudaGetErrorString(cudaGetLastError());
    return false;
  }
  return true;
}

// Runs one step with the instruction timeline on and prints the first `ops` ops of its summary.
inline void print_timeline(const Program& p, DeviceProgram& d, int ops) {
  if (!d.enable_trace().ok() || d.launch(nullptr) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) {
    std::printf("timeline: the traced step failed\n");
    return;
  }
  auto marks = d.trace();
  if (!marks.ok()) return;
  const std::string t = p.summarize_trace(*marks);
  size_t cut = 0;
  for (int line = 0; line <= ops && cut != std::string::npos; ++line) cut = t.find('\n', cut + 1);
  std::printf("%s", t.substr(0, cut == std::string::npos ? cut : cut + 1).c_str());
}

}  // namespace lily::cuda::mk::test_util
