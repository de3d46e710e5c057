// lily bench --mode ttft (bench_ttft.h): a child `lily serve`, a minimal HTTP/1.1 client on a loopback socket
// (Content-Length requests; chunked or Content-Length responses), and the clock around one streamed request.
#include "cli/bench_ttft.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <sys/time.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <thread>
#include <vector>

namespace lily::cli {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

// One request on a fresh connection. `on_body` receives the de-chunked body bytes as they arrive and returns
// false to stop reading early.
class HttpCall {
 public:
  explicit HttpCall(int port) : port_(port) {}
  ~HttpCall() {
    if (fd_ >= 0) ::close(fd_);
  }
  HttpCall(const HttpCall&) = delete;
  HttpCall& operator=(const HttpCall&) = delete;

  Status send(const std::string& method, const std::string& path, const std::string& body) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd_ < 0) return io_error("socket: %s", std::strerror(errno));
    timeval tv{120, 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port_));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0)
      return io_error("connect to 127.0.0.1:%d: %s", port_, std::strerror(errno));
    std::string req = method + " " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n";
    if (!body.empty()) req += "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n";
    req += "\r\n" + body;
    for (std::string_view s = req; !s.empty();) {
      const ssize_t n = ::send(fd_, s.data(), s.size(), MSG_NOSIGNAL);
      if (n <= 0) return io_error("send: %s", std::strerror(errno));
      s.remove_prefix(static_cast<size_t>(n));
    }
    return ok_status();
  }

  // Reads the status line and headers, then the body through `on_body`; returns the HTTP status.
  template <typename F>
  Result<int> read(F&& on_body) {
    size_t end;
    while ((end = buf_.find("\r\n\r\n")) == std::string::npos)
      if (!fill()) return io_error("the server closed the connection before its headers");
    const std::string head = buf_.substr(0, end);
    buf_.erase(0, end + 4);
    int status = 0;
    if (std::sscanf(head.c_str(), "HTTP/1.%*d %d", &status) != 1) return format_error("bad status line");
    std::string lower = head;
    std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
    if (lower.find("transfer-encoding: chunked") == std::string::npos) {  // Content-Length or until close
      while (true) {
        if (!buf_.empty() && !on_body(std::string_view(buf_))) return status;
        buf_.clear();
        if (!fill()) return status;
      }
    }
    while (true) {  // chunked: hex size line, data, CRLF; a zero size ends the body
      size_t eol;
      while ((eol = buf_.find("\r\n")) == std::string::npos)
        if (!fill()) return status;
      const size_t size = std::strtoul(buf_.c_str(), nullptr, 16);
      if (size == 0) return status;
      while (buf_.size() < eol + 2 + size + 2)
        if (!fill()) return status;
      const bool more = on_body(std::string_view(buf_).substr(eol + 2, size));
      buf_.erase(0, eol + 2 + size + 2);
      if (!more) return status;
    }
  }

 private:
  bool fill() {
    char tmp[65536];
    const ssize_t n = ::recv(fd_, tmp, sizeof(tmp), 0);
    if (n <= 0) return false;
    buf_.append(tmp, static_cast<size_t>(n));
    return true;
  }
  int port_;
  int fd_ = -1;
  std::string buf_;
};

Result<std::pair<int, std::string>> request(int port, const std::string& method, const std::string& path,
                                            const std::string& body) {
  HttpCall call(port);
  RETURN_IF_ERROR(call.send(method, path, body));
  std::string all;
  ASSIGN_OR_RETURN(int status, call.read([&](std::string_view b) {
    all.append(b);
    return true;
  }));
  return std::make_pair(status, all);
}

// A user message of `words` distinct words; `tag` makes every prompt different from the start.
std::string prompt_text(int words, int tag) {
  static const char* kWords[] = {"river", "stone", "amber", "quiet", "lantern", "orbit", "meadow", "signal",
                                 "harbor", "velvet", "thunder", "pixel", "garden", "copper", "echo", "violet"};
  std::string s = "Request " + std::to_string(tag) + ":";
  for (int i = 0; i < words; ++i) s += std::string(" ") + kWords[(i * 7 + tag) % 16] + std::to_string(i % 97);
  return s;
}

std::string chat_body(const std::string& model, const std::string& text, int max_tokens, bool stream) {
  json b = {{"model", model}, {"messages", json::array({{{"role", "user"}, {"content", text}}})},
            {"max_tokens", max_tokens}, {"temperature", 0}, {"stream", stream}};
  return b.dump();
}

