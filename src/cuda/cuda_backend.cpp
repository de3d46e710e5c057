#include "cuda/cuda_backend.h"

#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <random>

#include "cuda/cuda_sequence.h"
#include "cuda/device_model.h"
#include "cuda/kernels/attention.cuh"
#include "cuda/kernels/attn_prefill.cuh"
#include "cuda/kernels/dispatch.cuh"
#include "cuda/kernels/embed.cuh"
#include "cuda/kernels/gdn.cuh"
#include "cuda/kernels/gdn_prefill.cuh"
#include "cuda/kernels/gemv.cuh"
#include "cuda/kernels/l2_prefetch.cuh"
#include "cuda/kernels/moe.cuh"
#include "cuda/kernels/qgemm.cuh"
#include "cuda/kernels/sample.cuh"
#include "cuda/kernels/trace.cuh"
#include "engine/backend_factory.h"

namespace lily::cuda {

namespace {

constexpr int kMaxSplits = 256;
constexpr int kRingSize = 1024;
constexpr int kSampleScratch = 2 * 1024 * 64;
constexpr int kHeadRows = 128;  // prefill rows whose logits one lm_head GEMM computes (LogitsRows::all)
constexpr size_t kMaxGraphs = 8;  // decode graphs kept per sequence

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
  void begin(const std::string& name, double bytes, double flops = 0) {
    Entry e{name, bytes, flops, nullptr, nullptr};
    if (names_only) return entries.push_back(e);
    cudaEventCreate(&e.start);
    cudaEventCreate(&e.stop);
    cudaEventRecord(e.start, stream);
    entries.push_back(e);
  }
  void end() {
    if (!names_only) cudaEventRecord(entries.back().stop, stream);
  }
  ~Profiler() {
    for (auto& e : entries)
      if (e.start) cudaEventDestroy(e.start), cudaEventDestroy(e.stop);
  }
  // Totals per kernel kind (call after the stream has finished).
  std::vector<KernelTiming> totals() const {
    std::vector<KernelTiming> out;
    for (auto& e : entries) {
      float ms = 0;
      cudaEventElapsedTime(&ms, e.start, e.stop);
      auto it = std::find_if(out.begin(), out.end(), [&](const KernelTiming& k) { return k.name == e.name; });
      if (it == out.end()) it = out.insert(out.end(), KernelTiming{e.name, 0, 0, 0, 0});
      it->ms += ms;
      it->bytes += e.bytes;
      it->flops += e.flops;
      it->launches += 1;
    }
    return out;
  }
};

class CudaBackend final : public CudaBackendApi {
 public:
  CudaBackend(std::shared_ptr<const ModelWeights> weights, CudaBackendOptions options)
      : weights_(std::move(weights)), options_(options), pool_(std::make_shared<SequencePool>()) {
    pool_->max_parked = static_cast<size_t>(std::max(0, options_.sequence_pool));
  }
  ~CudaBackend() override {
    if (ring_) cudaFreeHost(ring_);
    if (fork_) cudaEventDestroy(fork_);
    if (join_) cudaEventDestroy(join_);
    if (side_) cudaStreamDestroy(side_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  Status init();
  const char* name() const override { return "cuda"; }
  const ModelConfig& config() const override { return weights_->config; }
  std::unique_ptr<SequenceState> new_sequence() override;
  Status forward(SequenceState& seq, std::span<const int32_t> tokens, LogitsRows rows,
                 std::vector<float>* logits) override;
  int preferred_prefill_tokens() const override {
    return options_.prefill_chunk > 0 ? options_.prefill_chunk : Backend::preferred_prefill_tokens();
  }
  bool has_device_sampling() const override { return true; }
  Status generate_on_device(SequenceState& seq, int32_t first, const DeviceSampling& sampling, int max_new,
                            const std::function<bool(int32_t)>& on_token) override;
  Result<std::unique_ptr<Checkpoint>> forward_with_checkpoint(SequenceState& seq, std::span<const int32_t> tokens,
                                                              int64_t split, LogitsRows rows,
                                                              std::vector<float>* logits) override;
  Status set_context_for_bench(SequenceState& seq, int64_t n) override;
  Result<double> time_decode(SequenceState& seq, int steps) override;
  Result<std::vector<KernelTiming>> profile_step(SequenceState& seq) override;
  Result<std::vector<TraceLaunch>> trace_decode(SequenceState& seq, int steps) override;
  Result<double> time_prefill(SequenceState& seq, int64_t n, std::vector<KernelTiming>* profile) override;
  size_t prefill_scratch_bytes() const override { return prefill_bytes_; }
  size_t device_bytes_in_use() const override {
    size_t free_b = 0, total_b = 0;
    return cudaMemGetInfo(&free_b, &total_b) == cudaSuccess ? total_b - free_b : 0;
  }
  size_t weight_bytes_per_token() const override { return model_->decode_weight_bytes(); }
  std::string device_name() const override { return device_name_; }
  void set_decode_rows_max(int rows) override { options_.decode_rows_max = rows; }
  void set_anchor_from_chunk_states(bool on) override { options_.anchor_from_chunk_states = on; }
  void set_sequence_pool(int max_parked) override {
    options_.sequence_pool = max_parked;
    std::lock_guard lock(pool_->mu);
    pool_->max_parked = static_cast<size_t>(std::max(0, max_parked));
    while (pool_->parked.size() > pool_->max_parked) pool_->parked.pop_back();
  }
  GraphCaptureStats graph_capture_stats() const override { return capture_stats_; }

 private:
  Status enqueue_step(CudaSequence& s, int n_splits, const DeviceSampling* sampling, Profiler* prof);
  Status fork_prefetch(const DeviceLayer& L);
  Status fork_side();
  Result<cudaGraphExec_t> graph_for(CudaSequence& s, const DeviceSampling* sampling);
  Status run_step(CudaSequence& s, const DeviceSampling* sampling);
  Status warm_up_decode(CudaSequence& s, const DeviceSampling& greedy);
  Result<CudaSequence*> check_sequence(SequenceState& base, int64_t new_tokens);
  bool prefill_supported() const;
  Status ensure_prefill_scratch();
  Status prefill_chunk(CudaSequence& s, const int* tokens, int T, Profiler* prof, int split = 0,
                       CudaCheckpoint* cp = nullptr);
  Status prefill(CudaSequence& s, int64_t T, LogitsRows rows, std::vector<float>* logits, Profiler* prof,
                 int64_t split = 0, CudaCheckpoint* cp = nullptr);
  Status copy_recurrent(const CudaSequence& s, CudaCheckpoint& cp, int layer);
  GdnPrefillParams gdn_shape(int T) const;
  int64_t checkpoint_row(int64_t T, int64_t split) const;
  Status upload_tokens(std::span<const int32_t> ids);

  std::shared_ptr<const ModelWeights> weights_;
  CudaBackendOptions options_;
  std::unique_ptr<DeviceModel> model_;
  std::string device_name_;
  cudaStream_t stream_ = nullptr;
  // The decode step's parallel branch (options_.decode_prefetch): side_ at the lowest priority, forked from
  // stream_ by fork_ and joined back by join_.
  cudaStream_t side_ = nullptr;
  cudaEvent_t fork_ = nullptr, join_ = nullptr;
  // Scratch shared by all sequences (batch 1: one step runs at a time).
  DeviceArray<float> h_, proj_, q_, attn_out_, gdn_o_, moe_x_, moe_logits_, topk_w_, shared_gate_, act_, logits_;
  DeviceArray<float> part_o_, part_ml_, sample_scratch_;
  DeviceArray<SampleKnobs> sample_knobs_;  // the running request's sampling numbers (SampleParams::knobs)
  DeviceArray<int> topk_idx_, token_in_, tokens_;
  DeviceArray<unsigned> counters_;  // [0] moe_route, [1] sample; barriers: [2] moe_fused, [3] gdn_fused, [4] attn_fused
  int* ring_ = nullptr;             // host-mapped
  int* ring_dev_ = nullptr;
  // Prefill scratch, sized by options_.prefill_chunk rows (allocated on the first prefill).
  DeviceArray<float> ph_, pproj_, plogits_;
  DeviceArray<__half> pxb_, pob_;  // fp16 A operands of the prefill GEMMs
  DeviceArray<unsigned char> pscratch_;
  size_t prefill_bytes_ = 0;
  // Storage and graphs of destroyed sequences (options_.sequence_pool); sequences hold it weakly.
  std::shared_ptr<SequencePool> pool_;
  GraphCaptureStats capture_stats_;
};

Status CudaBackend::init() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) return error(ErrorCode::unsupported, "no CUDA device");
  cudaDeviceProp prop{};
  CUDA_RETURN(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  device_name_ = prop.name;
  // The wgmma kernels are built for sm_90a only (qgemm_wgmma.cu, attn_prefill_wgmma.cu): elsewhere the dense
  // projections, the MoE experts and the attention take mma.sync.
  if (prop.major != 9 || prop.minor != 0) options_.dense_wgmma = options_.moe_wgmma = options_.attn_wgmma = false;
  if (options_.attn_wgmma && !attn_prefill_wgmma_built()) options_.attn_wgmma = false;  // no sm_90a code here
  CUDA_RETURN(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  int least = 0, greatest = 0;
  CUDA_RETURN(cudaDeviceGetStreamPriorityRange(&least, &greatest), "stream priorities");
  CUDA_RETURN(cudaStreamCreateWithPriority(&side_, cudaStreamNonBlocking, least), "cudaStreamCreate");
  CUDA_RETURN(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming), "cudaEventCreate");
  CUDA_RETURN(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming), "cudaEventCreate");
  ASSIGN_OR_RETURN(model_, DeviceModel::upload(*weights_));
  const ModelConfig& c = config();
  const size_t H = c.hidden_size, D = c.head_dim, nq = c.num_attention_heads, I = c.moe_intermediate_size;
  size_t proj_rows = 0;
  for (const DeviceLayer& l : model_->layers)
    proj_rows = std::max<size_t>(proj_rows, l.type == LayerType::full_attention ? l.attn_in.rows : l.gdn_in.rows);
  RETURN_IF_ERROR(h_.alloc(H));
  RETURN_IF_ERROR(proj_.alloc(proj_rows));
  RETURN_IF_ERROR(q_.alloc(nq * D));
  RETURN_IF_ERROR(attn_out_.alloc(nq * D));
  RETURN_IF_ERROR(gdn_o_.alloc(static_cast<size_t>(c.linear_value_dim())));
  RETURN_IF_ERROR(moe_x_.alloc(H));
  RETURN_IF_ERROR(moe_logits_.alloc(static_cast<size_t>(c.num_experts)));
  RETURN_IF_ERROR(topk_w_.alloc(static_cast<size_t>(c.num_experts_per_tok)));
  RETURN_IF_ERROR(topk_idx_.alloc(static_cast<size_t>(c.num_experts_per_tok)));
  RETURN_IF_ERROR(shared_gate_.alloc(1));
  RETURN_IF_ERROR(act_.alloc((c.num_experts_per_tok + 1) * I));
  RETURN_IF_ERROR(logits_.alloc(static_cast<size_t>(c.vocab_size)));
  RETURN_IF_ERROR(part_o_.alloc(kMaxSplits * nq * D));
  RETURN_IF_ERROR(part_ml_.alloc(kMaxSplits * nq * 2));
  RETURN_IF_ERROR(sample_scratch_.alloc(kSampleScratch));
  RETURN_IF_ERROR(sample_knobs_.alloc(1));
  const SampleKnobs greedy_knobs;
  CUDA_RETURN(cudaMemcpy(sample_knobs_.ptr, &greedy_knobs, sizeof greedy_knobs, cudaMemcpyHostToDevice), "knobs");
  RETURN_IF_ERROR(token_in_.alloc(1));
  RETURN_IF_ERROR(counters_.alloc(5));
  CUDA_RETURN(cudaHostAlloc(reinterpret_cast<void**>(&ring_), kRingSize * sizeof(int), cudaHostAllocMapped), "ring");
  CUDA_RETURN(cudaHostGetDevicePointer(reinterpret_cast<void**>(&ring_dev_), ring_, 0), "ring");
  return ok_status();
}

std::unique_ptr<SequenceState> CudaBackend::new_sequence() {
  auto s = std::make_unique<CudaSequence>();
  s->owner = this;
  if (options_.sequence_pool > 0) s->pool = pool_;
  auto parked = pool_->take();
  // An error path may have returned with kernels of the parked sequence still in flight on stream_; the reuse
  // clears the block on the legacy stream, which does not wait for stream_.
  if (parked && cudaStreamSynchronize(stream_) != cudaSuccess) return nullptr;
  if (!s->allocate(config(), options_.max_context, std::move(parked)).ok()) return nullptr;
  return s;
}

Result<CudaSequence*> CudaBackend::check_sequence(SequenceState& base, int64_t new_tokens) {
  auto* s = dynamic_cast<CudaSequence*>(&base);
  if (!s || s->owner != this) return invalid_argument("sequence state is not from this CUDA backend");
  if (s->n + new_tokens > s->capacity)
    return error(ErrorCode::out_of_range, "%lld tokens exceed the KV capacity of %lld (--ctx-size)",
                 (long long)(s->n + new_tokens), (long long)s->capacity);
  return s;
}

// The expert kernels may select the experts from the router logits themselves (moe.cuh; the decode step does so
// unless CudaBackendOptions::moe_select_in_experts is off) when the fast MoE kernels serve this geometry (their
// launchers' shapes, up to 256 experts); other kernels read moe_route's selection.
bool select_in_expert_kernels(const ModelConfig& c) {
  const int H = c.hidden_size, I = c.moe_intermediate_size;
  return c.num_experts <= 256 && c.num_experts_per_tok <= 16 && (H == 1024 || H == 2048 || H == 4096) &&
         (I == 512 || I == 1024) && c.shared_expert_intermediate_size == I;
}

// gdn_step applies the out_proj's gated RMSNorm itself (GdnStepParams::norm_w, a cluster per head) when the fast
// kernel serves this geometry (its launcher's shapes); else the out_proj GEMV's prologue does.
bool gated_norm_in_gdn_step(const ModelConfig& c) {
  return c.linear_key_head_dim == 128 && c.linear_value_head_dim % 32 == 0 && c.linear_value_head_dim <= 256 &&
         c.linear_num_key_heads > 0 && c.linear_num_value_heads % c.linear_num_key_heads == 0 &&
         c.linear_conv_kernel_dim == 4;
}

// Enqueues `call`; when profiling, between events, recording the bytes it must move (and the FLOPs, optional).
#define STEP_OP(name, bytes, call, ...)                                                \
  do {                                                                                 \
    if (prof) prof->begin(name, static_cast<double>(bytes) __VA_OPT__(, __VA_ARGS__)); \
    CUDA_RETURN(call, name);                                                           \
    if (prof) prof->end();                                                             \
  } while (0)

// The decode step's parallel branch: from this point of stream_, side_ prefetches into the L2 the matrices of layer
// L that do not depend on the routing (its attention or Gated DeltaNet in/out projections, the router, the shared
// expert: 21.3 MB for a Gated DeltaNet layer at full geometry, 17.7 MB for an attention layer), while stream_ goes
// on with the current layer. Nothing waits for it but the step's end (join_).
Status CudaBackend::fork_prefetch(const DeviceLayer& L) {
  L2PrefetchParams p;
  p.evict_last = options_.decode_prefetch >= 2;
  const bool gdn = L.type == LayerType::linear_attention;
  for (const QMatrix* q : {gdn ? &L.gdn_in : &L.attn_in, gdn ? &L.gdn_out : &L.attn_out, &L.router,
                           &L.shared_gate_row, &L.shared_gate, &L.shared_up, &L.shared_down})
    if (!p.add(*q))
      return error(ErrorCode::internal, "decode prefetch: more than %d ranges", L2PrefetchParams::kMaxRanges);
  RETURN_IF_ERROR(fork_side());
  CUDA_RETURN(l2_prefetch(p, side_), "l2_prefetch");
  return ok_status();
}

// side_ continues from this point of stream_ (the step's prefetch branch).
Status CudaBackend::fork_side() {
  CUDA_RETURN(cudaEventRecord(fork_, stream_), "fork");
  CUDA_RETURN(cudaStreamWaitEvent(side_, fork_, 0), "fork");
  return ok_status();
}

// One decode step (eqs 4-6 with every block), reading the input token from token_in_ and the position from s.pos.
// With options_.decode_prefetch, a second branch of the step prefetches layer l + 1's routing-independent weights
// into the L2 from the start of layer l (fork_prefetch) and, with 3, each MoE block's selected experts' down
// matrices from the end of moe_route (moe_prefetch_down); not when profiling, whose events time one stream.
Status CudaBackend::enqueue_step(CudaSequence& s, int n_splits, const DeviceSampling* sampling, Profiler* prof) {
  const ModelConfig& c = config();
  const DeviceModel& m = *model_;
  const float eps = c.rms_norm_eps;
  const bool branch = options_.decode_prefetch > 0 && prof == nullptr;
  STEP_OP("embed", m.embed.bytes() / m.embed.rows, embed_lookup({m.embed, token_in_.ptr, h_.ptr}, stream_));
  for (size_t l = 0; l < m.layers.size(); ++l) {
    const DeviceLayer& L = m.layers[l];
    if (branch && l + 1 < m.layers.size()) RETURN_IF_ERROR(fork_prefetch(m.layers[l + 1]));
    if (L.type == LayerType::linear_attention) {
      // Opt-in: the whole layer as one persistent kernel (gdn_fused.cu) where its launcher takes the geometry.
      GdnFusedParams gf;
      gf.in_proj = L.gdn_in, gf.out_proj = L.gdn_out, gf.h = h_.ptr, gf.input_norm = L.input_norm;
      gf.conv_w = L.conv_w, gf.A_log = L.A_log, gf.dt_bias = L.dt_bias, gf.norm_w = L.gdn_norm;
      gf.conv_ring = s.conv[l]->ptr, gf.S = s.S[l]->ptr, gf.pos = s.pos.ptr;
      gf.n_k = c.linear_num_key_heads, gf.n_v = c.linear_num_value_heads, gf.d_k = c.linear_key_head_dim;
      gf.d_v = c.linear_value_head_dim, gf.kernel = c.linear_conv_kernel_dim, gf.eps = eps;
      gf.proj = proj_.ptr, gf.o = gdn_o_.ptr, gf.barrier = counters_.ptr + 3;
      gf.prefetch_state = true;  // as gdn_step's: S, the ring and pos are written by no kernel before it in a step
      if (options_.gdn_fused && gdn_fused_supported(gf)) {
        STEP_OP("gdn_fused", L.gdn_in.bytes() + L.gdn_out.bytes() + 2.0 * s.S[l]->bytes(), gdn_fused(gf, stream_));
      } else {
        GemvParams in{L.gdn_in, h_.ptr, GemvPrologue::rms_norm, L.input_norm, nullptr, 0, eps, nullptr, proj_.ptr};
        STEP_OP("gemv gdn_in", L.gdn_in.bytes(), dispatch::gemv(in, stream_));
        GdnStepParams g{proj_.ptr, s.conv[l]->ptr, L.conv_w, L.A_log, L.dt_bias, s.S[l]->ptr, s.pos.ptr,
                        c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                        c.linear_value_head_dim, c.linear_conv_kernel_dim, gdn_o_.ptr};
        g.prefetch_state = true;  // S, the conv ring and pos are written by no kernel before it in a step
        const bool fused_norm = gated_norm_in_gdn_step(c);
        if (fused_norm) g.gate_z = proj_.ptr + c.linear_conv_dim(), g.norm_w = L.gdn_norm, g.eps = eps;
        STEP_OP("gdn_step", 2.0 * s.S[l]->bytes(), dispatch::gdn_step(g, stream_));
        const GemvPrologue out_prologue = fused_norm ? GemvPrologue::none : GemvPrologue::gated_rms_norm;
        GemvParams out{L.gdn_out, gdn_o_.ptr, out_prologue, L.gdn_norm, proj_.ptr + c.linear_conv_dim(),
                       c.linear_value_head_dim, eps, h_.ptr, h_.ptr};
        STEP_OP("gemv gdn_out", L.gdn_out.bytes(), dispatch::gemv(out, stream_));
      }
    } else {
      const double kv_bytes = 2.0 * (s.n + 1) * c.num_key_value_heads * c.head_dim * 2;
      // Opt-in: the whole layer as one persistent kernel (attn_fused.cu) where its launcher takes the geometry.
      AttnFusedParams af;
      af.in_proj = L.attn_in, af.out_proj = L.attn_out, af.h = h_.ptr, af.input_norm = L.input_norm;
      af.q_norm = L.q_norm, af.k_norm = L.k_norm, af.nq = c.num_attention_heads, af.nkv = c.num_key_value_heads;
      af.head_dim = c.head_dim, af.rotary_dim = c.rotary_dim(), af.rope_theta = static_cast<float>(c.rope_theta);
      af.eps = eps, af.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim)), af.pos = s.pos.ptr;
      af.k_cache = s.k[l]->ptr, af.v_cache = s.v[l]->ptr, af.n_splits = n_splits, af.proj = proj_.ptr;
      af.part_o = part_o_.ptr, af.part_ml = part_ml_.ptr, af.attn_out = attn_out_.ptr, af.barrier = counters_.ptr + 4;
      af.prefetch_cache = true;  // as attn_decode's: rows < pos and pos are written by no kernel before it in a step
      if (options_.attn_fused && attn_fused_supported(af)) {
        STEP_OP("attn_fused", L.attn_in.bytes() + L.attn_out.bytes() + kv_bytes, attn_fused(af, stream_));
      } else {
        GemvParams in{L.attn_in, h_.ptr, GemvPrologue::rms_norm, L.input_norm, nullptr, 0, eps, nullptr, proj_.ptr};
        STEP_OP("gemv attn_in", L.attn_in.bytes(), dispatch::gemv(in, stream_));
        AttnPrepParams prep{proj_.ptr, L.q_norm, L.k_norm, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                            c.rotary_dim(), static_cast<float>(c.rope_theta), eps, s.pos.ptr, q_.ptr,
                            s.k[l]->ptr, s.v[l]->ptr};
        STEP_OP("attn_prep", 0, dispatch::attn_prep(prep, stream_));
        AttnDecodeParams dec{q_.ptr, s.k[l]->ptr, s.v[l]->ptr, c.num_attention_heads, c.num_key_value_heads,
                             c.head_dim, s.pos.ptr, n_splits, 1.0f / std::sqrt(static_cast<float>(c.head_dim)),
                             part_o_.ptr, part_ml_.ptr};
        dec.prefetch_cache = true;  // rows < pos and pos itself are written by no kernel before attn_prep in a step
        STEP_OP("attn_decode", kv_bytes, dispatch::attn_decode(dec, stream_));
        AttnCombineParams comb{part_o_.ptr, part_ml_.ptr, n_splits, c.num_attention_heads, c.head_dim, proj_.ptr,
                               attn_out_.ptr};
        STEP_OP("attn_combine", 0, dispatch::attn_combine(comb, stream_));
        GemvParams out{L.attn_out, attn_out_.ptr, GemvPrologue::none, nullptr, nullptr, 0, eps, h_.ptr, h_.ptr};
        STEP_OP("gemv attn_out", L.attn_out.bytes(), dispatch::gemv(out, stream_));
      }
    }
    const int k = c.num_experts_per_tok;
    // Opt-in: the whole block as one persistent kernel (moe_fused.cu) where its launcher takes the geometry.
    MoeFusedParams f;
    f.router = L.router, f.shared_gate_row = L.shared_gate_row, f.gate = L.expert_gate, f.up = L.expert_up;
    f.down = L.expert_down, f.shared_gate = L.shared_gate, f.shared_up = L.shared_up, f.shared_down = L.shared_down;
    f.h = h_.ptr, f.norm_w = L.post_norm, f.eps = eps, f.top_k = k, f.logits = moe_logits_.ptr;
    f.shared_gate_value = shared_gate_.ptr, f.act = act_.ptr, f.barrier = counters_.ptr + 2;
    if (options_.moe_fused && moe_fused_supported(f)) {
      const double expert = static_cast<double>(L.expert_gate.bytes() + L.expert_up.bytes() + L.expert_down.bytes());
      const double bytes = static_cast<double>(L.router.bytes() + L.shared_gate_row.bytes()) + k * expert +
                           L.shared_gate.bytes() + L.shared_up.bytes() + L.shared_down.bytes();
      STEP_OP("moe_fused", bytes, moe_fused(f, stream_));
      continue;
    }
    const bool select_in_experts = options_.moe_select_in_experts && select_in_expert_kernels(c);
    MoeRouteParams route{L.router, L.shared_gate_row, h_.ptr, L.post_norm, eps, k, moe_x_.ptr, moe_logits_.ptr,
                         counters_.ptr, topk_idx_.ptr, topk_w_.ptr, shared_gate_.ptr};
    route.select_top_k = !select_in_experts;
    STEP_OP("moe_route", L.router.bytes() + L.shared_gate_row.bytes(), dispatch::moe_route(route, stream_));
    if (branch && options_.decode_prefetch == 3) {  // the selected experts' down matrices, during moe_expert_in
      RETURN_IF_ERROR(fork_side());
      CUDA_RETURN(moe_prefetch_down({moe_logits_.ptr, k, L.expert_down, c.num_experts}, side_), "moe_prefetch_down");
    }
    MoeExpertInParams ein{L.expert_gate, L.expert_up, L.shared_gate, L.shared_up, moe_x_.ptr, topk_idx_.ptr, k,
                          act_.ptr};
    if (select_in_experts) ein.router_logits = moe_logits_.ptr, ein.n_experts = c.num_experts;
    const bool out_reads = select_in_experts && options_.moe_out_reads_selection;
    if (out_reads) ein.topk_idx_out = topk_idx_.ptr, ein.topk_w_out = topk_w_.ptr;
    STEP_OP("moe_expert_in", k * (L.expert_gate.bytes() + L.expert_up.bytes()) + L.shared_gate.bytes() + L.shared_up.bytes(),
            dispatch::moe_expert_in(ein, stream_));
    MoeExpertOutParams eout{L.expert_down, L.shared_down, act_.ptr, topk_idx_.ptr, topk_w_.ptr, shared_gate_.ptr, k,
                            h_.ptr};
    if (select_in_experts && !out_reads) eout.router_logits = moe_logits_.ptr, eout.n_experts = c.num_experts;
    STEP_OP("moe_expert_out", k * L.expert_down.bytes() + L.shared_down.bytes(), dispatch::moe_expert_out(eout, stream_));
  }
  GemvParams head{m.lm_head, h_.ptr, GemvPrologue::rms_norm, m.final_norm, nullptr, 0, eps, nullptr, logits_.ptr};
  STEP_OP("gemv lm_head", m.lm_head.bytes(), dispatch::gemv(head, stream_));
  if (sampling) {
    SampleParams sp{logits_.ptr, c.vocab_size, sampling->temperature, sampling->top_k, sampling->top_p,
                    sampling->min_p, sampling->seed, s.pos.ptr, sample_scratch_.ptr, counters_.ptr + 1,
                    token_in_.ptr, ring_dev_, kRingSize, sample_knobs_.ptr};
    STEP_OP("sample", 4.0 * c.vocab_size, sample_token(sp, stream_));
  }
  STEP_OP("advance", 0, advance_position(s.pos.ptr, stream_));
  if (branch && m.layers.size() > 1) {  // the branch rejoins stream_ (a capture must end with every fork joined)
    CUDA_RETURN(cudaEventRecord(join_, side_), "join");
    CUDA_RETURN(cudaStreamWaitEvent(stream_, join_, 0), "join");
  }
  return ok_status();
}

