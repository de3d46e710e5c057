#include "server/http_parse.h"

#include <algorithm>
#include <cctype>

#include "util/status.h"

namespace lily {

namespace {

std::string trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return std::string(s);
}

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

bool percent_decode(std::string_view in, std::string& out) {
  out.clear();
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i] != '%') {
      out += in[i];
      continue;
    }
    if (i + 2 >= in.size() || hex_digit(in[i + 1]) < 0 || hex_digit(in[i + 2]) < 0) return false;
    out += static_cast<char>(hex_digit(in[i + 1]) * 16 + hex_digit(in[i + 2]));
    i += 2;
  }
  return true;
}

// RFC 9110 token characters: what a header field name may hold (no spaces: `Content-Length : 5` is refused).
bool is_token(std::string_view s) {
  static const std::string_view kExtra = "!#$%&'*+-.^_`|~";
  return !s.empty() && std::all_of(s.begin(), s.end(), [](unsigned char c) {
    return std::isalnum(c) || kExtra.find(static_cast<char>(c)) != std::string_view::npos;
  });
}

bool parse_length(std::string_view s, size_t& out) {
  if (s.empty() || s.size() > 18 || !std::all_of(s.begin(), s.end(), ::isdigit)) return false;
  out = 0;
  for (char c : s) out = out * 10 + static_cast<size_t>(c - '0');
  return true;
}

BodyFraming refuse(int status, std::string message, bool drain) {
  BodyFraming f;
  f.status = status;
  f.error = std::move(message);
  f.drain = drain;
  return f;
}

}  // namespace

std::string ascii_lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return std::tolower(c); });
  return out;
}

HeadEnd find_head_end(std::string_view buf) {
  for (size_t nl = buf.find('\n'); nl != std::string_view::npos; nl = buf.find('\n', nl + 1)) {
    if (nl + 1 < buf.size() && buf[nl + 1] == '\n') return {true, nl + 1, nl + 2};
    if (nl + 2 < buf.size() && buf[nl + 1] == '\r' && buf[nl + 2] == '\n') return {true, nl + 1, nl + 3};
  }
  return {};
}

std::string parse_head(std::string_view head, HttpRequest& req, bool& http11) {
  size_t eol = head.find('\n');
  std::string line = trim(head.substr(0, eol));
  size_t sp1 = line.find(' '), sp2 = line.rfind(' ');
  if (sp1 == std::string::npos || sp2 == sp1) return "malformed request line";
  req.method = line.substr(0, sp1);
  if (!is_token(req.method)) return "malformed request method";
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
    if (colon == std::string_view::npos || !is_token(h.substr(0, colon))) return "malformed header line";
    req.headers.emplace_back(ascii_lower(h.substr(0, colon)), trim(h.substr(colon + 1)));
  }
  return "";
}

BodyFraming body_framing(const HttpRequest& req, size_t max_body_bytes) {
  bool has_length = false, has_te = false;
  size_t length = 0;
  std::string te;
  for (const auto& [name, value] : req.headers) {
    if (name == "transfer-encoding") {
      te += (has_te ? "," : "") + value;
      has_te = true;
    }
    if (name != "content-length") continue;
    // `Content-Length: 5, 5` and repeated equal fields are one length (RFC 9110 8.6); different ones are not.
    std::string_view rest = value;
    for (;;) {
      size_t comma = rest.find(',');
      std::string part = trim(rest.substr(0, comma));
      size_t n = 0;
      if (!parse_length(part, n)) return refuse(400, "bad Content-Length `" + value + "`", false);
      if (has_length && n != length) return refuse(400, "conflicting Content-Length headers", false);
      has_length = true, length = n;
      if (comma == std::string_view::npos) break;
      rest.remove_prefix(comma + 1);
    }
  }
  BodyFraming f;
  if (has_te) {
    if (has_length) return refuse(400, "both Transfer-Encoding and Content-Length were sent", false);
    if (ascii_lower(trim(te)) != "chunked") {
      return refuse(400, "unsupported Transfer-Encoding `" + te + "`; only `chunked` is accepted", false);
    }
    f.chunked = true;
    return f;
  }
  if (length > max_body_bytes) {
    return refuse(413,
                  format("request body of %zu bytes exceeds the limit of %zu bytes", length, max_body_bytes),
                  true);
  }
  f.length = length;
  return f;
}

ChunkedDecoder::State ChunkedDecoder::fail(std::string message) {
  error_ = std::move(message);
  return State::malformed;
}

ChunkedDecoder::State ChunkedDecoder::feed(std::string& in, std::string& body) {
  size_t at = 0;  // consumed bytes of `in`, erased on return
  struct Erase {
    std::string& in;
    size_t& at;
    ~Erase() { in.erase(0, at); }
  } erase{in, at};
  for (;;) {
    if (part_ == Part::data) {
      size_t n = std::min(left_, in.size() - at);
      body.append(in, at, n);
      at += n, left_ -= n;
      if (left_ > 0) return State::more;
      part_ = Part::data_end;
      continue;
    }
    size_t nl = in.find('\n', at);
    if (nl == std::string::npos) {
      if (in.size() - at > 4096) return fail("chunk size line or trailer field too long");
      return State::more;
    }
    std::string line = trim(std::string_view(in).substr(at, nl - at));
    at = nl + 1;
    switch (part_) {
      case Part::size_line: {
        std::string_view digits = std::string_view(line).substr(0, line.find(';'));  // extensions ignored
        while (!digits.empty() && (digits.back() == ' ' || digits.back() == '\t')) digits.remove_suffix(1);
        if (digits.empty() || digits.size() > 15) return fail("bad chunk size `" + line + "`");
        size_t size = 0;
        for (char c : digits) {
          if (hex_digit(c) < 0) return fail("bad chunk size `" + line + "`");
          size = size * 16 + static_cast<size_t>(hex_digit(c));
        }
        if (size > max_body_ || body.size() > max_body_ - size) {
          error_ = format("chunked request body exceeds the limit of %zu bytes", max_body_);
          return State::too_large;
        }
        if (size == 0) {
          part_ = Part::trailer;
        } else {
          part_ = Part::data, left_ = size;
        }
        break;
      }
      case Part::data_end:
        if (!line.empty()) return fail("chunk data longer than its size");
        part_ = Part::size_line;
        break;
      case Part::trailer:
        if (line.empty()) return State::done;
        trailer_bytes_ += line.size();
        if (trailer_bytes_ > 65536) return fail("trailer fields too large");
        break;
      case Part::data:
        break;
    }
  }
}

}  // namespace lily
