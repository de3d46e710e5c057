// The engine interface every backend implements (CPU reference, CUDA). The forward is written against the
// model's coarse operations; a backend owns its weights' device copies, its scratch memory and the per-sequence
// state (KV cache of the attention layers, conv and recurrent state of the Gated DeltaNet layers).
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/sampler.h"
#include "model/weights.h"
#include "util/byte_io.h"
#include "util/status.h"

namespace lily {

// The recurrent part of a sequence at one position: conv and Gated DeltaNet state (and, with the MTP head
// enabled, the head's KV length and the main model's rows it has not read yet). The KV caches are not copied:
// restoring truncates them (docs/DESIGN.md section 2).
class Checkpoint {
 public:
  virtual ~Checkpoint() = default;
  virtual int64_t n_tokens() const = 0;
  virtual size_t bytes() const = 0;
  // Appends the recurrent state in the backend's own layout (the MTP head's part too, when the sequence had
  // one), for Backend::load_checkpoint of the same backend and model (the session cache's disk tier; the file
  // around it names both).
  virtual Status save(ByteWriter& out) const {
    (void)out;
    return error(ErrorCode::unsupported, "this backend cannot save a checkpoint");
  }
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
  // Appends the KV cache up to n_tokens() and the recurrent state, and with the MTP head enabled the head's
  // state as the next forward would find it (its KV entries up to the position, its pending rows: no draft's),
  // for Backend::load_sequence (as Checkpoint::save). Called between forward calls, like checkpoint().
  virtual Status save(ByteWriter& out) const {
    (void)out;
    return error(ErrorCode::unsupported, "this backend cannot save a sequence");
  }
};

enum class LogitsRows { none, last, all };

// Sampling a backend can do on the device (greedy, temperature, top-k <= 64, top-p, min-p, and the presence,
// frequency and repetition penalties with engine/sampler.h's semantics); logit_bias, logprobs and min_tokens need
// the logits on the host and use the generation loop's CPU sampler instead.
struct DeviceSampling {
  float temperature = 0.0f;  // 0: greedy
  int top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  uint64_t seed = 0;
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  float repetition_penalty = 1.0f;  // 1: off
  // What the penalties read (as Sampler::sample's arguments): the request's prompt + generated ids, the first
  // n_prompt of them the prompt. Read only at the start of a call, before the first token is emitted (the
  // caller's on_token may append to it). history_id names the request whose history it is (0: none): a backend
  // may keep its penalty state from the previous call while history_id is the same and the history has grown by
  // exactly the tokens it sampled since (engine/penalties.h PenaltySync), and rebuilds it otherwise.
  std::span<const int32_t> history{};
  size_t n_prompt = 0;
  uint64_t history_id = 0;

