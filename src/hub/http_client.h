// A small HTTPS client over libcurl for the hub: one request at a time, response headers of the final response
// (lowercased names), the body either kept in memory or streamed to a callback. Transport failures (refused,
// reset, timeout, a body cut short) are io errors that name the URL; HTTP statuses are returned as they are.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "util/status.h"

namespace lily {

struct HttpRequest {
  std::string method = "GET";  // GET or HEAD
  std::string url;
  std::vector<std::string> headers;  // "Name: value"
  bool follow_redirects = true;
  // Streams the body of a 2xx response (with its status); returning false aborts the transfer. Unset: the
  // body is kept in HttpResponse::body (non-2xx bodies are always kept, for the error message).
  std::function<bool(long status, const char* data, size_t n_bytes)> on_body;
  long connect_timeout_s = 30;
  long low_speed_timeout_s = 60;  // abort when under 1 byte/s for this long (a stalled connection)
};

struct HttpResponse {
  long status = 0;
  std::map<std::string, std::string> headers;  // of the last response (after redirects); names lowercased
  std::string body;
  std::string effective_url;
  std::string header(const std::string& lowercase_name) const;
};

Result<HttpResponse> http_request(const HttpRequest& request);

}  // namespace lily
