// Engine: the generation loop over one backend, with the session cache that lets the next turn of a
// conversation prefill only its new tokens (docs/DESIGN.md section 2). generate() runs one request to the
// end; the step calls (begin, prefill_step, decode_step, run_alone, finish) let the server's scheduler keep
// several requests going at once. Calls are serialised by the caller (the CLI, or the scheduler's one
// thread). The backend may be CPU or CUDA: when a request needs nothing the device sampler lacks (logit_bias,
// logprobs, min_tokens, top_k > 64), decoding uses Backend::generate_on_device (penalties included: DeviceSampling
// carries them with the request's history); otherwise logits come to the host and Sampler (engine/sampler.h)
// picks the token.
// With EngineOptions::speculative_tokens a request that decodes alone goes through engine/speculative.h.
#pragma once
#include <atomic>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "engine/sampler.h"
#include "engine/session_disk.h"
#include "tokenizer/tokenizer.h"

namespace lily {

struct EngineOptions {
  size_t session_cache_bytes = 8ull << 30;  // LRU budget for cached sequences and their checkpoints
  // Also checkpoint every N prompt tokens of long prompts; 0: the larger of 2,048 and the prefill chunk, so a
  // long prompt reaches the backend in whole chunks (the CUDA backend's 4,096 rows run ~14% faster per token
  // than two 2,048-row pieces).
  int checkpoint_interval = 0;
  int prefill_chunk = 0;                    // prompt tokens per backend forward call; 0: the backend's
                                            // preferred_prefill_tokens()
  // Tokens a sequence may hold; 0: what the backend holds (Backend::max_context).
  int64_t max_context = 0;
  // > 0: every request decodes speculatively with K = this many drafts per step from the checkpoint's MTP head
  // (engine/speculative.h); the backend must have had enable_mtp() called (load_model does).
  int speculative_tokens = 0;
  // The session cache's disk tier (`--cache-dir`); none when disk.dir is empty. Its files are marked with
  // model_fingerprint (engine/session_file.h; load_model sets it) and the backend's name, and with
  // mtp_fingerprint when the backend has the MTP head on (Backend::mtp_enabled; load_model sets it too): their
  // states then hold the head's state as well.
  SessionDiskOptions disk;
  std::string model_fingerprint, mtp_fingerprint;
};

struct GenerationRequest {
  std::vector<int32_t> prompt;              // the whole prompt, already rendered and tokenized
  SamplingParams sampling;                  // validated by the caller
  std::vector<int32_t> stop_token_ids;      // e.g. <|im_end|>, <|endoftext|>
  bool reuse_cache = true;                  // false: neither read nor write the session cache
  const std::atomic<bool>* cancel = nullptr;  // checked between tokens
};

// on_piece gets one piece per generated token (its text may be empty while bytes are held back: an incomplete
// code point or a possible stop string), then possibly one last piece with token -1 carrying the held text.
struct GenerationPiece {
  std::string text;                         // UTF-8 safe, stop strings already held back/removed
  int32_t token = -1;
  float logprob = 0;                        // when sampling.logprobs
  std::vector<TokenLogprob> top;            // sampling.top_logprobs entries
};

struct GenerationResult {
  std::vector<int32_t> tokens;              // generated ids (stop token excluded)
  std::string finish_reason;                // "stop" | "length" | "cancelled"
  std::string stop_string;                  // the sampling.stop string that ended it, if one did
  int32_t stop_token = -1;                  // the stop token that ended it, if one did
  // completion_tokens counts every sampled token, a final stop token included (as vLLM reports usage);
  // cached_tokens: prompt tokens not prefilled (resumed from the session cache).
  int prompt_tokens = 0, completion_tokens = 0, cached_tokens = 0;
  // prefill_ms: from the start of prefill to the first sampled token (the whole prompt, its last token's
  // forward included); decode_ms: from there to the end; time_to_first_token_ms also covers the cache lookup.
  double prefill_ms = 0, decode_ms = 0, time_to_first_token_ms = 0;
  // Speculative decoding: verification forwards, draft tokens verified, and those kept.
  int64_t speculative_steps = 0, drafted_tokens = 0, accepted_tokens = 0;
};

struct EngineStats {
  uint64_t cache_hits = 0, cache_misses = 0, cache_evictions = 0;  // requests with reuse_cache only
  size_t cache_bytes = 0, cache_entries = 0, cache_budget_bytes = 0;
  // Speculative decoding since start (all requests): verification forwards, draft tokens verified and kept.
  uint64_t speculative_steps = 0, drafted_tokens = 0, accepted_tokens = 0;
  // The disk tier (0 without one): requests resumed from a file, files written / evicted / refused, and
  // what the files hold.
  uint64_t disk_hits = 0, disk_writes = 0, disk_evictions = 0, disk_refused = 0;
  uint64_t disk_bytes = 0, disk_files = 0, disk_budget_bytes = 0;
};

// One request between Engine::begin and Engine::finish: its leased sequence and its decode state (sampler and
// RNG, token history, text decoder, stop strings, budget), owned by the request and never shared, so its
// tokens are the same whether it decodes alone or beside others.
class Generation {
 public:
  ~Generation();
  Generation(const Generation&) = delete;
  Generation& operator=(const Generation&) = delete;
  bool prefilling() const;  // prompt tokens are left to consume (and it has not ended)
  bool done() const;        // ended (a finish reason or an error): finish() is next

 private:
  friend class Engine;
  struct State;
  explicit Generation(std::unique_ptr<State> state);
  std::unique_ptr<State> s_;
};

class Engine {
 public:
  Engine(std::unique_ptr<Backend> backend, Tokenizer tokenizer, EngineOptions options = {});
  ~Engine();
  const Backend& backend() const;
  const Tokenizer& tokenizer() const;
  const ModelConfig& config() const;
  const EngineOptions& options() const;
  // Runs one request to completion. on_piece returns false to stop early (finish_reason "cancelled").
  Result<GenerationResult> generate(const GenerationRequest& request,
                                    const std::function<bool(const GenerationPiece&)>& on_piece);

  // Step by step (the server's continuous batching, src/server/scheduler.h). begin() validates the request
  // and leases its sequence from the session cache; prefill_step() consumes one piece of the prompt (the
  // pieces generate() makes, so the numerics are the same); decode_step() makes one token for each of several
  // prefilled generations, the host-sampled ones in one Backend::forward_batch call; run_alone() decodes one
  // on the single-request path (the device loop where the request allows it) until it ends or yield(),
  // asked between tokens, returns true; finish() hands the sequence back to the cache and returns the
  // result, or the error that ended a step (such a sequence is dropped). generate() is begin, prefill_step
  // until prefilled, run_alone, finish.
  Result<std::unique_ptr<Generation>> begin(const GenerationRequest& request,
                                            std::function<bool(const GenerationPiece&)> on_piece);
  void prefill_step(Generation& generation);
  void decode_step(std::span<Generation* const> generations);
  void run_alone(Generation& generation, const std::function<bool()>& yield);
  Result<GenerationResult> finish(std::unique_ptr<Generation> generation);

  EngineStats stats() const;  // safe to call from another thread while generate() runs
  void clear_cache();         // the sessions in memory (the disk tier's files stay)
  void flush_disk_cache();    // waits until the disk tier has written every session handed to it

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace lily
