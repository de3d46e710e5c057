// lily serve: the OpenAI-compatible HTTP server (src/server/README.md).
#include <pthread.h>

#include <csignal>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "cli/cli_common.h"
#include "cli/commands.h"
#include "engine/speculative.h"
#include "hub/hf_cache.h"
#include "server/server.h"
#include "util/byte_size.h"

namespace lily::cli {

namespace {

struct ServeArgs {
  std::string model, host = "127.0.0.1", api_key, backend = "auto", name, cuda_options;
  std::string ctx_size, speculative, mtp_from, cache_dir, cache_disk_budget;
  int port = 8080, threads = 0, max_tokens = 32768, parallel = 4;
  double grace_s = 10, request_timeout_s = 0;
  size_t max_queue = 64, max_body_mb = 16, cache_mb = 8192, max_per_client = 64;
  std::vector<std::string> allow_origins;
  bool quiet = false;
};

// SIGINT / SIGTERM are blocked in every thread and taken by one waiting thread, which asks the server to shut
// down; a second signal exits at once.
void handle_signals(Server& server, sigset_t signals) {
  int sig = 0;
  if (sigwait(&signals, &sig) != 0) return;
  std::fprintf(stderr, "\nlily serve: %s, shutting down (again to exit now)\n",
               sig == SIGINT ? "SIGINT" : "SIGTERM");
  std::thread([&server] { server.shutdown(); }).detach();
  if (sigwait(&signals, &sig) == 0) std::_Exit(130);
}

int run_serve(const ServeArgs& a) {
  ServerOptions o;
  Result<ModelLocation> where = resolve_model(a.model);
  if (!where.ok()) {
    std::fprintf(stderr, "lily serve: %s\n", where.status().message().c_str());
    return 2;
  }
  o.model_dir = where->path;
  o.served_model_name = a.name.empty() ? where->repo_id : a.name;  // empty: the directory's name
  o.api_key = a.api_key;
  Result<BackendKind> kind = parse_backend_kind(a.backend);
  if (!kind.ok()) {
    std::fprintf(stderr, "lily serve: %s\n", kind.status().message().c_str());
    return 2;
  }
  o.backend.kind = *kind, o.backend.n_threads = a.threads;
  o.backend.cuda_options = a.cuda_options;
  Result<int64_t> ctx = parse_ctx_size(a.ctx_size);
  if (!ctx.ok()) {
    std::fprintf(stderr, "lily serve: %s\n", ctx.status().message().c_str());
    return 2;
  }
  o.ctx_size = *ctx;
  Result<int> k = parse_speculative(a.speculative);
  if (!k.ok()) {
    std::fprintf(stderr, "lily serve: %s\n", k.status().message().c_str());
    return 2;
  }
  o.engine.speculative_tokens = *k;
  if (!a.mtp_from.empty()) {
    Result<ModelLocation> head = resolve_model(a.mtp_from);
    if (!head.ok()) {
      std::fprintf(stderr, "lily serve: --mtp-from: %s\n", head.status().message().c_str());
      return 2;
    }
    o.mtp_from = head->path;
  }
  o.max_queue = a.max_queue;
  o.parallel = a.parallel;
  o.shutdown_grace_ms = static_cast<int>(a.grace_s * 1000);
  o.max_tokens = a.max_tokens;
  o.request_timeout_ms = static_cast<int>(a.request_timeout_s * 1000);
  o.allowed_origins = a.allow_origins;
  o.http.max_connections_per_client = a.max_per_client;
  o.log_requests = !a.quiet;
  o.http.host = a.host;
  o.http.port = a.port;
  o.http.max_body_bytes = a.max_body_mb << 20;
  o.engine.session_cache_bytes = a.cache_mb << 20;
  o.engine.disk.dir = a.cache_dir;
  if (!a.cache_disk_budget.empty()) {
    Result<uint64_t> budget = parse_byte_size(a.cache_disk_budget);
    if (!budget.ok() || *budget == 0) {
      std::fprintf(stderr, "lily serve: --cache-disk-budget: %s\n",
                   budget.ok() ? "0 would hold no session; leave --cache-dir out instead"
                               : budget.status().message().c_str());
      return 2;
    }
    if (a.cache_dir.empty()) {
      std::fprintf(stderr, "lily serve: --cache-disk-budget needs --cache-dir\n");
      return 2;
    }
    o.engine.disk.budget_bytes = *budget;
  }

  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);  // before any thread starts: all inherit it
  std::signal(SIGPIPE, SIG_IGN);

