// Engine::generate: acquire a sequence from the session cache (resumed inside the longest shared prefix),
// prefill the rest of the prompt in calls split at the checkpoint positions, then decode on the device or
// with the host sampler, streaming UTF-8-safe text with stop strings applied; the sequence goes back to the
// cache.
#include "engine/engine.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>

#include "engine/session_cache.h"
#include "engine/speculative.h"
#include "engine/stop_strings.h"
#include "util/check.h"

namespace lily {

namespace {

using Clock = std::chrono::steady_clock;
using PieceFn = std::function<bool(const GenerationPiece&)>;

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

bool cancelled(const GenerationRequest& r) {
  return r.cancel && r.cancel->load(std::memory_order_relaxed);
}

// Receives each sampled token: stop tokens, text (StreamDecoder -> StopMatcher), the piece callback,
// cancellation and the token budget. accept() returns false once generation must end, with the reason set.
class TokenSink {
 public:
  TokenSink(const Tokenizer& tokenizer, const GenerationRequest& request, const PieceFn& on_piece,
            GenerationResult& result, int64_t budget)
      : request_(request),
        on_piece_(on_piece),
        result_(result),
        decoder_(tokenizer),
        matcher_(request.sampling.stop, request.sampling.include_stop_str_in_output),
        budget_(budget) {}

  // Stop strings are looked for from the min_tokens-th token on (before it, text bypasses the matcher, as
  // vLLM checks stops only from there); stop tokens are banned until then by the host loop.
  bool accept(int32_t id, float logprob = 0, std::vector<TokenLogprob> top = {}) {
    if (emitted_.empty()) first_token_at_ = Clock::now();
    emitted_.push_back(id);
    const auto& stops = request_.stop_token_ids;
    if (std::find(stops.begin(), stops.end(), id) != stops.end()) {
      result_.stop_token = id;
      return end("stop");
    }
    result_.tokens.push_back(id);
    const bool stops_armed = static_cast<int64_t>(emitted_.size()) >= request_.sampling.min_tokens;
    std::string text = decoder_.push(id);
    GenerationPiece piece{stops_armed ? matcher_.push(text) : std::move(text), id, logprob, std::move(top)};
    if (on_piece_ && !on_piece_(piece)) return end("cancelled");
    if (matcher_.stopped()) return end("stop");
    if (cancelled(request_)) return end("cancelled");
    if (static_cast<int64_t>(emitted_.size()) >= budget_) return end("length");
    return true;
  }

  // Generation ended (any reason): releases the text still held back unless the caller stopped listening.
  void finish() {
    if (result_.finish_reason.empty()) result_.finish_reason = "length";
    if (result_.finish_reason != "cancelled") {
      std::string rest = matcher_.push(decoder_.flush());
      if (matcher_.stopped()) result_.finish_reason = "stop";
      rest += matcher_.flush();
      if (!rest.empty() && on_piece_) on_piece_(GenerationPiece{std::move(rest), -1, 0, {}});
    }
    if (auto k = matcher_.matched_stop()) result_.stop_string = request_.sampling.stop[*k];
  }

  bool end(const char* reason) {
    result_.finish_reason = reason;
    return false;
  }
  const std::vector<int32_t>& emitted() const { return emitted_; }  // every sampled id, a stop token included
  Clock::time_point first_token_at() const { return first_token_at_; }

 private:
  const GenerationRequest& request_;
  const PieceFn& on_piece_;
  GenerationResult& result_;
  StreamDecoder decoder_;
  StopMatcher matcher_;
  int64_t budget_;
  std::vector<int32_t> emitted_;
  Clock::time_point first_token_at_;
};

// min_tokens needs the stop tokens banned step by step, which the device sampler cannot do: the host runs it.
bool device_can_sample(const Backend& backend, const SamplingParams& p) {
  return backend.has_device_sampling() && p.presence_penalty == 0 && p.frequency_penalty == 0 &&
         p.repetition_penalty == 1 && p.logit_bias.empty() && !p.logprobs && p.top_logprobs == 0 &&
         p.top_k <= 64 && p.min_tokens == 0;
}

}  // namespace

struct Engine::Impl {
  std::unique_ptr<Backend> backend;
  Tokenizer tokenizer;
  EngineOptions options;
  SessionCache cache;
  int32_t im_start_id;
  std::atomic<uint64_t> spec_steps{0}, spec_drafted{0}, spec_accepted{0};

