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
#include <cstring>
#include <set>
#include <thread>

#include "server/api_error.h"

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

std::string to_lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

std::string trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return std::string(s);
}

bool percent_decode(std::string_view in, std::string& out) {
  out.clear();
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i] != '%') {
      out += in[i];
      continue;
    }
    if (i + 2 >= in.size() || !std::isxdigit(static_cast<unsigned char>(in[i + 1])) ||
        !std::isxdigit(static_cast<unsigned char>(in[i + 2]))) {
      return false;
    }
    out += static_cast<char>(std::stoi(std::string(in.substr(i + 1, 2)), nullptr, 16));
    i += 2;
  }
  return true;
}

// Parses the request line and headers (text before the blank line). Returns an error message or "".
std::string parse_head(std::string_view head, HttpRequest& req, bool& http11) {
  size_t eol = head.find('\n');
  std::string line = trim(head.substr(0, eol));
  size_t sp1 = line.find(' '), sp2 = line.rfind(' ');
  if (sp1 == std::string::npos || sp2 == sp1) return "malformed request line";
  req.method = line.substr(0, sp1);
  std::string target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  std::string version = line.substr(sp2 + 1);
  if (version != "HTTP/1.1" && version != "HTTP/1.0") return "unsupported HTTP version `" + version + "`";
  http11 = version == "HTTP/1.1";
  if (target.starts_with("http://") || target.starts_with("https://")) {  // absolute form
    size_t slash = target.find('/', target.find("//") + 2);
    target = slash == std::string::npos ? "/" : target.substr(slash);
  }
  if (target.empty() || target[0] != '/') return "malformed request target";
  size_t q = target.find('?');
  if (q != std::string::npos) req.query = target.substr(q + 1);
  if (!percent_decode(std::string_view(target).substr(0, q), req.path)) return "malformed percent-encoding";
  while (eol != std::string_view::npos && eol + 1 < head.size()) {
    size_t next = head.find('\n', eol + 1);
    std::string_view h =
        head.substr(eol + 1, next == std::string_view::npos ? std::string_view::npos : next - eol - 1);
    eol = next;
    if (trim(h).empty()) continue;
    if (h.front() == ' ' || h.front() == '\t') return "obsolete header line folding";
    size_t colon = h.find(':');
    if (colon == std::string_view::npos || colon == 0) return "malformed header line";
    req.headers.emplace_back(to_lower(std::string(h.substr(0, colon))), trim(h.substr(colon + 1)));
  }
  return "";
}

bool parse_length(const std::string& s, size_t& out) {
  if (s.empty() || s.size() > 18 || !std::all_of(s.begin(), s.end(), ::isdigit)) return false;
  out = std::stoull(s);
  return true;
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
  h += "\r\nContent-Type: ";
  h += content_type;
  h += chunked ? "\r\nTransfer-Encoding: chunked" : "\r\nContent-Length: " + std::to_string(length);
  for (const auto& [k, v] : headers) h += "\r\n" + k + ": " + v;
  if (!keep_alive_) h += "\r\nConnection: close";
  h += "\r\n\r\n";
  return h;
}

void HttpExchange::send(int status, std::string_view content_type, std::string_view body,
                        const HttpHeaders& headers) {
  if (responded_) return;
  responded_ = true;
  status_ = status;
  std::string out = head(status, content_type, headers, false, body.size());
  out.append(body);
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
    : options_(std::move(options)), handler_(std::move(handler)) {}

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
  return open_fds_.size();
}

void HttpServer::shutdown() {
  stopping_.store(true);
}

void HttpServer::run() {
  while (!stopping_.load()) {
    pollfd p{listen_fd_, POLLIN, 0};
    if (::poll(&p, 1, kPollSliceMs) <= 0) continue;
    int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    {
      std::lock_guard lock(mu_);
      if (open_fds_.size() >= options_.max_connections) {
        HttpExchange ex(fd, false, 1000);
        ex.send_json(503, error_body(server_error(503, "too many open connections", "too_many_connections")));
        ::close(fd);
        continue;
      }
      open_fds_.insert(fd);
    }
    std::thread([this, fd] {
      serve_connection(fd);
      std::lock_guard lock(mu_);
      open_fds_.erase(fd);
      ::close(fd);  // under the lock: run() never shuts down a number that was closed and reused
      cv_.notify_all();
    }).detach();
  }
  ::close(listen_fd_);
  listen_fd_ = -1;
  // Busy connections finish their response; past the drain timeout their sockets are shut down, which ends
  // any read, write or poll in progress, so no connection thread outlives the server.
  std::unique_lock lock(mu_);
  if (!cv_.wait_for(lock, std::chrono::milliseconds(options_.drain_timeout_ms),
                    [&] { return open_fds_.empty(); })) {
    for (int fd : open_fds_) ::shutdown(fd, SHUT_RDWR);
    cv_.wait_for(lock, std::chrono::seconds(5), [&] { return open_fds_.empty(); });
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
  size_t head_end;
  while ((head_end = buf.find("\r\n\r\n")) == std::string::npos) {
    if (buf.size() > options_.max_header_bytes) return fail(431, "request headers too large", false);
    bool idle = buf.empty();
    if (!idle)
      deadline = std::min(deadline, Clock::now() + std::chrono::milliseconds(options_.io_timeout_ms));
    if (recv_some(fd, buf, deadline, idle, stopping_) != 1) return false;
  }
  if (head_end > options_.max_header_bytes) return fail(431, "request headers too large", false);
  req.arrival = Clock::now();
  bool http11 = true;
  std::string err = parse_head(std::string_view(buf).substr(0, head_end + 2), req, http11);
  if (!err.empty()) return fail(400, "bad HTTP request: " + err, false);
  std::string connection = to_lower(req.header("connection"));
  ex = HttpExchange(fd, http11 ? connection != "close" : connection == "keep-alive", options_.io_timeout_ms);
  if (!req.header("transfer-encoding").empty()) {
    return fail(411, "chunked request bodies are not supported; send Content-Length", true);
  }
  size_t length = 0;
  std::string cl = req.header("content-length");
  if (!cl.empty() && !parse_length(cl, length)) return fail(400, "bad Content-Length `" + cl + "`", false);
  if (length > options_.max_body_bytes) {
    return fail(
        413,
        format("request body of %zu bytes exceeds the limit of %zu bytes", length, options_.max_body_bytes),
        true);
  }
  buf.erase(0, head_end + 4);
  if (to_lower(req.header("expect")) == "100-continue" && buf.size() < length) {
    if (::send(fd, "HTTP/1.1 100 Continue\r\n\r\n", 25, MSG_NOSIGNAL) != 25) return false;
  }
  auto body_deadline = Clock::now() + std::chrono::milliseconds(options_.io_timeout_ms);
  while (buf.size() < length) {
    if (recv_some(fd, buf, body_deadline, false, stopping_) != 1) return false;
  }
  req.body = buf.substr(0, length);
  buf.erase(0, length);
  return true;
}

void HttpServer::serve_connection(int fd) {
  std::string buf;
  while (!stopping_.load()) {
    HttpRequest req;
    HttpExchange ex(fd, false, options_.io_timeout_ms);
    if (!read_request(fd, buf, req, ex)) return;
    if (stopping_.load()) ex.close_after();
    handler_(req, ex);
    if (!ex.responded()) ex.send_json(500, error_body(server_error(500, "no response was produced")));
    if (!ex.keep_alive()) return;
  }
}

}  // namespace lily