// The prefill kernels' shapes (qgemm: K a multiple of 64; gdn_prefill: d_k = d_v in {64, 128}, conv kernel 4;
// attn_prefill: head_dim in {64, 128, 256}): every preset of the model family. Other geometries (and
// prefill_chunk = 0) run prompts token by token through the decode step.
bool CudaBackend::prefill_supported() const {
  const ModelConfig& c = config();
  const bool dims64 = c.hidden_size % 64 == 0 && c.moe_intermediate_size % 64 == 0 &&
                      c.shared_expert_intermediate_size % 64 == 0 && c.linear_value_dim() % 64 == 0 &&
                      (c.num_attention_heads * c.head_dim) % 64 == 0;
  const bool gdn = c.linear_key_head_dim == c.linear_value_head_dim &&
                   (c.linear_key_head_dim == 64 || c.linear_key_head_dim == 128) && c.linear_conv_kernel_dim == 4;
  const bool attn = c.head_dim == 64 || c.head_dim == 128 || c.head_dim == 256;
  return options_.prefill_chunk > 0 && dims64 && gdn && attn;
}

Status CudaBackend::ensure_prefill_scratch() {
  if (prefill_bytes_ > 0) return ok_status();
  const ModelConfig& c = config();
  const int C = options_.prefill_chunk, H = c.hidden_size, D = c.head_dim, nq = c.num_attention_heads;
  size_t proj_cols = 0;
  for (const DeviceLayer& l : model_->layers)
    proj_cols = std::max<size_t>(proj_cols, l.type == LayerType::full_attention ? l.attn_in.rows : l.gdn_in.rows);
  const size_t mixer_cols = std::max<size_t>(c.linear_value_dim(), static_cast<size_t>(nq) * D);
  const size_t scratch = std::max({moe_prefill_scratch_bytes(C, H, c.moe_intermediate_size,
                                                             c.shared_expert_intermediate_size, c.num_experts,
                                                             c.num_experts_per_tok),
                                   gdn_prefill_scratch_bytes(C, c.linear_num_key_heads, c.linear_num_value_heads,
                                                             c.linear_key_head_dim, c.linear_value_head_dim),
                                   attn_prefill_scratch_bytes(C, nq, D)});
  RETURN_IF_ERROR(ph_.alloc(static_cast<size_t>(C) * H));
  RETURN_IF_ERROR(pproj_.alloc(static_cast<size_t>(C) * proj_cols));
  RETURN_IF_ERROR(pxb_.alloc(static_cast<size_t>(C) * std::max<size_t>(H, mixer_cols)));
  RETURN_IF_ERROR(pob_.alloc(static_cast<size_t>(C) * mixer_cols));
  RETURN_IF_ERROR(pscratch_.alloc(scratch));
  RETURN_IF_ERROR(plogits_.alloc(static_cast<size_t>(std::min(C, kHeadRows)) * c.vocab_size));
  prefill_bytes_ = ph_.bytes() + pproj_.bytes() + pxb_.bytes() + pob_.bytes() + pscratch_.bytes() + plogits_.bytes();
  return ok_status();
}