  Impl(std::unique_ptr<Backend> b, Tokenizer t, EngineOptions o)
      : backend(std::move(b)),
        tokenizer(std::move(t)),
        options(o),
        cache(o.session_cache_bytes),
        im_start_id(tokenizer.token_id("<|im_start|>")) {
    if (options.prefill_chunk == 0) options.prefill_chunk = backend->preferred_prefill_tokens();
    if (options.checkpoint_interval == 0) options.checkpoint_interval = std::max(2048, options.prefill_chunk);
    CHECK(options.prefill_chunk > 0 && options.checkpoint_interval > 0,
          "prefill_chunk %d, checkpoint_interval %d", options.prefill_chunk, options.checkpoint_interval);
  }

  int64_t max_context() const {
    const int64_t capacity = backend->max_context();
    return options.max_context > 0 ? std::min<int64_t>(options.max_context, capacity) : capacity;
  }
  Status validate(const GenerationRequest& request) const;
  int64_t anchor_of(std::span<const int32_t> prompt) const;
  Status prefill(CachedSequence& seq, std::span<const int32_t> prompt, int64_t to, int64_t anchor,
                 bool checkpoints, const GenerationRequest& request);
  Status decode_on_host(SequenceState& state, const GenerationRequest& request, TokenSink& sink);
  Status decode(SequenceState& state, const GenerationRequest& request, TokenSink& sink, int64_t budget,
                GenerationResult& result);
};

Status Engine::Impl::validate(const GenerationRequest& request) const {
  const auto& p = request.prompt;
  if (p.empty()) return invalid_argument("the prompt is empty");
  const int32_t vocab = backend->config().vocab_size;
  for (size_t i = 0; i < p.size(); ++i)
    if (p[i] < 0 || p[i] >= vocab)
      return invalid_argument("prompt token %zu: id %d is outside the vocabulary [0, %d)", i, p[i], vocab);
  for (int32_t id : request.stop_token_ids)
    if (id < 0 || id >= vocab)
      return invalid_argument("stop token id %d is outside the vocabulary [0, %d)", id, vocab);
  if (static_cast<int64_t>(p.size()) > max_context())
    return error(ErrorCode::out_of_range, "the prompt has %zu tokens; the context holds %lld", p.size(),
                 (long long)max_context());
  return request.sampling.validate(vocab);
}

// The position of the last <|im_start|> (the assistant's generation prompt in a rendered chat): the next turn
// of the conversation shares the prompt up to there. Without one, the end of the prefilled part.
int64_t Engine::Impl::anchor_of(std::span<const int32_t> prompt) const {
  const int64_t end = static_cast<int64_t>(prompt.size()) - 1;
  for (int64_t i = end; i >= 0; --i)
    if (prompt[i] == im_start_id) return i;
  return end;
}

// Consumes prompt[seq.tokens.size():to] in forward calls split at multiples of checkpoint_interval and every
// prefill_chunk tokens, the piece holding the anchor through forward_with_checkpoint (the same calls whether or
// not the cache is used, so reuse changes nothing numerically); checkpoints at the anchor, the grid and `to`.
// Stops early (consistently) when cancelled.
Status Engine::Impl::prefill(CachedSequence& seq, std::span<const int32_t> prompt, int64_t to, int64_t anchor,
                             bool checkpoints, const GenerationRequest& request) {
  const int64_t interval = options.checkpoint_interval;
  int64_t pos = static_cast<int64_t>(seq.tokens.size());
  while (pos < to) {
    if (cancelled(request)) return ok_status();
    const int64_t next = std::min({to, pos + options.prefill_chunk, (pos / interval + 1) * interval});
    auto part = prompt.subspan(static_cast<size_t>(pos), static_cast<size_t>(next - pos));
    if (anchor > pos && anchor < next) {
      // The anchor's checkpoint from inside the piece (one call, whether or not it is kept: the same numerics
      // with and without the cache).
      ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> cp,
                       backend->forward_with_checkpoint(*seq.state, part, anchor - pos, LogitsRows::none, nullptr));
      if (cp && cp->n_tokens() != anchor)
        return error(ErrorCode::internal, "%s backend: the checkpoint for %lld is at %lld (piece from %lld)",
                     backend->name(), (long long)anchor, (long long)cp->n_tokens(), (long long)pos);
      if (checkpoints && cp && !seq.checkpoints.contains(anchor)) seq.checkpoints[anchor] = std::move(cp);
    } else {
      RETURN_IF_ERROR(backend->forward(*seq.state, part, LogitsRows::none, nullptr));
    }
    seq.tokens.insert(seq.tokens.end(), part.begin(), part.end());
    pos = next;
    if (checkpoints && (pos == anchor || pos % interval == 0 || pos == to) &&
        !seq.checkpoints.contains(pos)) {
      std::unique_ptr<Checkpoint> cp = seq.state->checkpoint();
      if (cp) seq.checkpoints[pos] = std::move(cp);  // none when the device is out of memory: just fewer
    }
  }
  return ok_status();
}