// Milliseconds from sending a streamed request to the first chunk with content or reasoning_content.
Result<double> time_first_token(int port, const std::string& model, const std::string& text) {
  HttpCall call(port);
  const auto t0 = Clock::now();
  RETURN_IF_ERROR(call.send("POST", "/v1/chat/completions", chat_body(model, text, 8, true)));
  double first = -1;
  std::string pending, error_body;
  ASSIGN_OR_RETURN(int status, call.read([&](std::string_view b) {
    pending.append(b);
    size_t eol;
    while ((eol = pending.find('\n')) != std::string::npos) {
      const std::string line = pending.substr(0, eol);
      pending.erase(0, eol + 1);
      if (line.rfind("data: {", 0) != 0) continue;
      const json ev = json::parse(line.substr(6), nullptr, false);
      if (ev.is_discarded() || !ev.contains("choices") || ev["choices"].empty()) continue;
      const json& d = ev["choices"][0].value("delta", json::object());
      auto has = [&](const char* k) { return d.contains(k) && d[k].is_string() && !d[k].get<std::string>().empty(); };
      if (has("content") || has("reasoning_content")) {
        first = ms_since(t0);
        return false;
      }
    }
    error_body.append(b.substr(0, std::min<size_t>(b.size(), 300)));
    return true;
  }));
  if (status != 200) return error(ErrorCode::internal, "the server answered %d: %s", status, error_body.c_str());
  if (first < 0) return error(ErrorCode::internal, "the stream ended without a content chunk");
  return first;
}

}  // namespace

Status run_ttft_bench(const TtftOptions& o, json& out) {
  if (o.model.empty()) return invalid_argument("--mode ttft needs --model DIR (a checkpoint with its tokenizer)");
  if (o.prompt_tokens < 16 || o.reps < 1) return invalid_argument("--prompt-tokens must be >= 16 and --reps >= 1");
  const std::string port = std::to_string(o.port), ctx = std::to_string(o.ctx_size),
                    threads = std::to_string(o.threads);
  const pid_t child = ::fork();
  if (child < 0) return io_error("fork: %s", std::strerror(errno));
  if (child == 0) {
    ::execl("/proc/self/exe", "lily", "serve", "--model", o.model.c_str(), "--port", port.c_str(), "--backend",
            o.backend.c_str(), "--ctx-size", ctx.c_str(), "--threads", threads.c_str(), "--quiet",
            "--cuda-options", o.cuda_options.c_str(), static_cast<char*>(nullptr));
    std::_Exit(127);
  }
  struct Reap {  // the server goes down with this function, however it returns
    pid_t pid;
    ~Reap() {
      if (pid <= 0) return;
      ::kill(pid, SIGTERM);
      int st;
      ::waitpid(pid, &st, 0);
    }
  } reap{child};

  const auto t_start = Clock::now();
  while (true) {  // up: /health 200 (503 while the model loads)
    int st;
    if (::waitpid(child, &st, WNOHANG) == child) {
      reap.pid = -1;  // nothing left to signal
      return error(ErrorCode::internal, "lily serve exited (code %d) before it was ready: see its messages above",
                   WIFEXITED(st) ? WEXITSTATUS(st) : -1);
    }
    auto r = request(o.port, "GET", "/health", "");
    if (r.ok() && r->first == 200) break;
    if (ms_since(t_start) > 900e3) return error(ErrorCode::internal, "lily serve not ready after 15 minutes");
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  std::fprintf(stderr, "server ready in %.1f s\n", ms_since(t_start) / 1e3);

  ASSIGN_OR_RETURN(auto models, request(o.port, "GET", "/v1/models", ""));
  const json mj = json::parse(models.second, nullptr, false);
  if (models.first != 200 || mj.is_discarded() || !mj.contains("data") || mj["data"].empty())
    return error(ErrorCode::internal, "GET /v1/models failed (%d): %.300s", models.first, models.second.c_str());
  const std::string served = mj["data"][0].value("id", "");

  // Calibrate the word count on the server's own prompt token count (chat template included).
  int words = o.prompt_tokens / 2, prompt_tokens = 0;
  for (int round = 0; round < 3; ++round) {
    ASSIGN_OR_RETURN(auto r, request(o.port, "POST", "/v1/chat/completions", chat_body(served, prompt_text(words, 0), 1, false)));
    const json j = json::parse(r.second, nullptr, false);
    if (r.first != 200 || j.is_discarded() || !j.contains("usage"))
      return error(ErrorCode::internal, "calibration request failed (%d): %.300s", r.first, r.second.c_str());
    prompt_tokens = j["usage"]["prompt_tokens"].get<int>();
    if (std::abs(prompt_tokens - o.prompt_tokens) <= o.prompt_tokens / 100 + 2) break;
    words = std::max(1, static_cast<int>(static_cast<double>(words) * o.prompt_tokens / prompt_tokens));
  }

  std::vector<double> ms;
  for (int i = 0; i <= o.reps; ++i) {  // request 0 warms up
    ASSIGN_OR_RETURN(double t, time_first_token(o.port, served, prompt_text(words, i + 1)));
    if (i > 0) ms.push_back(t);
  }
  std::vector<double> sorted = ms;
  std::sort(sorted.begin(), sorted.end());
  const size_t n = sorted.size();
  const double median = n % 2 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
  std::printf("time to first token through the server, ~%d-token prompt: median %.1f ms (min %.1f, max %.1f) over "
              "%d requests\n", prompt_tokens, median, sorted.front(), sorted.back(), o.reps);
  out = {{"prompt_tokens", prompt_tokens}, {"ttft_ms_median", median}, {"ttft_ms_min", sorted.front()},
         {"ttft_ms_max", sorted.back()}, {"ttft_ms", ms}, {"backend", o.backend}, {"model", o.model}};
  return ok_status();
}

}  // namespace lily::cli
