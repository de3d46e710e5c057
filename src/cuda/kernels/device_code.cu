// sm90_code_built (common.cuh): a probe kernel with static shared memory only in an sm_90+ device pass, so
// cudaFuncGetAttributes says which code the runtime loaded for the current GPU without a launch (safe inside a
// stream capture). Every translation unit of the kernels library is compiled for the same targets, so the probe
// speaks for all of them.
#include "cuda/kernels/common.cuh"

namespace lily::cuda {

namespace {

__global__ void sm90_probe_kernel(int* out) {
#if defined(LILY_SM90_PASS)
  __shared__ volatile int marker[64];
  marker[threadIdx.x & 63] = 1;
  *out = marker[0];
#else
  *out = 0;
#endif
}

}  // namespace

bool probe_marked(const void* probe, int (&cache)[64]) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return false;
  if (cache[dev] == 0) {
    cudaFuncAttributes attr{};
    const bool ok = cudaFuncGetAttributes(&attr, probe) == cudaSuccess;
    if (!ok) (void)cudaGetLastError();
    cache[dev] = ok && attr.sharedSizeBytes >= 64 * sizeof(int) ? 1 : 2;
  }
  return cache[dev] == 1;
}

bool sm90_code_built() {
  static int cache[64] = {};
  return probe_marked(reinterpret_cast<const void*>(sm90_probe_kernel), cache);
}

}  // namespace lily::cuda
