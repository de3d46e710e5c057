// `lily serve`: the OpenAI-compatible server. It listens at once, loads the model in a background thread
// (/health says "loading" until then), and answers:
//   GET  /                      the chat page (static HTML + JS, embedded)
//   GET  /health                {"status": "ok"} or 503 {"status": "loading" | "error"}
//   GET  /metrics               Prometheus text
//   GET  /v1/models[/{id}]      the served model
//   POST /v1/chat/completions   chat, streamed (SSE) or not; tools, reasoning, logprobs, usage
//   POST /v1/completions        raw text completion of a string or token ids
//   POST /apply-template        the rendered chat prompt of a chat request (as llama.cpp's server), for
//   debugging
//   GET  /props                 the served model, context size and per-request limits (as llama.cpp's server)
//   POST /v1/messages[/count_tokens]  the Anthropic Messages API
//   POST /v1/responses          the OpenAI Responses API (stateless)
//   POST /tokenize, /detokenize  llama-server's tokenizer endpoints
// With an API key, everything but /, /health and /metrics needs `Authorization: Bearer KEY` (or
// `x-api-key: KEY`, as Anthropic's clients send it).
#pragma once
#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/backend_factory.h"
#include "engine/engine.h"
#include "engine/generation_config.h"
#include "server/auth.h"
#include "server/chat_request.h"
#include "server/http.h"
#include "server/metrics.h"
#include "server/origin_policy.h"
#include "server/scheduler.h"
#include "server/sse.h"

namespace lily {

struct ResponseMeta;  // chat_response.h

struct ServerOptions {
  std::string model_dir;
  std::string served_model_name;  // empty: the model directory's name
  std::string api_key;            // empty: no authentication
  BackendOptions backend;
  int64_t ctx_size = 0;           // 0: the backend's default; BackendOptions::kContextAuto: the largest that fits
  size_t max_queue = 64;          // requests waiting for a slot; more get 429
  int parallel = 4;               // requests active at once (slots, 1..Scheduler::kMaxParallel)
  int shutdown_grace_ms = 10000;  // SIGTERM: in-flight work may finish within this, then is cancelled
  // Per-request limits (src/server/README.md, "Limits"): the completion tokens of a request that sets none,
  // and the most any request gets (larger asks are clamped); 0: up to the context.
  int max_tokens = 32768;
  int request_timeout_ms = 0;  // > 0: a generation running longer ends with finish_reason "length"
  std::vector<std::string> allowed_origins;  // --allow-origin: browser origins besides the server's own
  bool log_requests = true;
  HttpServerOptions http;
  EngineOptions engine;   // speculative_tokens: --speculative mtp:K
  std::string mtp_from;   // --mtp-from DIR (ModelLoadOptions::mtp_from)
};

class Server {
 public:
  explicit Server(ServerOptions options);
  ~Server();

  Status start();   // listens, then starts loading the model in the background
  int run();        // serves until shutdown(); 0, or 1 when the model failed to load
  void shutdown();  // stop accepting, drop queued work, let in-flight work finish (grace), cancel the rest
  int port() const { return http_.port(); }

 private:
  enum class State { loading, ready, failed };
  struct Loaded;  // engine, tokenizer, defaults: set once by the loader

