// The CUDA backend's start-up (kernel paths, the memory check), sequences, forward and the device-side generation
// loop (cuda_backend.h). The decode step, its graphs, the prefill path and the bench hooks have files of their own
// (cuda_backend_impl.h lists them).
#include <cstdio>

#include "cuda/cuda_backend_impl.h"
#include "cuda/kernels/attn_prefill.cuh"
#include "engine/backend_factory.h"
#include "engine/context_fit.h"

namespace lily::cuda {

namespace {

// The device loop feeds each sampled token straight back and never has the token a step consumed on the host,
// which the MTP head pairs with that step's final-norm row: sequences with the head sample on the host (the engine
// puts every request of a speculative engine there).
Status mtp_on_device_refused() {
  return error(ErrorCode::unsupported,
               "device-side sampling of a sequence carrying the MTP head's state: speculative decoding samples on "
               "the host");
}

// The expert kernels may select the experts from the router logits themselves (moe.cuh) where the fast MoE kernels
// serve this geometry (their launchers' shapes, up to 256 experts); else moe_route selects.
bool select_in_expert_kernels(const ModelConfig& c) {
  const int H = c.hidden_size, I = c.moe_intermediate_size;
  return c.num_experts <= 256 && c.num_experts_per_tok <= 16 && (H == 1024 || H == 2048 || H == 4096) &&
         (I == 512 || I == 1024) && c.shared_expert_intermediate_size == I;
}

// gdn_step applies the out_proj's gated RMSNorm itself (GdnStepParams::norm_w, a cluster per head) when the fast
// kernel serves this geometry (its launcher's shapes); else the out_proj GEMV's prologue does.
bool gated_norm_fits_gdn_step(const ModelConfig& c) {
  return c.linear_key_head_dim == 128 && c.linear_value_head_dim % 32 == 0 && c.linear_value_head_dim <= 256 &&
         c.linear_num_key_heads > 0 && c.linear_num_value_heads % c.linear_num_key_heads == 0 &&
         c.linear_conv_kernel_dim == 4;
}

}  // namespace

std::string KernelPaths::describe(const std::string& device) const {
  const char* code = wgmma ? "sm_90a code" : sm90_code ? "sm_90 code" : "pre-sm_90 code";
  char line[320];
  std::snprintf(line, sizeof line,
                "cuda: %s sm_%d%d (%s), prefill: %s, attention: %s, decode: %s, gated norm in %s, top-k in %s",
                device.c_str(), cc_major, cc_minor, code,
                !wgmma ? "mma.sync" : expert_copies ? "wgmma (MoE: fp16 expert copies)" : "wgmma (MoE: register-sourced tiles)",
                attn_wgmma ? "wgmma" : "mma.sync",
                megakernel ? "megakernel" : sm90_code ? "PDL chain" : "stream order",
                gdn_norm_in_step ? "gdn_step" : "out_proj", moe_select_in_experts ? "experts" : "moe_route");
  return line;
}

CudaBackend::CudaBackend(std::shared_ptr<const ModelWeights> weights, CudaBackendOptions options)
    : weights_(std::move(weights)), options_(options) {}

CudaBackend::~CudaBackend() {
  if (ring_) cudaFreeHost(ring_);
  if (stream_) cudaStreamDestroy(stream_);
}

// The wgmma kernels run only where this binary has sm_90a code and the GPU is compute 9.0 (wgmma_built asks the
// runtime which code it loaded: a compute_80 PTX build JIT-compiled on an H200 has none); clusters and
// programmatic dependent launch need sm_90 code. Everything else is the mma.sync / cp.async path of sm_80.
Status CudaBackend::choose_paths(const cudaDeviceProp& prop) {
  if (prop.major < 8)
    return error(ErrorCode::unsupported, "%s is compute %d.%d; the CUDA backend needs sm_80 or later", prop.name,
                 prop.major, prop.minor);
  const ModelConfig& c = config();
  paths_.cc_major = prop.major, paths_.cc_minor = prop.minor;
  paths_.sm90_code = sm90_code_built();
  paths_.wgmma = prop.major == 9 && prop.minor == 0 && wgmma_built();
  paths_.attn_wgmma = paths_.wgmma && attn_prefill_wgmma_built() && c.head_dim == 256;
  paths_.gdn_norm_in_step = paths_.sm90_code && gated_norm_fits_gdn_step(c);
  paths_.moe_select_in_experts = select_in_expert_kernels(c);
  return ok_status();
}

// The requested context (or, with kContextAuto, the largest) against the memory free after the weights: one
// sequence, the scratch and kRuntimeReserve (engine/context_fit.h).
Status CudaBackend::fit_context() {
  size_t free_b = 0, total_b = 0;
  CUDA_RETURN(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
  ContextFit f;
  f.free_bytes = free_b;
  f.reserve_bytes = kRuntimeReserve;
  f.sequence = sequence_bytes(config());
  const int64_t model_max = config().max_position_embeddings;
  // The experts' fp16 copies only where they leave room for what a server holds beside them at the context asked
  // for (auto: the model's whole context): kMaxBatchRows sequences (its parallel streams) and the engine's
  // default session cache (kSessionCacheHeadroom), not the one sequence the context check counts.
  if (options_.expert_copies != 0 && paths_.wgmma && prefill_supported() && expert_copies_fit()) {
    f.scratch_bytes = prefill_scratch_needed();  // without the copies
    const int64_t want = std::min(
        options_.max_context == CudaBackendOptions::kContextAuto ? model_max : options_.max_context, model_max);
    paths_.expert_copies = optional_fits(f, expert_copies_bytes(), want, model_max, kMaxBatchRows, kSessionCacheHeadroom);
  }
  f.scratch_bytes = prefill_supported() ? prefill_scratch_needed() : 0;
  if (options_.max_context == CudaBackendOptions::kContextAuto) {
    context_auto_ = true;
    options_.max_context = max_context_that_fits(f, model_max);
    if (options_.max_context < 1) return check_context_fits(f, 1, model_max, device_name_);
    return ok_status();
  }
  if (options_.max_context < 1) return invalid_argument("context size %lld: must be positive or auto",
                                                        (long long)options_.max_context);
  options_.max_context = std::min(options_.max_context, model_max);
  return check_context_fits(f, options_.max_context, model_max, device_name_);
}

Status CudaBackend::init() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) return error(ErrorCode::unsupported, "no CUDA device");
  cudaDeviceProp prop{};
  CUDA_RETURN(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  device_name_ = prop.name;
  RETURN_IF_ERROR(choose_paths(prop));
  CUDA_RETURN(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  size_t free_b = 0, total_b = 0;
  CUDA_RETURN(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
  Result<std::unique_ptr<DeviceModel>> uploaded = DeviceModel::upload(*weights_);
  if (!uploaded.ok()) {
    // The checkpoint's bytes bound the device copy from above for an MLX checkpoint (an HF one is quantized at
    // upload): say so when that is what did not fit.
    if (weights_->tensor_bytes > free_b)
      return error(ErrorCode::out_of_range, "%s: the weights (%.2f GiB in the checkpoint) do not fit the %.2f GiB free (%s)",
                   prop.name, weights_->tensor_bytes / 1073741824.0, free_b / 1073741824.0,
                   uploaded.status().message().c_str());
    return uploaded.status();
  }
  model_ = std::move(uploaded).value();
  RETURN_IF_ERROR(fit_context());
  const ModelConfig& c = config();
  const size_t H = c.hidden_size, D = c.head_dim, nq = c.num_attention_heads, I = c.moe_intermediate_size;
  size_t proj_rows = 0;
  for (const DeviceLayer& l : model_->layers)
    proj_rows = std::max<size_t>(proj_rows, l.type == LayerType::full_attention ? l.attn_in.rows : l.gdn_in.rows);
  // kMaxBatchRows rows of each (several-row steps), rows 64 floats apart at least (16-byte vector loads).
  auto row = [](size_t n) { return (n + 63) / 64 * 64; };
  RowStrides& st = strides_;
  st.h = H;  // embed_rows writes rows H apart (H is a multiple of 64)
  st.proj = row(proj_rows), st.q = row(nq * D), st.attn_out = st.q;
  st.gdn_o = row(static_cast<size_t>(c.linear_value_dim()));
  st.moe_logits = row(static_cast<size_t>(c.num_experts));
  st.topk = row(static_cast<size_t>(c.num_experts_per_tok)), st.shared_gate = 64;
  st.act = row((c.num_experts_per_tok + 1) * I);
  st.logits = row(static_cast<size_t>(c.vocab_size));
  st.part_o = kMaxSplits * nq * D, st.part_ml = kMaxSplits * nq * 2;
  const size_t R = kMaxBatchRows;
  RETURN_IF_ERROR(h_.alloc(R * st.h));
  RETURN_IF_ERROR(proj_.alloc(R * st.proj));
  RETURN_IF_ERROR(q_.alloc(R * st.q));
  RETURN_IF_ERROR(attn_out_.alloc(R * st.attn_out));
  RETURN_IF_ERROR(gdn_o_.alloc(R * st.gdn_o));
  RETURN_IF_ERROR(moe_x_.alloc(R * st.h));
  RETURN_IF_ERROR(moe_logits_.alloc(R * st.moe_logits));
  RETURN_IF_ERROR(topk_w_.alloc(R * st.topk));
  RETURN_IF_ERROR(topk_idx_.alloc(R * st.topk));
  RETURN_IF_ERROR(shared_gate_.alloc(R * st.shared_gate));
  RETURN_IF_ERROR(act_.alloc(R * st.act));
  RETURN_IF_ERROR(logits_.alloc(R * st.logits));
  RETURN_IF_ERROR(part_o_.alloc(R * st.part_o));
  RETURN_IF_ERROR(part_ml_.alloc(R * st.part_ml));
  RETURN_IF_ERROR(sample_scratch_.alloc(R * kSampleScratch));
  RETURN_IF_ERROR(sample_knobs_.alloc(R));
  const std::vector<SampleKnobs> greedy_knobs(R);
  CUDA_RETURN(cudaMemcpyAsync(sample_knobs_.ptr, greedy_knobs.data(), R * sizeof(SampleKnobs), cudaMemcpyHostToDevice,
                              stream_),
              "knobs");
  CUDA_RETURN(cudaStreamSynchronize(stream_), "knobs");  // greedy_knobs goes out of scope
  RETURN_IF_ERROR(token_in_.alloc(R));
  RETURN_IF_ERROR(counters_.alloc(2 * R));
  CUDA_RETURN(cudaHostAlloc(reinterpret_cast<void**>(&ring_), R * kRingSize * sizeof(int), cudaHostAllocMapped),
              "ring");
  CUDA_RETURN(cudaHostGetDevicePointer(reinterpret_cast<void**>(&ring_dev_), ring_, 0), "ring");
  RETURN_IF_ERROR(init_megakernel());  // after the scratch: it builds a program on it
  std::fprintf(stderr, "%s, context %lld\n", paths_.describe(device_name_).c_str(), (long long)options_.max_context);
  return ok_status();
}

size_t CudaBackend::device_bytes_in_use() const {
  size_t free_b = 0, total_b = 0;
  return cudaMemGetInfo(&free_b, &total_b) == cudaSuccess ? total_b - free_b : 0;
}

std::unique_ptr<SequenceState> CudaBackend::new_sequence() {
  auto s = std::make_unique<CudaSequence>();
  s->owner = this;
  if (!s->allocate(config(), options_.max_context, mtp_on_).ok()) return nullptr;
  return s;
}

Result<std::unique_ptr<SequenceState>> CudaBackend::load_sequence(ByteReader& in) {
  std::unique_ptr<SequenceState> base = new_sequence();
  if (!base) return error(ErrorCode::out_of_range, "no device memory for another sequence");
  RETURN_IF_ERROR(static_cast<CudaSequence&>(*base).load(in));
  return base;
}

Result<std::unique_ptr<Checkpoint>> CudaBackend::load_checkpoint(ByteReader& in) {
  std::unique_ptr<CudaCheckpoint> cp =
      CudaCheckpoint::allocate(SequenceLayout::of(config(), options_.max_context, mtp_on_), 0);
  if (!cp) return error(ErrorCode::out_of_range, "no device memory for another checkpoint");
  RETURN_IF_ERROR(cp->load(in));
  return std::unique_ptr<Checkpoint>(std::move(cp));
}

Result<CudaSequence*> CudaBackend::check_sequence(SequenceState& base, int64_t new_tokens) {
  auto* s = dynamic_cast<CudaSequence*>(&base);
  if (!s || s->owner != this) return invalid_argument("sequence state is not from this CUDA backend");
  if (s->verify_base >= 0)
    return invalid_argument("the sequence has %d verified rows pending: accept_verified must say which to keep first",
                            s->verify_rows);
  if (s->n + new_tokens > s->capacity)
    return error(ErrorCode::out_of_range, "%lld tokens exceed the KV capacity of %lld (--ctx-size)",
                 (long long)(s->n + new_tokens), (long long)s->capacity);
  return s;
}

Status CudaBackend::check_tokens(std::span<const int32_t> tokens) const {
  const int64_t V = config().vocab_size;
  for (int32_t id : tokens)
    if (id < 0 || id >= V) return invalid_argument("token id %d is outside the vocabulary [0, %lld)", id, (long long)V);
  return ok_status();
}

// Copies token ids into tokens_ (grown as needed, never below 4,096 ids).
Status CudaBackend::upload_tokens(std::span<const int32_t> ids) {
  if (tokens_.n < ids.size()) RETURN_IF_ERROR(tokens_.alloc(std::max<size_t>(ids.size(), 4096)));
  // On stream_ (a cudaMemcpy from pageable memory may return before its DMA lands, and stream_ does not wait for
  // the legacy stream): the kernels that read the ids come after it in stream order.
  CUDA_RETURN(cudaMemcpyAsync(tokens_.ptr, ids.data(), ids.size() * sizeof(int), cudaMemcpyHostToDevice, stream_),
              "upload tokens");
  return ok_status();
}

Status CudaBackend::forward(SequenceState& base, std::span<const int32_t> tokens, LogitsRows rows,
                            std::vector<float>* logits) {
  const int64_t T = static_cast<int64_t>(tokens.size());
  if (T == 0) return invalid_argument("forward: no tokens");
  ASSIGN_OR_RETURN(CudaSequence * s, check_sequence(base, T));
  RETURN_IF_ERROR(check_tokens(tokens));
  const int64_t V = config().vocab_size;
  RETURN_IF_ERROR(upload_tokens(tokens));
  if (rows != LogitsRows::none) logits->resize(static_cast<size_t>((rows == LogitsRows::all ? T : 1) * V));
  if (s->mtp_on) RETURN_IF_ERROR(mtp_prepare(*s, 1));
  if (T > 1 && prefill_supported()) {
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
    if (s->mtp_on) RETURN_IF_ERROR(mtp_read_rows(*s, h_.ptr, 1, tokens_.ptr + t, nullptr));
  }
  CUDA_RETURN(cudaStreamSynchronize(stream_), "forward");
  return ok_status();
}

Status CudaBackend::generate_on_device(SequenceState& base, int32_t first, const DeviceSampling& sampling, int max_new,
                                       const std::function<bool(int32_t)>& on_token) {
  ASSIGN_OR_RETURN(CudaSequence * s, check_sequence(base, max_new));
  if (s->mtp_on) return mtp_on_device_refused();
  if (first < 0 || first >= config().vocab_size) return invalid_argument("token id %d is outside the vocabulary", first);
  if (sampling.top_k > 64) return invalid_argument("device sampling supports top_k <= 64, got %d", sampling.top_k);
  RETURN_IF_ERROR(prepare_penalties(*s, sampling, max_new));  // before the first token: on_token grows the history
  CUDA_RETURN(cudaMemcpyAsync(token_in_.ptr, &first, sizeof(int), cudaMemcpyHostToDevice, stream_), "token");
  const SampleKnobs knobs = sample_knobs_of(sampling);
  CUDA_RETURN(cudaMemcpyAsync(sample_knobs_.ptr, &knobs, sizeof knobs, cudaMemcpyHostToDevice, stream_), "sampling knobs");
  const bool penalised = sampling.has_penalties();
  for (int i = 0; i < max_new; ++i) {
    const int64_t step = s->n;
    RETURN_IF_ERROR(run_step(*s, &sampling));
    CUDA_RETURN(cudaStreamSynchronize(stream_), "decode step");
    if (penalised) s->penalty_sync.advance();  // the step counted its token into the table
    const int32_t tok = reinterpret_cast<volatile int*>(ring_)[step % kRingSize];
    if (!on_token(tok)) break;
  }
  return ok_status();
}

Result<std::vector<CudaSequence*>> CudaBackend::check_rows(std::span<SequenceState* const> seqs,
                                                         std::span<const int32_t> tokens) {
  if (seqs.empty() || seqs.size() != tokens.size())
    return invalid_argument("several-row step: %zu sequences, %zu tokens", seqs.size(), tokens.size());
  std::vector<CudaSequence*> rows;
  for (size_t i = 0; i < seqs.size(); ++i) {
    Result<CudaSequence*> s = check_sequence(*seqs[i], 1);
    if (!s.ok()) return error(s.status().code(), "row %zu: %s", i, s.status().message().c_str());
    if (std::find(rows.begin(), rows.end(), s.value()) != rows.end())
      return invalid_argument("row %zu: the sequence is already in the batch", i);
    if (tokens[i] < 0 || tokens[i] >= config().vocab_size)
      return invalid_argument("row %zu: token id %d is outside the vocabulary [0, %d)", i, tokens[i],
                              config().vocab_size);
    rows.push_back(s.value());
  }
  return rows;
}

// One several-row step: the graph of this set of rows, so that ~300 launches cost one (an eager chain was tried
// once, 2026-12-02: it ended in an illegal memory access not yet explained, docs/PERF_NOTES.md); each row's
// position advances.
Status CudaBackend::run_rows(std::span<CudaSequence* const> rows, std::span<const int32_t> tokens,
                             std::span<const DeviceSampling> sampling) {
  const size_t R = rows.size();
  CUDA_RETURN(cudaMemcpyAsync(token_in_.ptr, tokens.data(), R * sizeof(int), cudaMemcpyHostToDevice, stream_),
              "tokens");
  if (!sampling.empty()) {
    SampleKnobs knobs[kMaxBatchRows];
    for (size_t r = 0; r < R; ++r) knobs[r] = sample_knobs_of(sampling[r]);
    CUDA_RETURN(cudaMemcpyAsync(sample_knobs_.ptr, knobs, R * sizeof(SampleKnobs), cudaMemcpyHostToDevice, stream_),
                "sampling knobs");
  }
  ASSIGN_OR_RETURN(cudaGraphExec_t g, rows_graph_for(rows, sampling));
  CUDA_RETURN(cudaGraphLaunch(g, stream_), "graph launch");
  for (CudaSequence* s : rows) s->n += 1;
  return ok_status();
}

Status CudaBackend::forward_batch(std::span<SequenceState* const> seqs, std::span<const int32_t> tokens,
                                  std::vector<float>* logits) {
  ASSIGN_OR_RETURN(std::vector<CudaSequence*> rows, check_rows(seqs, tokens));
  // The head reads each row's final-norm row after its step (forward): rows with it step one at a time.
  if (std::any_of(rows.begin(), rows.end(), [](const CudaSequence* s) { return s->mtp_on; }))
    return Backend::forward_batch(seqs, tokens, logits);
  const size_t V = static_cast<size_t>(config().vocab_size);
  logits->resize(rows.size() * V);
  for (size_t first = 0; first < rows.size(); first += kMaxBatchRows) {
    const size_t R = std::min<size_t>(kMaxBatchRows, rows.size() - first);
    const std::span<CudaSequence* const> part(rows.data() + first, R);
    RETURN_IF_ERROR(run_rows(part, tokens.subspan(first, R), {}));
    CUDA_RETURN(cudaMemcpy2DAsync(logits->data() + first * V, V * sizeof(float), logits_.ptr,
                                  strides_.logits * sizeof(float), V * sizeof(float), R, cudaMemcpyDeviceToHost,
                                  stream_),
                "logits");
    CUDA_RETURN(cudaStreamSynchronize(stream_), "several-row step");
  }
  return ok_status();
}

Status CudaBackend::decode_batch_on_device(std::span<SequenceState* const> seqs, std::span<const int32_t> tokens,
                                           std::span<const DeviceSampling> sampling, std::vector<int32_t>* next) {
  if (sampling.size() != seqs.size())
    return invalid_argument("decode_batch_on_device: %zu sequences, %zu samplings", seqs.size(), sampling.size());
  ASSIGN_OR_RETURN(std::vector<CudaSequence*> rows, check_rows(seqs, tokens));
  for (const CudaSequence* s : rows)
    if (s->mtp_on) return mtp_on_device_refused();
  for (size_t i = 0; i < sampling.size(); ++i)
    if (sampling[i].top_k > 64)
      return invalid_argument("row %zu: device sampling supports top_k <= 64, got %d", i, sampling[i].top_k);
  for (size_t i = 0; i < rows.size(); ++i) {  // a table loaded for a row that does not run is still right
    if (Status st = prepare_penalties(*rows[i], sampling[i], 1); !st.ok())
      return error(st.code(), "row %zu: %s", i, st.message().c_str());
  }
  next->assign(rows.size(), -1);
  for (size_t first = 0; first < rows.size(); first += kMaxBatchRows) {
    const size_t R = std::min<size_t>(kMaxBatchRows, rows.size() - first);
    std::vector<int64_t> steps;
    for (size_t r = 0; r < R; ++r) steps.push_back(rows[first + r]->n);
    RETURN_IF_ERROR(run_rows(std::span<CudaSequence* const>(rows.data() + first, R), tokens.subspan(first, R),
                             sampling.subspan(first, R)));
    CUDA_RETURN(cudaStreamSynchronize(stream_), "several-row step");
    const volatile int* ring = ring_;
    for (size_t r = 0; r < R; ++r) {
      (*next)[first + r] = ring[r * kRingSize + steps[r] % kRingSize];
      if (sampling[first + r].has_penalties()) rows[first + r]->penalty_sync.advance();
    }
  }
  return ok_status();
}

Result<std::unique_ptr<CudaBench>> make_cuda_bench(std::shared_ptr<const ModelWeights> weights,
                                                   const CudaBackendOptions& options) {
  if (options.prefill_chunk < 0) return invalid_argument("prefill_chunk must be >= 0, got %d", options.prefill_chunk);
  auto b = std::make_unique<CudaBackend>(std::move(weights), options);
  RETURN_IF_ERROR(b->init());
  return std::unique_ptr<CudaBench>(std::move(b));
}

Result<std::unique_ptr<Backend>> make_cuda_backend(std::shared_ptr<const ModelWeights> weights,
                                                   const CudaBackendOptions& options) {
  ASSIGN_OR_RETURN(auto b, make_cuda_bench(std::move(weights), options));
  return std::unique_ptr<Backend>(std::move(b));
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
    if (o.max_context == BackendOptions::kContextAuto) co.max_context = CudaBackendOptions::kContextAuto;
    else if (o.max_context > 0) co.max_context = o.max_context;  // else the default (at most the model's maximum)
    RETURN_IF_ERROR(apply_option_spec(o.cuda_options, co, "--cuda-options"));
    return make_cuda_backend(std::move(w), co);
  });
}

}  // namespace lily::cuda
