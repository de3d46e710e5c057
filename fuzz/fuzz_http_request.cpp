// libFuzzer target for the HTTP/1.1 request parser (server/http_parse.h), as HttpServer::read_request uses
// it: requests one after another in one buffer (pipelining), each head located, parsed and its body framed,
// then read by Content-Length or decoded as chunked. Invariants: the head ends inside the buffer; a refusal
// has a 4xx status and a message; a chunked body never exceeds the limit, and decoding it in two pieces gives
// exactly what decoding it at once gives (the decoder is incremental: bytes arrive in any split).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "server/http_parse.h"

namespace {

constexpr size_t kMaxBody = 4096;

[[noreturn]] void violated(const char* what) {
  std::fprintf(stderr, "fuzz_http_request: invariant violated: %s\n", what);
  std::abort();
}

// Decodes `in` at once and split at `split`; both must agree. Returns the state; `in` keeps what follows.
lily::ChunkedDecoder::State decode(std::string& in, size_t split) {
  lily::ChunkedDecoder whole(kMaxBody), pieces(kMaxBody);
  std::string whole_in = in, whole_body, piece_body;
  auto st = whole.feed(whole_in, whole_body);
  std::string piece_in = in.substr(0, split % (in.size() + 1));
  std::string rest = in.substr(piece_in.size());
  auto st2 = pieces.feed(piece_in, piece_body);
  if (st2 == lily::ChunkedDecoder::State::more) {
    piece_in += rest;
    st2 = pieces.feed(piece_in, piece_body);
  } else {
    piece_in += rest;
  }
  if (whole_body.size() > kMaxBody) violated("chunked body over the limit");
  if (st == lily::ChunkedDecoder::State::done &&
      (st2 != st || piece_body != whole_body || piece_in != whole_in))
    violated("split decoding differs from whole decoding");
  in = whole_in;
  return st;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string buf(reinterpret_cast<const char*>(data), size);
  size_t split = size > 0 ? data[0] : 0;
  for (int n = 0; n < 8; ++n) {
    size_t blank = buf.find_first_not_of("\r\n");
    buf.erase(0, blank == std::string::npos ? buf.size() : blank);
    lily::HeadEnd end = lily::find_head_end(buf);
    if (!end.found) return 0;
    if (end.head_size > end.body_start || end.body_start > buf.size())
      violated("head end outside the buffer");
    lily::HttpRequest req;
    bool http11 = false;
    std::string err = lily::parse_head(std::string_view(buf).substr(0, end.head_size), req, http11);
    if (!err.empty()) return 0;
    if (req.path.empty() || req.path[0] != '/') violated("a parsed path must start with /");
    (void)req.header("host");
    lily::BodyFraming framing = lily::body_framing(req, kMaxBody);
    if (framing.status != 0) {
      if (framing.status < 400 || framing.status >= 500 || framing.error.empty()) violated("bad refusal");
      return 0;
    }
    buf.erase(0, end.body_start);
    if (framing.chunked) {
      if (decode(buf, split) != lily::ChunkedDecoder::State::done) return 0;
    } else {
      if (framing.length > kMaxBody) violated("a length over the limit was accepted");
      if (buf.size() < framing.length) return 0;
      buf.erase(0, framing.length);
    }
  }
  return 0;
}
