// Engine::generate and its steps: acquire a sequence from the session cache (resumed inside the longest
// shared prefix), prefill the rest of the prompt in calls split at the checkpoint positions, then decode on
// the device or with the host sampler (alone, or one token per step beside other requests), streaming
// UTF-8-safe text with stop strings applied; the sequence goes back to the cache.
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

// min_tokens needs the stop tokens banned step by step, which the device sampler cannot do: the host runs it, as
// logit_bias and logprobs. The penalties run on the device (DeviceSampling carries them with the history).
bool device_can_sample(const Backend& backend, const SamplingParams& p) {
  return backend.has_device_sampling() && p.logit_bias.empty() && !p.logprobs && p.top_logprobs == 0 &&
         p.top_k <= 64 && p.min_tokens == 0;
}

// DeviceSampling::history_id: unique per request for the process's lifetime (never 0).
uint64_t next_history_id() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

std::unique_ptr<SessionDisk> open_disk(const EngineOptions& o, const Backend& backend) {
  if (o.disk.dir.empty()) return nullptr;
  CHECK(!o.model_fingerprint.empty(), "a disk tier needs the model fingerprint");
  // The files say whether their states carry the MTP head's (engine/session_file.h): they do when the backend
  // has it on.
  const bool mtp = backend.mtp_enabled();
  CHECK(!mtp || !o.mtp_fingerprint.empty(), "a disk tier with the MTP head on needs the head's fingerprint");
  return SessionDisk::open(o.disk,
                           SessionFileOwner{o.model_fingerprint, backend.name(), mtp ? o.mtp_fingerprint : ""});
}

}  // namespace

// The per-request decode state, the same for the lone and the batched path: one sampler (its RNG seeded per
// request), the token history its penalties read, the next token to consume, and the sink.
struct Generation::State {
  State(const Tokenizer& tokenizer, const GenerationRequest& r, PieceFn piece_fn, int64_t token_budget)
      : request(r),
        on_piece(std::move(piece_fn)),
        budget(token_budget),
        sampler(request.sampling),
        speculative_rng(speculative_seed(sampler.seed())),
        history(request.prompt),
        next(request.prompt.back()),
        sink(tokenizer, request, on_piece, result, budget) {}

  bool ended() const { return !failure.ok() || finished; }
  void fail(Status st) {
    failure = std::move(st);
    if (failure.ok()) failure = error(ErrorCode::internal, "a step failed without a reason");
  }
  void end(const char* reason) {
    sink.end(reason);
    finished = true;
  }
  // A sampled id into the history and the sink; false once generation ends.
  bool take(int32_t id, float logprob = 0, std::vector<TokenLogprob> top = {}) {
    history.push_back(id);
    next = id;
    if (!sink.accept(id, logprob, std::move(top))) finished = true;
    return !finished;
  }
  // One host-sampled token from this request's row of logits: the min_tokens ban of the stop tokens, then the
  // sampler (an error for logits it cannot sample from: a NaN, or nothing finite).
  Status sample(std::span<float> logits) {
    if (static_cast<int64_t>(sink.emitted().size()) < request.sampling.min_tokens) {
      for (int32_t id : request.stop_token_ids) logits[static_cast<size_t>(id)] = -INFINITY;
    }
    ASSIGN_OR_RETURN(SampleResult r, sampler.sample(logits, history, request.prompt.size()));
    take(r.id, r.logprob, std::move(r.top));
    return ok_status();
  }
  // The request's device sampling; the history span stays valid until the next take().
  DeviceSampling device_sampling() const {
    const SamplingParams& p = request.sampling;
    DeviceSampling d{p.temperature, p.top_k, p.top_p, p.min_p, sampler.seed()};
    d.presence_penalty = p.presence_penalty;
    d.frequency_penalty = p.frequency_penalty;
    d.repetition_penalty = p.repetition_penalty;
    d.history = history;
    d.n_prompt = request.prompt.size();
    d.history_id = history_id;
    return d;
  }
  int64_t left() const { return budget - static_cast<int64_t>(sink.emitted().size()); }

  GenerationRequest request;
  PieceFn on_piece;
  GenerationResult result;
  std::unique_ptr<CachedSequence> seq;
  int64_t to = 0, anchor = 0, budget = 0;  // prefill up to `to` (the last prompt token decodes)
  Clock::time_point t_start, t_prefill;
  Sampler sampler;
  SplitMix64 speculative_rng;    // the speculative loop's draws (engine/speculative.h), kept across calls
  std::vector<int32_t> history;  // prompt + sampled ids
  const uint64_t history_id = next_history_id();  // DeviceSampling::history_id
  int32_t next;                  // the token the next decode step consumes
  bool on_device = false;        // sampled by Backend::generate_on_device
  bool finished = false;         // the sink has a finish reason
  Status failure;
  TokenSink sink;
};

