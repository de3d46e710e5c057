// The request side of HTTP/1.1 (RFC 9112) as pure functions over bytes, so the socket code in http.cpp stays
// small and the parser can be fuzzed without sockets (fuzz/fuzz_http_request.cpp): where the head ends (CRLF,
// or bare LF as RFC 9112 section 2.2 lets a recipient accept), the request line and header fields, how the
// body is framed (one Content-Length, or chunked; conflicting framings are refused as request smuggling), and
// an incremental decoder of chunked bodies under the same size limit as Content-Length ones.
#pragma once
#include <cstddef>
#include <string>
#include <string_view>

#include "server/http.h"

namespace lily {

std::string ascii_lower(std::string_view s);

// Where the blank line ending the head is: `head_size` bytes of head (its last line's terminator included),
// the body from `body_start`. found == false: not complete yet.
struct HeadEnd {
  bool found = false;
  size_t head_size = 0, body_start = 0;
};
HeadEnd find_head_end(std::string_view buf);

// Parses the request line and header fields (the head without the blank line). Returns an error message or
// "".
std::string parse_head(std::string_view head, HttpRequest& req, bool& http11);

// How the body is framed. status != 0: the request is refused with that status and message.
struct BodyFraming {
  bool chunked = false;
  size_t length = 0;  // Content-Length (0 when absent)
  int status = 0;
  std::string error;
  bool drain = false;  // the refusal should drain what the client is still sending
};
BodyFraming body_framing(const HttpRequest& req, size_t max_body_bytes);

// Decodes a chunked body as bytes arrive: feed() consumes what it can from the front of `in`, appending chunk
// data to `body`. Chunk extensions and trailer fields are read and ignored.
class ChunkedDecoder {
 public:
  enum class State { more, done, too_large, malformed };
  explicit ChunkedDecoder(size_t max_body_bytes) : max_body_(max_body_bytes) {}
  State feed(std::string& in, std::string& body);
  const std::string& error() const { return error_; }

 private:
  enum class Part { size_line, data, data_end, trailer };
  State fail(std::string message);

  size_t max_body_;
  Part part_ = Part::size_line;
  size_t left_ = 0;  // data bytes still to come in this chunk
  size_t trailer_bytes_ = 0;
  std::string error_;
};

}  // namespace lily
