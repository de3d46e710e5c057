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
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
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

// The JSON events of an SSE stream as its bytes arrive: on_event(ev) for each `data: {...}` line, false to stop.
class SseEvents {
 public:
  template <class OnEvent>
  bool feed(std::string_view bytes, OnEvent&& on_event) {
    pending_.append(bytes);
    size_t eol;
    while ((eol = pending_.find('\n')) != std::string::npos) {
      const std::string line = pending_.substr(0, eol);
      pending_.erase(0, eol + 1);
      if (line.rfind("data: {", 0) != 0) continue;
      const json ev = json::parse(line.substr(6), nullptr, false);
      if (!ev.is_discarded() && !on_event(ev)) return false;
    }
    return true;
  }

 private:
  std::string pending_;
};

// Whether a chat completion chunk carries generated text (content or reasoning_content).
bool carries_text(const json& ev) {
  if (!ev.contains("choices") || ev["choices"].empty()) return false;
  const json& d = ev["choices"][0].value("delta", json::object());
  auto has = [&](const char* k) { return d.contains(k) && d[k].is_string() && !d[k].get<std::string>().empty(); };
  return has("content") || has("reasoning_content");
}

// Milliseconds from sending a streamed request to the first chunk with content or reasoning_content.
Result<double> time_first_token(int port, const std::string& model, const std::string& text) {
  HttpCall call(port);
  const auto t0 = Clock::now();
  RETURN_IF_ERROR(call.send("POST", "/v1/chat/completions", chat_body(model, text, 8, true)));
  double first = -1;
  std::string error_body;
  SseEvents events;
  ASSIGN_OR_RETURN(int status, call.read([&](std::string_view b) {
    error_body.append(b.substr(0, std::min<size_t>(b.size(), 300)));
    return events.feed(b, [&](const json& ev) {
      if (!carries_text(ev)) return true;
      first = ms_since(t0);
      return false;
    });
  }));
  if (status != 200) return error(ErrorCode::internal, "the server answered %d: %s", status, error_body.c_str());
  if (first < 0) return error(ErrorCode::internal, "the stream ended without a content chunk");
  return first;
}

// A streamed greedy answer of at most `tokens` tokens (no min_tokens: that keeps the stop tokens banned step by step,
// which only the host sampler does, so the request would not take the device decode loop that plain requests take):
// the client's decode rate between its first and last content chunk.
struct StreamedDecode {
  int tokens = 0;
  double first_ms = 0, last_ms = 0;
  double tok_per_s() const { return tokens > 1 && last_ms > first_ms ? (tokens - 1) / ((last_ms - first_ms) / 1e3) : 0; }
};

// `started`, when given, counts the streams that have had their first content chunk.
Result<StreamedDecode> time_streamed_decode(int port, const std::string& model, const std::string& text, int tokens,
                                            const json& extra, std::atomic<int>* started = nullptr) {
  json b = json::parse(chat_body(model, text, tokens, true));
  b.update(extra);
  b["stream_options"] = {{"include_usage", true}};
  HttpCall call(port);
  const auto t0 = Clock::now();
  RETURN_IF_ERROR(call.send("POST", "/v1/chat/completions", b.dump()));
  StreamedDecode d;
  std::string error_body;
  SseEvents events;
  ASSIGN_OR_RETURN(int status, call.read([&](std::string_view body) {
    error_body.append(body.substr(0, std::min<size_t>(body.size(), 300)));
    return events.feed(body, [&](const json& ev) {
      if (ev.contains("usage") && ev["usage"].is_object()) d.tokens = ev["usage"].value("completion_tokens", 0);
      if (carries_text(ev)) {
        d.last_ms = ms_since(t0);
        if (d.first_ms == 0 && started) started->fetch_add(1);
        if (d.first_ms == 0) d.first_ms = d.last_ms;
      }
      return true;
    });
  }));
  if (status != 200) return error(ErrorCode::internal, "the server answered %d: %s", status, error_body.c_str());
  if (d.tokens < 2 || d.tokens > tokens)
    return error(ErrorCode::internal, "the stream carried %d tokens (%d asked for; at least 2 are timed)", d.tokens,
                 tokens);
  return d;
}

// The server's own sums from GET /metrics: time to first token (arrival -> first generated token, queue
// included) and the engine's prefill time (prefill start -> first token), each summed over its requests, once
// the server has ended all `chat_requests` chat completions sent so far and is idle (the client stops reading at
// the first token, so a generation - and its prefill record - may end a little after; the server counts such a
// request as 499).
struct ServerSums {
  double ttft_s = 0, ttft_count = 0, prefill_s = 0;
};

