// Per-sequence device state of the CUDA backend: KV caches (bf16 [capacity, n_kv, D] per attention layer),
// the conv ring and recurrent state S (fp32) per Gated DeltaNet layer, the position in device memory, and the
// CUDA graphs captured for this sequence (they bake in its pointers).
//
// A sequence's arrays are carved out of ONE device allocation (cudaMalloc costs ~0.1-1 ms and cudaFree
// synchronises the device, per call), laid out as
//   [recurrent region: conv_l, S_l of every Gated DeltaNet layer | pos | k_l, v_l of every attention layer],
// each array 256-byte aligned. A checkpoint is one allocation holding a copy of the recurrent region (one
// device-to-device copy, the same offsets), so checkpoint and restore are one copy each.
//
// With the MTP head enabled (CudaBackend::enable_mtp) the block ends with the head's state (cuda_mtp.cpp):
//   [... | mtp k, v (the head's attention layer, the same capacity) | pending rows [kMtpPendingRows, H] | chain [H]]
// and a checkpoint's block has room for the pending rows after its recurrent region.
//
// Saved (the session cache's disk tier): n, the recurrent region's bytes as they are (the layout is a
// function of the model, so the same offsets on load), then the KV rows [0, n) of each attention layer; a
// checkpoint is n and its recurrent region. Then the MTP head's part, as on the CPU backend: a byte (1: the head
// is on), and when 1 the head's KV length m and pending row count P (m + P = n), the head's k and v rows [0, m)
// (a sequence only), the P pending rows [P, H] (fp32) and their P-1 tokens. The KV rows are bf16 as on the
// device, so a saved CUDA sequence loads only into the CUDA backend (the file names its backend). A backend
// without the head reads past its part; one with the head refuses a saved form without it (Backend::load_sequence).
//
// Copies run on the legacy default stream, then the host waits for them: the backend's own stream is
// non-blocking (no implicit ordering with stream 0) and has finished every kernel touching a sequence when
// forward()/generate_on_device() return, so a sequence is quiescent whenever these are called.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cuda/kernels/sample.cuh"
#include "cuda/megakernel/step.cuh"
#include "engine/backend.h"
#include "engine/penalties.h"

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
    // cudaMemset runs on the legacy stream, asynchronously to the host: without this wait a kernel on a
    // non-blocking stream (the backend's) may write the array before the zeros land on it (the fp16 weight copies
    // written right after their alloc() came out partly zero, now and then: 2026-12-08, H100).
    CUDA_RETURN(cudaStreamSynchronize(cudaStreamLegacy), "cudaMemset");
    return ok_status();
  }
  size_t bytes() const { return n * sizeof(T); }
  // At least `count` elements: a new, cleared array when this one is shorter (cudaFree waits for the device, so no
  // kernel still reads the old one).
  Status reserve(size_t count) {
    if (ptr && count <= n) return ok_status();
    cudaFree(ptr);
    ptr = nullptr;
    return alloc(count);
  }
};

// One untyped device allocation owned by RAII, not cleared (the owner decides what to zero).
struct DeviceBlock {
  void* ptr = nullptr;
  size_t bytes = 0;
  DeviceBlock() = default;
  DeviceBlock(const DeviceBlock&) = delete;
  DeviceBlock& operator=(const DeviceBlock&) = delete;
  DeviceBlock(DeviceBlock&& o) noexcept : ptr(o.ptr), bytes(o.bytes) { o.ptr = nullptr, o.bytes = 0; }
  DeviceBlock& operator=(DeviceBlock&& o) noexcept {
    std::swap(ptr, o.ptr);
    std::swap(bytes, o.bytes);
    return *this;
  }
  ~DeviceBlock() { cudaFree(ptr); }
  Status alloc(size_t n) {
    CUDA_RETURN(cudaMalloc(&ptr, std::max<size_t>(n, 1)), "cudaMalloc");
    bytes = n;
    return ok_status();
  }
};

