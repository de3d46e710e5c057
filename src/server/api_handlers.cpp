// The generation endpoints: POST /v1/chat/completions, POST /v1/completions, POST /apply-template.
// Each parses and validates on the connection's thread (JSON, schema, chat template, tokenizer), then hands a
// GenerationJob to the scheduler and streams or collects its pieces.
#include <algorithm>
#include <ctime>

#include "server/chat_response.h"
#include "server/generation_job.h"
#include "server/loaded_model.h"
#include "server/server.h"

namespace lily {

namespace {

ApiError context_exceeded(const std::string& message, const std::string& param) {
  return bad_request(message, param, "context_length_exceeded");
}

// How a finished (or refused) job is reported, streamed or not.
struct Outcome {
  DriveOutcome drive;
  const GenerationJob* job;
  std::optional<ApiError> error() const {
    switch (drive) {
      case DriveOutcome::queue_full:
        return ApiError{429, "rate_limit_error", "The request queue is full; retry later.", "", "queue_full"};
      case DriveOutcome::stopped:
      case DriveOutcome::dropped:
        return server_error(503, "The server is shutting down.", "shutting_down");
      case DriveOutcome::client_gone:
        return std::nullopt;
      case DriveOutcome::finished:
        break;
    }
    const Result<GenerationResult>& r = job->result();
    if (!r.ok()) return from_status(r.status());
    if (r->finish_reason == "cancelled")
      return server_error(503,
                          "The generation was cancelled: the server is "
                          "shutting down.",
                          "cancelled");
    return std::nullopt;
  }
};

}  // namespace

MaybeError Server::make_generation_request(const std::vector<int32_t>& prompt,
                                           const SamplingRequest& sampling, bool logprobs, int top_logprobs,
                                           bool reuse_cache, int default_max_tokens, const std::string& param,
                                           GenerationRequest& out) {
  const Loaded& L = *loaded_;
  const int n = static_cast<int>(prompt.size());
  const int ctx = L.served.ctx_size;
  if (n == 0) return bad_request("The prompt is empty.", param);
  if (n >= ctx) {
    return context_exceeded(
        format("This model's maximum context length is %d tokens. However, your %s resulted "
               "in %d tokens. Please reduce the length of the %s.",
               ctx, param.c_str(), n, param.c_str()),
        param);
  }
  SamplingParams p = sampling.params;
  RequestOverrides overrides = sampling.overrides;
  if (!overrides.max_tokens && default_max_tokens > 0) overrides.max_tokens = default_max_tokens;
  apply_defaults(p, L.defaults, overrides);
  p.logprobs = logprobs;
  p.top_logprobs = top_logprobs;
  const int room = ctx - n;
  if (sampling.overrides.max_tokens && *sampling.overrides.max_tokens > room) {
    return context_exceeded(
        format("This model's maximum context length is %d tokens. However, you requested %d "
               "tokens (%d in the %s, %d in the completion). Please reduce the length of the "
               "%s or completion.",
               ctx, n + *sampling.overrides.max_tokens, n, param.c_str(), *sampling.overrides.max_tokens,
               param.c_str()),
        "max_tokens");
  }
  // --max-tokens: the default of a request that sets none, and the most any request gets (clamped, not
  // refused).
  if (const int limit = options_.max_tokens; limit > 0 && (p.max_tokens <= 0 || p.max_tokens > limit))
    p.max_tokens = limit;
  if (p.max_tokens <= 0 || p.max_tokens > room) p.max_tokens = room;
  if (Status st = p.validate(L.served.vocab_size); !st.ok()) return from_status(st);
  out.prompt = prompt;
  out.sampling = std::move(p);
  out.stop_token_ids = L.stop_token_ids;
  for (int32_t id : sampling.stop_token_ids)
    if (std::find(out.stop_token_ids.begin(), out.stop_token_ids.end(), id) == out.stop_token_ids.end())
      out.stop_token_ids.push_back(id);
  out.reuse_cache = reuse_cache;
  return std::nullopt;
}

std::shared_ptr<GenerationJob> Server::make_job(GenerationRequest request) {
  return std::make_shared<GenerationJob>(*loaded_->engine, std::move(request), metrics_,
                                         options_.request_timeout_ms);
}

void Server::run_job(const HttpRequest& req, HttpExchange& ex, const std::shared_ptr<GenerationJob>& job,
                     StreamCallbacks& cb) {
  bool first = true;
  auto on_first = [&] {
    if (first)
      metrics_.observe_ttft(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - req.arrival).count());
    first = false;
  };
  if (!cb.stream) {
    DriveOutcome d = drive(
        *scheduler_, job, ex, [] { return true; },
        [&](const GenerationPiece& piece) {
          on_first();
          cb.piece(piece);
          return true;
        });
    Outcome outcome{d, job.get()};
    if (d == DriveOutcome::client_gone) return ex.abandon();
    if (auto e = outcome.error()) return send_error(req, ex, *e);
    std::string body = cb.finish(job->result().value());
    return ex.send_json(200, body, cb.headers);
  }
  DriveOutcome d = drive(
      *scheduler_, job, ex,
      [&] {
        return ex.begin_stream(200, "text/event-stream", {{"Cache-Control", "no-cache"}}) &&
               ex.write(cb.start());
      },
      [&](const GenerationPiece& piece) {
        on_first();
        return ex.write(cb.piece(piece));
      });
  Outcome outcome{d, job.get()};
  if (d == DriveOutcome::client_gone) return ex.abandon();
  if (!ex.responded()) {  // refused before the stream began: a plain error response
    if (auto e = outcome.error()) return send_error(req, ex, *e);
  }
  if (auto e = outcome.error()) {
    ex.write(cb.stream_error ? cb.stream_error(*e) : sse_event(error_body(*e)) + sse_done());
  } else {
    ex.write(cb.finish(job->result().value()));
  }
  ex.end_stream();
}

