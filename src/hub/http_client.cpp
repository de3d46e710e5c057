#include "hub/http_client.h"

#include <curl/curl.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <memory>
#include <mutex>

namespace lily {

namespace {

struct Transfer {
  const HttpRequest* request = nullptr;
  HttpResponse* response = nullptr;
  bool aborted_by_sink = false;
};

std::string trim(std::string s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  size_t i = 0;
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  return s.substr(i);
}

// Each response of a redirect chain starts with its status line: the headers kept are the last response's.
size_t on_header(char* data, size_t size, size_t n, void* user) {
  auto* t = static_cast<Transfer*>(user);
  const std::string line(data, size * n);
  if (line.rfind("HTTP/", 0) == 0) {  // "HTTP/1.1 206 Partial Content": the body callback routes on it
    t->response->headers.clear();
    const size_t sp = line.find(' ');
    t->response->status = sp == std::string::npos ? 0 : std::strtol(line.c_str() + sp + 1, nullptr, 10);
  } else if (const size_t colon = line.find(':'); colon != std::string::npos) {
    std::string name = line.substr(0, colon);
    std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
    t->response->headers[name] = trim(line.substr(colon + 1));
  }
  return size * n;
}

size_t on_write(char* data, size_t size, size_t n, void* user) {
  auto* t = static_cast<Transfer*>(user);
  const size_t bytes = size * n;
  const bool success = t->response->status / 100 == 2;
  if (success && t->request->on_body) {
    if (!t->request->on_body(t->response->status, data, bytes)) {
      t->aborted_by_sink = true;
      return 0;  // curl stops with CURLE_WRITE_ERROR
    }
    return bytes;
  }
  if (t->response->body.size() < (64u << 20)) t->response->body.append(data, bytes);
  return bytes;
}

void global_init() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

}  // namespace

std::string HttpResponse::header(const std::string& lowercase_name) const {
  auto it = headers.find(lowercase_name);
  return it == headers.end() ? "" : it->second;
}

Result<HttpResponse> http_request(const HttpRequest& request) {
  global_init();
  std::unique_ptr<CURL, void (*)(CURL*)> curl(curl_easy_init(), curl_easy_cleanup);
  if (!curl) return io_error("libcurl could not start a request");
  HttpResponse response;
  Transfer t{&request, &response};
  std::unique_ptr<curl_slist, void (*)(curl_slist*)> headers(nullptr, curl_slist_free_all);
  for (const std::string& h : request.headers) headers.reset(curl_slist_append(headers.release(), h.c_str()));
  CURL* c = curl.get();
  char curl_error[CURL_ERROR_SIZE] = "";
  curl_easy_setopt(c, CURLOPT_URL, request.url.c_str());
  curl_easy_setopt(c, CURLOPT_ERRORBUFFER, curl_error);
  curl_easy_setopt(c, CURLOPT_HTTPHEADER, headers.get());
  curl_easy_setopt(c, CURLOPT_USERAGENT, "lily/1 (huggingface_hub-compatible)");
  if (request.method == "HEAD") curl_easy_setopt(c, CURLOPT_NOBODY, 1L);
  curl_easy_setopt(c, CURLOPT_FOLLOWLOCATION, request.follow_redirects ? 1L : 0L);
  curl_easy_setopt(c, CURLOPT_MAXREDIRS, 10L);
  curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT, request.connect_timeout_s);
  curl_easy_setopt(c, CURLOPT_LOW_SPEED_LIMIT, 1L);
  curl_easy_setopt(c, CURLOPT_LOW_SPEED_TIME, request.low_speed_timeout_s);
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, on_header);
  curl_easy_setopt(c, CURLOPT_HEADERDATA, &t);
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_write);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, &t);
  const CURLcode rc = curl_easy_perform(c);
  curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &response.status);
  if (char* url = nullptr; curl_easy_getinfo(c, CURLINFO_EFFECTIVE_URL, &url) == CURLE_OK && url)
    response.effective_url = url;
  if (t.aborted_by_sink) return io_error("%s: the download was stopped (could not write the file)", request.url.c_str());
  if (rc != CURLE_OK)
    return io_error("%s: %s", request.url.c_str(), curl_error[0] ? curl_error : curl_easy_strerror(rc));
  return response;
}

}  // namespace lily
