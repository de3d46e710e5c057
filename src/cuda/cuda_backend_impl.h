// The CUDA backend's class, shared by its translation units: cuda_backend.cpp (start-up, sequences, forward, the
// device-side generation loop), cuda_decode.cpp (the decode step), cuda_graph.cpp (its graph per sequence),
// cuda_prefill.cpp (the prefill path) and cuda_bench.cpp (the benchmark and trace hooks). Not for other callers:
// they use cuda_backend.h or cuda_bench.h.
#pragma once
#include <cuda_fp16.h>

#include <algorithm>
#include <array>
#include <functional>
#include <list>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cuda/cuda_bench.h"
#include "cuda/cuda_sequence.h"
#include "cuda/device_model.h"
#include "cuda/kernels/sample.cuh"

namespace lily::cuda {

// The sample kernel's numbers for a request (cuda_penalties.cpp).
SampleKnobs sample_knobs_of(const DeviceSampling& s);

// Records an event pair around each kernel when profiling an eager (non-graph) step.
struct Profiler {
  struct Entry {
    std::string name;
    double bytes, flops;
    cudaEvent_t start, stop;
  };
  std::vector<Entry> entries;
  cudaStream_t stream;
  bool names_only = false;  // record the launches' names in order, no events (trace_decode)
  void begin(const std::string& name, double bytes, double flops = 0);
  void end();
  ~Profiler();
  std::vector<KernelTiming> totals() const;  // per kernel kind (call after the stream has finished)
};

// Enqueues `call`; when profiling, between events, recording the bytes it must move (and the FLOPs, optional).
#define STEP_OP(name, bytes, call, ...)                                                \
  do {                                                                                 \
    if (prof) prof->begin(name, static_cast<double>(bytes) __VA_OPT__(, __VA_ARGS__)); \
    CUDA_RETURN(call, name);                                                           \
    if (prof) prof->end();                                                             \
  } while (0)

// Which kernels the backend runs, chosen once at start from the GPU and the device code this binary carries for it
// (a build of compute_80 PTX alone runs the non-Hopper paths on a Hopper GPU too).
struct KernelPaths {
  int cc_major = 0, cc_minor = 0;
  bool sm90_code = false;  // thread block clusters and programmatic dependent launch (sm90_code_built)
  bool wgmma = false;      // the sm_90a wgmma kernels (wgmma_built, compute capability 9.0)
  bool attn_wgmma = false;  // prefill attention on wgmma (head_dim 256 only)
  bool gdn_norm_in_step = false;  // decode: gdn_step applies eq 19 over a cluster (else the out_proj prologue)
  bool moe_select_in_experts = false;  // decode: moe_expert_in selects the experts (else moe_route)
  bool expert_copies = false;  // prefill: the experts' resident fp16 copies (fit_context: where they fit)
  bool megakernel = false;     // decode: the megakernel (CudaBackendOptions::megakernel, init_megakernel)
  std::string describe(const std::string& device) const;  // "cuda: <device> sm_90, prefill: wgmma, ..."
};

class CudaBackend final : public CudaBench {
 public:
  CudaBackend(std::shared_ptr<const ModelWeights> weights, CudaBackendOptions options);
  ~CudaBackend() override;
  Status init();