Generation::Generation(std::unique_ptr<State> state) : s_(std::move(state)) {}
Generation::~Generation() = default;
bool Generation::prefilling() const {
  return !s_->ended() && static_cast<int64_t>(s_->seq->tokens.size()) < s_->to;
}
bool Generation::done() const {
  return s_->ended();
}

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
        cache(o.session_cache_bytes, open_disk(o, *backend)),
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
  Status prefill_piece(CachedSequence& seq, std::span<const int32_t> prompt, int64_t to, int64_t anchor,
                       bool checkpoints);
  void decode_on_host(Generation::State& g, const std::function<bool()>& yield);
  void decode_speculative(Generation::State& g, const std::function<bool()>& yield);
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

// Consumes the next piece of prompt[seq.tokens.size():to] in one forward call. Pieces end at multiples of
// checkpoint_interval and every prefill_chunk tokens, the piece holding the anchor goes through
// forward_with_checkpoint (the same calls whether or not the cache is used, and whether or not other requests
// run between the pieces, so neither changes anything numerically); checkpoints at the anchor, the grid and
// `to`.
Status Engine::Impl::prefill_piece(CachedSequence& seq, std::span<const int32_t> prompt, int64_t to,
                                   int64_t anchor, bool checkpoints) {
  const int64_t interval = options.checkpoint_interval;
  const int64_t pos = static_cast<int64_t>(seq.tokens.size());
  const int64_t next = std::min({to, pos + options.prefill_chunk, (pos / interval + 1) * interval});
  auto part = prompt.subspan(static_cast<size_t>(pos), static_cast<size_t>(next - pos));
  if (anchor > pos && anchor < next) {
    // The anchor's checkpoint from inside the piece (one call, whether or not it is kept: the same numerics
    // with and without the cache).
    ASSIGN_OR_RETURN(
        std::unique_ptr<Checkpoint> cp,
        backend->forward_with_checkpoint(*seq.state, part, anchor - pos, LogitsRows::none, nullptr));
    if (cp && cp->n_tokens() != anchor)
      return error(ErrorCode::internal, "%s backend: the checkpoint for %lld is at %lld (piece from %lld)",
                   backend->name(), (long long)anchor, (long long)cp->n_tokens(), (long long)pos);
    if (checkpoints && cp && !seq.checkpoints.contains(anchor)) seq.checkpoints[anchor] = std::move(cp);
  } else {
    RETURN_IF_ERROR(backend->forward(*seq.state, part, LogitsRows::none, nullptr));
  }
  seq.tokens.insert(seq.tokens.end(), part.begin(), part.end());
  if (checkpoints && (next == anchor || next % interval == 0 || next == to) &&
      !seq.checkpoints.contains(next)) {
    std::unique_ptr<Checkpoint> cp = seq.state->checkpoint();
    if (cp) seq.checkpoints[next] = std::move(cp);  // none when the device is out of memory: just fewer
  }
  return ok_status();
}

// Forward the next token, sample on the host, emit, until the sink says stop or yield() asks for the thread.
void Engine::Impl::decode_on_host(Generation::State& g, const std::function<bool()>& yield) {
  std::vector<float> logits;
  while (true) {
    Status st =
        backend->forward(*g.seq->state, std::span<const int32_t>(&g.next, 1), LogitsRows::last, &logits);
    if (st.code() == ErrorCode::out_of_range && !g.sink.emitted().empty()) return g.end("length");  // KV full
    if (!st.ok()) return g.fail(std::move(st));
    if (st = g.sample(logits); !st.ok()) return g.fail(std::move(st));
    if (g.finished || yield()) return;
  }
}

