// The engine interface every backend implements (CPU reference, CUDA). The forward is written against the
// model's coarse operations; a backend owns its weights' device copies, its scratch memory and the per-sequence
// state (KV cache of the attention layers, conv and recurrent state of the Gated DeltaNet layers).
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "model/weights.h"
#include "util/status.h"

namespace lily {

// The recurrent part of a sequence at one position: conv and Gated DeltaNet state. The KV cache is not copied:
// restoring truncates it to `n_tokens` (shared/DESIGN.md section 2).
class Checkpoint {
 public:
  virtual ~Checkpoint() = default;
  virtual int64_t n_tokens() const = 0;
  virtual size_t bytes() const = 0;
};

class SequenceState {
 public:
  virtual ~SequenceState() = default;
  virtual int64_t n_tokens() const = 0;  // tokens consumed so far (the next token's position)
  virtual size_t bytes() const = 0;      // memory held (KV + recurrent state)
  virtual std::unique_ptr<Checkpoint> checkpoint() const = 0;
  // Back to a checkpoint taken from this sequence (or one with the same token prefix) at most n_tokens() ago.
  virtual Status restore(const Checkpoint& cp) = 0;
  virtual std::unique_ptr<SequenceState> clone() const = 0;
};

enum class LogitsRows { none, last, all };

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  virtual const ModelConfig& config() const = 0;
  virtual std::unique_ptr<SequenceState> new_sequence() = 0;
  // Consumes `tokens` at positions n_tokens().. of `seq`. Writes logits [rows, vocab_size] for the rows asked.
  virtual Status forward(SequenceState& seq, std::span<const int32_t> tokens, LogitsRows rows,
                         std::vector<float>* logits) = 0;
};

}  // namespace lily
