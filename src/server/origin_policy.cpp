#include "server/origin_policy.h"

#include <arpa/inet.h>

#include <algorithm>
#include <cctype>

namespace lily {

namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return std::tolower(c); });
  return out;
}

bool is_loopback_ipv4(const std::string& s) {
  in_addr a{};
  return ::inet_pton(AF_INET, s.c_str(), &a) == 1 && (ntohl(a.s_addr) >> 24) == 127;
}

// "name" of "name:port", "[v6]" of "[v6]:port"; empty when the port is not digits.
std::string strip_port(std::string_view host) {
  size_t colon = host.rfind(':');
  bool bracketed = !host.empty() && host.front() == '[';
  if (colon == std::string_view::npos || (bracketed && colon < host.rfind(']'))) return std::string(host);
  std::string_view port = host.substr(colon + 1);
  if (port.empty() || !std::all_of(port.begin(), port.end(), ::isdigit)) return "";
  return std::string(host.substr(0, colon));
}

bool origin_listed(const std::string& origin, const OriginPolicy& policy) {
  for (std::string_view o : policy.allowed_origins) {
    if (o.ends_with('/')) o.remove_suffix(1);  // `http://localhost:3000/` as written; browsers send no slash
    if (o == "*" || lower(o) == origin) return true;
  }
  return false;
}

// The origin of the page the server itself serves: the scheme and the Host the browser used.
bool same_origin(const std::string& origin, const HttpRequest& req) {
  std::string host = lower(req.header("host"));
  return !host.empty() && (origin == "http://" + host || origin == "https://" + host);
}

ApiError forbidden(std::string message, std::string code) {
  return ApiError{403, "invalid_request_error", std::move(message), "", std::move(code)};
}

}  // namespace

bool is_loopback_bind(std::string_view host) {
  std::string h = lower(host);
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  return h == "localhost" || h == "::1" || is_loopback_ipv4(h);
}

bool is_loopback_host_header(std::string_view value) {
  std::string h = strip_port(lower(value));
  if (h.empty()) return false;
  if (h == "[::1]") return true;
  return h == "localhost" || h.ends_with(".localhost") || is_loopback_ipv4(h);
}

std::optional<ApiError> check_origin(const HttpRequest& req, const OriginPolicy& policy) {
  std::string host = req.header("host");
  if (policy.check_host && !host.empty() && !is_loopback_host_header(host)) {
    return forbidden("The Host header `" + host +
                         "` does not name this machine's loopback; the server listens on loopback only and "
                         "refuses other names (DNS rebinding).",
                     "host_not_allowed");
  }
  if (!req.has_header("origin")) return std::nullopt;
  std::string origin = lower(req.header("origin"));
  if (same_origin(origin, req) || origin_listed(origin, policy)) return std::nullopt;
  return forbidden("Cross-origin requests from `" + req.header("origin") +
                       "` are not allowed; start the server with --allow-origin " + req.header("origin") +
                       " to allow them.",
                   "origin_not_allowed");
}

HttpHeaders cors_headers(const HttpRequest& req, const OriginPolicy& policy) {
  if (!req.has_header("origin")) return {};
  std::string origin = lower(req.header("origin"));
  if (same_origin(origin, req) || !origin_listed(origin, policy)) return {};
  return {{"Access-Control-Allow-Origin", req.header("origin")}, {"Vary", "Origin"}};
}

void answer_options(const HttpRequest& req, const OriginPolicy& policy, std::string_view allow,
                    HttpExchange& ex) {
  HttpHeaders h{{"Allow", std::string(allow)}};
  if (req.has_header("origin") && req.has_header("access-control-request-method")) {
    for (auto& kv : cors_headers(req, policy)) h.push_back(std::move(kv));
    h.emplace_back("Access-Control-Allow-Methods", std::string(allow));
    std::string asked = req.header("access-control-request-headers");
    h.emplace_back("Access-Control-Allow-Headers", asked.empty() ? "Authorization, Content-Type" : asked);
    h.emplace_back("Access-Control-Max-Age", "600");
  }
  ex.send(204, "text/plain", "", h);
}

}  // namespace lily
