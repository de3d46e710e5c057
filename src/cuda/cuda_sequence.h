// Per-sequence device state of the CUDA backend: KV caches (bf16 [capacity, n_kv, D] per attention layer), the
// conv ring and recurrent state S (fp32) per Gated DeltaNet layer, the position in device memory, and the CUDA
// graphs captured for this sequence (they bake in its pointers).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/backend.h"

namespace lily::cuda {

Status cuda_status(cudaError_t e, const char* what);
#define CUDA_RETURN(expr, what) RETURN_IF_ERROR(::lily::cuda::cuda_status((expr), what))

// Device allocation owned by RAII.
template <typename T>
struct DeviceArray {
  T* ptr = nullptr;
  size_t n = 0;
  DeviceArray() = default;
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() { cudaFree(ptr); }
  Status alloc(size_t count) {
    n = count;
    CUDA_RETURN(cudaMalloc(&ptr, std::max<size_t>(count, 1) * sizeof(T)), "cudaMalloc");
    CUDA_RETURN(cudaMemset(ptr, 0, std::max<size_t>(count, 1) * sizeof(T)), "cudaMemset");
    return ok_status();
  }
  size_t bytes() const { return n * sizeof(T); }
};

struct GraphExec {
  cudaGraphExec_t exec = nullptr;
  ~GraphExec() {
    if (exec) cudaGraphExecDestroy(exec);
  }
};

class CudaCheckpoint final : public Checkpoint {
 public:
  int64_t n = 0;
  std::vector<std::unique_ptr<DeviceArray<float>>> conv, S;
  int64_t n_tokens() const override { return n; }
  size_t bytes() const override {
    size_t b = 0;
    for (auto& c : conv) b += c->bytes();
    for (auto& s : S) b += s->bytes();
    return b;
  }
};

class CudaSequence final : public SequenceState {
 public:
  const void* owner = nullptr;
  int64_t n = 0, capacity = 0;
  DeviceArray<int> pos;  // device copy of n
  // Per layer: attention layers use k/v, Gated DeltaNet layers conv/S.
  std::vector<std::unique_ptr<DeviceArray<__nv_bfloat16>>> k, v;
  std::vector<std::unique_ptr<DeviceArray<float>>> conv, S;
  std::map<std::string, std::unique_ptr<GraphExec>> graphs;

  int64_t n_tokens() const override { return n; }
  size_t bytes() const override {
    size_t b = 0;
    for (auto& x : k) b += x ? 2 * x->bytes() : 0;
    for (auto& x : conv) b += x ? x->bytes() : 0;
    for (auto& x : S) b += x ? x->bytes() : 0;
    return b;
  }
  std::unique_ptr<Checkpoint> checkpoint() const override {
    auto cp = std::make_unique<CudaCheckpoint>();
    cp->n = n;
    for (size_t l = 0; l < conv.size(); ++l) {
      cp->conv.emplace_back(new DeviceArray<float>());
      cp->S.emplace_back(new DeviceArray<float>());
      if (!conv[l]) continue;
      if (!cp->conv[l]->alloc(conv[l]->n).ok() || !cp->S[l]->alloc(S[l]->n).ok()) return nullptr;
      cudaMemcpy(cp->conv[l]->ptr, conv[l]->ptr, conv[l]->bytes(), cudaMemcpyDeviceToDevice);
      cudaMemcpy(cp->S[l]->ptr, S[l]->ptr, S[l]->bytes(), cudaMemcpyDeviceToDevice);
    }
    return cp;
  }
  Status restore(const Checkpoint& base) override {
    auto* cp = dynamic_cast<const CudaCheckpoint*>(&base);
    if (!cp || cp->conv.size() != conv.size()) return invalid_argument("checkpoint is not from this backend/model");
    if (cp->n > n) return invalid_argument("checkpoint at %lld is past the sequence end %lld", (long long)cp->n, (long long)n);
    for (size_t l = 0; l < conv.size(); ++l) {
      if (!conv[l]) continue;
      CUDA_RETURN(cudaMemcpy(conv[l]->ptr, cp->conv[l]->ptr, conv[l]->bytes(), cudaMemcpyDeviceToDevice), "restore");
      CUDA_RETURN(cudaMemcpy(S[l]->ptr, cp->S[l]->ptr, S[l]->bytes(), cudaMemcpyDeviceToDevice), "restore");
    }
    n = cp->n;  // the KV cache is truncated by the position alone
    int host_pos = static_cast<int>(n);
    CUDA_RETURN(cudaMemcpy(pos.ptr, &host_pos, sizeof(int), cudaMemcpyHostToDevice), "restore");
    return ok_status();
  }
  std::unique_ptr<SequenceState> clone() const override;
  Status allocate(const ModelConfig& c, int64_t cap);
};

}  // namespace lily::cuda