// One chunk of T <= prefill_chunk rows at positions s.n .. s.n+T-1 (eqs 4-5 for every layer): the residual stream
// ph_ [T, H] in fp32, each block's input normalised to fp16 for the tensor-core GEMMs (fp16, not bf16: its
// 2^-11 rounding keeps the prefill within the decode path's accuracy; normalised activations stay far from its
// 65504 range). Leaves the final residual
// rows in ph_ for the lm_head. With 0 < split < T, each Gated DeltaNet layer scans rows [0, split), copies its conv
// ring and state S into *cp (the state at pos0 + split), then scans [split, T): the same two gdn_prefill calls as
// two chunks would make, while every other kernel still runs once over the T rows. With anchor_from_chunk_states,
// a split at a multiple of 64 rows and a scan that stores its chunk states, each layer scans the T rows once and
// copies the state at the split out of the scan's scratch instead (gdn_prefill_checkpoint).
Status CudaBackend::prefill_chunk(CudaSequence& s, const int* tokens, int T, Profiler* prof, int split,
                                  CudaCheckpoint* cp) {
  const ModelConfig& c = config();
  const DeviceModel& m = *model_;
  const float eps = c.rms_norm_eps;
  const int H = c.hidden_size, pos0 = static_cast<int>(s.n), k = c.num_experts_per_tok;
  const double rows = T;
  STEP_OP("embed", rows * m.embed.bytes() / m.embed.rows, embed_rows(m.embed, tokens, T, ph_.ptr, stream_));
  for (size_t l = 0; l < m.layers.size(); ++l) {
    const DeviceLayer& L = m.layers[l];
    STEP_OP("rms_norm", rows * H * 6, rms_norm_rows(ph_.ptr, L.input_norm, T, H, eps, pxb_.ptr, stream_));
    const QMatrix& in = L.type == LayerType::linear_attention ? L.gdn_in : L.attn_in;
    const QMatrix& out = L.type == LayerType::linear_attention ? L.gdn_out : L.attn_out;
    QGemmParams gin{in, pxb_.ptr, T, GemmOut::f32, pproj_.ptr, 0, options_.dense_wgmma};
    if (L.type == LayerType::linear_attention) {
      STEP_OP("qgemm gdn_in", in.bytes(), qgemm(gin, stream_), 2.0 * rows * in.rows * in.cols);
      const bool split_here = cp && split > 0 && split < T;
      // The checkpoint from the scan's stored chunk states (checkpoint_row chose such a split): one call.
      const bool from_states = split_here && options_.anchor_from_chunk_states && split % kGdnPrefillChunkRows == 0 &&
                               gdn_prefill_stores_chunk_states(gdn_shape(T));
      const bool two_calls = split_here && !from_states;
      for (int part = 0; part < (two_calls ? 2 : 1); ++part) {
        const int r0 = part == 0 ? 0 : split, Tp = two_calls ? (part == 0 ? split : T - split) : T;
        GdnPrefillParams g{pproj_.ptr + static_cast<size_t>(r0) * in.rows, Tp, pos0 + r0, s.conv[l]->ptr, L.conv_w,
                           L.A_log, L.dt_bias, s.S[l]->ptr, c.linear_num_key_heads, c.linear_num_value_heads,
                           c.linear_key_head_dim, c.linear_value_head_dim, c.linear_conv_kernel_dim, L.gdn_norm,
                           eps, pob_.ptr + static_cast<size_t>(r0) * c.linear_value_dim(), pscratch_.ptr,
                           pscratch_.bytes(), options_.gdn_scan_variant};
        STEP_OP("gdn_prefill", 2.0 * s.S[l]->bytes(), gdn_prefill(g, stream_),
                4.0 * Tp * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim);
        if (two_calls && part == 0) RETURN_IF_ERROR(copy_recurrent(s, *cp, static_cast<int>(l)));
        if (from_states)  // before the MoE block reuses the scratch
          STEP_OP("gdn_checkpoint", 2.0 * (cp->S[l]->bytes() + cp->conv[l]->bytes()),
                  gdn_prefill_checkpoint(g, split, cp->S[l]->ptr, cp->conv[l]->ptr, stream_));
      }
      QGemmParams gout{out, pob_.ptr, T, GemmOut::add_f32, ph_.ptr, 0, options_.dense_wgmma};
      STEP_OP("qgemm gdn_out", out.bytes(), qgemm(gout, stream_), 2.0 * rows * out.rows * out.cols);
    } else {
      STEP_OP("qgemm attn_in", in.bytes(), qgemm(gin, stream_), 2.0 * rows * in.rows * in.cols);
      AttnPrefillParams a{pproj_.ptr, T, pos0, L.q_norm, L.k_norm, c.num_attention_heads, c.num_key_value_heads,
                          c.head_dim, c.rotary_dim(), static_cast<float>(c.rope_theta), eps,
                          1.0f / std::sqrt(static_cast<float>(c.head_dim)), s.k[l]->ptr, s.v[l]->ptr, pob_.ptr,
                          pscratch_.ptr, pscratch_.bytes()};
      if (options_.attn_wgmma && c.head_dim == 256) a.variant = 1;
      // Causal: row t attends pos0 + t + 1 rows.
      const double attended = rows * pos0 + rows * (rows + 1) / 2;
      STEP_OP("attn_prefill", 0, attn_prefill(a, stream_), 4.0 * c.num_attention_heads * c.head_dim * attended);
      QGemmParams gout{out, pob_.ptr, T, GemmOut::add_f32, ph_.ptr, 0, options_.dense_wgmma};
      STEP_OP("qgemm attn_out", out.bytes(), qgemm(gout, stream_), 2.0 * rows * out.rows * out.cols);
    }
    MoePrefillParams moe{L.router, L.shared_gate_row, L.expert_gate, L.expert_up, L.expert_down, L.shared_gate,
                         L.shared_up, L.shared_down, ph_.ptr, L.post_norm, eps, T, k, pscratch_.ptr,
                         pscratch_.bytes()};
    moe.use_wgmma = options_.moe_wgmma && T >= options_.moe_wgmma_min_rows;
    const double moe_flops = 2.0 * rows * H *
                             (3.0 * k * c.moe_intermediate_size + 3.0 * c.shared_expert_intermediate_size +
                              c.num_experts + 1);
    STEP_OP("moe_prefill", 0, moe_prefill(moe, stream_), moe_flops);
  }
  s.n += T;
  return ok_status();
}