// engine/speculative.h's loop until the sink says stop or yield() asks for the thread between two rounds (a later
// call resumes from the history, with the request's sampler and speculative RNG).
void Engine::Impl::decode_speculative(Generation::State& g, const std::function<bool()>& yield) {
  SpeculativeRequest r{&g.history, g.request.prompt.size(), g.request.stop_token_ids,
                       static_cast<int64_t>(g.sink.emitted().size()), g.left(), options.speculative_tokens, yield};
  SpeculativeCounts counts;
  Status st = speculative_decode(
      *backend, *g.seq->state, g.sampler, g.speculative_rng, r,
      [&](int32_t id, float logprob, std::vector<TokenLogprob> top) { return g.take(id, logprob, std::move(top)); },
      counts);
  g.result.speculative_steps += counts.steps;
  g.result.drafted_tokens += counts.drafted;
  g.result.accepted_tokens += counts.accepted;
  spec_steps += static_cast<uint64_t>(counts.steps);
  spec_drafted += static_cast<uint64_t>(counts.drafted);
  spec_accepted += static_cast<uint64_t>(counts.accepted);
  if (st.code() == ErrorCode::out_of_range && !g.sink.emitted().empty()) return g.end("length");  // KV full
  if (!st.ok()) g.fail(std::move(st));
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
  ASSIGN_OR_RETURN(std::unique_ptr<Generation> g, begin(request, on_piece));
  while (g->prefilling()) prefill_step(*g);
  if (!g->done()) run_alone(*g, [] { return false; });
  return finish(std::move(g));
}

Result<std::unique_ptr<Generation>> Engine::begin(const GenerationRequest& request, PieceFn on_piece) {
  Impl& m = *impl_;
  const auto t_start = Clock::now();
  RETURN_IF_ERROR(m.validate(request));
  const std::span<const int32_t> prompt = request.prompt;
  const int64_t n_prompt = static_cast<int64_t>(prompt.size());
  const int64_t max_tokens = request.sampling.max_tokens > 0 ? request.sampling.max_tokens : INT64_MAX;
  const int64_t budget = std::min(max_tokens, m.max_context() - n_prompt + 1);
  auto s = std::make_unique<Generation::State>(m.tokenizer, request, std::move(on_piece), budget);
  s->t_start = t_start;
  s->to = n_prompt - 1;  // the last prompt token is the first decode step's input
  if (request.reuse_cache) {
    ASSIGN_OR_RETURN(SessionCache::Lease lease, m.cache.acquire(*m.backend, prompt, s->to));
    s->seq = std::move(lease.seq);
  } else {
    s->seq = std::make_unique<CachedSequence>();
    ASSIGN_OR_RETURN(s->seq->state, m.cache.new_state(*m.backend));
  }
  s->result.prompt_tokens = static_cast<int>(n_prompt);
  s->result.cached_tokens = static_cast<int>(s->seq->tokens.size());
  s->anchor = m.anchor_of(prompt);  // the next turn resumes from its checkpoint
  s->on_device = m.options.speculative_tokens == 0 && device_can_sample(*m.backend, request.sampling);
  s->t_prefill = Clock::now();
  return std::unique_ptr<Generation>(new Generation(std::move(s)));
}

// Cancellation is looked at before each piece and before the first token (prefill stops early then).
void Engine::prefill_step(Generation& generation) {
  Generation::State& g = *generation.s_;
  CHECK(generation.prefilling(), "prefill_step of a generation that is not prefilling");
  if (cancelled(g.request)) return g.end("cancelled");
  Status st = impl_->prefill_piece(*g.seq, g.request.prompt, g.to, g.anchor, g.request.reuse_cache);
  if (!st.ok()) g.fail(std::move(st));
}

void Engine::run_alone(Generation& generation, const std::function<bool()>& yield) {
  Impl& m = *impl_;
  Generation::State& g = *generation.s_;
  CHECK(!generation.prefilling() && !generation.done(), "run_alone of a generation that cannot decode");
  if (cancelled(g.request)) return g.end("cancelled");
  if (m.options.speculative_tokens > 0) return m.decode_speculative(g, yield);
  if (g.on_device) {
    const size_t before = g.sink.emitted().size();
    const int max_new = static_cast<int>(std::min<int64_t>(g.left(), INT_MAX));
    Status st = m.backend->generate_on_device(*g.seq->state, g.next, g.device_sampling(), max_new,
                                              [&](int32_t id) { return g.take(id) && !yield(); });
    if (st.ok()) return;
    // A KV capacity below the model's context is refused up front: the host loop then runs up to the limit.
    if (st.code() != ErrorCode::out_of_range || g.sink.emitted().size() != before)
      return g.fail(std::move(st));
    g.on_device = false;
  }
  m.decode_on_host(g, yield);
}

