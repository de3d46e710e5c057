// Helpers of the persistent decode kernels (moe_fused.cu, gdn_fused.cu, attn_fused.cu): a grid-wide barrier between
// the phases of one launch, L2 prefetches, and their launchers' check of a 4-bit matrix. The barrier needs every block of the grid resident at once: the
// launchers size the grid from the occupancy API and refuse larger grids.
#pragma once
#include "cuda/kernels/common.cuh"
#include "cuda/kernels/quant_dot.cuh"

#if defined(__CUDACC__)
namespace lily::cuda {

__device__ __forceinline__ unsigned ld_acquire_gpu(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// Asks the L2 for chunk u of m's rows (Q4Layout<COLS>: rows u * kRowsPerChunk ..) as this lane will load them in
// a later phase: its 16-byte word vectors, and from the first lane of each row the row's scales and biases.
template <int COLS>
__device__ __forceinline__ void prefetch_q4_chunk_l2(const QMatrix& m, int u, int lane) {
  using Lay = Q4Layout<COLS>;
#pragma unroll
  for (int pass = 0; pass < Lay::kPasses; ++pass) {
    const int row = u * Lay::kRowsPerChunk + pass * Lay::kRowsPerPass + lane / Lay::kLanesPerRow;
    const uint4* w_row = reinterpret_cast<const uint4*>(m.w) + static_cast<size_t>(row) * Lay::kVecsPerRow;
#pragma unroll
    for (int v = 0; v < Lay::kVecsPerLane; ++v) prefetch_l2(w_row + v * Lay::kLanesPerRow + lane % Lay::kLanesPerRow);
    if (lane % Lay::kLanesPerRow == 0) {
      prefetch_l2(m.scales + static_cast<size_t>(row) * (COLS / 64));
      prefetch_l2(m.biases + static_cast<size_t>(row) * (COLS / 64));
    }
  }
}

// A persistent kernel's grid: the barriers need every block resident at once, so the grid is at most what fits the
// whole device (an ordinary launch, so PDL keeps working and the launch is legal in stream capture: see
// moe_fused.cu's launcher for why that cannot deadlock). Sets `sms` and `blocks` (`asked` if > 0, else every block
// that fits); cudaErrorCooperativeLaunchTooLarge when none fits or `asked` is more.
template <class Kernel>
cudaError_t persistent_grid(Kernel kernel, int threads, size_t smem, int asked, int& blocks, int& sms) {
  int per_sm = 0, device = 0;
  CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  CUDA_TRY(cudaGetDevice(&device));
  CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int resident = per_sm * sms;
  blocks = asked > 0 ? asked : resident;
  return resident < 1 || blocks > resident ? cudaErrorCooperativeLaunchTooLarge : cudaSuccess;
}

// A launcher's check: m is a 4-bit [rows, cols] matrix with 16-byte aligned arrays.
inline bool is_q4(const QMatrix& m, int rows, int cols) {
  return m.w && m.scales && m.biases && m.bits == 4 && m.rows == rows && m.cols == cols && aligned16(m.w) &&
         aligned16(m.scales) && aligned16(m.biases);
}

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// A barrier is open within microseconds; one still closed after this long has a block that can never arrive:
// trap (the launch fails with an error the caller sees) rather than hang the device.
constexpr unsigned long long kBarrierTimeoutNs = 2000000000ull;

// Grid-wide barrier (cooperative groups' algorithm): thread 0 of every block adds 1 to the counter, block 0 adds
// 2^31 - (gridDim.x - 1), so the top bit flips exactly when the last block arrives and the low bits are back at
// zero; a block leaves once the top bit differs from the one its own add saw. Nothing to reset: a launch with an
// even number of barriers flips the top bit back, so every launch and graph replay leaves the counter as it found
// it (its low 31 bits must be zero). The fence before the add publishes the block's writes (ordered before it by
// __syncthreads); the acquire load and the fence after the wait order the other blocks' writes before the
// block's later reads (which go through L2: __ldcg, or weights). A wait longer than kBarrierTimeoutNs traps.
__device__ __forceinline__ void grid_barrier(unsigned* counter) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned add = blockIdx.x == 0 ? 0x80000000u - (gridDim.x - 1) : 1u;
    __threadfence();
    const unsigned old = atomicAdd(counter, add);
    const unsigned long long start = global_ns();
    while (((old ^ ld_acquire_gpu(counter)) & 0x80000000u) == 0u) {
      if (global_ns() - start > kBarrierTimeoutNs) __trap();
    }
    __threadfence();
  }
  __syncthreads();
}

}  // namespace lily::cuda
#endif  // __CUDACC__
