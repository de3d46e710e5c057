// Hopper (sm_90a) device helpers shared by the warpgroup-MMA kernels (qgemm_wgmma.cu, moe_prefill_rs.cu,
// attn_prefill_wgmma.cu): mbarriers (CTA scope), the generic -> async proxy fence, the producer warpgroup's named
// barrier, the wgmma fence / commit / wait wrappers, the register fence around asynchronous accumulators and the
// descriptor of a K-major operand in the 128-byte swizzled layout.
// Use them only inside `#if defined(LILY_SM90A_PASS)`: the instructions exist in an sm_90a device pass only (the
// kernels compile to nothing elsewhere and their launchers refuse to launch, see wgmma_built). In their own
// namespace so that they never collide with other kernels' helpers.
#pragma once
#include <cstdint>

#include "cuda/kernels/common.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define LILY_SM90A_PASS 1  // this device pass targets sm_90a: wgmma, mbarriers and named barriers are there
#endif

namespace lily::cuda {

namespace wgmma_util {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- mbarrier (CTA scope)
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// Makes the initialised barriers visible to the other threads (and the async proxy) before their first use.
__device__ __forceinline__ void fence_mbar_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}
// Waits until the phase of parity `parity` of the barrier has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}
// Generic-proxy writes to shared memory (st.shared, cp.async) made visible to the async proxy (wgmma).
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// The producer warpgroup's named barrier (barrier 1, the 128 threads of one warpgroup; barrier 0 is
// __syncthreads).
__device__ __forceinline__ void producer_bar_sync() { asm volatile("bar.sync 1, 128;" ::: "memory"); }

// ---- wgmma
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
// Waits until at most N committed wgmma groups of this warpgroup are pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accumulator reads or writes across an asynchronous wgmma: the tensor cores read
// and write these registers until wgmma.wait_group.
template <int R>
__device__ __forceinline__ void fence_regs(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Matrix descriptor of a K-major operand in the 128-byte swizzled layout (16-byte chunk c of 128-byte row r
// stored at chunk c ^ (r & 7), tiles 1024-byte aligned): start address >> 4 (bits 0-13), leading byte offset
// (unused for this layout: 1), stride byte offset 1024 >> 4 (bits 32-45: from one group of 8 rows to the next),
// base offset 0, swizzle mode 1 = 128B (bits 62-63). The k-th 16-element slice of a 64-element row starts 32 k
// bytes further (the hardware applies the XOR to the address bits).
__device__ __forceinline__ uint64_t desc_sw128(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

}  // namespace wgmma_util
}  // namespace lily::cuda
