// The persistent decode kernel: one block per SM interprets its instruction list (program.h).
//
// Block = 16 consumer warps + 1 loader warp. Shared memory: a ring of 5 pages of 36 KB (a page = 32 rows of a
// 2048-column 4-bit matrix or 16 rows of a 4096-column one, weights then scales then biases, as in the checkpoint),
// the input vector x (padded, quant_dot.cuh) and one full / one empty mbarrier per page.
//   loader (one lane): walks the block's instructions and their pages in order; for each page it waits until the
//     consumers have released it, then asks the bulk-copy engine (cp.async.bulk, Hopper) for the page's three
//     contiguous pieces. It never waits for a dependency: weights stream up to 5 pages (184 KB) ahead of the
//     instruction that is waiting for its input.
//   consumers: per instruction load what no op of the step writes (the prologue's norm multipliers; a Gated
//     DeltaNet unit's state slice, conv history and constants), wait for the counters it reads (one thread polls
//     with ld.acquire.gpu, then a named barrier), build x (RMSNorm or gated-norm prologue) from L2, then per page: wait full, 4 (or 2) rows a warp with the
//     gemv dot products of quant_dot.cuh, release the page; after the last page's stores a named barrier, a fence,
//     and one release-add on the op's counter.
// Memory-bound: a step moves the program's weight bytes once; the floor is bytes / 4.27 TB/s, plus one
// dependency latency (~1 us) per op on the critical path that the prefetch cannot hide.
//
// Built for sm_90a only (bulk copies, mbarrier transaction counts); step_supported() says whether this binary and
// device can run it. Elsewhere the kernel-per-op chain is the decode path.
#pragma once
#include <cuda_runtime.h>

#include <memory>

#include "cuda/megakernel/program.h"

namespace lily::cuda::mk {

constexpr int kConsumerWarps = 16;  // 8 measured 4% slower (the x prologue has half the threads)
constexpr int kThreads = 32 * (kConsumerWarps + 1);
constexpr int kPageBytes = 36864;
constexpr int kPages = 5;  // 3 and 2 measured slower; the fence cost did not change with the ring's depth

// The program in device memory, with its counters (zero at upload) and the launch.
class DeviceProgram {
 public:
  static Result<std::unique_ptr<DeviceProgram>> upload(const Program& p);
  ~DeviceProgram();
  DeviceProgram(const DeviceProgram&) = delete;
  DeviceProgram& operator=(const DeviceProgram&) = delete;

  // One step: every block runs its list once (capturable in a CUDA graph).
  cudaError_t launch(cudaStream_t stream) const;
  // The counters' values (for tests: after n steps counter i is n * signals_per_step(i)).
  Result<std::vector<unsigned long long>> counters() const;
  int n_blocks() const { return view_.n_blocks; }
  // The instruction timeline (program.h kTraceMarks per instruction, the last traced step's): recorded by the
  // launches from enable_trace() until disable_trace() (a captured graph keeps the setting of its capture).
  Status enable_trace();
  void disable_trace() { view_.trace = nullptr; }
  Result<std::vector<unsigned long long>> trace() const;

 private:
  DeviceProgram() = default;
  ProgramView view_;
  int n_counters_ = 0;
  int n_instrs_ = 0;
  unsigned long long* trace_ = nullptr;  // the timeline's marks (enable_trace)
  std::vector<void*> allocations_;
};

// Whether this binary holds the kernel's sm_90a code and device 0 can run it (co-resident blocks, shared memory).
bool step_supported();
size_t step_smem_bytes();

}  // namespace lily::cuda::mk