  // Backend
  const char* name() const override { return "cuda"; }
  const ModelConfig& config() const override { return weights_->config; }
  int64_t max_context() const override { return options_.max_context; }
  std::unique_ptr<SequenceState> new_sequence() override;
  Status forward(SequenceState& seq, std::span<const int32_t> tokens, LogitsRows rows,
                 std::vector<float>* logits) override;
  int preferred_prefill_tokens() const override {
    return options_.prefill_chunk > 0 ? options_.prefill_chunk : Backend::preferred_prefill_tokens();
  }
  bool has_device_sampling() const override { return true; }
  Status generate_on_device(SequenceState& seq, int32_t first, const DeviceSampling& sampling, int max_new,
                            const std::function<bool(int32_t)>& on_token) override;
  Status forward_batch(std::span<SequenceState* const> seqs, std::span<const int32_t> tokens,
                       std::vector<float>* logits) override;
  Status decode_batch_on_device(std::span<SequenceState* const> seqs, std::span<const int32_t> tokens,
                                std::span<const DeviceSampling> sampling, std::vector<int32_t>* next) override;
  Status forward_verify(SequenceState& seq, std::span<const int32_t> tokens, std::vector<float>* logits) override;
  // The argmax of each row on the device (the greedy sample kernel): R ids come back instead of R x 1 MB of logits.
  Status forward_verify_argmax(SequenceState& seq, std::span<const int32_t> tokens,
                               std::vector<int32_t>* ids) override;
  Status accept_verified(SequenceState& seq, int64_t n_keep) override;
  // cuda_mtp.cpp: the head needs the prefill kernels (mtp_rows).
  bool has_mtp() const override;
  Status enable_mtp() override;
  bool mtp_enabled() const override { return mtp_on_; }
  Status mtp_draft(SequenceState& seq, int32_t token, std::vector<float>* logits) override;
  Status mtp_draft_argmax(SequenceState& seq, int32_t token, int32_t* id) override;
  Result<std::unique_ptr<Checkpoint>> forward_with_checkpoint(SequenceState& seq, std::span<const int32_t> tokens,
                                                              int64_t split, LogitsRows rows,
                                                              std::vector<float>* logits) override;
  Result<std::unique_ptr<SequenceState>> load_sequence(ByteReader& in) override;
  Result<std::unique_ptr<Checkpoint>> load_checkpoint(ByteReader& in) override;
  // CudaBench (cuda_bench.cpp)
  Status set_context_for_bench(SequenceState& seq, int64_t n) override;
  Result<double> time_decode(SequenceState& seq, int steps) override;
  Result<std::vector<KernelTiming>> profile_step(SequenceState& seq) override;
  Result<double> time_decode_rows(std::span<SequenceState* const> seqs, int steps) override;
  Result<std::vector<KernelTiming>> profile_rows(std::span<SequenceState* const> seqs) override;
  Result<std::vector<TraceLaunch>> trace_decode(SequenceState& seq, int steps) override;
  Result<std::string> megakernel_timeline(SequenceState& seq, double* span_us) override;  // cuda_megakernel.cpp
  Result<double> time_prefill(SequenceState& seq, int64_t n, std::vector<KernelTiming>* profile,
                              int64_t pos0 = 0) override;
  size_t prefill_scratch_bytes() const override { return prefill_bytes_; }
  size_t device_bytes_in_use() const override;
  size_t weight_bytes_per_token() const override { return model_->decode_weight_bytes(); }
  std::string device_name() const override { return device_name_; }
  std::string kernel_paths() const override { return paths_.describe(device_name_); }
  GraphCaptureStats graph_capture_stats() const override { return capture_stats_; }
  Status mtp_head_for_test(std::span<const int32_t> tokens, const std::vector<float>& hidden,
                           std::vector<float>* logits, std::vector<float>* out_hidden) override;