// A typed array inside a DeviceBlock (not owning): the same ptr / n / bytes() as DeviceArray.
template <typename T>
struct DeviceSpan {
  T* ptr = nullptr;
  size_t n = 0;
  size_t bytes() const { return n * sizeof(T); }
};

struct GraphExec {
  cudaGraphExec_t exec = nullptr;
  GraphExec() = default;
  GraphExec(const GraphExec&) = delete;
  GraphExec& operator=(const GraphExec&) = delete;
  ~GraphExec() {
    if (exec) cudaGraphExecDestroy(exec);
  }
};
using GraphMap = std::map<std::string, std::unique_ptr<GraphExec>>;

// Byte offsets of a sequence's arrays in its block; a function of the model geometry and the capacity only,
// so two sequences of one backend (and their checkpoints) share it.
struct SequenceLayout {
  static constexpr size_t kAlign = 256;
  // Pending main-model rows the MTP head's state holds: one verification (up to kMaxBatchRows rows) after an
  // accepted one; past that the head reads the ready rows first (cuda_mtp.cpp mtp_prepare).
  static constexpr int kMtpPendingRows = 16;
  std::vector<bool> attention;           // per layer: attention (k/v) or Gated DeltaNet (conv/S)
  std::vector<size_t> off_a, off_b;      // per layer: k and v, or conv and S
  size_t conv_n = 0, S_n = 0, kv_n = 0;  // elements per array
  size_t recurrent_bytes = 0;            // [0, recurrent_bytes): every conv and S
  size_t pos_off = 0, total_bytes = 0;
  // The MTP head's arrays (mtp: enabled): its k and v (kv_n each), the pending rows and the chained row.
  bool mtp = false;
  size_t hidden = 0;  // H (with the head on or off)
  size_t mtp_k_off = 0, mtp_v_off = 0, mtp_pending_off = 0, mtp_chain_off = 0;
  size_t mtp_pending_bytes() const { return mtp ? kMtpPendingRows * hidden * sizeof(float) : 0; }
  static SequenceLayout of(const ModelConfig& c, int64_t capacity, bool mtp = false);
};

class CudaCheckpoint final : public Checkpoint {
 public:
  int64_t n = 0;
  DeviceBlock storage;                                    // the sequence's recurrent region (then the mtp rows)
  size_t recurrent_bytes = 0;                             // [0, recurrent_bytes) of storage
  size_t hidden = 0;                                      // H (the width of the mtp rows)
  std::vector<std::optional<DeviceSpan<float>>> conv, S;  // views into storage (Gated DeltaNet layers)
  // The MTP head's part (mtp_on: written from a sequence with the head): its KV length and the pending rows
  // [mtp_rows, H] (in storage after the recurrent region) with their tokens, as the CPU backend's checkpoint.
  bool mtp_on = false;
  int64_t mtp_n = 0;
  int mtp_rows = 0;
  DeviceSpan<float> mtp_pending;  // room for kMtpPendingRows rows (null without the head)
  std::vector<int32_t> mtp_tokens;
  int64_t n_tokens() const override { return n; }
  size_t bytes() const override {
    size_t b = mtp_pending.bytes() + mtp_tokens.size() * sizeof(int32_t);
    for (auto& c : conv) b += c ? c->bytes() : 0;
    for (auto& s : S) b += s ? s->bytes() : 0;
    return b;
  }
  Status save(ByteWriter& out) const override;
  // A checkpoint of a sequence laid out as `L`, at position `at`, allocated but not written; null when the
  // device has no memory for it.
  static std::unique_ptr<CudaCheckpoint> allocate(const SequenceLayout& L, int64_t at);
  Status load(ByteReader& in);  // fills an allocated checkpoint from what save() wrote
};