  bool has_penalties() const {
    return presence_penalty != 0.0f || frequency_penalty != 0.0f || repetition_penalty != 1.0f;
  }
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  virtual const ModelConfig& config() const = 0;
  virtual std::unique_ptr<SequenceState> new_sequence() = 0;
  // Tokens one sequence can hold: the CUDA backend's KV capacity (checked against the GPU's free memory at load),
  // the CPU backend's the model's max_position_embeddings (its state grows as needed).
  virtual int64_t max_context() const { return config().max_position_embeddings; }
  // Consumes `tokens` at positions n_tokens().. of `seq`. Writes logits [rows, vocab_size] for the rows asked.
  virtual Status forward(SequenceState& seq, std::span<const int32_t> tokens, LogitsRows rows,
                         std::vector<float>* logits) = 0;
  // One decode token for each of several sequences in one call: seqs[i] consumes tokens[i] (distinct
  // sequences) and row i of `logits` ([n, vocab_size]) is its next-token logits. Each row's arithmetic must
  // be independent of the other rows, so a request's tokens do not depend on what decodes beside it (the
  // server's continuous batching). By default a loop over forward(); on an error the rows before the failing
  // one have consumed their token.
  virtual Status forward_batch(std::span<SequenceState* const> seqs, std::span<const int32_t> tokens,
                               std::vector<float>* logits) {
    if (seqs.size() != tokens.size())
      return invalid_argument("forward_batch: %zu sequences, %zu tokens", seqs.size(), tokens.size());
    const size_t V = static_cast<size_t>(config().vocab_size);
    logits->resize(seqs.size() * V);
    std::vector<float> row;
    for (size_t i = 0; i < seqs.size(); ++i) {
      RETURN_IF_ERROR(forward(*seqs[i], tokens.subspan(i, 1), LogitsRows::last, &row));
      std::copy(row.begin(), row.end(), logits->begin() + static_cast<std::ptrdiff_t>(i * V));
    }
    return ok_status();
  }
  // One device-sampled decode token for each of several sequences in one call: seqs[i] consumes tokens[i] and
  // next[i] is the token drawn for it with sampling[i] - the token generate_on_device would draw for it alone
  // (the device's draw is keyed by the position). Every row is checked before any runs: on an error no row has
  // consumed its token (out_of_range: a row has reached the backend's limit). Backends without it return
  // ErrorCode::unsupported (the engine then steps the rows one at a time).
  virtual Status decode_batch_on_device(std::span<SequenceState* const> seqs, std::span<const int32_t> tokens,
                                        std::span<const DeviceSampling> sampling, std::vector<int32_t>* next) {
    (void)seqs, (void)tokens, (void)sampling, (void)next;
    return error(ErrorCode::unsupported, "%s backend has no several-row device step", name());
  }
  // Prompt tokens this backend takes best in one forward call: the engine's default prefill piece (the CUDA
  // backend's prefill chunk; the CPU backend's activations scale with it).
  virtual int preferred_prefill_tokens() const { return 512; }
  // forward() of `tokens` that also returns the checkpoint taken after its first `split` tokens (0 < split <
  // size; null when the device has no memory for one); `rows` refer to the tokens after the split. By default
  // forward(first split) + checkpoint() + forward(rest); a backend whose prefill can copy its recurrent state in
  // mid-call (CUDA) does it in one pass, so the few tokens after a chat prompt's anchor cost a few rows, not a
  // forward of their own.
  virtual Result<std::unique_ptr<Checkpoint>> forward_with_checkpoint(SequenceState& seq,
                                                                      std::span<const int32_t> tokens, int64_t split,
                                                                      LogitsRows rows, std::vector<float>* logits) {
    if (split <= 0 || split >= static_cast<int64_t>(tokens.size()))
      return invalid_argument("forward_with_checkpoint: split %lld outside (0, %zu)", (long long)split, tokens.size());
    RETURN_IF_ERROR(forward(seq, tokens.first(static_cast<size_t>(split)), LogitsRows::none, nullptr));
    std::unique_ptr<Checkpoint> cp = seq.checkpoint();
    RETURN_IF_ERROR(forward(seq, tokens.subspan(static_cast<size_t>(split)), rows, logits));
    return cp;
  }

