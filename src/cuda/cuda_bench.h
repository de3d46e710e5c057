// The CUDA backend's benchmark and trace hooks, outside the production interface: `lily bench` (src/cli/cmd_bench.cpp)
// and the CUDA tests use them; the server and the engine see only Backend (cuda_backend.h).
#pragma once
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cuda/cuda_backend.h"

namespace lily::cuda {

// One kernel launch of a profiled step.
struct KernelTiming {
  std::string name;
  double ms = 0;
  double bytes = 0;  // bytes the kernel must move
  double flops = 0;  // useful FLOPs it must do (prefill)
  int launches = 0;
};

// One launch of a traced decode step (kernels/trace.cuh; `lily bench --trace`): its blocks' first and last start,
// pdl_wait() return and end, in microseconds from the first traced block's start (%globaltimer). wait 0: thread 0
// of no block waited (a kernel launched without programmatic dependent launch).
struct TraceLaunch {
  std::string name;  // the step's op name
  uint32_t kind = 0;
  int blocks = 0;
  double start_first = 0, start_last = 0, wait_first = 0, wait_last = 0, end_first = 0, end_last = 0;
};

// Decode-graph captures so far: how many, and the host wall time spent capturing and instantiating them.
struct GraphCaptureStats {
  int captures = 0;
  double capture_ms = 0, instantiate_ms = 0;
};

class CudaBench : public Backend {
 public:
  // Make `seq` look like it holds n tokens (KV rows filled with random values; the recurrent state keeps whatever
  // it had), so decode at context n can be timed without an n-token prefill.
  virtual Status set_context_for_bench(SequenceState& seq, int64_t n) = 0;
  // Replays `steps` decode steps back to back (greedy on the device) and returns milliseconds per step.
  virtual Result<double> time_decode(SequenceState& seq, int steps) = 0;
  // One step with an event around every kernel: per-kernel-kind totals.
  virtual Result<std::vector<KernelTiming>> profile_step(SequenceState& seq) = 0;
  // Several-row steps (one token of each sequence a step, greedy on the device, as the server's continuous
  // batching runs them): milliseconds per step over `steps` steps after one warm-up step; and one such step with
  // an event around every kernel (launched eagerly).
  virtual Result<double> time_decode_rows(std::span<SequenceState* const> seqs, int steps) = 0;
  virtual Result<std::vector<KernelTiming>> profile_rows(std::span<SequenceState* const> seqs) = 0;
  // Replays `steps` decode steps (the step graph, greedy) with the block timeline recorded: every launch of
  // every step, in launch order (a -DLILY_TRACE=ON build only).
  virtual Result<std::vector<TraceLaunch>> trace_decode(SequenceState& seq, int steps) = 0;
  // With the decode megakernel on (--cuda-options megakernel=1): one step replayed with its instruction
  // timeline recorded (%globaltimer marks of every instruction), summarised by op label (mk::Program::
  // summarize_trace_by_label); *span_us gets the step's span. unsupported when the megakernel is off.
  virtual Result<std::string> megakernel_timeline(SequenceState& seq, double* span_us) = 0;
  // Empties `seq` (zero recurrent state, no tokens), then prefills n random tokens with the logits of the last
  // row copied to the host, as a prompt would: wall milliseconds. With profile, one event pair per kernel launch
  // of the first chunk instead (slower), summed by kind into *profile; with pos0 > 0 that chunk follows pos0 tokens
  // of context (random keys and values, as set_context_for_bench), i.e. the chunk of a longer prompt at pos0.
  virtual Result<double> time_prefill(SequenceState& seq, int64_t n, std::vector<KernelTiming>* profile,
                                      int64_t pos0 = 0) = 0;
  // Device memory of the prefill path's scratch (fixed by prefill_chunk; 0 before the first prefill).
  virtual size_t prefill_scratch_bytes() const = 0;
  // Device memory in use on this GPU now (cudaMemGetInfo: total - free), all allocations of the process included.
  virtual size_t device_bytes_in_use() const = 0;
  virtual size_t weight_bytes_per_token() const = 0;
  virtual std::string device_name() const = 0;
  // The kernel paths chosen at start (the line printed then: "cuda: <GPU> sm_XY, prefill: ...").
  virtual std::string kernel_paths() const = 0;
  virtual GraphCaptureStats graph_capture_stats() const = 0;
  // The MTP head (cuda_mtp.cpp) over R rows at positions 0 .. R-1 of a fresh KV cache of its own: token ids and
  // the main model's final-norm rows `hidden` [R, H] in; the last row's logits [V] and the head's normalised
  // output rows [R, H] out (for the op test against the CPU reference).
  virtual Status mtp_head_for_test(std::span<const int32_t> tokens, const std::vector<float>& hidden,
                                   std::vector<float>* logits, std::vector<float>* out_hidden) = 0;
};

Result<std::unique_ptr<CudaBench>> make_cuda_bench(std::shared_ptr<const ModelWeights> weights,
                                                   const CudaBackendOptions& options = {});

}  // namespace lily::cuda