 private:
  Status choose_paths(const cudaDeviceProp& prop);
  Status fit_context();
  // cuda_decode.cpp: one step of 1 to kMaxBatchRows rows (distinct sequences); sampling empty or one per row.
  // chained: the rows are successive positions of one sequence (verification, cuda_verify.cpp): the Gated
  // DeltaNet layers step row after row, each from the state the row before left into its own (GdnStepParams
  // S_out / ring_out; rows[R - 1] holds the sequence's own state, which row 0 starts from), and no kernel reads a
  // sequence's state or KV rows ahead of its wait (rows before r are written in the same step).
  Status enqueue_step(std::span<CudaSequence* const> rows, int n_splits, std::span<const DeviceSampling> sampling,
                      Profiler* prof, bool chained = false);
  Status enqueue_gdn_layer(std::span<CudaSequence* const> rows, size_t l, bool chained, Profiler* prof);
  Status enqueue_attention_layer(std::span<CudaSequence* const> rows, size_t l, int n_splits, bool chained,
                                 Profiler* prof);
  Status enqueue_moe_block(int rows, size_t l, Profiler* prof);
  // The same on any layer's weights (the MTP head's): attention rows by their KV cache and position (n: the
  // context before the step, for the byte count), the MoE block over the first R rows of h_.
  struct AttnRow {
    __nv_bfloat16 *k = nullptr, *v = nullptr;
    const int* pos = nullptr;
  };
  Status enqueue_attention(const DeviceLayer& L, std::span<const AttnRow> rows, int64_t n, int n_splits, bool chained,
                           Profiler* prof);
  Status enqueue_moe(const DeviceLayer& L, int rows, Profiler* prof);
  // cuda_backend.cpp: the checks of a several-row call (distinct sequences of this backend with room for a token,
  // tokens in the vocabulary), then one step of up to kMaxBatchRows rows without a graph.
  Result<std::vector<CudaSequence*>> check_rows(std::span<SequenceState* const> seqs, std::span<const int32_t> tokens);
  Status run_rows(std::span<CudaSequence* const> rows, std::span<const int32_t> tokens,
                  std::span<const DeviceSampling> sampling);
  // cuda_graph.cpp
  Result<cudaGraphExec_t> graph_for(CudaSequence& s, const DeviceSampling* sampling);
  Result<cudaGraphExec_t> rows_graph_for(std::span<CudaSequence* const> rows, std::span<const DeviceSampling> sampling);
  Result<std::unique_ptr<GraphExec>> capture(const std::function<Status()>& enqueue);
  // The backend's graph under `key` (row_graphs_, least recently used out first), captured from `enqueue` when
  // there is none.
  Result<cudaGraphExec_t> row_graph(const std::string& key, const std::function<Status()>& enqueue);
  Status run_step(CudaSequence& s, const DeviceSampling* sampling);
  // cuda_megakernel.cpp: the megakernel's checks and scratch (options_.megakernel; sets paths_.megakernel), the
  // program of a sequence's batch-1 step (its layers and lm_head: h_ -> logits_), built and uploaded once per
  // sequence (before the step's graph is captured).
  Status init_megakernel();
  Result<mk::Program> step_program(const CudaSequence& s) const;
  Status ensure_step_program(CudaSequence& s);
  // cuda_prefill.cpp
  bool prefill_supported() const;
  size_t prefill_scratch_needed() const;
  bool expert_copies_fit() const;
  size_t expert_copies_bytes() const;  // every layer's (paths_.expert_copies)
  Status ensure_prefill_scratch();
  Status prefill_chunk(CudaSequence& s, const int* tokens, int T, Profiler* prof, int split = 0,
                       CudaCheckpoint* cp = nullptr);
  Status prefill_gdn_mixer(CudaSequence& s, size_t l, int T, Profiler* prof, int split, CudaCheckpoint* cp);
  Status prefill_attention(const DeviceLayer& L, __nv_bfloat16* k, __nv_bfloat16* v, int T, int pos0, Profiler* prof);
  // w16_layer: the index of L's resident fp16 copies (w16_off_), or -1 for a layer that has none (the MTP head's).
  Status prefill_layer(const DeviceLayer& L, int T, const std::function<Status()>& mixer, Profiler* prof,
                       int w16_layer = -1);
  Status prefill(CudaSequence& s, int64_t T, LogitsRows rows, std::vector<float>* logits, Profiler* prof,
                 int64_t split = 0, CudaCheckpoint* cp = nullptr);
  Status copy_recurrent(const CudaSequence& s, CudaCheckpoint& cp, int layer);
  // cuda_mtp.cpp: the MTP head over R <= prefill_chunk rows (tokens on the device, the main model's final-norm
  // rows `hidden` [R, H]), its KV k / v at positions pos0 ..; out_hidden [R, H] gets its normalised output, logits
  // (optional) [V] the last row's; up to kMaxBatchRows rows on the decode kernels (mtp_rows_decode), more on the
  // prefill kernels. model_->mtp must be uploaded and the prefill scratch allocated.
  Status mtp_rows(const int* tokens, const float* hidden, int R, __nv_bfloat16* k, __nv_bfloat16* v, int pos0,
                  float* out_hidden, float* logits, Profiler* prof);
  // The head's state around the main forwards of a sequence with it (s.mtp_on): mtp_prepare before one (drafts
  // dropped; at most max_pending rows left pending), mtp_read_rows after each plain forward's T rows (residual rows
  // [T, H] and their tokens on the device), mtp_append_verified after a verification's graph.
  Status mtp_rows_decode(const int* tokens, const float* hidden, int R, __nv_bfloat16* k, __nv_bfloat16* v, int pos0,
                         float* out_hidden, Profiler* prof);  // R <= kMaxBatchRows, without the logits (mtp_rows)
  // The draft step and the verification with `read_out` enqueued after them (the logits' copy to the host, or
  // enqueue_argmax), then the synchronisation and the sequence's bookkeeping.
  Status mtp_draft_then(SequenceState& base, int32_t token, const std::function<Status()>& read_out);
  Status forward_verify_then(SequenceState& base, std::span<const int32_t> tokens,
                             const std::function<Status(int rows)>& read_out);
  // The greedy sample kernel on rows 0 .. R-1 of logits_, the R ids copied to `ids` (host) after it.
  Status enqueue_argmax(int R, int32_t* ids);
  Status mtp_prepare(CudaSequence& s, int max_pending);
  Status mtp_read_rows(CudaSequence& s, const float* residual, int T, const int* tokens, Profiler* prof,
                       CudaCheckpoint* cp = nullptr, int cp_row = -1);
  Status mtp_append_verified(CudaSequence& s, std::span<const int32_t> tokens);
  // cuda_verify.cpp: verify_views_[0 .. R) as the rows of a verification of s (R <= kMaxBatchRows).
  Status bind_verify_views(CudaSequence& s, int R);
  // cuda_bench.cpp
  Status warm_up_decode(CudaSequence& s, const DeviceSampling& greedy);
  // cuda_penalties.cpp: the penalty table of s holds sp.history (rebuilt unless PenaltySync says it does), with
  // room for max_new more tokens; nothing without penalties. An error for penalty values or a history the
  // device cannot take (invalid_argument), out_of_range when the table has no room or no memory
  // (the engine then samples the request on the host).
  Status prepare_penalties(CudaSequence& s, const DeviceSampling& sp, int64_t max_new);
  Status allocate_penalties(CudaSequence& s);
  // cuda_backend.cpp
  Result<CudaSequence*> check_sequence(SequenceState& base, int64_t new_tokens);
  Status check_tokens(std::span<const int32_t> tokens) const;
  Status upload_tokens(std::span<const int32_t> ids);

