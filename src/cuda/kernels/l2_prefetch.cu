// l2_prefetch (l2_prefetch.cuh). Each thread takes 32 KiB pieces of the ranges in turn (piece i of all ranges
// concatenated goes to thread i mod threads) and issues one l2_prefetch_bytes per piece.
#include "cuda/kernels/l2_prefetch.cuh"

namespace lily::cuda {

namespace {

constexpr int kThreads = 128;
constexpr int kBlocks = 4;
constexpr size_t kPiece = 32 * 1024;

__global__ void __launch_bounds__(kThreads) l2_prefetch_kernel(L2PrefetchParams p) {
  const trace::BlockTrace trace_block(trace::kL2Prefetch);
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
      l2_prefetch_bytes(reinterpret_cast<const char*>(begin + off),
                        static_cast<uint32_t>(len - off < kPiece ? len - off : kPiece), p.evict_last);
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
  return launch_lowest_priority(l2_prefetch_kernel, dim3(kBlocks), dim3(kThreads), stream, p);
}

}  // namespace lily::cuda
