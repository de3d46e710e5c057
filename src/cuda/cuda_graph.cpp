// The decode step's CUDA graph per sequence: captured on first use (per split count and sampling mode), then
// replayed once per token. The graph bakes the sequence's device pointers, so it lives with the sequence.
#include <chrono>

#include "cuda/cuda_backend_impl.h"

namespace lily::cuda {

// The sample kernel reads the request's numbers (temperature, top-k/p, min-p, seed) from sample_knobs_, written
// before the steps run, so one graph per mode serves every request. At most kMaxGraphs a sequence.
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
  CudaSequence* rows[] = {&s};
  Status st = enqueue_step(rows, n_splits, sp ? std::span<const DeviceSampling>(sp, 1) : std::span<const DeviceSampling>(), nullptr);
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

}  // namespace lily::cuda
