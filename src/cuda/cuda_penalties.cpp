// Device sampling's penalties (engine/sampler.h steps 2-3): each sequence's table of the running request's
// distinct history ids (sample.cuh PenaltyState), built on the host from DeviceSampling::history once per request
// (engine/penalties.h PenaltyTable::of) and then kept by the sample kernels themselves, which count every token
// they choose; the host only tracks how long a history the table holds (PenaltySync), so the device loop neither
// uploads nor synchronises per token for it.
#include <cmath>

#include "cuda/cuda_backend_impl.h"

namespace lily::cuda {

SampleKnobs sample_knobs_of(const DeviceSampling& s) {
  SampleKnobs k{s.temperature, s.top_k, s.top_p, s.min_p, s.seed};
  k.presence_penalty = s.presence_penalty;
  k.frequency_penalty = s.frequency_penalty;
  k.repetition_penalty = s.repetition_penalty;
  return k;
}

// One block: [slot: vocab ints | ids: capacity ints | counts: capacity ints | n], the index cleared to -1. The
// capacity covers every id the sequence's context can hold (its KV capacity + the one token sampled, not
// consumed), at most the vocabulary.
Status CudaBackend::allocate_penalties(CudaSequence& s) {
  const int V = config().vocab_size;
  const int cap = static_cast<int>(std::min<int64_t>(V, s.capacity + 1));
  const size_t ints = static_cast<size_t>(V) + 2 * static_cast<size_t>(cap) + 1;
  DeviceBlock block;
  if (!block.alloc(ints * sizeof(int)).ok()) {
    (void)cudaGetLastError();  // an allocation failure is not sticky: clear it for the next call
    // out_of_range: the engine then samples this request on the host, as for a context the device cannot hold.
    return error(ErrorCode::out_of_range, "no device memory for a penalty table (%zu bytes)", ints * sizeof(int));
  }
  int* base = static_cast<int*>(block.ptr);
  PenaltyState st;
  st.slot = base, st.ids = base + V, st.counts = st.ids + cap, st.n = st.counts + cap;
  st.capacity = cap, st.vocab = V;
  CUDA_RETURN(cudaMemsetAsync(st.slot, 0xFF, static_cast<size_t>(V) * sizeof(int), stream_), "penalty index");
  CUDA_RETURN(cudaMemsetAsync(st.ids, 0, (2 * static_cast<size_t>(cap) + 1) * sizeof(int), stream_), "penalty table");
  CUDA_RETURN(cudaStreamSynchronize(stream_), "penalty table");
  s.penalty_storage = std::move(block);
  s.penalties = st;
  s.penalty_sync.clear();
  return ok_status();
}

Status CudaBackend::prepare_penalties(CudaSequence& s, const DeviceSampling& sp, int64_t max_new) {
  if (!sp.has_penalties()) return ok_status();
  if (!(sp.repetition_penalty > 0.0f) || !std::isfinite(sp.repetition_penalty) ||
      !std::isfinite(sp.presence_penalty) || !std::isfinite(sp.frequency_penalty))
    return invalid_argument("device penalties: repetition_penalty %g must be positive and finite, presence_penalty %g "
                            "and frequency_penalty %g finite",
                            double(sp.repetition_penalty), double(sp.presence_penalty), double(sp.frequency_penalty));
  if (sp.n_prompt > sp.history.size())
    return invalid_argument("device penalties: n_prompt %zu is past the history's %zu ids", sp.n_prompt,
                            sp.history.size());
  if (s.penalty_sync.holds(sp)) return ok_status();
  if (Status st = check_tokens(sp.history); !st.ok())
    return error(st.code(), "device penalties' history: %s", st.message().c_str());
  if (!s.penalty_storage.ptr) RETURN_IF_ERROR(allocate_penalties(s));
  const PenaltyTable table = PenaltyTable::of(sp.history, sp.n_prompt);
  // The table grows by at most one entry a token, and never past the vocabulary.
  const int64_t most = std::min<int64_t>(config().vocab_size, static_cast<int64_t>(table.size()) + max_new);
  if (most > s.penalties.capacity)
    return error(ErrorCode::out_of_range,
                 "device penalties: %zu distinct history ids and %lld new tokens exceed the table's %d entries",
                 table.size(), (long long)max_new, s.penalties.capacity);
  s.penalty_sync.clear();  // until the load below has run
  CUDA_RETURN(penalty_state_load(s.penalties, table.ids.data(), table.counts.data(), static_cast<int>(table.size()),
                                 stream_),
              "penalty table");
  CUDA_RETURN(cudaStreamSynchronize(stream_), "penalty table");  // `table` is freed on return
  s.penalty_sync.set(sp);
  return ok_status();
}

}  // namespace lily::cuda
