// The CPU reference backend: the whole forward of docs/MODEL.md eqs 1-25 in fp32, multi-threaded.
#pragma once
#include <memory>

#include "cpu/blocks.h"
#include "engine/backend.h"

namespace lily {

struct CpuBackendOptions {
  int n_threads = 0;       // 0: all hardware threads
  cpu::TraceFn trace;      // optional intermediate dump hook
};

class CpuBackend final : public Backend {
 public:
  CpuBackend(std::shared_ptr<const ModelWeights> weights, CpuBackendOptions options = {});
  const char* name() const override { return "cpu"; }
  const ModelConfig& config() const override { return weights_->config; }
  std::unique_ptr<SequenceState> new_sequence() override;
  Status forward(SequenceState& seq, std::span<const int32_t> tokens, LogitsRows rows,
                 std::vector<float>* logits) override;
  // Every row is checked (its sequence, token and context) before any consumes its token, so bad input leaves
  // all of them as they were; then each row runs its own forward (a row's arithmetic is exactly that of a
  // lone decode step, whatever decodes beside it).
  Status forward_batch(std::span<SequenceState* const> seqs, std::span<const int32_t> tokens,
                       std::vector<float>* logits) override;
  bool has_mtp() const override { return weights_->mtp.has_value(); }
  Status enable_mtp() override;
  bool mtp_enabled() const override { return mtp_on_; }
  Status mtp_draft(SequenceState& seq, int32_t token, std::vector<float>* logits) override;
  Status forward_verify(SequenceState& seq, std::span<const int32_t> tokens, std::vector<float>* logits) override;
  Status accept_verified(SequenceState& seq, int64_t n_keep) override;
  Result<std::unique_ptr<SequenceState>> load_sequence(ByteReader& in) override;
  Result<std::unique_ptr<Checkpoint>> load_checkpoint(ByteReader& in) override;

 private:
  Status run(SequenceState& seq, std::span<const int32_t> tokens, bool verify, LogitsRows rows,
             std::vector<float>* logits);
  Status mtp_run(SequenceState& seq, std::span<const int32_t> tokens, const float* hidden,
                 std::vector<float>* logits);
  bool mtp_on_ = false;
  std::shared_ptr<const ModelWeights> weights_;
  CpuBackendOptions options_;
  std::unique_ptr<ThreadPool> pool_;
};

}  // namespace lily