// Copies layer l's conv ring and state S (or, with l < 0, the whole recurrent region) into cp, on the stream.
Status CudaBackend::copy_recurrent(const CudaSequence& s, CudaCheckpoint& cp, int l) {
  if (l < 0) {
    CUDA_RETURN(cudaMemcpyAsync(cp.storage.ptr, s.storage.ptr, s.layout.recurrent_bytes, cudaMemcpyDeviceToDevice,
                                stream_), "checkpoint");
    return ok_status();
  }
  CUDA_RETURN(cudaMemcpyAsync(cp.conv[l]->ptr, s.conv[l]->ptr, s.conv[l]->bytes(), cudaMemcpyDeviceToDevice, stream_),
              "checkpoint");
  CUDA_RETURN(cudaMemcpyAsync(cp.S[l]->ptr, s.S[l]->ptr, s.S[l]->bytes(), cudaMemcpyDeviceToDevice, stream_),
              "checkpoint");
  return ok_status();
}

// The shape of the Gated DeltaNet scan over a T-row prefill chunk, for gdn_prefill_stores_chunk_states.
GdnPrefillParams CudaBackend::gdn_shape(int T) const {
  const ModelConfig& c = config();
  GdnPrefillParams g;
  g.T = T;
  g.n_k = c.linear_num_key_heads, g.n_v = c.linear_num_value_heads;
  g.d_k = c.linear_key_head_dim, g.d_v = c.linear_value_head_dim, g.kernel = c.linear_conv_kernel_dim;
  g.scan_variant = options_.gdn_scan_variant;
  return g;
}

