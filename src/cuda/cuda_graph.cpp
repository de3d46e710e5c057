// The decode step's CUDA graph per sequence: captured on first use (per split count and sampling mode), then
// replayed once per token. The graph bakes the sequence's device pointers, so it lives with the sequence. The
// several-row step's graphs live in the backend, keyed by their rows' sequence ids.
#include <chrono>

#include "cuda/cuda_backend_impl.h"

namespace lily::cuda {

// The sample kernel reads the request's numbers (temperature, top-k/p, min-p, seed, penalties) from sample_knobs_,
// written before the steps run, so one graph per mode (and with or without penalties) serves every request. At
// most kMaxGraphs a sequence.
Result<std::unique_ptr<GraphExec>> CudaBackend::capture(const std::function<Status()>& enqueue) {
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  cudaGraph_t graph = nullptr;
  CUDA_RETURN(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "begin capture");
  Status st = enqueue();
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
  return exec;
}

Result<cudaGraphExec_t> CudaBackend::graph_for(CudaSequence& s, const DeviceSampling* sp) {
  const int n_splits = attention_splits(s.n + 1);
  std::string key = std::to_string(n_splits);
  if (sp) key += "/" + std::to_string(sample_mode(sp->temperature, sp->top_k, sp->top_p, sp->min_p));
  if (sp && sp->has_penalties()) key += "p";  // the penalty kernels around the choice (sample.cuh)
  auto it = s.graphs.find(key);
  if (it != s.graphs.end()) return it->second->exec;
  if (s.graphs.size() >= kMaxGraphs) s.graphs.clear();  // none is in flight: every caller synchronised
  if (paths_.megakernel) RETURN_IF_ERROR(ensure_step_program(s));  // uploads: not while capturing
  CudaSequence* rows[] = {&s};
  const auto sampling = sp ? std::span<const DeviceSampling>(sp, 1) : std::span<const DeviceSampling>();
  ASSIGN_OR_RETURN(std::unique_ptr<GraphExec> exec,
                   capture([&] { return enqueue_step(rows, n_splits, sampling, nullptr); }));
  cudaGraphExec_t e = exec->exec;
  s.graphs[key] = std::move(exec);
  return e;
}

// A set of rows keeps decoding together for many steps (continuous batching changes it when a stream joins or
// ends), so its graph is replayed until then; the least recently used of kMaxRowGraphs goes first. A graph whose
// sequence is gone is never matched again (ids are never reused) and ages out.
Result<cudaGraphExec_t> CudaBackend::rows_graph_for(std::span<CudaSequence* const> rows,
                                                    std::span<const DeviceSampling> sampling) {
  const int n_splits = attention_splits(rows[0]->n + 1);
  std::string key = std::to_string(n_splits);
  for (size_t r = 0; r < rows.size(); ++r) {
    key += "|" + std::to_string(rows[r]->id);
    if (!sampling.empty()) {
      const DeviceSampling& sp = sampling[r];
      key += "/" + std::to_string(sample_mode(sp.temperature, sp.top_k, sp.top_p, sp.min_p));
      if (sp.has_penalties()) key += "p";
    }
  }
  return row_graph(key, [&] { return enqueue_step(rows, n_splits, sampling, nullptr); });
}

Result<cudaGraphExec_t> CudaBackend::row_graph(const std::string& key, const std::function<Status()>& enqueue) {
  for (auto it = row_graphs_.begin(); it != row_graphs_.end(); ++it) {
    if (it->first != key) continue;
    row_graphs_.splice(row_graphs_.begin(), row_graphs_, it);
    return row_graphs_.front().second->exec;
  }
  ASSIGN_OR_RETURN(std::unique_ptr<GraphExec> exec, capture(enqueue));
  row_graphs_.emplace_front(key, std::move(exec));
  if (row_graphs_.size() > kMaxRowGraphs) row_graphs_.pop_back();  // none is in flight: every caller synchronised
  return row_graphs_.front().second->exec;
}

Status CudaBackend::run_step(CudaSequence& s, const DeviceSampling* sampling) {
  ASSIGN_OR_RETURN(cudaGraphExec_t g, graph_for(s, sampling));
  CUDA_RETURN(cudaGraphLaunch(g, stream_), "graph launch");
  s.n += 1;
  return ok_status();
}

}  // namespace lily::cuda