// Logits of the last prompt token, then sample -> emit -> forward the sampled token, until the sink says
// stop.
Status Engine::Impl::decode_on_host(SequenceState& state, const GenerationRequest& request, TokenSink& sink) {
  Sampler sampler(request.sampling);
  std::vector<int32_t> history = request.prompt;
  std::vector<float> logits;
  int32_t next = request.prompt.back();
  while (true) {
    Status st = backend->forward(state, std::span<const int32_t>(&next, 1), LogitsRows::last, &logits);
    if (st.code() == ErrorCode::out_of_range && !sink.emitted().empty()) {
      sink.end("length");  // the backend's KV capacity is full
      return ok_status();
    }
    RETURN_IF_ERROR(st);
    if (static_cast<int64_t>(sink.emitted().size()) < request.sampling.min_tokens) {
      for (int32_t id : request.stop_token_ids) logits[static_cast<size_t>(id)] = -INFINITY;  // min_tokens
    }
    SampleResult r = sampler.sample(logits, history, request.prompt.size());
    history.push_back(r.id);
    next = r.id;
    if (!sink.accept(r.id, r.logprob, std::move(r.top))) return ok_status();
  }
}

Status Engine::Impl::decode(SequenceState& state, const GenerationRequest& request, TokenSink& sink,
                            int64_t budget, GenerationResult& result) {
  const SamplingParams& p = request.sampling;
  if (options.speculative_tokens > 0) {
    SpeculativeRequest sr{request.prompt, &p, request.stop_token_ids, budget, options.speculative_tokens};
    SpeculativeCounts counts;
    Status st = speculative_decode(
        *backend, state, sr,
        [&](int32_t id, float logprob, std::vector<TokenLogprob> top) { return sink.accept(id, logprob, std::move(top)); },
        counts);
    result.speculative_steps = counts.steps, result.drafted_tokens = counts.drafted;
    result.accepted_tokens = counts.accepted;
    spec_steps += static_cast<uint64_t>(counts.steps);
    spec_drafted += static_cast<uint64_t>(counts.drafted);
    spec_accepted += static_cast<uint64_t>(counts.accepted);
    if (st.code() == ErrorCode::out_of_range && !sink.emitted().empty()) {
      sink.end("length");  // the backend's KV capacity is full
      return ok_status();
    }
    return st;
  }
  if (device_can_sample(*backend, p)) {
    DeviceSampling ds{p.temperature, p.top_k, p.top_p, p.min_p, Sampler(p).seed()};
    const int max_new = static_cast<int>(std::min<int64_t>(budget, INT_MAX));
    Status st = backend->generate_on_device(state, request.prompt.back(), ds, max_new,
                                            [&](int32_t id) { return sink.accept(id); });
    // A KV capacity below the model's context is refused up front: the host loop then runs up to the limit.
    if (st.ok() || st.code() != ErrorCode::out_of_range || !sink.emitted().empty()) return st;
  }
  return decode_on_host(state, request, sink);
}

