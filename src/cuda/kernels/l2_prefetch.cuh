// l2_prefetch: asks the L2 cache to fetch byte ranges of device memory ahead of the kernels that will read them.
// The decode step's weights never depend on the token, so the next layer's dense matrices can be on their way into
// the L2 while the current layer's chain runs at ~1 TB/s of the 4.27 TB/s the memory can give (docs/PERF_NOTES.md):
// the step's parallel graph branch (CudaBackendOptions::decode_prefetch) launches this kernel, on a stream of its
// own, once a layer. A hint only: no data is written, nothing reads its result, and a range it skips (unaligned
// edges: the bulk prefetch takes 16-byte aligned addresses and sizes) is simply read from DRAM later.
//
// Bytes: moves the ranges' bytes from DRAM into the L2 (the point); writes none.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/kernels/common.cuh"

namespace lily::cuda {

struct L2PrefetchParams {
  static constexpr int kMaxRanges = 24;
  const void* ptr[kMaxRanges] = {};
  size_t bytes[kMaxRanges] = {};
  int n = 0;
  // Prefetch with the L2 evict_last policy (the lines are the last to go when the L2 needs room) instead of the
  // default one.
  bool evict_last = false;

  // Appends a range; false when full.
  bool add(const void* p, size_t b) {
    if (n == kMaxRanges) return false;
    ptr[n] = p, bytes[n] = b, ++n;
    return true;
  }
  // Appends a quantised matrix's three arrays (words, scales, biases); false when they do not fit.
  bool add(const QMatrix& m) {
    if (m.w == nullptr) return true;  // no such matrix: nothing to fetch
    if (n + 3 > kMaxRanges) return false;
    const size_t groups = static_cast<size_t>(m.rows) * m.groups_per_row() * sizeof(*m.scales);
    add(m.w, static_cast<size_t>(m.rows) * m.words_per_row() * sizeof(*m.w));
    add(m.scales, groups);
    add(m.biases, groups);
    return true;
  }
  size_t total_bytes() const {
    size_t t = 0;
    for (int i = 0; i < n; ++i) t += bytes[i];
    return t;
  }
};

#if defined(__CUDACC__)
// Asks the L2 for `bytes` at p (both 16-byte aligned: cp.async.bulk.prefetch.L2 on sm_90, with the evict_last policy
// when asked; on older devices a prefetch.global.L2 per 128-byte line). Returns at once.
__device__ __forceinline__ void l2_prefetch_bytes(const void* p, uint32_t bytes, bool evict_last) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (evict_last) {
    uint64_t policy;
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
    asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" ::"l"(p), "r"(bytes), "l"(policy)
                 : "memory");
  } else {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
  }
#else
  (void)evict_last;
  for (uint32_t o = 0; o < bytes; o += 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(static_cast<const char*>(p) + o));
#endif
}

// kernel<<<grid, block, 0, stream>>>(p) at the device's lowest stream priority (the prefetch branch's kernels: the
// blocks of the step's own kernels go first).
template <class Params>
cudaError_t launch_lowest_priority(void (*kernel)(Params), dim3 grid, dim3 block, cudaStream_t stream,
                                   const Params& p) {
  int least = 0, greatest = 0;
  CUDA_TRY(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributePriority;
  attr[0].val.priority = least;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, p);
}
#endif  // __CUDACC__

// One small grid (a few blocks of 128 threads: the prefetch instructions are asynchronous, so few threads issue
// them all) at the lowest stream priority, so the blocks of the step's own kernels go first. cudaErrorInvalidValue
// for n outside [0, kMaxRanges] or a null pointer with a non-zero size.
cudaError_t l2_prefetch(const L2PrefetchParams& p, cudaStream_t stream);

}  // namespace lily::cuda
