// A small HTTP/1.1 server on POSIX sockets: what the OpenAI API needs and no more. One thread per connection,
// keep-alive, Content-Length or chunked request bodies (with `Expect: 100-continue`; parsing in
// http_parse.h), HEAD, fixed-length or chunked responses (SSE), and a non-blocking check that the client is
// still there, so a generation can stop within one token of a disconnect. Limits (header and body size,
// connection count, timeouts) answer with OpenAI error JSON.
//
// Why not cpp-httplib: Debian 12's libcpp-httplib-dev is the split (compiled) build, whose declarations
// depend on the OpenSSL/zlib/brotli defines it was built with and which needs -lcpp-httplib at link time;
// lily_server does not link it, and the GPU machine has no Debian libraries at all. Sockets need nothing.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "server/connection_table.h"
#include "util/status.h"

namespace lily {

using HttpHeaders = std::vector<std::pair<std::string, std::string>>;

struct HttpRequest {
  std::string method, path, query;  // path percent-decoded; query as sent (no '?')
  HttpHeaders headers;              // names lower-cased
  std::string body;
  std::chrono::steady_clock::time_point arrival;          // when the request head was complete
  std::string header(std::string_view lower_name) const;  // "" when absent
  bool has_header(std::string_view lower_name) const;
};

// One request's answer: send() once, or begin_stream(), write()..., end_stream().
class HttpExchange {
 public:
  HttpExchange(int fd, bool keep_alive, int io_timeout_ms)
      : fd_(fd), keep_alive_(keep_alive), io_timeout_ms_(io_timeout_ms) {}
  void send(int status, std::string_view content_type, std::string_view body,
            const HttpHeaders& headers = {});
  // OpenAI error JSON with its status.
  void send_json(int status, std::string_view json_body, const HttpHeaders& headers = {});
  bool begin_stream(int status, std::string_view content_type, const HttpHeaders& headers = {});
  bool write(std::string_view data);  // one chunk; false once the client is gone
  void end_stream();
  // Non-blocking: true when the peer has closed or reset the connection.
  bool client_gone();
  // client_gone() as a callback, for work that checks now and then (parse_json_body, prepare_chat).
  std::function<bool()> client_gone_fn() {
    return [this] { return client_gone(); };
  }

  // Headers every response of this exchange carries (CORS), added before it is sent.
  void add_header(std::string name, std::string value) {
    extra_headers_.emplace_back(std::move(name), std::move(value));
  }
  // HEAD: responses carry the headers GET would (Content-Length included) and no body.
  void set_head_only() { head_only_ = true; }
  bool streaming() const { return streaming_; }

  bool responded() const { return responded_; }
  int status() const { return status_; }  // of the response sent (0: none yet)
  bool keep_alive() const { return keep_alive_ && !broken_; }
  void close_after() { keep_alive_ = false; }
  // The client left before the response was complete: nothing more is sent, the connection closes, and the
  // request is recorded as status 499 (as nginx does), even when a streamed 200 had begun.
  void abandon() {
    responded_ = broken_ = true;
    status_ = 499;
  }

 private:
  bool write_all(std::string_view data);
  std::string head(int status, std::string_view content_type, const HttpHeaders& headers, bool chunked,
                   size_t length);

  int fd_;
  bool keep_alive_;
  int io_timeout_ms_;
  int status_ = 0;
  bool responded_ = false, streaming_ = false, broken_ = false, head_only_ = false;
  HttpHeaders extra_headers_;
};

struct HttpServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;  // 0: any free port (see HttpServer::port())
  size_t max_body_bytes = 16u << 20;
  size_t max_header_bytes = 64u << 10;
  size_t max_connections = 512;
  size_t max_connections_per_client = 64;  // from one address; past either cap an idle connection is evicted
  // A keep-alive connection with no request. The OpenAI SDKs (httpx) drop pooled connections after 5 s idle,
  // so 10 s keeps their reuse while an idle flood frees its slots quickly.
  int idle_timeout_ms = 10000;
  int header_timeout_ms = 10000;  // from the first byte of a request to the end of its head
  int io_timeout_ms = 30000;      // a request body or response that stalls
  int drain_timeout_ms = 15000;  // after shutdown(): how long busy connections may take to finish
};

using HttpHandler = std::function<void(const HttpRequest&, HttpExchange&)>;

class HttpServer {
 public:
  HttpServer(HttpServerOptions options, HttpHandler handler);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  Status listen();  // binds and listens; an error names the address
  int port() const { return port_; }
  void run();  // accepts until shutdown(); returns when every connection has closed (or 10 s passed)
  // Stops accepting; idle keep-alive connections close, busy ones after their current response. Thread-safe
  // and signal-thread-safe (no allocation before the flag is set).
  void shutdown();
  size_t connections() const;
  size_t evicted_connections() const;  // idle connections closed to make room (ConnectionTable)

 private:
  void serve_connection(int fd);
  bool read_request(int fd, std::string& buf, HttpRequest& req, HttpExchange& ex);
  bool read_body(int fd, std::string& buf, HttpRequest& req, bool chunked, size_t length, HttpExchange& ex);
  void accept_one();
  void set_idle(int fd, bool idle);

  HttpServerOptions options_;
  HttpHandler handler_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  mutable std::mutex mu_;
  std::condition_variable cv_;
  ConnectionTable conns_;  // connections being served
};

// "200 OK", "413 Payload Too Large", ...
const char* http_status_text(int status);

}  // namespace lily
