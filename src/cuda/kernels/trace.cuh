// Block timeline of the decode step (`lily bench --trace`): what an event breakdown cannot show and a profiler
// that serialises kernels hides. Built with -DLILY_TRACE=ON only: then, with a buffer set (trace_set_buffer),
// thread 0 of every block of an instrumented kernel records when the block started, when its pdl_wait() returned
// and when it ended (%globaltimer, ns), keyed by %gridid (one launch per replay of a graph node). The kernels
// read the buffer pointer at run time, so the step graph replays with tracing on or off. Not in the normal
// build: the instrumentation holds a few registers through every kernel (measured 2026-11-30: 4K step 1.576 ->
// 1.907 ms with the hooks compiled in and tracing off; inferred to be moe_expert_in's occupancy, not profiled).
//
// Each CUDA translation unit has its own copy of the device-side pointer (no relocatable device code), so each
// registers a setter at static initialisation; trace_set_buffer() calls them all.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace lily::cuda::trace {

enum Kind : uint32_t {
  kEmbed = 1, kGemv, kGdnStep, kMoeRoute, kMoeExpertIn, kMoeExpertOut, kAttnPrep, kAttnDecode, kAttnCombine,
  kSample, kAdvance
};

struct BlockRecord {
  uint64_t grid;                    // %gridid: one launch
  uint64_t t_start, t_wait, t_end;  // ns; t_wait 0 where thread 0 never waited
  uint32_t kind, block;
};

struct Buffer {
  BlockRecord* rec = nullptr;
  uint32_t* count = nullptr;  // records written (may exceed capacity: the rest were dropped)
  uint32_t capacity = 0;
};

#if defined(LILY_TRACE)
inline constexpr bool kEnabled = true;
#else
inline constexpr bool kEnabled = false;
#endif

using Setter = cudaError_t (*)(const Buffer&);
bool register_setter(Setter s);  // trace.cu
// Points every translation unit's kernels at b (b.rec == nullptr: tracing off); cudaErrorNotSupported in a build
// without LILY_TRACE.
cudaError_t trace_set_buffer(const Buffer& b);

#if defined(__CUDACC__) && !defined(LILY_TRACE)
struct BlockTrace {
  __device__ explicit BlockTrace(uint32_t) {}
};
__device__ __forceinline__ void mark_wait() {}
#elif defined(__CUDACC__)
namespace {
__device__ Buffer g_buffer;  // this translation unit's copy
cudaError_t set_here(const Buffer& b) { return cudaMemcpyToSymbol(g_buffer, &b, sizeof b); }
[[maybe_unused]] const bool g_registered = register_setter(&set_here);
}  // namespace

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// When this block's pdl_wait() returned (written by thread 0; 0 until then).
__device__ __forceinline__ uint64_t& wait_slot() {
  __shared__ uint64_t t;
  return t;
}

__device__ __forceinline__ void mark_wait() {
  if (threadIdx.x == 0 && threadIdx.y == 0) wait_slot() = now_ns();
}

// One per kernel, first statement: records the block at thread 0's exit.
struct BlockTrace {
  Buffer b;
  uint64_t t0 = 0;
  uint32_t kind;
  __device__ explicit BlockTrace(uint32_t k) : kind(k) {
    if (threadIdx.x == 0 && threadIdx.y == 0) {
      b = g_buffer;
      t0 = now_ns();
      wait_slot() = 0;
    }
  }
  __device__ ~BlockTrace() {
    if (threadIdx.x != 0 || threadIdx.y != 0 || b.rec == nullptr) return;
    const uint64_t t1 = now_ns();
    uint64_t grid;
    asm volatile("mov.u64 %0, %%gridid;" : "=l"(grid));
    const uint32_t i = atomicAdd(b.count, 1u);
    if (i < b.capacity) b.rec[i] = BlockRecord{grid, t0, wait_slot(), t1, kind, blockIdx.x};
  }
};
#endif  // __CUDACC__

}  // namespace lily::cuda::trace
