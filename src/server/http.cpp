#include "server/http.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <system_error>
#include <thread>

#include "server/api_error.h"
#include "server/http_parse.h"

namespace lily {

namespace {

using Clock = std::chrono::steady_clock;
constexpr int kPollSliceMs = 100;  // how often a waiting connection looks at the stop flag
constexpr size_t kDrainLimitBytes = 64u << 20;
constexpr int kDrainMs = 2000;

int ms_until(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<long long>(left, 0, 1 << 30));
}

// Reads what is available into buf, waiting until `deadline`. 1: got bytes; 0: peer closed; -1: timeout,
// error or (when `idle`) the server is stopping.
int recv_some(int fd, std::string& buf, Clock::time_point deadline, bool idle,
              const std::atomic<bool>& stopping) {
  for (;;) {
    if (idle && stopping.load()) return -1;
    int wait = std::min(kPollSliceMs, ms_until(deadline));
    pollfd p{fd, POLLIN, 0};
    int r = ::poll(&p, 1, wait);
    if (r < 0 && errno != EINTR) return -1;
    if (r > 0) {
      char tmp[16384];
      ssize_t n = ::recv(fd, tmp, sizeof(tmp), 0);
      if (n > 0) {
        buf.append(tmp, static_cast<size_t>(n));
        return 1;
      }
      if (n == 0) return 0;
      if (errno != EINTR && errno != EAGAIN) return -1;
    }
    if (Clock::now() >= deadline) return -1;
  }
}

// Reads and discards what the client is still sending (up to a limit), so it sees our error response
// instead of a reset, then the caller closes.
void drain(int fd) {
  ::shutdown(fd, SHUT_WR);
  auto deadline = Clock::now() + std::chrono::milliseconds(kDrainMs);
  size_t drained = 0;
  std::atomic<bool> never{false};
  std::string sink;
  while (drained < kDrainLimitBytes) {
    sink.clear();
    if (recv_some(fd, sink, deadline, false, never) != 1) break;
    drained += sink.size();
  }
}

}  // namespace

std::string HttpRequest::header(std::string_view lower_name) const {
  for (const auto& [k, v] : headers) {
    if (k == lower_name) return v;
  }
  return "";
}

bool HttpRequest::has_header(std::string_view lower_name) const {
  for (const auto& [k, v] : headers) {
    if (k == lower_name) return true;
  }
  return false;
}

const char* http_status_text(int status) {
  switch (status) {
    case 100:
      return "100 Continue";
    case 200:
      return "200 OK";
    case 204:
      return "204 No Content";
    case 400:
      return "400 Bad Request";
    case 401:
      return "401 Unauthorized";
    case 403:
      return "403 Forbidden";
    case 404:
      return "404 Not Found";
    case 405:
      return "405 Method Not Allowed";
    case 408:
      return "408 Request Timeout";
    case 411:
      return "411 Length Required";
    case 413:
      return "413 Payload Too Large";
    case 415:
      return "415 Unsupported Media Type";
    case 429:
      return "429 Too Many Requests";
    case 501:
      return "501 Not Implemented";
    case 431:
      return "431 Request Header Fields Too Large";
    case 500:
      return "500 Internal Server Error";
    case 503:
      return "503 Service Unavailable";
    case 505:
      return "505 HTTP Version Not Supported";
    default:
      return status < 500 ? "400 Bad Request" : "500 Internal Server Error";
  }
}

