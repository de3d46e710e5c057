// The CUDA backend for batch-1 decode on the H200: the whole step (embedding, 40 layers, lm_head, sampling) is
// one CUDA graph replayed per token; positions live in device memory so the same graph serves every step, and the
// sampled token is written straight into the next step's input slot. Prompts of more than decode_rows_max tokens
// (default 1) take the prefill path: chunks of up to `prefill_chunk` rows through tensor-core GEMMs (qgemm.cuh), the
// Gated DeltaNet scan (gdn_prefill.cuh) and flash attention (attn_prefill.cuh); scratch memory is sized by the
// chunk, not the prompt.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "engine/backend.h"

namespace lily::cuda {

struct CudaBackendOptions {
  int64_t max_context = 32768;  // KV capacity of each sequence
  int prefill_chunk = 4096;     // rows per prefill chunk; 0: prompts run token by token through the decode step
  int gdn_scan_variant = 0;     // GdnPrefillParams::scan_variant (0: the kernel's own choice by length)
  // Dense prefill projections on the wgmma kernel (QGemmParams::use_wgmma; 1.1-1.2x the mma.sync kernel on the
  // H200); only on a compute 9.0 device, else mma.sync.
  bool dense_wgmma = true;
  // Forwards of at most this many tokens run as decode steps (graph replays, ~1.6 ms a token at full geometry)
  // instead of the prefill path, whose fixed cost per call is ~40 layers of small-grid GEMMs. 1: every multi-token
  // forward takes the prefill path (the default until the crossover is measured: tests/cuda/test_ttft_breakdown).
  int decode_rows_max = 1;
  // Destroyed sequences' device storage and captured decode graphs kept for the next new_sequence() (at most this
  // many; each holds a whole sequence: ~0.73 GB at full geometry and 32K tokens). 0: every sequence allocates and
  // captures anew.
  int sequence_pool = 0;
  // moe_prefill's grouped expert GEMMs on the wgmma kernel (MoePrefillParams::use_wgmma) for chunks of at least
  // moe_wgmma_min_rows rows; only on a compute 9.0 device, else mma.sync. H200 (2026-11-30, whole prefill): 4K
  // +2.0%, 16K +2.1%, 64K +1.5%, but 1K -3.7% (hence the row threshold; 2K not measured yet).
  bool moe_wgmma = true;
  int moe_wgmma_min_rows = 4096;
  // Prefill flash attention on the wgmma kernel (AttnPrefillParams::variant 1, attn_prefill_wgmma.cu); only on a
  // compute 9.0 device and head_dim 256. H200 (2026-11-30): attention 158 -> 217 TFLOP/s at a 4K chunk; whole
  // prefill 1K +0.3%, 4K +1.7%, 16K +6.4%, 64K +21.5%.
  bool attn_wgmma = true;
  // Decode: the MoE block of every layer as one persistent kernel (moe_fused, moe.cuh) instead of moe_route +
  // moe_expert_in + moe_expert_out, where its launcher takes the geometry. Correct, but slower on the H200
  // (2026-11-30: 4K step 1.577 -> 1.853 ms; docs/PERF_NOTES.md): off.
  bool moe_fused = false;
  // Decode: every Gated DeltaNet layer as one persistent kernel (gdn_fused, gdn.cuh) instead of gemv gdn_in +
  // gdn_step + gemv gdn_out, where its launcher takes the geometry. Correct; with moe_fused on it saves 26 us of a
  // 4K step (1.853 -> 1.827 ms); off until measured against the default chain.
  bool gdn_fused = false;
  // Decode: every full-attention layer as one persistent kernel (attn_fused, attention.cuh) instead of gemv attn_in +
  // attn_prep + attn_decode + attn_combine + gemv attn_out, where its launcher takes the geometry. Correct, but
  // slower on the H200 (2026-11-30: +189 us a 4K step over the five-kernel chain): off.
  bool attn_fused = false;
  // Decode: a parallel branch in the step's graph that prefetches, from the start of each layer, the next layer's
  // routing-independent weights into the L2 (l2_prefetch.cuh) while the chain runs at ~1 TB/s. 0: off; 1: on;
  // 2: on, with the L2 evict_last policy; 3: as 2, and each MoE block's selected experts' down matrices too
  // (moe_prefetch_down, moe.cuh). Correct (bit-identical results) but slower on the H200 (2026-11-30: 4K step
  // 1.576 -> 1.815 / 1.809 / 2.634 ms for 1 / 2 / 3; docs/PERF_NOTES.md): off.
  int decode_prefetch = 0;
  // Decode, three-kernel MoE chain: the expert kernels select the experts from the router logits (where their
  // shapes allow; see select_in_expert_kernels) or, false, moe_route selects them.
  bool moe_select_in_experts = true;
  // Decode, with moe_select_in_experts: moe_expert_in also writes its selection, and moe_expert_out reads it after
  // its wait instead of selecting from the logits itself (its blocks become resident only as moe_expert_in's leave,
  // so its own selection sat on the critical path: the block timeline's 2.5 us release). Results bit-identical.
  // H200 (2026-11-30): 4K step 1.587 -> 1.548 ms (+2.5%), 32K 1.786 -> 1.727 (+3.4%): on.
  bool moe_out_reads_selection = true;
  // forward_with_checkpoint (the engine's chat anchor): take the checkpoint at the last multiple of 64 rows at or
  // before the split (from the start of the prefill chunk) when the Gated DeltaNet scan of that chunk stores its
  // chunk states (scan variants 11-14; the default from 512 rows): each layer scans once and its state there is copied
  // out of the scan's scratch (gdn_prefill_checkpoint), instead of two gdn_prefill calls split at the anchor. The
  // next turn resumes up to 63 tokens earlier. Off: today's two calls. Correct, but no faster on the H200
  // (2026-11-30: forward_with_checkpoint of 1,025 rows 54.76 -> 54.65 ms; the split itself costs ~0.4 ms).
  bool anchor_from_chunk_states = false;
};

// Applies a spec `key=value,key=value` to o: the keys are the options above by name (gdn_scan for
// gdn_scan_variant, wgmma for dense_wgmma; option_keys() lists them), bools as on/off/1/0/true/false, ints in
// decimal. `lily bench --variants` and `--cuda-options` take these specs. Errors (prefixed with `what`) name the
// unknown key or the bad value; o may be partly set then.
Status apply_option_spec(const std::string& spec, CudaBackendOptions& o, const char* what);
std::string option_keys();

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
  std::string name;  // the step's op name, or the kernel kind for launches off the main chain
  uint32_t kind = 0;
  bool chain = true;  // on the step's main stream (false: the prefetch branch)
  int blocks = 0;
  double start_first = 0, start_last = 0, wait_first = 0, wait_last = 0, end_first = 0, end_last = 0;
};

