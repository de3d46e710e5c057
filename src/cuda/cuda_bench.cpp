// The benchmark and trace hooks (cuda_bench.h): decode at a given context without its prefill, timed steps and
// prefills, the per-kernel breakdown (an event pair around each launch of an eager step) and the block timeline.
#include <chrono>
#include <map>
#include <random>

#include "cuda/cuda_backend_impl.h"
#include "cuda/kernels/trace.cuh"

namespace lily::cuda {

void Profiler::begin(const std::string& name, double bytes, double flops) {
  Entry e{name, bytes, flops, nullptr, nullptr};
  if (names_only) return entries.push_back(e);
  cudaEventCreate(&e.start);
  cudaEventCreate(&e.stop);
  cudaEventRecord(e.start, stream);
  entries.push_back(e);
}

void Profiler::end() {
  if (!names_only) cudaEventRecord(entries.back().stop, stream);
}

Profiler::~Profiler() {
  for (auto& e : entries)
    if (e.start) cudaEventDestroy(e.start), cudaEventDestroy(e.stop);
}

std::vector<KernelTiming> Profiler::totals() const {
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
    CUDA_RETURN(cudaMemcpyAsync(s->k[l]->ptr, host.data(), count * 2, cudaMemcpyHostToDevice, stream_), "bench kv");
    CUDA_RETURN(cudaMemcpyAsync(s->v[l]->ptr, host.data(), count * 2, cudaMemcpyHostToDevice, stream_), "bench kv");
  }
  s->n = n;
  s->mtp_n = n, s->mtp_rows = 0, s->mtp_chained = false;  // the head starts over here (as after a load)
  s->mtp_tokens.clear();
  int p = static_cast<int>(n);
  CUDA_RETURN(cudaMemcpyAsync(s->pos.ptr, &p, sizeof(int), cudaMemcpyHostToDevice, stream_), "bench pos");
  CUDA_RETURN(cudaStreamSynchronize(stream_), "bench pos");  // host and p go out of scope
  return ok_status();
}

// The benchmarks' first step: token 0 in, one greedy step (capturing the graph), synchronised.
Status CudaBackend::warm_up_decode(CudaSequence& s, const DeviceSampling& greedy) {
  int zero = 0;
  CUDA_RETURN(cudaMemcpyAsync(token_in_.ptr, &zero, sizeof(int), cudaMemcpyHostToDevice, stream_), "token");
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

Result<double> CudaBackend::time_prefill(SequenceState& base, int64_t n, std::vector<KernelTiming>* profile,
                                         int64_t pos0) {
  auto* s = dynamic_cast<CudaSequence*>(&base);
  if (!s || s->owner != this) return invalid_argument("sequence state is not from this CUDA backend");
  if (!prefill_supported()) return error(ErrorCode::unsupported, "the prefill kernels do not take this geometry");
  for (size_t l = 0; l < s->conv.size(); ++l) {  // an empty sequence
    if (!s->conv[l]) continue;
    CUDA_RETURN(cudaMemset(s->conv[l]->ptr, 0, s->conv[l]->bytes()), "reset");
    CUDA_RETURN(cudaMemset(s->S[l]->ptr, 0, s->S[l]->bytes()), "reset");
  }
  CUDA_RETURN(cudaStreamSynchronize(cudaStreamLegacy), "reset");  // the memsets before stream_'s prefill
  s->n = 0;
  if (pos0 > 0) {
    if (!profile) return invalid_argument("a prefill at a context is timed with a profile only");
    RETURN_IF_ERROR(set_context_for_bench(*s, pos0));
  }
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
  CudaSequence* rows[] = {s};
  RETURN_IF_ERROR(enqueue_step(rows, attention_splits(s->n + 1), std::span<const DeviceSampling>(&greedy, 1), &prof));
  s->n += 1;
  CUDA_RETURN(cudaStreamSynchronize(stream_), "profile");
  return prof.totals();
}

Result<double> CudaBackend::time_decode_rows(std::span<SequenceState* const> seqs, int steps) {
  if (steps < 1) return invalid_argument("time_decode_rows: steps must be at least 1");
  std::vector<int32_t> tokens(seqs.size(), 0), next;
  const std::vector<DeviceSampling> greedy(seqs.size());
  RETURN_IF_ERROR(decode_batch_on_device(seqs, tokens, greedy, &next));  // the graph captured before timing
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) RETURN_IF_ERROR(decode_batch_on_device(seqs, next, greedy, &next));
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / steps;
}

Result<std::vector<KernelTiming>> CudaBackend::profile_rows(std::span<SequenceState* const> seqs) {
  const std::vector<int32_t> tokens(seqs.size(), 0);
  ASSIGN_OR_RETURN(std::vector<CudaSequence*> rows, check_rows(seqs, tokens));
  if (rows.size() > kMaxBatchRows) return invalid_argument("profile_rows: at most %d rows", kMaxBatchRows);
  CUDA_RETURN(cudaMemcpyAsync(token_in_.ptr, tokens.data(), rows.size() * sizeof(int), cudaMemcpyHostToDevice, stream_),
              "tokens");
  Profiler prof;
  prof.stream = stream_;
  const std::vector<DeviceSampling> greedy(rows.size());
  RETURN_IF_ERROR(enqueue_step(rows, attention_splits(rows[0]->n + 1), greedy, &prof));
  for (CudaSequence* s : rows) s->n += 1;
  CUDA_RETURN(cudaStreamSynchronize(stream_), "profile");
  return prof.totals();
}

namespace {

// One replay's block records, one TraceLaunch per launch (%gridid), in launch order, times from its first block's
// start; unnamed.
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

}  // namespace

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
  CudaSequence* rows[] = {s};
  Status st = enqueue_step(rows, attention_splits(s->n + 1), std::span<const DeviceSampling>(&greedy, 1), &names);
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
    CUDA_RETURN(cudaStreamSynchronize(cudaStreamLegacy), "trace: count");
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
      if (!names.entries.empty()) l.name = names.entries[next_name++ % names.entries.size()].name;
      out.push_back(std::move(l));
    }
  }
  if (next_name != names.entries.size() * static_cast<size_t>(steps))
    return error(ErrorCode::internal, "trace: %zu launches on the chain for %d steps of %zu ops", next_name, steps,
                 names.entries.size());
  return out;
}

}  // namespace lily::cuda
