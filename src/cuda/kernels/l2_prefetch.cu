// l2_prefetch (l2_prefetch.cuh). Each thread takes 32 KiB pieces of the ranges in turn (piece i of all ranges
// concatenated goes to thread i mod threads) and issues one cp.async.bulk.prefetch.L2 per piece (sm_90; on older
// devices a prefetch.global.L2 per 128-byte line of the piece).
#include "cuda/kernels/l2_prefetch.cuh"

namespace lily::cuda {

namespace {

constexpr int kThreads = 128;
constexpr int kBlocks = 4;
constexpr size_t kPiece = 32 * 1024;

__device__ __forceinline__ void prefetch_piece(const char* p, uint32_t bytes, bool evict_last) {
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
  for (uint32_t o = 0; o < bytes; o += 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(p + o));
#endif
}

__global__ void __launch_bounds__(kThreads) l2_prefetch_kernel(L2PrefetchParams p) {
  const size_t threads = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t piece = 0;  // index of the current range's first piece among all ranges' pieces
  const size_t me = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int r = 0; r < p.n; ++r) {
    // The 16-byte aligned interior of the range.
    const uintptr_t a = reinterpret_cast<uintptr_t>(p.ptr[r]);
    const uintptr_t begin = (a + 15) & ~uintptr_t{15}, end = (a + p.bytes[r]) & ~uintptr_t{15};
    const size_t len = end > begin ? end - begin : 0, pieces = (len + kPiece - 1) / kPiece;
    // This thread's first piece of range r: the smallest i >= 0 with (piece + i) mod threads == me.
    for (size_t i = (me + threads - piece % threads) % threads; i < pieces; i += threads) {
      const size_t off = i * kPiece;
      prefetch_piece(reinterpret_cast<const char*>(begin + off), static_cast<uint32_t>(len - off < kPiece ? len - off : kPiece),
                     p.evict_last);
    }
    piece += pieces;
  }
}

}  // namespace

cudaError_t l2_prefetch(const L2PrefetchParams& p, cudaStream_t stream) {
  if (p.n < 0 || p.n > L2PrefetchParams::kMaxRanges) return cudaErrorInvalidValue;
  for (int i = 0; i < p.n; ++i)
    if (p.ptr[i] == nullptr && p.bytes[i] != 0) return cudaErrorInvalidValue;
  if (p.n == 0) return cudaSuccess;
  int least = 0, greatest = 0;
  CUDA_TRY(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributePriority;
  attr[0].val.priority = least;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(kBlocks);
  cfg.blockDim = dim3(kThreads);
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, l2_prefetch_kernel, p);
}

}  // namespace lily::cuda