// Decode-graph captures so far: how many, and the host wall time spent capturing and instantiating them.
struct GraphCaptureStats {
  int captures = 0;
  double capture_ms = 0, instantiate_ms = 0;
};

class CudaBackendApi : public Backend {
 public:
  // Benchmark hooks: make `seq` look like it holds n tokens (KV rows filled with random values; the recurrent
  // state keeps whatever it had), so decode at context n can be timed without an n-token prefill.
  virtual Status set_context_for_bench(SequenceState& seq, int64_t n) = 0;
  // Replays `steps` decode steps back to back (greedy on the device) and returns milliseconds per step.
  virtual Result<double> time_decode(SequenceState& seq, int steps) = 0;
  // One step with an event around every kernel: per-kernel-kind totals.
  virtual Result<std::vector<KernelTiming>> profile_step(SequenceState& seq) = 0;
  // Replays `steps` decode steps (the step graph, greedy) with the block timeline recorded: every launch of
  // every step, in launch order.
  virtual Result<std::vector<TraceLaunch>> trace_decode(SequenceState& seq, int steps) = 0;
  // Empties `seq` (zero recurrent state, no tokens), then prefills n random tokens with the logits of the last
  // row copied to the host, as a prompt would: wall milliseconds. With profile, one event pair per kernel launch
  // of the first chunk instead (slower), summed by kind into *profile.
  virtual Result<double> time_prefill(SequenceState& seq, int64_t n, std::vector<KernelTiming>* profile) = 0;
  // Device memory of the prefill path's scratch (fixed by prefill_chunk; 0 before the first prefill).
  virtual size_t prefill_scratch_bytes() const = 0;
  // Device memory in use on this GPU now (cudaMemGetInfo: total - free), all allocations of the process included.
  virtual size_t device_bytes_in_use() const = 0;
  virtual size_t weight_bytes_per_token() const = 0;
  virtual std::string device_name() const = 0;
  // Test and bench hooks: the options above that choose between equivalent paths, changed after construction.
  virtual void set_decode_rows_max(int rows) = 0;
  virtual void set_anchor_from_chunk_states(bool on) = 0;
  virtual void set_sequence_pool(int max_parked) = 0;
  virtual GraphCaptureStats graph_capture_stats() const = 0;
};

Result<std::unique_ptr<CudaBackendApi>> make_cuda_backend(std::shared_ptr<const ModelWeights> weights,
                                                          const CudaBackendOptions& options = {});

// Registers make_cuda_backend with the engine's backend factory (call once at start-up).
void register_cuda_backend();

// Split-KV blocks per KV head for a context of n rows (measured: docs/PERF_NOTES.md).
int attention_splits(int64_t n);

}  // namespace lily::cuda