// Where forward_with_checkpoint of T prefill rows takes the checkpoint asked at `split` (rows from the call's
// start). With anchor_from_chunk_states: the last multiple of 64 rows at or before the split, counted from the start
// of the prefill chunk that holds it, when that chunk's scan stores its chunk states and the multiple is past the
// chunk's start (split - 63 <= row <= split, Backend::kCheckpointEarly: the next turn prefills the difference
// again). Otherwise the split.
int64_t CudaBackend::checkpoint_row(int64_t T, int64_t split) const {
  static_assert(kGdnPrefillChunkRows - 1 <= Backend::kCheckpointEarly, "the contract's slack");
  const int64_t C = options_.prefill_chunk, off = split / C * C, in_chunk = split - off;
  if (!options_.anchor_from_chunk_states || in_chunk < kGdnPrefillChunkRows) return split;
  if (!gdn_prefill_stores_chunk_states(gdn_shape(static_cast<int>(std::min(C, T - off))))) return split;
  return off + in_chunk / kGdnPrefillChunkRows * kGdnPrefillChunkRows;
}

// Prefills the T tokens in tokens_ (device) in chunks; logits of the rows asked for go to the host. With cp, the
// recurrent state after the first `split` rows (0 < split < T) is copied into it on the way.
Status CudaBackend::prefill(CudaSequence& s, int64_t T, LogitsRows rows, std::vector<float>* logits,
                            Profiler* prof, int64_t split, CudaCheckpoint* cp) {
  RETURN_IF_ERROR(ensure_prefill_scratch());
  const ModelConfig& c = config();
  const DeviceModel& m = *model_;
  const int64_t V = c.vocab_size, C = options_.prefill_chunk;
  const int H = c.hidden_size;
  for (int64_t off = 0; off < T; off += C) {
    const int Tc = static_cast<int>(std::min<int64_t>(C, T - off));
    const int in_chunk = cp && split > off && split < off + Tc ? static_cast<int>(split - off) : 0;
    RETURN_IF_ERROR(prefill_chunk(s, tokens_.ptr + off, Tc, prof, in_chunk, cp));
    if (cp && split == off + Tc) RETURN_IF_ERROR(copy_recurrent(s, *cp, -1));  // the split is a chunk boundary
    if (rows == LogitsRows::all) {  // the lm_head for every row, kHeadRows at a time
      for (int r = 0; r < Tc; r += kHeadRows) {
        const int R = std::min(kHeadRows, Tc - r);
        STEP_OP("rms_norm", R * H * 6.0,
                rms_norm_rows(ph_.ptr + static_cast<size_t>(r) * H, m.final_norm, R, H, c.rms_norm_eps, pxb_.ptr, stream_));
        QGemmParams head{m.lm_head, pxb_.ptr, R, GemmOut::f32, plogits_.ptr, 0};
        STEP_OP("qgemm lm_head", m.lm_head.bytes(), qgemm(head, stream_), 2.0 * R * V * H);
        CUDA_RETURN(cudaMemcpyAsync(logits->data() + (off + r) * V, plogits_.ptr, R * V * sizeof(float),
                                    cudaMemcpyDeviceToHost, stream_), "logits");
      }
    } else if (rows == LogitsRows::last && off + Tc == T) {  // one row: the decode GEMV
      GemvParams head{m.lm_head, ph_.ptr + static_cast<size_t>(Tc - 1) * H, GemvPrologue::rms_norm, m.final_norm,
                      nullptr, 0, c.rms_norm_eps, nullptr, logits_.ptr};
      STEP_OP("gemv lm_head", m.lm_head.bytes(), dispatch::gemv(head, stream_));
      CUDA_RETURN(cudaMemcpyAsync(logits->data(), logits_.ptr, V * sizeof(float), cudaMemcpyDeviceToHost, stream_),
                  "logits");
    }
  }
  CUDA_RETURN(set_position(s.pos.ptr, static_cast<int>(s.n), stream_), "position");
  return ok_status();
}