bool HttpExchange::write_all(std::string_view data) {
  if (broken_) return false;
  auto deadline = Clock::now() + std::chrono::milliseconds(io_timeout_ms_);
  while (!data.empty()) {
    ssize_t n = ::send(fd_, data.data(), data.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      data.remove_prefix(static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      pollfd p{fd_, POLLOUT, 0};
      int wait = ms_until(deadline);
      if (wait == 0 || (::poll(&p, 1, wait) < 0 && errno != EINTR)) break;
      if (p.revents & (POLLERR | POLLHUP)) break;
      continue;
    }
    break;
  }
  if (!data.empty()) broken_ = true;
  return data.empty();
}

std::string HttpExchange::head(int status, std::string_view content_type, const HttpHeaders& headers,
                               bool chunked, size_t length) {
  std::string h = "HTTP/1.1 ";
  h += http_status_text(status);
  if (!content_type.empty()) h += "\r\nContent-Type: " + std::string(content_type);
  if (chunked) {
    h += "\r\nTransfer-Encoding: chunked";
  } else if (status != 204) {
    h += "\r\nContent-Length: " + std::to_string(length);
  }
  for (const auto& [k, v] : headers) h += "\r\n" + k + ": " + v;
  for (const auto& [k, v] : extra_headers_) h += "\r\n" + k + ": " + v;
  if (!keep_alive_) h += "\r\nConnection: close";
  h += "\r\n\r\n";
  return h;
}

void HttpExchange::send(int status, std::string_view content_type, std::string_view body,
                        const HttpHeaders& headers) {
  if (responded_) return;
  responded_ = true;
  status_ = status;
  std::string out = head(status, status == 204 ? "" : content_type, headers, false, body.size());
  if (!head_only_) out.append(body);  // HEAD: the headers GET would send, no body
  write_all(out);
}

void HttpExchange::send_json(int status, std::string_view json_body, const HttpHeaders& headers) {
  send(status, "application/json", json_body, headers);
}

bool HttpExchange::begin_stream(int status, std::string_view content_type, const HttpHeaders& headers) {
  if (responded_) return false;
  responded_ = streaming_ = true;
  status_ = status;
  return write_all(head(status, content_type, headers, true, 0));
}

bool HttpExchange::write(std::string_view data) {
  if (!streaming_ || data.empty()) return !broken_;
  char size_line[24];
  std::snprintf(size_line, sizeof(size_line), "%zx\r\n", data.size());
  std::string chunk = size_line;
  chunk.append(data).append("\r\n");
  return write_all(chunk);
}

void HttpExchange::end_stream() {
  if (!streaming_) return;
  streaming_ = false;
  write_all("0\r\n\r\n");
}

bool HttpExchange::client_gone() {
  if (broken_) return true;
  pollfd p{fd_, POLLIN | POLLRDHUP, 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) return broken_ = true;
  if (p.revents & POLLIN) {  // EOF reads as readable: peek to tell it from a pipelined request
    char c;
    ssize_t n = ::recv(fd_, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) return broken_ = true;
  }
  return false;
}

HttpServer::HttpServer(HttpServerOptions options, HttpHandler handler)
    : options_(std::move(options)),
      handler_(std::move(handler)),
      conns_(options_.max_connections, options_.max_connections_per_client) {}

HttpServer::~HttpServer() {
  if (listen_fd_ >= 0) ::close(listen_fd_);
}

Status HttpServer::listen() {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  std::string port = std::to_string(options_.port);
  if (int rc = ::getaddrinfo(options_.host.c_str(), port.c_str(), &hints, &res); rc != 0) {
    return invalid_argument("--host %s: %s", options_.host.c_str(), ::gai_strerror(rc));
  }
  Status st = io_error("cannot listen on %s:%d", options_.host.c_str(), options_.port);
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 256) == 0) {
      sockaddr_storage bound{};
      socklen_t len = sizeof(bound);
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
      port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                                : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
      listen_fd_ = fd;
      st = ok_status();
      break;
    }
    st = io_error("cannot listen on %s:%d: %s", options_.host.c_str(), options_.port, std::strerror(errno));
    ::close(fd);
  }
  ::freeaddrinfo(res);
  return st;
}

size_t HttpServer::connections() const {
  std::lock_guard lock(mu_);
  return conns_.size();
}

size_t HttpServer::evicted_connections() const {
  std::lock_guard lock(mu_);
  return conns_.evicted();
}

void HttpServer::set_idle(int fd, bool idle) {
  std::lock_guard lock(mu_);
  conns_.set_idle(fd, idle);
}

void HttpServer::shutdown() {
  stopping_.store(true);
}

namespace {

// The client's address without the port: connections are counted per address.
std::string peer_address(const sockaddr_storage& a) {
  char text[INET6_ADDRSTRLEN] = "?";
  if (a.ss_family == AF_INET6) {
    ::inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&a)->sin6_addr, text, sizeof(text));
  } else if (a.ss_family == AF_INET) {
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&a)->sin_addr, text, sizeof(text));
  }
  return text;
}

}  // namespace

void HttpServer::accept_one() {
  sockaddr_storage peer{};
  socklen_t peer_len = sizeof(peer);
  int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&peer), &peer_len, SOCK_CLOEXEC);
  if (fd < 0) return;
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  {
    std::lock_guard lock(mu_);
    if (!conns_.admit(fd, peer_address(peer))) {
      HttpExchange ex(fd, false, 1000);
      ex.send_json(503, error_body(server_error(503, "too many open connections", "too_many_connections")),
                   {{"Retry-After", "1"}});
      ::close(fd);
      return;
    }
  }
  auto serve = [this, fd] {
    try {
      serve_connection(fd);
    } catch (const std::exception& e) {  // the handler has its own catch-all; this is the thread's last stop
      std::fprintf(stderr, "lily serve: connection error: %s\n", e.what());
    } catch (...) {
      std::fprintf(stderr, "lily serve: connection error (unknown exception)\n");
    }
    std::lock_guard lock(mu_);
    conns_.remove(fd);
    ::close(fd);  // under the lock: run() never shuts down a number that was closed and reused
    cv_.notify_all();
  };
  try {
    std::thread(serve).detach();
  } catch (const std::system_error& e) {  // no thread to be had: refuse this one, keep serving the others
    std::fprintf(stderr, "lily serve: cannot start a connection thread: %s\n", e.what());
    std::lock_guard lock(mu_);
    conns_.remove(fd);
    ::close(fd);
  }
}