  void load_model();
  void handle(const HttpRequest& req, HttpExchange& ex);  // the catch-all around route()
  void route(const HttpRequest& req, HttpExchange& ex);
  void answer_exception(const HttpRequest& req, HttpExchange& ex, const char* what);
  void handle_props(HttpExchange& ex);
  bool authorized(const HttpRequest& req, HttpExchange& ex);
  void send_error(HttpExchange& ex, const ApiError& e);
  void handle_health(HttpExchange& ex);
  void handle_models(const HttpRequest& req, HttpExchange& ex);
  void handle_chat(const HttpRequest& req, HttpExchange& ex);
  void handle_completions(const HttpRequest& req, HttpExchange& ex);
  void handle_apply_template(const HttpRequest& req, HttpExchange& ex);
  // compat_handlers.cpp: the Anthropic Messages API, the OpenAI Responses API, llama-server's tokenizer.
  void handle_messages(const HttpRequest& req, HttpExchange& ex);
  void handle_count_tokens(const HttpRequest& req, HttpExchange& ex);
  void handle_responses(const HttpRequest& req, HttpExchange& ex);
  void handle_tokenize(const HttpRequest& req, HttpExchange& ex);
  void handle_detokenize(const HttpRequest& req, HttpExchange& ex);
  // An error in the shape of the API the path belongs to (Anthropic's for /v1/messages*, else OpenAI's).
  void send_error(const HttpRequest& req, HttpExchange& ex, const ApiError& e);
  // A chat-completions body (as sent, or translated from another API) -> validated request, rendered
  // prompt and the engine request.
  // client_gone: asked before tokenizing; true -> a 499 error, which send_error turns into abandon().
  MaybeError prepare_chat(const json& body, ChatRequest& chat, ChatPrompt& prompt, GenerationRequest& g,
                          const std::function<bool()>& client_gone = {});
  ResponseMeta response_meta(const char* id_prefix) const;
  // Shared by the two generation endpoints: defaults, validation, context check, stop tokens. `param` names
  // the prompt's field in errors ("messages", "prompt").
  MaybeError make_generation_request(const std::vector<int32_t>& prompt, const SamplingRequest& sampling,
                                     bool logprobs, int top_logprobs, bool reuse_cache,
                                     int default_max_tokens, const std::string& param,
                                     GenerationRequest& out);
  std::shared_ptr<class GenerationJob> make_job(GenerationRequest request);
  struct StreamCallbacks {
    bool stream = false;
    std::function<std::string()> start;                          // SSE bytes before the first piece
    std::function<std::string(const GenerationPiece&)> piece;    // SSE bytes (streaming) or ""
    std::function<std::string(const GenerationResult&)> finish;  // SSE tail, or the whole JSON body
    std::function<std::string(const ApiError&)> stream_error;    // SSE bytes of an error once streaming;
                                                                 // unset: OpenAI's error event + [DONE]
    HttpHeaders headers;                                         // extra headers of a JSON response
  };
  // Callbacks that feed a response builder (chat, completion, messages, responses): its SSE chunks when
  // streaming; else the pieces are collected and the finish renders the whole JSON body.
  template <typename Builder>
  static StreamCallbacks builder_callbacks(Builder& builder, bool stream);
  // Queues the job and answers: streamed, or one JSON body; errors as OpenAI error JSON (or an SSE error
  // event once the stream has begun).
  void run_job(const HttpRequest& req, HttpExchange& ex, const std::shared_ptr<class GenerationJob>& job,
               StreamCallbacks& cb);
  json model_json() const;
  LiveGauges live_gauges() const;

  ServerOptions options_;
  OriginPolicy origin_policy_;
  HttpServer http_;
  Metrics metrics_;
  std::unique_ptr<Scheduler> scheduler_;
  std::atomic<State> state_{State::loading};
  std::string load_error_;
  std::unique_ptr<Loaded> loaded_;
  std::thread loader_;
  std::atomic<bool> shutting_down_{false};
  std::once_flag shutdown_once_;
  int64_t started_at_ = 0;
};

template <typename Builder>
Server::StreamCallbacks Server::builder_callbacks(Builder& builder, bool stream) {
  StreamCallbacks cb;
  cb.stream = stream;
  cb.start = [] { return std::string(); };
  if (stream) {
    cb.piece = [&builder](const GenerationPiece& p) { return builder.stream_piece(p); };
    cb.finish = [&builder](const GenerationResult& r) { return builder.stream_finish(r); };
  } else {
    cb.piece = [&builder](const GenerationPiece& p) {
      builder.add_piece(p);
      return std::string();
    };
    cb.finish = [&builder](const GenerationResult& r) { return dump_json(builder.response(r)); };
  }
  return cb;
}

}  // namespace lily