class CudaSequence final : public SequenceState {
 public:
  const void* owner = nullptr;
  // Unique for the process's lifetime (clones and loaded sequences get their own): the key of the several-row
  // step graphs that bake this sequence's device pointers.
  const uint64_t id = next_id();
  int64_t n = 0, capacity = 0;
  SequenceLayout layout;
  DeviceBlock storage;
  DeviceSpan<int> pos;  // device copy of n
  // Per layer: attention layers use k/v, Gated DeltaNet layers conv/S (views into storage).
  std::vector<std::optional<DeviceSpan<__nv_bfloat16>>> k, v;
  std::vector<std::optional<DeviceSpan<float>>> conv, S;
  // With the decode megakernel (CudaBackend::ensure_step_program): the batch-1 step's program, which bakes this
  // sequence's pointers as its graphs do (declared first: the graphs that launch it go first).
  std::unique_ptr<mk::DeviceProgram> step_program;
  GraphMap graphs;
  // Between forward_verify and accept_verified (cuda_verify.cpp): the position of the first verified row and how
  // many there are; -1 / 0 otherwise (no other call takes the sequence meanwhile).
  int64_t verify_base = -1;
  int verify_rows = 0;
  // The MTP head's state (layout.mtp; cuda_mtp.cpp), the CPU backend's MtpState on the device: its KV entry at
  // position i is computed from the token at i+1 and the main model's final-norm row at i, so the head runs one
  // position behind; the rows of positions mtp_n .. n-1 wait in mtp_pending until the token after each is known.
  bool mtp_on = false;
  int64_t mtp_n = 0;                     // head KV entries 0 .. mtp_n-1 (past n: a draft's)
  int mtp_rows = 0;                      // P: rows [P, H] in mtp_pending, positions mtp_n .. mtp_n+P-1
  std::vector<int32_t> mtp_tokens;       // the tokens at positions mtp_n+1 .. mtp_n+P-1 (P-1 of them)
  bool mtp_chained = false;              // mtp_chain holds the head's output of the last draft step
  DeviceSpan<__nv_bfloat16> mtp_k, mtp_v;
  DeviceSpan<float> mtp_pending, mtp_chain;  // [kMtpPendingRows, H], [H]
  // Device sampling's penalties (sample.cuh PenaltyState, cuda_penalties.cpp): the running request's table of
  // distinct history ids and its index by id, in one block allocated on the first penalised request and kept
  // (graphs bake its pointers); penalty_sync says which request's history it holds. Neither saved nor cloned:
  // a restored, cloned or loaded sequence rebuilds it from the next request's history.
  DeviceBlock penalty_storage;
  PenaltyState penalties;
  PenaltySync penalty_sync;

  CudaSequence() = default;
  CudaSequence(const CudaSequence&) = delete;
  CudaSequence& operator=(const CudaSequence&) = delete;

  int64_t n_tokens() const override { return n; }
  size_t bytes() const override {
    size_t b = 0;
    for (auto& x : k) b += x ? 2 * x->bytes() : 0;
    for (auto& x : conv) b += x ? x->bytes() : 0;
    for (auto& x : S) b += x ? x->bytes() : 0;
    if (mtp_on)
      b += 2 * mtp_k.bytes() + mtp_pending.bytes() + mtp_chain.bytes() + mtp_tokens.size() * sizeof(int32_t);
    return b + penalty_storage.bytes;
  }
  std::unique_ptr<Checkpoint> checkpoint() const override;
  // A checkpoint at position `at` whose storage is allocated but not written (the caller copies the state
  // in).
  std::unique_ptr<CudaCheckpoint> empty_checkpoint(int64_t at) const;
  Status restore(const Checkpoint& base) override;
  std::unique_ptr<SequenceState> clone() const override;
  Status save(ByteWriter& out) const override;
  // A fresh, zeroed sequence of `cap` tokens (with the MTP head's state when `mtp`).
  Status allocate(const ModelConfig& c, int64_t cap, bool mtp = false);
  Status load(ByteReader& in);  // fills this fresh sequence (allocate()) from what save() wrote

 private:
  static uint64_t next_id();
  void bind_views();  // k, v, conv, S, pos (and the head's arrays) from layout and storage
};

}  // namespace lily::cuda