Result<ServerSums> server_sums(int port, int chat_requests) {
  const auto t0 = std::chrono::steady_clock::now();
  while (true) {
    ASSIGN_OR_RETURN(auto r, request(port, "GET", "/metrics", ""));
    if (r.first != 200)
      return error(ErrorCode::internal, "GET /metrics answered %d: %.300s", r.first, r.second.c_str());
    ServerSums s;
    double finished = 0, busy = 0;
    std::istringstream in(r.second);
    std::string line;
    while (std::getline(in, line)) {
      const size_t sp = line.rfind(' ');
      if (sp == std::string::npos || line[0] == '#') continue;
      const std::string name = line.substr(0, sp);
      const double v = std::strtod(line.c_str() + sp + 1, nullptr);
      if (name == "lily_time_to_first_token_seconds_sum") s.ttft_s = v;
      if (name == "lily_time_to_first_token_seconds_count") s.ttft_count = v;
      if (name == "lily_prefill_seconds_total") s.prefill_s = v;
      if (name == "lily_requests_running" || name == "lily_queue_depth") busy += v;
      // Answered (200), or ended by the client leaving after its first token (499).
      if (name == "lily_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"}" ||
          name == "lily_requests_total{endpoint=\"/v1/chat/completions\",status=\"499\"}")
        finished += v;
    }
    if (finished >= chat_requests && busy == 0) return s;  // every generation done (and recorded: job.run)
    if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(30))
      return error(ErrorCode::internal, "the server finished %.0f of %d chat requests after 30 s", finished,
                   chat_requests);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace

Status run_ttft_bench(const TtftOptions& o, json& out) {
  if (o.model.empty()) return invalid_argument("--mode ttft needs --model DIR (a checkpoint with its tokenizer)");
  if (o.prompt_tokens < 16 || o.reps < 1) return invalid_argument("--prompt-tokens must be >= 16 and --reps >= 1");
  if ((!o.streams.empty() || o.busy_streams > 0) && o.decode_tokens < 2)
    return invalid_argument("--streams and --busy-streams need --decode-tokens >= 2");
  for (int n : o.streams) {
    if (n < 1 || n > 64) return invalid_argument("--streams: %d clients (1 to 64)", n);
  }
  json extra = json::object();  // --decode-field KEY=JSON: added to every decode request's body
  for (const std::string& f : o.decode_fields) {
    const size_t eq = f.find('=');
    const json v = eq == std::string::npos ? json() : json::parse(f.substr(eq + 1), nullptr, false);
    if (eq == std::string::npos || eq == 0 || v.is_discarded())
      return invalid_argument("--decode-field takes KEY=JSON (e.g. min_tokens=1), got `%s`", f.c_str());
    extra[f.substr(0, eq)] = v;
  }
  std::vector<std::string> args = {"lily", "serve", "--model", o.model, "--port", std::to_string(o.port),
                                   "--backend", o.backend, "--ctx-size", std::to_string(o.ctx_size),
                                   "--threads", std::to_string(o.threads), "--quiet", "--cuda-options", o.cuda_options};
  if (o.parallel > 0) args.insert(args.end(), {"--parallel", std::to_string(o.parallel)});
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t child = ::fork();
  if (child < 0) return io_error("fork: %s", std::strerror(errno));
  if (child == 0) {
    ::execv("/proc/self/exe", argv.data());
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
  int words = o.prompt_tokens / 2, prompt_tokens = 0, sent = 0;  // sent: chat requests so far
  for (int round = 0; round < 3; ++round) {
    ++sent;
    ASSIGN_OR_RETURN(auto r, request(o.port, "POST", "/v1/chat/completions", chat_body(served, prompt_text(words, 0), 1, false)));
    const json j = json::parse(r.second, nullptr, false);
    if (r.first != 200 || j.is_discarded() || !j.contains("usage"))
      return error(ErrorCode::internal, "calibration request failed (%d): %.300s", r.first, r.second.c_str());
    prompt_tokens = j["usage"]["prompt_tokens"].get<int>();
    if (std::abs(prompt_tokens - o.prompt_tokens) <= o.prompt_tokens / 100 + 2) break;
    words = std::max(1, static_cast<int>(static_cast<double>(words) * o.prompt_tokens / prompt_tokens));
  }

  std::vector<double> ms;
  ServerSums before;
  for (int i = 0; i <= o.reps; ++i) {  // request 0 warms up
    ASSIGN_OR_RETURN(double t, time_first_token(o.port, served, prompt_text(words, i + 1)));
    ++sent;
    if (i > 0) ms.push_back(t);
    if (i == 0) {  // the server's sums before the timed requests
      ASSIGN_OR_RETURN(before, server_sums(o.port, sent));
    }
  }
  ASSIGN_OR_RETURN(ServerSums after, server_sums(o.port, sent));
  const double n_timed = after.ttft_count - before.ttft_count;
  const double server_ms = n_timed > 0 ? 1e3 * (after.ttft_s - before.ttft_s) / n_timed : 0;
  const double engine_ms = n_timed > 0 ? 1e3 * (after.prefill_s - before.prefill_s) / n_timed : 0;
  std::vector<double> sorted = ms;
  std::sort(sorted.begin(), sorted.end());
  const size_t n = sorted.size();
  const double median = n % 2 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
  std::printf("time to first token through the server, ~%d-token prompt: median %.1f ms (min %.1f, max %.1f) over "
              "%d requests\n", prompt_tokens, median, sorted.front(), sorted.back(), o.reps);
  std::printf("  server side (its /metrics, mean of the same requests): arrival -> first token %.1f ms, of which "
              "the engine's prefill and first token %.1f ms\n", server_ms, engine_ms);
  out = {{"prompt_tokens", prompt_tokens}, {"ttft_ms_median", median}, {"ttft_ms_min", sorted.front()},
         {"ttft_ms_max", sorted.back()}, {"ttft_ms", ms}, {"server_ttft_ms_mean", server_ms},
         {"engine_prefill_ms_mean", engine_ms}, {"backend", o.backend}, {"model", o.model}};
  if (o.decode_tokens > 0) {
    ASSIGN_OR_RETURN(StreamedDecode d, time_streamed_decode(o.port, served, prompt_text(words, o.reps + 2), o.decode_tokens, extra));
    std::printf("decode through the server after the ~%d-token prompt: %d tokens streamed at %.1f tok/s (first "
                "content chunk at %.1f ms, last at %.1f ms)\n", prompt_tokens, d.tokens, d.tok_per_s(), d.first_ms,
                d.last_ms);
    out["decode_tokens"] = d.tokens;
    out["decode_tok_per_s"] = d.tok_per_s();
  }
  if (o.busy_streams > 0) {  // a new prompt's first token while that many streams decode
    std::atomic<int> started{0};
    std::vector<Result<StreamedDecode>> got(static_cast<size_t>(o.busy_streams), error(ErrorCode::internal, "not run"));
    std::vector<std::thread> clients;
    for (int i = 0; i < o.busy_streams; ++i) {
      clients.emplace_back([&, i] {
        got[static_cast<size_t>(i)] =
            time_streamed_decode(o.port, served, prompt_text(words, 500 + i), o.decode_tokens, extra, &started);
      });
    }
    const auto wait_from = Clock::now();
    while (started.load() < o.busy_streams && ms_since(wait_from) < 120e3)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    Result<double> t = time_first_token(o.port, served, prompt_text(words, 499));
    for (std::thread& c : clients) c.join();
    for (auto& r : got) {
      if (!r.ok()) return r.status();
      if (r->last_ms < r->first_ms + 1) return error(ErrorCode::internal, "a busy stream ended too soon to overlap");
    }
    if (!t.ok()) return t.status();
    std::printf("time to first token of a ~%d-token prompt while %d streams decode: %.1f ms\n", prompt_tokens,
                o.busy_streams, *t);
    out["busy_streams"] = o.busy_streams;
    out["ttft_ms_while_busy"] = *t;
  }
  for (int n : o.streams) {  // n clients at once, each its own prompt of the same length
    std::vector<Result<StreamedDecode>> got(static_cast<size_t>(n), error(ErrorCode::internal, "not run"));
    std::vector<std::thread> clients;
    for (int i = 0; i < n; ++i) {
      clients.emplace_back([&, i] {
        got[static_cast<size_t>(i)] =
            time_streamed_decode(o.port, served, prompt_text(words, 1000 * n + i), o.decode_tokens, extra);
      });
    }
    for (std::thread& t : clients) t.join();
    double sum_rate = 0, first = 1e300, last = 0, min_rate = 1e300;
    int tokens = 0;
    for (auto& r : got) {
      if (!r.ok()) return r.status();
      sum_rate += r->tok_per_s(), min_rate = std::min(min_rate, r->tok_per_s()), tokens += r->tokens;
      first = std::min(first, r->first_ms), last = std::max(last, r->last_ms);
    }
    const double span_rate = last > first ? (tokens - n) / ((last - first) / 1e3) : 0;
    std::printf("%2d concurrent streams of ~%d prompt tokens: %d tokens, per stream %.1f tok/s (slowest %.1f), "
                "aggregate %.1f tok/s (sum of the streams' rates; %.1f over the whole span)\n", n, prompt_tokens,
                tokens, sum_rate / n, min_rate, sum_rate, span_rate);
    out["streams"].push_back({{"streams", n}, {"tokens", tokens}, {"per_stream_tok_per_s", sum_rate / n},
                              {"slowest_tok_per_s", min_rate}, {"aggregate_tok_per_s", sum_rate},
                              {"span_tok_per_s", span_rate}});
  }
  return ok_status();
}

}  // namespace lily::cli