  // Speculative decoding with the checkpoint's multi-token-prediction head (docs/MODEL.md eq 26; the loop is
  // engine/speculative.h). Backends without it return ErrorCode::unsupported from all four.
  //
  // enable_mtp(): from now on every sequence also carries the head's state (its attention layer's KV cache and
  // the main model's hidden rows it has not consumed yet); fails when the checkpoint has no head. Called once,
  // before any sequence exists.
  virtual bool has_mtp() const { return false; }
  virtual Status enable_mtp() { return error(ErrorCode::unsupported, "%s backend has no MTP head", name()); }
  // enable_mtp() succeeded: sequences (and their saved form) carry the head's state.
  virtual bool mtp_enabled() const { return false; }
  // One draft step: the head reads `token` (the token after the sequence's last position, or the previous
  // draft) with the hidden state it pairs with (the main model's at the last consumed position, or the head's
  // own output of the previous step) and writes the logits [vocab_size] of the token after it. Drafts never
  // change what forward() computes: the next forward or forward_verify drops their KV entries.
  virtual Status mtp_draft(SequenceState& seq, int32_t token, std::vector<float>* logits) {
    (void)seq, (void)token, (void)logits;
    return error(ErrorCode::unsupported, "%s backend has no MTP head", name());
  }
  // Verification: consumes `tokens` (the last sampled token, then the drafts) like forward(), writes the logits
  // of every row [rows, vocab_size], and keeps the recurrent state after each row, so that accept_verified(seq,
  // n) can keep the first n rows (1 <= n <= rows) without recomputing anything: the KV cache is cut back and
  // the recurrent state is the kept copy of row n-1. Until accept_verified the sequence holds all the rows.
  virtual Status forward_verify(SequenceState& seq, std::span<const int32_t> tokens, std::vector<float>* logits) {
    (void)seq, (void)tokens, (void)logits;
    return error(ErrorCode::unsupported, "%s backend has no speculative verification", name());
  }
  virtual Status accept_verified(SequenceState& seq, int64_t n_keep) {
    (void)seq, (void)n_keep;
    return error(ErrorCode::unsupported, "%s backend has no speculative verification", name());
  }
  // Greedy speculative decoding where nothing but the argmax is wanted (no logit transforms, no logprobs): the
  // argmax (the first maximum: ties -> lowest id) of the row mtp_draft would write, and of each row
  // forward_verify would write, with the same effect on the sequence. These defaults call those two and search
  // the logits on the host (a NaN logit is an error, as in Sampler); a backend may find them where the logits
  // are, without copying them out.
  virtual Status mtp_draft_argmax(SequenceState& seq, int32_t token, int32_t* id) {
    std::vector<float> logits;
    RETURN_IF_ERROR(mtp_draft(seq, token, &logits));
    ASSIGN_OR_RETURN(*id, argmax_of_row(logits));
    return ok_status();
  }
  virtual Status forward_verify_argmax(SequenceState& seq, std::span<const int32_t> tokens,
                                       std::vector<int32_t>* ids) {
    std::vector<float> logits;
    RETURN_IF_ERROR(forward_verify(seq, tokens, &logits));
    const size_t V = tokens.empty() ? 0 : logits.size() / tokens.size();
    ids->resize(tokens.size());
    for (size_t r = 0; r < tokens.size(); ++r) {
      ASSIGN_OR_RETURN((*ids)[r], argmax_of_row(std::span<const float>(logits.data() + r * V, V)));
    }
    return ok_status();
  }

  // The device-side decode loop: consumes `first`, samples the next token on the device, feeds it back, and so
  // on; on_token(id) is called for each new token and returns false to stop. The last token emitted is not
  // consumed (as with forward + host sampling). Backends without it return ErrorCode::unsupported.
  virtual bool has_device_sampling() const { return false; }
  virtual Status generate_on_device(SequenceState& seq, int32_t first, const DeviceSampling& sampling, int max_new,
                                    const std::function<bool(int32_t)>& on_token) {
    (void)seq, (void)first, (void)sampling, (void)max_new, (void)on_token;
    return error(ErrorCode::unsupported, "%s backend has no device-side sampling", name());
  }

  // A new sequence / checkpoint from what SequenceState::save / Checkpoint::save of this backend and model
  // wrote. Sizes that do not match this model are a format error; a sequence this backend has no memory for
  // (or a context longer than max_context()) is out_of_range. The MTP head's part: skipped without
  // enable_mtp(); with it, a saved form without one is unsupported (the head's KV cannot be rebuilt from the
  // main model's state: only a prefill computes the hidden rows it reads).
  virtual Result<std::unique_ptr<SequenceState>> load_sequence(ByteReader& in) {
    (void)in;
    return error(ErrorCode::unsupported, "the %s backend cannot load a saved sequence", name());
  }
  virtual Result<std::unique_ptr<Checkpoint>> load_checkpoint(ByteReader& in) {
    (void)in;
    return error(ErrorCode::unsupported, "the %s backend cannot load a saved checkpoint", name());
  }
};

}  // namespace lily