// The graph for this sequence, split count and sampling mode (captured on first use). The sample kernel reads
// the request's numbers (temperature, top-k/p, min-p, seed) from sample_knobs_, written before the steps run, so
// one graph per mode serves every request. At most kMaxGraphs a sequence (split counts x modes).
Result<cudaGraphExec_t> CudaBackend::graph_for(CudaSequence& s, const DeviceSampling* sp) {
  const int n_splits = attention_splits(s.n + 1);
  std::string key = std::to_string(n_splits);
  if (sp) key += "/" + std::to_string(sample_mode(sp->temperature, sp->top_k, sp->top_p, sp->min_p));
  auto it = s.graphs.find(key);
  if (it != s.graphs.end()) return it->second->exec;
  if (s.graphs.size() >= kMaxGraphs) s.graphs.clear();  // none is in flight: every caller synchronised
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  cudaGraph_t graph = nullptr;
  CUDA_RETURN(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "begin capture");
  Status st = enqueue_step(s, n_splits, sp, nullptr);
  cudaError_t end = cudaStreamEndCapture(stream_, &graph);
  RETURN_IF_ERROR(st);
  CUDA_RETURN(end, "end capture");
  const auto t1 = Clock::now();
  auto exec = std::make_unique<GraphExec>();
  cudaError_t inst = cudaGraphInstantiate(&exec->exec, graph, 0);
  cudaGraphDestroy(graph);
  CUDA_RETURN(inst, "graph instantiate");
  capture_stats_.captures += 1;
  capture_stats_.capture_ms += std::chrono::duration<double, std::milli>(t1 - t0).count();
  capture_stats_.instantiate_ms += std::chrono::duration<double, std::milli>(Clock::now() - t1).count();
  cudaGraphExec_t e = exec->exec;
  s.graphs[key] = std::move(exec);
  return e;
}

Status CudaBackend::run_step(CudaSequence& s, const DeviceSampling* sampling) {
  ASSIGN_OR_RETURN(cudaGraphExec_t g, graph_for(s, sampling));
  CUDA_RETURN(cudaGraphLaunch(g, stream_), "graph launch");
  s.n += 1;
  return ok_status();
}

// Copies token ids into tokens_ (grown as needed, never below 4,096 ids).
Status CudaBackend::upload_tokens(std::span<const int32_t> ids) {
  if (tokens_.n < ids.size()) RETURN_IF_ERROR(tokens_.alloc(std::max<size_t>(ids.size(), 4096)));
  CUDA_RETURN(cudaMemcpy(tokens_.ptr, ids.data(), ids.size() * sizeof(int), cudaMemcpyHostToDevice), "upload tokens");
  return ok_status();
}

Status CudaBackend::forward(SequenceState& base, std::span<const int32_t> tokens, LogitsRows rows,
                            std::vector<float>* logits) {
  const int64_t T = static_cast<int64_t>(tokens.size());
  if (T == 0) return invalid_argument("forward: no tokens");
  ASSIGN_OR_RETURN(CudaSequence * s, check_sequence(base, T));
  const int64_t V = config().vocab_size;
  for (int32_t id : tokens)
    if (id < 0 || id >= V) return invalid_argument("token id %d is outside the vocabulary [0, %lld)", id, (long long)V);
  RETURN_IF_ERROR(upload_tokens(tokens));
  if (rows != LogitsRows::none) logits->resize(static_cast<size_t>((rows == LogitsRows::all ? T : 1) * V));
  if (T > std::max(1, options_.decode_rows_max) && prefill_supported()) {
    RETURN_IF_ERROR(prefill(*s, T, rows, logits, nullptr));
    CUDA_RETURN(cudaStreamSynchronize(stream_), "prefill");
    return ok_status();
  }
  for (int64_t t = 0; t < T; ++t) {
    CUDA_RETURN(cudaMemcpyAsync(token_in_.ptr, tokens_.ptr + t, sizeof(int), cudaMemcpyDeviceToDevice, stream_), "token");
    RETURN_IF_ERROR(run_step(*s, nullptr));
    const bool want = rows == LogitsRows::all || (rows == LogitsRows::last && t == T - 1);
    if (want) {
      float* dst = logits->data() + (rows == LogitsRows::all ? t * V : 0);
      CUDA_RETURN(cudaMemcpyAsync(dst, logits_.ptr, V * sizeof(float), cudaMemcpyDeviceToHost, stream_), "logits");
    }
  }
  CUDA_RETURN(cudaStreamSynchronize(stream_), "forward");
  return ok_status();
}

