// Who may talk to the server from a browser. Without an API key (the default) any page the user visits could
// POST to a local server (a `text/plain` body needs no CORS preflight), and a DNS-rebinding page could even
// read the answers. So:
//   - bound to a loopback address, the `Host` header must name a loopback host (localhost, 127.x.y.z, [::1],
//     with or without a port): a rebound name (`evil.example:8080` resolving to 127.0.0.1) gets 403;
//   - a request carrying `Origin` (browsers send it on cross-site requests and on every POST) must come from
//   the
//     server's own origin (`http://` + the Host header) or one listed with --allow-origin; else 403. Listed
//     origins get CORS headers on their responses and an answer to their preflight OPTIONS.
// Clients that send no Origin (curl, the OpenAI SDKs) are unaffected, and so is the chat page served at `/`.
#pragma once
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "server/api_error.h"
#include "server/http.h"

namespace lily {

struct OriginPolicy {
  bool check_host = true;                    // the server listens on loopback only
  std::vector<std::string> allowed_origins;  // "http://host:port" as browsers send it; "*": any
};

// Whether `host` (a --host value) is a loopback address or name: the Host check applies then.
bool is_loopback_bind(std::string_view host);
// A Host header value naming this machine's loopback: localhost, *.localhost, 127.0.0.0/8, [::1]; optional
// port.
bool is_loopback_host_header(std::string_view host);

// 403 `host_not_allowed` / `origin_not_allowed`, or nothing when the request may go on.
std::optional<ApiError> check_origin(const HttpRequest& req, const OriginPolicy& policy);

// Headers every response to `req` carries: CORS for an allowed foreign origin (and Vary: Origin), else none.
HttpHeaders cors_headers(const HttpRequest& req, const OriginPolicy& policy);
// The answer to OPTIONS on a known path: 204 with Allow; a CORS preflight also gets the Access-Control-*
// headers.
void answer_options(const HttpRequest& req, const OriginPolicy& policy, std::string_view allow,
                    HttpExchange& ex);

}  // namespace lily