// The device-sampled generations share one decode_batch_on_device call (the device's draw is keyed by the
// position, so each gets the tokens of its uninterrupted loop; a single one steps through generate_on_device); if
// a row has reached the backend's limit (or the backend has no such call), they step one at a time. The host-sampled ones share one forward_batch
// call. A failed batched call ends all of its generations.
void Engine::decode_step(std::span<Generation* const> generations) {
  Impl& m = *impl_;
  std::vector<Generation::State*> device, host;
  for (Generation* generation : generations) {
    Generation::State& g = *generation->s_;
    CHECK(!generation->prefilling() && !generation->done(), "decode_step of a generation that cannot decode");
    if (cancelled(g.request)) {
      g.end("cancelled");
      continue;
    }
    (g.on_device ? device : host).push_back(&g);
  }
  bool batched = false;
  if (device.size() > 1) {
    std::vector<SequenceState*> states;
    std::vector<int32_t> tokens, next;
    std::vector<DeviceSampling> sampling;
    for (Generation::State* g : device) {
      states.push_back(g->seq->state.get());
      tokens.push_back(g->next);
      sampling.push_back(g->device_sampling());
    }
    Status st = m.backend->decode_batch_on_device(states, tokens, sampling, &next);
    if (st.ok()) {
      for (size_t i = 0; i < device.size(); ++i) device[i]->take(next[i]);
      batched = true;
    } else if (st.code() != ErrorCode::out_of_range && st.code() != ErrorCode::unsupported) {
      for (Generation::State* g : device) g->fail(st);
      batched = true;
    }
  }
  for (Generation::State* gp : device) {
    if (batched) break;
    Generation::State& g = *gp;
    Status st =
        m.backend->generate_on_device(*g.seq->state, g.next, g.device_sampling(), 1, [&](int32_t id) {
          g.take(id);
          return false;
        });
    if (st.ok()) continue;
    if (st.code() != ErrorCode::out_of_range) {
      g.fail(std::move(st));
      continue;
    }
    g.on_device = false;  // as in run_alone: the host loop runs up to the backend's limit
    host.push_back(&g);
  }
  if (host.empty()) return;
  std::vector<SequenceState*> states;
  std::vector<int32_t> tokens;
  for (Generation::State* g : host) {
    states.push_back(g->seq->state.get());
    tokens.push_back(g->next);
  }
  std::vector<float> logits;
  Status st = m.backend->forward_batch(states, tokens, &logits);
  if (!st.ok()) {
    for (Generation::State* g : host) {
      if (st.code() == ErrorCode::out_of_range && !g->sink.emitted().empty())
        g->end("length");
      else
        g->fail(st);
    }
    return;
  }
  const size_t V = static_cast<size_t>(m.backend->config().vocab_size);
  for (size_t i = 0; i < host.size(); ++i) {
    if (Status sampled = host[i]->sample(std::span<float>(logits.data() + i * V, V)); !sampled.ok())
      host[i]->fail(std::move(sampled));  // this request ends with the error; the others go on
  }
}

Result<GenerationResult> Engine::finish(std::unique_ptr<Generation> generation) {
  Impl& m = *impl_;
  Generation::State& g = *generation->s_;
  CHECK(generation->done(), "finish of a generation that has not ended");
  if (!g.failure.ok()) return g.failure;
  g.sink.finish();
  GenerationResult result = std::move(g.result);
  const std::vector<int32_t>& emitted = g.sink.emitted();
  const auto t_end = Clock::now();
  const bool any = !emitted.empty();
  result.completion_tokens = static_cast<int>(emitted.size());
  result.prefill_ms = ms_between(g.t_prefill, any ? g.sink.first_token_at() : t_end);
  result.decode_ms = any ? ms_between(g.sink.first_token_at(), t_end) : 0;
  result.time_to_first_token_ms = any ? ms_between(g.t_start, g.sink.first_token_at()) : 0;

  if (g.request.reuse_cache) {
    // The state has consumed the prompt and every sampled token but the last.
    std::unique_ptr<CachedSequence> seq = std::move(g.seq);
    const std::vector<int32_t>& prompt = g.request.prompt;
    const auto n = static_cast<size_t>(seq->state->n_tokens());
    CHECK(n >= seq->tokens.size() && n <= prompt.size() + emitted.size(), "state at %zu", n);
    for (size_t i = seq->tokens.size(); i < n; ++i)
      seq->tokens.push_back(i < prompt.size() ? prompt[i] : emitted[i - prompt.size()]);
    seq->anchor = std::min(g.anchor, g.to);
    if (g.anchor < g.to) seq->mark(g.anchor);
    seq->mark(g.to);
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
  out.disk_hits = s.disk_hits, out.disk_writes = s.disk_writes, out.disk_evictions = s.disk_evictions;
  out.disk_refused = s.disk_refused, out.disk_bytes = s.disk_bytes, out.disk_files = s.disk_files;
  out.disk_budget_bytes = s.disk_budget_bytes;
  return out;
}

void Engine::clear_cache() {
  impl_->cache.clear();
}

void Engine::flush_disk_cache() {
  if (SessionDisk* d = impl_->cache.disk()) d->flush();
}

}  // namespace lily