Result<std::unique_ptr<Checkpoint>> CudaBackend::forward_with_checkpoint(SequenceState& base,
                                                                         std::span<const int32_t> tokens,
                                                                         int64_t split, LogitsRows rows,
                                                                         std::vector<float>* logits) {
  const int64_t T = static_cast<int64_t>(tokens.size());
  if (split <= 0 || split >= T) return invalid_argument("forward_with_checkpoint: split %lld outside (0, %lld)",
                                                        (long long)split, (long long)T);
  ASSIGN_OR_RETURN(CudaSequence * s, check_sequence(base, T));
  const int64_t V = config().vocab_size;
  for (int32_t id : tokens)
    if (id < 0 || id >= V) return invalid_argument("token id %d is outside the vocabulary [0, %lld)", id, (long long)V);
  // Backend contract (engine/backend.h): `rows` refer to the tokens after the split; no device memory for the
  // checkpoint gives a null one, not an error.
  const auto tail = tokens.subspan(static_cast<size_t>(split));
  if (!(T > std::max(1, options_.decode_rows_max) && prefill_supported())) {  // the three calls it stands for
    RETURN_IF_ERROR(forward(*s, tokens.first(static_cast<size_t>(split)), LogitsRows::none, nullptr));
    std::unique_ptr<Checkpoint> cp = s->checkpoint();
    RETURN_IF_ERROR(forward(*s, tail, rows, logits));
    return cp;
  }
  const int64_t at = checkpoint_row(T, split);  // split - 63 <= at <= split (engine/backend.h)
  std::unique_ptr<CudaCheckpoint> cp = s->empty_checkpoint(s->n + at);
  RETURN_IF_ERROR(upload_tokens(tokens));
  if (rows != LogitsRows::none) logits->resize(static_cast<size_t>((rows == LogitsRows::all ? T : 1) * V));
  RETURN_IF_ERROR(prefill(*s, T, rows, logits, nullptr, cp ? at : 0, cp.get()));
  CUDA_RETURN(cudaStreamSynchronize(stream_), "prefill");
  if (rows == LogitsRows::all) logits->erase(logits->begin(), logits->begin() + split * V);
  return std::unique_ptr<Checkpoint>(std::move(cp));
}

Status CudaBackend::generate_on_device(SequenceState& base, int32_t first, const DeviceSampling& sampling, int max_new,
                                       const std::function<bool(int32_t)>& on_token) {
  ASSIGN_OR_RETURN(CudaSequence * s, check_sequence(base, max_new));
  if (first < 0 || first >= config().vocab_size) return invalid_argument("token id %d is outside the vocabulary", first);
  if (sampling.top_k > 64) return invalid_argument("device sampling supports top_k <= 64, got %d", sampling.top_k);
  CUDA_RETURN(cudaMemcpy(token_in_.ptr, &first, sizeof(int), cudaMemcpyHostToDevice), "token");
  const SampleKnobs knobs{sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p, sampling.seed};
  CUDA_RETURN(cudaMemcpy(sample_knobs_.ptr, &knobs, sizeof knobs, cudaMemcpyHostToDevice), "sampling knobs");
  for (int i = 0; i < max_new; ++i) {
    const int64_t step = s->n;
    RETURN_IF_ERROR(run_step(*s, &sampling));
    CUDA_RETURN(cudaStreamSynchronize(stream_), "decode step");
    const int32_t tok = reinterpret_cast<volatile int*>(ring_)[step % kRingSize];
    if (!on_token(tok)) break;
  }
  return ok_status();
}

Status CudaBackend::set_context_for_bench(SequenceState& base, int64_t n) {
  auto* s = dynamic_cast<CudaSequence*>(&base);
  if (!s || n >= s->capacity) return invalid_argument("context %lld does not fit the capacity", (long long)n);
  // Random bf16 in [-1, 1) for the KV rows: attention reads them as it would real ones.
  std::vector<__nv_bfloat16> host;
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (size_t l = 0; l < s->k.size(); ++l) {
    if (!s->k[l]) continue;
    size_t count = s->k[l]->n / s->capacity * n;
    if (host.size() < count) {
      host.resize(count);
      for (auto& x : host) x = __float2bfloat16(u(rng));
    }
    CUDA_RETURN(cudaMemcpy(s->k[l]->ptr, host.data(), count * 2, cudaMemcpyHostToDevice), "bench kv");
    CUDA_RETURN(cudaMemcpy(s->v[l]->ptr, host.data(), count * 2, cudaMemcpyHostToDevice), "bench kv");
  }
  s->n = n;
  int p = static_cast<int>(n);
  CUDA_RETURN(cudaMemcpy(s->pos.ptr, &p, sizeof(int), cudaMemcpyHostToDevice), "bench pos");
  return ok_status();
}

// The benchmarks' first step: token 0 in, one greedy step (capturing the graph), synchronised.
Status CudaBackend::warm_up_decode(CudaSequence& s, const DeviceSampling& greedy) {
  int zero = 0;
  CUDA_RETURN(cudaMemcpy(token_in_.ptr, &zero, sizeof(int), cudaMemcpyHostToDevice), "token");
  RETURN_IF_ERROR(run_step(s, &greedy));
  CUDA_RETURN(cudaStreamSynchronize(stream_), "warm-up");
  return ok_status();
}

Result<double> CudaBackend::time_decode(SequenceState& base, int steps) {
  ASSIGN_OR_RETURN(CudaSequence * s, check_sequence(base, steps + 2));
  DeviceSampling greedy;
  RETURN_IF_ERROR(warm_up_decode(*s, greedy));
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  cudaEventRecord(a, stream_);
  for (int i = 0; i < steps; ++i) RETURN_IF_ERROR(run_step(*s, &greedy));
  cudaEventRecord(b, stream_);
  CUDA_RETURN(cudaEventSynchronize(b), "timing");
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return static_cast<double>(ms) / steps;
}

Result<double> CudaBackend::time_prefill(SequenceState& base, int64_t n, std::vector<KernelTiming>* profile) {
  auto* s = dynamic_cast<CudaSequence*>(&base);
  if (!s || s->owner != this) return invalid_argument("sequence state is not from this CUDA backend");
  if (!prefill_supported()) return error(ErrorCode::unsupported, "the prefill kernels do not take this geometry");
  for (size_t l = 0; l < s->conv.size(); ++l) {  // an empty sequence
    if (!s->conv[l]) continue;
    CUDA_RETURN(cudaMemset(s->conv[l]->ptr, 0, s->conv[l]->bytes()), "reset");
    CUDA_RETURN(cudaMemset(s->S[l]->ptr, 0, s->S[l]->bytes()), "reset");
  }
  s->n = 0;
  ASSIGN_OR_RETURN(s, check_sequence(base, n));
  std::vector<int32_t> ids(static_cast<size_t>(n));
  std::mt19937 rng(static_cast<uint32_t>(n));
  std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(config().vocab_size) - 1);
  for (auto& id : ids) id = pick(rng);
  if (!profile) {
    std::vector<float> logits;
    CUDA_RETURN(cudaDeviceSynchronize(), "prefill timing");
    const auto t0 = std::chrono::steady_clock::now();
    RETURN_IF_ERROR(forward(*s, ids, LogitsRows::last, &logits));
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  }
  const int64_t T = std::min<int64_t>(n, options_.prefill_chunk);
  RETURN_IF_ERROR(upload_tokens(std::span<const int32_t>(ids.data(), static_cast<size_t>(T))));
  Profiler prof;
  prof.stream = stream_;
  RETURN_IF_ERROR(prefill(*s, T, LogitsRows::none, nullptr, &prof));
  CUDA_RETURN(cudaStreamSynchronize(stream_), "profile");
  *profile = prof.totals();
  double ms = 0;
  for (auto& k : *profile) ms += k.ms;
  return ms;
}