  // Device memory left for the runtime beside the weights, one sequence and the scratch: the CUDA context's own
  // allocations grow with graphs and modules (measured ~0.3-0.5 GB on the H200 after the first captures).
  static constexpr size_t kRuntimeReserve = size_t{1} << 30;
  // What the experts' fp16 copies leave free beyond the parallel streams' sequences: the engine's default session
  // cache budget (EngineOptions::session_cache_bytes, 8 GiB).
  static constexpr size_t kSessionCacheHeadroom = size_t{8} << 30;
  static constexpr int kMaxSplits = 256;
  static constexpr int kRingSize = 1024;
  static constexpr int kSampleScratch = 2 * 1024 * 64;
  static constexpr int kHeadRows = 128;    // prefill rows whose logits one lm_head GEMM computes (LogitsRows::all)
  static constexpr size_t kMaxGraphs = 8;  // decode graphs kept per sequence
  static constexpr size_t kMaxRowGraphs = 8;  // several-row step graphs kept (the most recently used)
  static constexpr int kRouteCounter = 0;              // counters_: moe_route's of row r at kRouteCounter + r
  static constexpr int kSampleCounter = kMaxBatchRows;  // ... the sample kernel's at kSampleCounter + r

  // Floats between scratch rows of a several-row step (row r of h_ at h_.ptr + r * h, ...); row 0 is the batch-1
  // step's scratch.
  struct RowStrides {
    size_t h = 0, proj = 0, q = 0, attn_out = 0, gdn_o = 0, moe_logits = 0, topk = 0, shared_gate = 0, act = 0;
    size_t logits = 0, part_o = 0, part_ml = 0;
  };
  RowStrides strides_;