void HttpServer::run() {
  while (!stopping_.load()) {
    pollfd p{listen_fd_, POLLIN, 0};
    if (::poll(&p, 1, kPollSliceMs) > 0) accept_one();
  }
  ::close(listen_fd_);
  listen_fd_ = -1;
  // Busy connections finish their response; past the drain timeout their sockets are shut down, which ends
  // any read, write or poll in progress, so no connection thread outlives the server.
  std::unique_lock lock(mu_);
  if (!cv_.wait_for(lock, std::chrono::milliseconds(options_.drain_timeout_ms),
                    [&] { return conns_.empty(); })) {
    for (int fd : conns_.fds()) ::shutdown(fd, SHUT_RDWR);
    cv_.wait_for(lock, std::chrono::seconds(5), [&] { return conns_.empty(); });
  }
}

bool HttpServer::read_request(int fd, std::string& buf, HttpRequest& req, HttpExchange& ex) {
  auto fail = [&](int status, const std::string& message, bool drain_body) {
    ex.close_after();
    ex.send_json(status, error_body(ApiError{status, "invalid_request_error", message, "", ""}));
    if (drain_body) drain(fd);
    return false;
  };
  auto deadline = Clock::now() + std::chrono::milliseconds(options_.idle_timeout_ms);
  bool started = false;
  HeadEnd end;
  for (;;) {
    size_t blank = buf.find_first_not_of("\r\n");  // empty lines before a request line are ignored (RFC 9112)
    buf.erase(0, blank == std::string::npos ? buf.size() : blank);
    if ((end = find_head_end(buf)).found) break;
    if (buf.size() > options_.max_header_bytes) return fail(431, "request headers too large", false);
    if (!buf.empty() && !started) {
      started = true;
      deadline = std::min(deadline, Clock::now() + std::chrono::milliseconds(options_.header_timeout_ms));
    }
    if (recv_some(fd, buf, deadline, buf.empty(), stopping_) != 1) {
      if (started && Clock::now() >= deadline)
        return fail(408, "the request head did not arrive in time", false);
      return false;
    }
  }
  set_idle(fd, false);
  if (end.head_size > options_.max_header_bytes) return fail(431, "request headers too large", false);
  req.arrival = Clock::now();
  bool http11 = true;
  std::string err = parse_head(std::string_view(buf).substr(0, end.head_size), req, http11);
  if (!err.empty()) return fail(400, "bad HTTP request: " + err, false);
  std::string connection = ascii_lower(req.header("connection"));
  ex = HttpExchange(fd, http11 ? connection != "close" : connection == "keep-alive", options_.io_timeout_ms);
  if (req.method == "HEAD") ex.set_head_only();
  BodyFraming framing = body_framing(req, options_.max_body_bytes);
  if (framing.status != 0) return fail(framing.status, framing.error, framing.drain);
  buf.erase(0, end.body_start);
  return read_body(fd, buf, req, framing.chunked, framing.length, ex);
}

bool HttpServer::read_body(int fd, std::string& buf, HttpRequest& req, bool chunked, size_t length,
                           HttpExchange& ex) {
  if (ascii_lower(req.header("expect")) == "100-continue" && (chunked || buf.size() < length)) {
    if (::send(fd, "HTTP/1.1 100 Continue\r\n\r\n", 25, MSG_NOSIGNAL) != 25) return false;
  }
  auto body_deadline = Clock::now() + std::chrono::milliseconds(options_.io_timeout_ms);
  if (!chunked) {
    while (buf.size() < length) {
      if (recv_some(fd, buf, body_deadline, false, stopping_) != 1) return false;
    }
    req.body = buf.substr(0, length);
    buf.erase(0, length);
    return true;
  }
  ChunkedDecoder decoder(options_.max_body_bytes);
  for (;;) {
    switch (decoder.feed(buf, req.body)) {
      case ChunkedDecoder::State::done:
        return true;
      case ChunkedDecoder::State::too_large:
        ex.close_after();
        ex.send_json(413, error_body(bad_request(decoder.error())));
        drain(fd);
        return false;
      case ChunkedDecoder::State::malformed:
        ex.close_after();
        ex.send_json(400, error_body(bad_request("bad HTTP request: " + decoder.error())));
        return false;
      case ChunkedDecoder::State::more:
        break;
    }
    if (recv_some(fd, buf, body_deadline, false, stopping_) != 1) return false;
  }
}

void HttpServer::serve_connection(int fd) {
  std::string buf;
  while (!stopping_.load()) {
    HttpRequest req;
    HttpExchange ex(fd, false, options_.io_timeout_ms);
    if (!read_request(fd, buf, req, ex)) return;
    if (stopping_.load()) ex.close_after();
    try {
      handler_(req, ex);
    } catch (const std::exception& e) {
      // Handlers should catch their own (Server::handle does); nothing gets past this one.
      std::fprintf(stderr, "lily serve: internal error in %s %s: %s\n", req.method.c_str(), req.path.c_str(),
                   e.what());
      ex.close_after();
      if (!ex.responded())
        ex.send_json(500, error_body(server_error(500, std::string("Internal server error: ") + e.what(),
                                                  "internal_error")));
      return;
    }
    if (!ex.responded()) ex.send_json(500, error_body(server_error(500, "no response was produced")));
    if (!ex.keep_alive()) return;
    set_idle(fd, true);
  }
}

}  // namespace lily