MaybeError Server::prepare_chat(const json& body, ChatRequest& chat, ChatPrompt& prompt, GenerationRequest& g,
                                const std::function<bool()>& client_gone) {
  const Loaded& L = *loaded_;
  RETURN_IF_API_ERROR(parse_chat_request(body, L.served, chat));
  Result<ChatPrompt> rendered = build_chat_prompt(chat);
  if (!rendered.ok()) return from_status(rendered.status(), "messages");
  prompt = std::move(rendered).value();
  if (chat.tool_choice == ToolChoice::none && !chat.tools.is_null() && L.tool_call_token >= 0) {
    chat.sampling.params.logit_bias[L.tool_call_token] = -100;  // no call can even begin
  }
  if (client_gone && client_gone()) return client_gone_error();  // before tokenizing: a long prompt costs CPU
  return make_generation_request(L.tokenizer.encode(prompt.text), chat.sampling, chat.logprobs,
                                 chat.top_logprobs, chat.stream.reuse_cache, -1, "messages", g);
}

ResponseMeta Server::response_meta(const char* id_prefix) const {
  return {new_id(id_prefix), std::time(nullptr), options_.served_model_name, loaded_->fingerprint};
}

void Server::handle_chat(const HttpRequest& req, HttpExchange& ex) {
  const Loaded& L = *loaded_;
  json body;
  ChatRequest chat;
  ChatPrompt prompt;
  GenerationRequest g;
  if (auto e = parse_json_body(req.body, body, ex.client_gone_fn())) return send_error(ex, *e);
  if (auto e = prepare_chat(body, chat, prompt, g, ex.client_gone_fn())) return send_error(ex, *e);
  ChatResponseBuilder builder(chat, prompt, L.tokenizer, response_meta("chatcmpl-"));
  StreamCallbacks cb = builder_callbacks(builder, chat.stream.stream);
  if (cb.stream) {
    cb.start = [&] { return builder.stream_start(); };
  } else if (chat.json_object) {  // validated, not enforced: see src/server/README.md
    cb.finish = [&](const GenerationResult& r) {
      json response = builder.response(r);
      bool valid = json::parse(builder.content(), nullptr, false).is_object();
      cb.headers.emplace_back("X-Lily-Json-Object", valid ? "valid" : "invalid");
      return dump_json(response);
    };
  }
  run_job(req, ex, make_job(std::move(g)), cb);
}

void Server::handle_completions(const HttpRequest& req, HttpExchange& ex) {
  const Loaded& L = *loaded_;
  json body;
  CompletionRequest creq;
  if (auto e = parse_json_body(req.body, body, ex.client_gone_fn())) return send_error(ex, *e);
  if (auto e = parse_completion_request(body, L.served, creq)) return send_error(ex, *e);
  if (ex.client_gone()) return ex.abandon();
  std::vector<int32_t> prompt = creq.prompt_is_ids ? creq.prompt_ids : L.tokenizer.encode(creq.prompt_text);
  GenerationRequest g;
  if (auto e = make_generation_request(prompt, creq.sampling, creq.logprobs >= 0, std::max(creq.logprobs, 0),
                                       creq.stream.reuse_cache, kDefaultCompletionTokens, "prompt", g)) {
    return send_error(ex, *e);
  }
  CompletionResponseBuilder builder(creq, L.tokenizer, response_meta("cmpl-"));
  StreamCallbacks cb = builder_callbacks(builder, creq.stream.stream);
  run_job(req, ex, make_job(std::move(g)), cb);
}

void Server::handle_apply_template(const HttpRequest& req, HttpExchange& ex) {
  const Loaded& L = *loaded_;
  json body;
  ChatRequest chat;
  if (auto e = parse_json_body(req.body, body, ex.client_gone_fn())) return send_error(ex, *e);
  if (!body.contains("model")) body["model"] = options_.served_model_name;
  if (auto e = parse_chat_request(body, L.served, chat)) return send_error(ex, *e);
  Result<ChatPrompt> prompt = build_chat_prompt(chat);
  if (!prompt.ok()) return send_error(ex, from_status(prompt.status(), "messages"));
  json out{{"prompt", prompt->text}, {"prompt_tokens", L.tokenizer.encode(prompt->text).size()}};
  ex.send_json(200, dump_json(out));
}

}  // namespace lily