Result<std::vector<KernelTiming>> CudaBackend::profile_step(SequenceState& base) {
  ASSIGN_OR_RETURN(CudaSequence * s, check_sequence(base, 1));
  Profiler prof;
  prof.stream = stream_;
  DeviceSampling greedy;
  RETURN_IF_ERROR(enqueue_step(*s, attention_splits(s->n + 1), &greedy, &prof));
  s->n += 1;
  CUDA_RETURN(cudaStreamSynchronize(stream_), "profile");
  return prof.totals();
}

// One replay's block records, one TraceLaunch per launch (%gridid), in launch order, times from its first block's
// start; unnamed but for the prefetch branch's kernels.
std::vector<TraceLaunch> launches_of(const std::vector<trace::BlockRecord>& records) {
  std::map<uint64_t, std::vector<const trace::BlockRecord*>> by_grid;  // %gridid grows with launch order
  uint64_t t0 = UINT64_MAX;
  for (const auto& r : records) by_grid[r.grid].push_back(&r), t0 = std::min(t0, r.t_start);
  auto us = [&](uint64_t t) { return static_cast<double>(t - t0) * 1e-3; };
  std::vector<TraceLaunch> out;
  for (auto& [grid, blocks] : by_grid) {
    TraceLaunch l;
    l.kind = blocks.front()->kind;
    l.blocks = static_cast<int>(blocks.size());
    l.chain = l.kind != trace::kL2Prefetch && l.kind != trace::kMoePrefetchDown;
    if (!l.chain) l.name = l.kind == trace::kL2Prefetch ? "l2_prefetch" : "moe_prefetch_down";
    uint64_t s0 = UINT64_MAX, s1 = 0, w0 = UINT64_MAX, w1 = 0, e0 = UINT64_MAX, e1 = 0;
    for (const auto* b : blocks) {
      s0 = std::min(s0, b->t_start), s1 = std::max(s1, b->t_start);
      e0 = std::min(e0, b->t_end), e1 = std::max(e1, b->t_end);
      if (b->t_wait) w0 = std::min(w0, b->t_wait), w1 = std::max(w1, b->t_wait);
    }
    l.start_first = us(s0), l.start_last = us(s1), l.end_first = us(e0), l.end_last = us(e1);
    l.wait_first = w1 ? us(w0) : 0.0, l.wait_last = w1 ? us(w1) : 0.0;
    out.push_back(std::move(l));
  }
  return out;
}

Result<std::vector<TraceLaunch>> CudaBackend::trace_decode(SequenceState& base, int steps) {
  if (steps < 1) return invalid_argument("trace_decode: steps must be at least 1");
  if (!trace::kEnabled)
    return error(ErrorCode::unsupported, "the block timeline needs a build with -DLILY_TRACE=ON (kernels/trace.cuh)");
  ASSIGN_OR_RETURN(CudaSequence * s, check_sequence(base, steps + 2));
  DeviceSampling greedy;
  // The chain's op names in launch order: the step enqueued once more under a capture that is thrown away.
  Profiler names;
  names.names_only = true;
  cudaGraph_t unused = nullptr;
  CUDA_RETURN(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "trace: begin capture");
  Status st = enqueue_step(*s, attention_splits(s->n + 1), &greedy, &names);
  cudaError_t end = cudaStreamEndCapture(stream_, &unused);
  if (unused) cudaGraphDestroy(unused);
  RETURN_IF_ERROR(st);
  CUDA_RETURN(end, "trace: end capture");

  RETURN_IF_ERROR(warm_up_decode(*s, greedy));  // the graph captured before tracing starts
  // One step per replay: a graph's kernel nodes keep their %gridid from one replay to the next.
  const uint32_t capacity = 200000u;
  DeviceArray<trace::BlockRecord> rec;
  DeviceArray<uint32_t> count;
  RETURN_IF_ERROR(rec.alloc(capacity));
  RETURN_IF_ERROR(count.alloc(1));
  std::vector<TraceLaunch> out;
  size_t next_name = 0;
  for (int step = 0; step < steps; ++step) {
    CUDA_RETURN(cudaMemset(count.ptr, 0, sizeof(uint32_t)), "trace: count");
    CUDA_RETURN(trace::trace_set_buffer({rec.ptr, count.ptr, capacity}), "trace: set buffer");
    Status run = run_step(*s, &greedy);
    cudaError_t sync = cudaStreamSynchronize(stream_);
    cudaError_t unset = trace::trace_set_buffer({});
    RETURN_IF_ERROR(run);
    CUDA_RETURN(sync, "trace: step");
    CUDA_RETURN(unset, "trace: unset buffer");
    uint32_t n = 0;
    CUDA_RETURN(cudaMemcpy(&n, count.ptr, sizeof n, cudaMemcpyDeviceToHost), "trace: count");
    if (n > capacity) return error(ErrorCode::internal, "trace: %u block records, room for %u", n, capacity);
    std::vector<trace::BlockRecord> host(n);
    CUDA_RETURN(cudaMemcpy(host.data(), rec.ptr, n * sizeof(trace::BlockRecord), cudaMemcpyDeviceToHost), "trace");

    for (TraceLaunch& l : launches_of(host)) {
      if (l.chain && !names.entries.empty()) l.name = names.entries[next_name++ % names.entries.size()].name;
      out.push_back(std::move(l));
    }
  }
  if (next_name != names.entries.size() * static_cast<size_t>(steps))
    return error(ErrorCode::internal, "trace: %zu launches on the chain for %d steps of %zu ops", next_name, steps,
                 names.entries.size());
  return out;
}

}  // namespace

Result<std::unique_ptr<CudaBackendApi>> make_cuda_backend(std::shared_ptr<const ModelWeights> weights,
                                                          const CudaBackendOptions& options) {
  if (options.decode_prefetch < 0 || options.decode_prefetch > 3)
    return invalid_argument("decode_prefetch must be 0, 1, 2 or 3, got %d", options.decode_prefetch);
  auto b = std::make_unique<CudaBackend>(std::move(weights), options);
  RETURN_IF_ERROR(b->init());
  return std::unique_ptr<CudaBackendApi>(std::move(b));
}

int attention_splits(int64_t n) {
  // Measured on the H200 (docs/PERF_NOTES.md): a fixed 66 splits per KV head (132 SMs / 2 KV heads) is within 5%
  // of the best split count at every context from 1K to 128K, because each block streams only ~60 GB/s and the
  // kernel divides the rows among splits at run time from the device position. One graph serves every length.
  (void)n;
  return 66;
}

void register_cuda_backend() {
  register_cuda_backend_factory([](std::shared_ptr<const ModelWeights> w,
                                   const BackendOptions& o) -> Result<std::unique_ptr<Backend>> {
    CudaBackendOptions co;
    co.max_context = std::min<int64_t>(o.max_context, w->config.max_position_embeddings);
    RETURN_IF_ERROR(apply_option_spec(o.cuda_options, co, "--cuda-options"));
    ASSIGN_OR_RETURN(auto b, make_cuda_backend(std::move(w), co));
    return std::unique_ptr<Backend>(std::move(b));
  });
}

}  // namespace lily::cuda