  std::shared_ptr<const ModelWeights> weights_;
  CudaBackendOptions options_;
  KernelPaths paths_;
  std::unique_ptr<DeviceModel> model_;
  std::string device_name_;
  cudaStream_t stream_ = nullptr;
  // Scratch shared by all sequences (one step runs at a time), kMaxBatchRows rows of each (strides_).
  DeviceArray<float> h_, proj_, q_, attn_out_, gdn_o_, moe_x_, moe_logits_, topk_w_, shared_gate_, act_, logits_;
  DeviceArray<float> part_o_, part_ml_, sample_scratch_;
  DeviceArray<SampleKnobs> sample_knobs_;  // the running request's sampling numbers (SampleParams::knobs)
  DeviceArray<int> topk_idx_, token_in_, tokens_;
  DeviceArray<unsigned> counters_;  // kRouteCounter + r, kSampleCounter + r
  int* ring_ = nullptr;             // host-mapped, kRingSize tokens per row
  int* ring_dev_ = nullptr;
  // Prefill scratch, sized by options_.prefill_chunk rows (allocated on the first prefill).
  DeviceArray<float> ph_, pproj_, plogits_;
  DeviceArray<__half> pxb_, pob_;  // fp16 A operands of the prefill GEMMs
  // Every layer's dense projections (in, out) expanded to fp16 once, kept for the fp16-W GEMM (QGemmParams::w16,
  // w16_expanded; the wgmma path, chunks of >= kW16MinRows rows; qgemm_w16_halves each, in its tile order);
  // w16_off_[l] = {in, out} offsets in halves.
  DeviceArray<__half> pw16_;
  std::vector<std::array<size_t, 2>> w16_off_;
  // With paths_.expert_copies, every layer's experts expanded to fp16 once (moe_expand_w16), layer l's at
  // pexp16_ + l expert16_stride_ (halves), for moe_prefill's fp16-copy tiles (MoePrefillParams::w16).
  DeviceArray<__half> pexp16_;
  size_t expert16_stride_ = 0;
  DeviceArray<__half> mtp_cat_;    // the MTP head's fc operand [rows, 2H] (cuda_mtp.cpp)
  // With the head enabled (enable_mtp): a plain forward chunk's final-norm rows after the pending one
  // [prefill_chunk + 1, H], and the tokens a draft or the head's catch-up reads [kMtpPendingRows].
  bool mtp_on_ = false;
  DeviceArray<float> mtp_hidden_;
  DeviceArray<int> mtp_tokens_;
  DeviceArray<float> mtp_cat32_;  // the decode path's fc input [kMaxBatchRows, 2H] (mtp_rows_decode)
  DeviceArray<int> mtp_pos_;      // its rows' positions in the head's KV cache
  bool context_auto_ = false;  // --ctx-size auto: enable_mtp fits the context again
  // The megakernel's scratch (init_megakernel): per layer the router's logits (at 0) and the experts'
  // activations, then the attention's partial outputs and their max / sum (offsets in floats); one block per SM.
  DeviceArray<float> mk_scratch_;
  std::vector<QMatrix> mk_router_of_;  // per layer: the router's and the shared gate's rows, 8-bit [E + 1, H]
  size_t mk_act_off_ = 0, mk_part_o_off_ = 0, mk_part_ml_off_ = 0;
  int mk_blocks_ = 0;
  DeviceArray<unsigned char> pscratch_;
  size_t prefill_bytes_ = 0;
  GraphCaptureStats capture_stats_;
  // Several-row step graphs by key (split count, each row's sequence id and sampling mode), most recent first.
  std::list<std::pair<std::string, std::unique_ptr<GraphExec>>> row_graphs_;
  // Verification (cuda_verify.cpp): the rows' positions, the recurrent state after each row but the last
  // (kMaxBatchRows - 1 copies of a sequence's recurrent region, allocated on the first verification), and the
  // rows as sequences (views of the verified sequence's KV cache and of these states).
  DeviceArray<int> verify_pos_;
  DeviceArray<int> argmax_ids_;  // enqueue_argmax: the rows' ids [kMaxBatchRows], then a step slot for the kernel
  DeviceBlock verify_states_;
  uint64_t verify_owner_ = 0;  // the id of the sequence whose rows verify_states_ holds
  std::vector<std::unique_ptr<CudaSequence>> verify_views_;
};

}  // namespace lily::cuda