Engine::Engine(std::unique_ptr<Backend> backend, Tokenizer tokenizer, EngineOptions options)
    : impl_(std::make_unique<Impl>(std::move(backend), std::move(tokenizer), options)) {}
Engine::~Engine() = default;

const Backend& Engine::backend() const {
  return *impl_->backend;
}
const Tokenizer& Engine::tokenizer() const {
  return impl_->tokenizer;
}
const ModelConfig& Engine::config() const {
  return impl_->backend->config();
}
const EngineOptions& Engine::options() const {
  return impl_->options;
}

Result<GenerationResult> Engine::generate(const GenerationRequest& request, const PieceFn& on_piece) {
  Impl& m = *impl_;
  const auto t_start = Clock::now();
  RETURN_IF_ERROR(m.validate(request));
  const std::span<const int32_t> prompt = request.prompt;
  const int64_t n_prompt = static_cast<int64_t>(prompt.size()), to = n_prompt - 1;  // the last token decodes

  std::unique_ptr<CachedSequence> seq;
  if (request.reuse_cache) {
    ASSIGN_OR_RETURN(SessionCache::Lease lease, m.cache.acquire(*m.backend, prompt, to));
    seq = std::move(lease.seq);
  } else {
    seq = std::make_unique<CachedSequence>();
    ASSIGN_OR_RETURN(seq->state, m.cache.new_state(*m.backend));
  }
  GenerationResult result;
  result.prompt_tokens = static_cast<int>(n_prompt);
  result.cached_tokens = static_cast<int>(seq->tokens.size());

  const int64_t anchor = m.anchor_of(prompt);  // the next turn resumes from its checkpoint
  const auto t_prefill = Clock::now();
  RETURN_IF_ERROR(m.prefill(*seq, prompt, to, anchor, request.reuse_cache, request));
  const int64_t max_tokens = request.sampling.max_tokens > 0 ? request.sampling.max_tokens : INT64_MAX;
  const int64_t budget = std::min(max_tokens, m.max_context() - n_prompt + 1);
  TokenSink sink(m.tokenizer, request, on_piece, result, budget);
  if (cancelled(request))
    sink.end("cancelled");  // before the first token (prefill stops early then)
  else
    RETURN_IF_ERROR(m.decode(*seq->state, request, sink, budget, result));
  sink.finish();

  const auto t_end = Clock::now();
  const bool any = !sink.emitted().empty();
  result.completion_tokens = static_cast<int>(sink.emitted().size());
  result.prefill_ms = ms_between(t_prefill, any ? sink.first_token_at() : t_end);
  result.decode_ms = any ? ms_between(sink.first_token_at(), t_end) : 0;
  result.time_to_first_token_ms = any ? ms_between(t_start, sink.first_token_at()) : 0;

  if (request.reuse_cache) {
    // The state has consumed the prompt and every sampled token but the last.
    const auto n = static_cast<size_t>(seq->state->n_tokens());
    CHECK(n >= seq->tokens.size() && n <= prompt.size() + sink.emitted().size(), "state at %zu", n);
    for (size_t i = seq->tokens.size(); i < n; ++i)
      seq->tokens.push_back(i < prompt.size() ? prompt[i] : sink.emitted()[i - prompt.size()]);
    seq->anchor = std::min(anchor, to);
    if (anchor < to) seq->mark(anchor);
    seq->mark(to);
    seq->prune_checkpoints(m.options.checkpoint_interval);
    m.cache.release(std::move(seq));
  }
  return result;
}

EngineStats Engine::stats() const {
  SessionCacheStats s = impl_->cache.stats();
  EngineStats out;
  out.cache_hits = s.hits, out.cache_misses = s.misses, out.cache_evictions = s.evictions;
  out.cache_bytes = s.bytes, out.cache_entries = s.entries;
  out.cache_budget_bytes = impl_->cache.budget_bytes();
  out.speculative_steps = impl_->spec_steps.load();
  out.drafted_tokens = impl_->spec_drafted.load();
  out.accepted_tokens = impl_->spec_accepted.load();
  return out;
}

void Engine::clear_cache() {
  impl_->cache.clear();
}

}  // namespace lily
