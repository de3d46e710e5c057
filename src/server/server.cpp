// Server lifecycle (listen, background model load, shutdown), routing, authentication and the small
// endpoints. The generation endpoints are in api_handlers.cpp.
#include "server/server.h"

#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>

#include "engine/model_loader.h"
#include "server/anthropic_api.h"
#include "server/chat_page.h"
#include "server/generation_job.h"
#include "server/loaded_model.h"
#include "server/sse.h"

namespace lily {

namespace {

bool post_endpoint(const std::string& p) {
  return p == "/v1/chat/completions" || p == "/v1/completions" || p == "/apply-template" ||
         p == "/v1/messages" || p == "/v1/messages/count_tokens" || p == "/v1/responses" || p == "/tokenize" ||
         p == "/detokenize";
}

bool known_endpoint(const std::string& p) {
  return find_chat_page_asset(p) != nullptr || p == "/health" || p == "/metrics" || p == "/v1/models" ||
         p.starts_with("/v1/models/") || p == "/props" || post_endpoint(p);
}

// The `endpoint` label of lily_requests_total.
std::string endpoint_label(const std::string& p) {
  return p.starts_with("/v1/models/") ? "/v1/models/{id}" : known_endpoint(p) ? p : "other";
}

// Defaults that depend on other options: the served name, and HTTP draining that outlasts the shutdown grace.
ServerOptions resolved(ServerOptions o) {
  o.http.drain_timeout_ms = o.shutdown_grace_ms + 5000;  // in-flight work ends (or is cancelled) first
  if (o.served_model_name.empty()) {
    std::filesystem::path dir = std::filesystem::path(o.model_dir).lexically_normal();
    o.served_model_name =
        dir.filename().empty() ? dir.parent_path().filename().string() : dir.filename().string();
  }
  return o;
}

}  // namespace

Server::Server(ServerOptions options)
    : options_(resolved(std::move(options))),
      origin_policy_{is_loopback_bind(options_.http.host), options_.allowed_origins},
      http_(options_.http, [this](const HttpRequest& req, HttpExchange& ex) { handle(req, ex); }),
      scheduler_(
          std::make_unique<Scheduler>(options_.max_queue, options_.parallel, GenerationJob::decode_together)),
      started_at_(static_cast<int64_t>(std::time(nullptr))) {}

Server::~Server() {
  shutdown();
  if (loader_.joinable()) loader_.join();
}

Status Server::start() {
  RETURN_IF_ERROR(http_.listen());
  std::fprintf(stderr, "lily serve: listening on http://%s:%d/ (model loading)\n", options_.http.host.c_str(),
               http_.port());
  loader_ = std::thread([this] { load_model(); });
  return ok_status();
}

int Server::run() {
  http_.run();
  if (loader_.joinable()) loader_.join();
  scheduler_->stop(0);
  return state_.load() == State::failed ? 1 : 0;
}

void Server::shutdown() {
  std::call_once(shutdown_once_, [this] {
    shutting_down_.store(true);
    http_.shutdown();
    scheduler_->stop(options_.shutdown_grace_ms);
  });
}

namespace {

// A stage progress bar on stderr while the model loads (one line per stage when stderr is not a terminal).
class LoadProgress {
 public:
  explicit LoadProgress(int n_stages)
      : n_(n_stages), tty_(::isatty(2)), t0_(std::chrono::steady_clock::now()) {}
  void stage(const std::string& what) {
    ++done_;
    int filled = 20 * (done_ - 1) / n_;
    std::string bar =
        std::string(static_cast<size_t>(filled), '#') + std::string(static_cast<size_t>(20 - filled), '-');
    std::fprintf(stderr, "%s[%s] %d/%d %s (%.1f s)%s", tty_ ? "\r\033[K" : "", bar.c_str(), done_ - 1, n_,
                 what.c_str(), elapsed(), tty_ ? "" : "\n");
  }
  void finish(const std::string& what) {
    std::fprintf(stderr, "%s[%s] %d/%d %s (%.1f s)\n", tty_ ? "\r\033[K" : "", std::string(20, '#').c_str(),
                 n_, n_, what.c_str(), elapsed());
  }