  Server server(o);
  if (Status st = server.start(); !st.ok()) {
    std::fprintf(stderr, "lily serve: %s\n", st.message().c_str());
    return 1;
  }
  std::thread(handle_signals, std::ref(server), signals).detach();
  int rc = server.run();
  std::fprintf(stderr, "lily serve: stopped\n");
  return rc;
}

void setup(CLI::App& app) {
  auto* cmd = app.add_subcommand("serve", "Serve the OpenAI-compatible API and the chat page");
  auto a = std::make_shared<ServeArgs>();
  cmd->add_option("--model", a->model, kModelHelp)->required();
  cmd->add_option("--host", a->host,
                  "address to listen on (default 127.0.0.1: this machine only; on loopback, requests "
                  "whose Host header is not a loopback name get 403)");
  cmd->add_option("--port", a->port, "TCP port (0: any free port)")->check(CLI::Range(0, 65535));
  cmd->add_option("--api-key", a->api_key, "require `Authorization: Bearer KEY` on the API");
  cmd->add_option("--backend", a->backend, "auto | cpu | cuda");
  cmd->add_option("--threads", a->threads, "CPU backend threads (0: all)")->check(CLI::Range(0, 1024));
  cmd->add_option("--ctx-size", a->ctx_size, kCtxSizeHelp);
  cmd->add_option("--cuda-options", a->cuda_options, kCudaOptionsHelp);
  cmd->add_option("--parallel", a->parallel,
                  "requests generated at once (slots, 1 to 16; default 4); more wait in the queue")
      ->check(CLI::Range(1, Scheduler::kMaxParallel));
  cmd->add_option("--speculative", a->speculative, kSpeculativeHelp);
  cmd->add_option("--mtp-from", a->mtp_from, kMtpFromHelp);
  cmd->add_option("--max-queue", a->max_queue, "requests that may wait for a slot (then 429)")
      ->check(CLI::Range(1, 100000));
  cmd->add_option("--max-body-mb", a->max_body_mb, "largest request body in MiB (then 413)")
      ->check(CLI::Range(1, 1024));
  cmd->add_option("--session-cache-mb", a->cache_mb, "memory budget of the session cache in MiB");
  cmd->add_option("--cache-dir", a->cache_dir,
                  "also keep sessions in this directory (created if missing), written in the background, so "
                  "that a conversation resumes without prefilling after a restart");
  cmd->add_option("--cache-disk-budget", a->cache_disk_budget,
                  "most bytes the --cache-dir files may take, e.g. 20G or 512M (default: 16G, at most half "
                  "the free space there); the least recently used go first");
  cmd->add_option("--served-model-name", a->name, "model id in the API (default: ORG/NAME, or the directory's name)");
  cmd->add_option("--shutdown-grace", a->grace_s, "seconds in-flight work may take to finish on SIGTERM")
      ->check(CLI::Range(0.0, 3600.0));
  cmd->add_option("--max-tokens", a->max_tokens,
                  "completion tokens of a request that sets no max_tokens, and the most any request "
                  "gets (larger asks are clamped; finish_reason length); 0: up to the context (default "
                  "32768)")
      ->check(CLI::Range(0, 1 << 30));
  cmd->add_option("--request-timeout", a->request_timeout_s,
                  "seconds a generation may run (prefill and decode, queue wait excluded); then it ends "
                  "with what it has and finish_reason length; 0: no limit")
      ->check(CLI::Range(0.0, 1e6));
  cmd->add_option("--allow-origin", a->allow_origins,
                  "a browser origin (e.g. http://localhost:3000) allowed to call the API besides the "
                  "server's own page; repeat or comma-separate; * allows any. Others get 403, no CORS")
      ->delimiter(',');
  cmd->add_option("--max-connections-per-client", a->max_per_client,
                  "open connections from one address (default 64; past it the oldest idle one is "
                  "closed, else 503)")
      ->check(CLI::Range(1, 100000));
  cmd->add_flag("--quiet", a->quiet, "no per-request log lines");
  cmd->callback([a] { set_exit_code(run_serve(*a)); });
}

}  // namespace

LILY_COMMAND(setup);

}  // namespace lily::cli