 private:
  double elapsed() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  }
  int n_, done_ = 0;
  bool tty_;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace

void Server::load_model() {
  auto fail = [this](const Status& st) {
    load_error_ = st.message();
    state_.store(State::failed);
    std::fprintf(stderr, "\nlily serve: the model failed to load: %s\n", st.message().c_str());
    shutdown();
  };
  LoadProgress progress(5);
  ModelLoadOptions o;
  o.model_dir = options_.model_dir;
  o.backend = options_.backend;
  o.backend.max_context = options_.ctx_size;  // 0: the backend's default; kContextAuto: the largest that fits
  o.engine = options_.engine;
  o.mtp_from = options_.mtp_from;
  Result<LoadedModel> m = ::lily::load_model(o, [&](const std::string& what) { progress.stage(what); });
  if (!m.ok()) return fail(m.status());
  const int ctx = static_cast<int>(std::min<int64_t>(m->ctx_size, INT32_MAX));
  const std::string backend_name = m->backend_name;
  auto loaded = std::make_unique<Loaded>(Loaded{std::move(m->engine),
                                                m->tokenizer,
                                                m->defaults,
                                                ServedModel{options_.served_model_name, m->vocab_size, ctx},
                                                m->stop_token_ids,
                                                -1,
                                                "lily-" + backend_name});
  loaded->tool_call_token = loaded->tokenizer.token_id("<tool_call>");
  loaded_ = std::move(loaded);
  state_.store(State::ready);
  progress.finish(format("ready: %s on %s, context %d tokens", options_.served_model_name.c_str(),
                         backend_name.c_str(), ctx));
  std::fprintf(stderr, "lily serve: chat page at http://%s:%d/\n", options_.http.host.c_str(), http_.port());
}

void Server::send_error(HttpExchange& ex, const ApiError& e) {
  if (e.status == 499) return ex.abandon();  // the client has gone (parse_json_body noticed): nothing to send
  HttpHeaders headers;
  if (e.status == 401) headers.emplace_back("WWW-Authenticate", "Bearer");
  if (e.status == 429 || e.status == 503) headers.emplace_back("Retry-After", "1");
  ex.send_json(e.status, error_body(e), headers);
}

void Server::send_error(const HttpRequest& req, HttpExchange& ex, const ApiError& e) {
  if (!is_anthropic_path(req.path) || e.status == 499) return send_error(ex, e);
  HttpHeaders headers;
  if (e.status == 429 || e.status == 503) headers.emplace_back("Retry-After", "1");
  ex.send_json(e.status, anthropic_error_body(e), headers);
}

// `Authorization: Bearer KEY`, or `x-api-key: KEY` (what Anthropic's clients send).
bool Server::authorized(const HttpRequest& req, HttpExchange& ex) {
  if (options_.api_key.empty()) return true;
  std::string auth = req.header("authorization");
  std::string x_api_key = req.header("x-api-key");
  if (bearer_token_matches(auth, options_.api_key)) return true;
  if (!x_api_key.empty() && bearer_token_matches("Bearer " + x_api_key, options_.api_key)) return true;
  ApiError e{401, "invalid_request_error",
             auth.empty() && x_api_key.empty()
                 ? "Missing API key: send the header `Authorization: Bearer KEY` or `x-api-key: KEY`."
                 : "Incorrect API key provided.",
             "", "invalid_api_key"};
  send_error(req, ex, e);
  return false;
}

json Server::model_json() const {
  json m;
  m["id"] = options_.served_model_name;
  m["object"] = "model";
  m["created"] = started_at_;
  m["owned_by"] = "lily";
  if (state_.load() == State::ready) m["max_model_len"] = loaded_->served.ctx_size;
  m["max_tokens"] = options_.max_tokens > 0 ? json(options_.max_tokens) : json(nullptr);
  m["request_timeout"] =
      options_.request_timeout_ms > 0 ? json(options_.request_timeout_ms / 1000.0) : json(nullptr);
  return m;
}

LiveGauges Server::live_gauges() const {
  LiveGauges g;
  g.queue_depth = scheduler_->queue_depth();
  g.running = scheduler_->running();
  g.parallel = static_cast<size_t>(scheduler_->parallel());
  const SlotCounts slots = scheduler_->slots();
  g.slots_prefilling = slots.prefilling, g.slots_decoding = slots.decoding;
  g.dropped = scheduler_->dropped_count();
  g.model_ready = state_.load() == State::ready;
  if (g.model_ready) g.cache = loaded_->engine->stats();  // thread-safe by Engine's contract
  return g;
}

void Server::handle_health(HttpExchange& ex) {
  switch (state_.load()) {
    case State::ready:
      ex.send_json(200, dump_json(json{{"status", "ok"}, {"model", options_.served_model_name}}));
      return;
    case State::loading:
      ex.send_json(503, dump_json(json{{"status", "loading"}, {"model", options_.served_model_name}}));
      return;
    case State::failed:
      ex.send_json(503, dump_json(json{{"status", "error"}, {"message", load_error_}}));
      return;
  }
}

// As llama.cpp's server: what a client may ask of this server before it sends a request.
void Server::handle_props(HttpExchange& ex) {
  const bool ready = state_.load() == State::ready;
  json ctx = ready ? json(loaded_->served.ctx_size) : json(nullptr);
  json params{{"max_tokens", options_.max_tokens > 0 ? json(options_.max_tokens) : json(nullptr)}};
  if (ready) {
    const SamplingDefaults& d = loaded_->defaults;
    auto decimal = [](float x) { return std::round(double{x} * 1e6) / 1e6; };  // 0.95f, not 0.949999988
    params.update(json{{"temperature", decimal(d.temperature)},
                       {"top_k", d.top_k},
                       {"top_p", decimal(d.top_p)},
                       {"min_p", decimal(d.min_p)},
                       {"repetition_penalty", decimal(d.repetition_penalty)}});
  }
  const HttpServerOptions& h = options_.http;
  json limits{{"n_ctx", ctx},
              {"max_tokens", params["max_tokens"]},
              {"request_timeout", model_json()["request_timeout"]},
              {"max_queue", options_.max_queue},
              {"parallel", options_.parallel},
              {"max_body_bytes", h.max_body_bytes},
              {"max_connections", h.max_connections},
              {"max_connections_per_client", h.max_connections_per_client},
              {"idle_timeout", h.idle_timeout_ms / 1000.0}};
  json out{{"model", options_.served_model_name},
           {"model_path", options_.model_dir},
           {"ready", ready},
           {"n_ctx", ctx},
           {"parallel", options_.parallel},
           {"total_slots", options_.parallel},
           {"limits", limits},
           {"default_generation_settings", json{{"n_ctx", ctx}, {"params", params}}}};
  ex.send_json(200, dump_json(out));
}

void Server::handle_models(const HttpRequest& req, HttpExchange& ex) {
  if (req.path == "/v1/models") {
    ex.send_json(200, dump_json(json{{"object", "list"}, {"data", json::array({model_json()})}}));
    return;
  }
  std::string id = req.path.substr(std::string("/v1/models/").size());
  if (id != options_.served_model_name) {
    ApiError e =
        bad_request(format("The model `%s` does not exist.", id.c_str()), "model", "model_not_found");
    e.status = 404;
    return send_error(ex, e);
  }
  ex.send_json(200, dump_json(model_json()));
}

void Server::handle(const HttpRequest& req, HttpExchange& ex) {
  using Clock = std::chrono::steady_clock;
  const std::string& p = req.path;
  const auto t0 = Clock::now();
  struct Recorder {  // records the request however the handler returns
    std::function<void()> fn;
    ~Recorder() { fn(); }
  } recorder{[&] {
    metrics_.record_request(endpoint_label(p), ex.status());
    if (options_.log_requests && p != "/health" && p != "/metrics") {
      double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
      std::fprintf(stderr, "%s %s %d %.1f ms\n", req.method.c_str(), p.c_str(), ex.status(), ms);
    }
  }};
  // No exception leaves a request: whatever a handler throws is answered 500 (or ends its stream with an
  // error event) and logged, and the server goes on.
  try {
    route(req, ex);
  } catch (const std::exception& e) {
    answer_exception(req, ex, e.what());
  } catch (...) {
    answer_exception(req, ex, "an unknown exception");
  }
}

void Server::answer_exception(const HttpRequest& req, HttpExchange& ex, const char* what) {
  std::fprintf(stderr, "lily serve: internal error in %s %s: %s\n", req.method.c_str(), req.path.c_str(),
               what);
  ApiError e = server_error(500, std::string("Internal server error: ") + what, "internal_error");
  ex.close_after();
  if (!ex.responded()) return send_error(req, ex, e);
  if (ex.streaming()) {
    ex.write(sse_event(error_body(e)) + sse_done());
    ex.end_stream();
  }
}

void Server::route(const HttpRequest& req, HttpExchange& ex) {
  const std::string& p = req.path;
  const ChatPageAsset* page = find_chat_page_asset(p);
  const bool known = known_endpoint(p);
  const bool post = post_endpoint(p);
  if (auto e = check_origin(req, origin_policy_)) return send_error(req, ex, *e);
  for (auto& [name, value] : cors_headers(req, origin_policy_)) ex.add_header(name, value);
  if (!known) {
    return send_error(
        req, ex, ApiError{404, "invalid_request_error", "Unknown endpoint " + req.method + " " + p, "", "not_found"});
  }
  const char* allow = post ? "POST, OPTIONS" : "GET, HEAD, OPTIONS";
  if (req.method == "OPTIONS") return answer_options(req, origin_policy_, allow, ex);
  const std::string method = req.method == "HEAD" ? "GET" : req.method;  // HEAD: GET without the body
  if (method != (post ? "POST" : "GET")) {
    ex.add_header("Allow", allow);
    return send_error(req, ex,
                      ApiError{405, "invalid_request_error",
                               format("%s does not accept %s", p.c_str(), req.method.c_str()), "",
                               "method_not_allowed"});
  }
  if (page != nullptr) return ex.send(200, page->content_type, page->body, chat_page_headers());
  if (p == "/health") return handle_health(ex);
  if (p == "/metrics") {
    return ex.send(200, "text/plain; version=0.0.4; charset=utf-8", metrics_.render(live_gauges()));
  }
  if (!authorized(req, ex)) return;
  if (p.starts_with("/v1/models")) return handle_models(req, ex);
  if (p == "/props") return handle_props(ex);
  if (state_.load() != State::ready) {
    return send_error(
        req, ex, server_error(503,
                         state_.load() == State::loading ? "The model is still loading; retry shortly."
                                                         : "The model failed to load: " + load_error_,
                         "model_not_ready"));
  }
  if (shutting_down_.load())
    return send_error(req, ex, server_error(503, "The server is shutting down.", "shutting_down"));
  if (p == "/v1/chat/completions") return handle_chat(req, ex);
  if (p == "/v1/completions") return handle_completions(req, ex);
  if (p == "/v1/messages") return handle_messages(req, ex);
  if (p == "/v1/messages/count_tokens") return handle_count_tokens(req, ex);
  if (p == "/v1/responses") return handle_responses(req, ex);
  if (p == "/tokenize") return handle_tokenize(req, ex);
  if (p == "/detokenize") return handle_detokenize(req, ex);
  return handle_apply_template(req, ex);
}

}  // namespace lily
